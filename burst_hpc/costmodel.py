"""Predicted time of each scheme across nodes (docs/RING.md, "Across nodes"), from

- the problem: batch B, sequence S, heads Hq / Hkv, head dim D, bytes per element, and the share
  of the S x S score matrix that is visible (1/2 causal, 1 full, less with documents or a window);
- the cluster: nodes N of w ranks (P = N w), one GPU each;
- rates: kernel FLOP/s forward and backward (the FlashAttention count: 4 S^2 Hq D forward, 2.5x
  that backward, scaled by the visible share), and per link class (NVLink inside a node, the
  network between nodes) the bandwidth per GPU each way and a latency per message.

Each scheme is a sequence of steps; a step costs the larger of its compute and the transfer on
each link class it uses (they run concurrently), and what cannot overlap is added: Ulysses'
all-to-alls and the last partials going home. The kernels' time is the critical path (the
busiest rank of every step, Problem.imbalance from the schedule's own account, workload.py),
not the mean. Exposed communication = predicted time - compute alone. ``step_prediction``
follows a flat ring's schedule step by step instead (any layout, the balanced one included).
"""
from dataclasses import dataclass, replace

from .accounting import attention_flops, step_bytes
from .errors import BurstError


@dataclass(frozen=True)
class Rates:
    name: str
    fwd_tflops: float        # kernel rate, forward (FlashAttention count)
    bwd_tflops: float        # kernel rate, backward
    intra_gbps: float        # GB/s per GPU each way inside a node
    inter_gbps: float        # GB/s per GPU each way between nodes (one NIC per GPU)
    intra_latency_us: float = 10.0
    inter_latency_us: float = 10.0


# from docs/BENCHMARKS.md (sm90 kernels on H100 at D=128, S >= 16k: forward 580-620, backward 500-558
# TFLOP/s with the FlashAttention-3-shaped backward; H200 scaled by its forward) and
# ../shared/DEVICE.md (NVLink ring exchange 300-356 GB/s); 50 GB/s per GPU between nodes is a
# 400 Gb/s NIC per GPU. "cpu" is this library's NumPy path on one host (emulated nodes).
GPU_RATES = {
    "H100": Rates("H100", 600.0, 520.0, 300.0, 50.0),
    "H200": Rates("H200", 610.0, 530.0, 350.0, 50.0),
    "cpu": Rates("cpu", 0.02, 0.01, 5.0, 5.0, 20.0, 20.0),
}


@dataclass(frozen=True)
class Problem:
    batch: int
    seqlen: int
    heads: int
    kv_heads: int
    head_dim: int
    itemsize: int = 2
    causal: bool = True
    visible: float = None    # share of the S x S scores that is visible; None: 1/2 causal, 1 otherwise
    reach: int = None        # how far back (tokens) a query sees, with a window (contiguous layout):
                             # the ring runs only the steps that reach has work in
    imbalance: float = 1.0   # critical path over mean work (workload.schedule_work): what the ring
                             # waits for is the busiest rank of every step, not the mean

    @property
    def share(self):
        return (0.5 if self.causal else 1.0) if self.visible is None else self.visible

    def steps(self, count, tokens):
        """Of ``count`` ring steps over shards of ``tokens`` tokens, those with work."""
        return count if self.reach is None else min(count, 1 + -(-self.reach // int(tokens)))

    def flops(self, backward=False):
        return attention_flops(self.batch, self.heads, self.head_dim, float(self.seqlen) ** 2 * self.share, backward)


@dataclass(frozen=True)
class Cluster:
    nodes: int
    per_node: int

    @property
    def ranks(self):
        return self.nodes * self.per_node


def token_bytes(pr, backward, heads=None, kv_heads=None):
    """(data, partial) bytes per token (and batch row) one ring step moves: the forward's K/V;
    the backward's cheaper ring (q-ring: Q, dO, lse, delta out and dQ back; kv-ring: K, V out and
    dK, dV back). ``heads``/``kv_heads``: the heads one rank carries (Ulysses: a share of them)."""
    sides = step_bytes(pr.heads if heads is None else heads, pr.kv_heads if kv_heads is None else kv_heads,
                       pr.head_dim, pr.itemsize)
    if not backward:
        return sides["forward"]
    return min(sides["kv"], sides["q"], key=sum)   # a tie goes to the kv-ring, as choose_backward_ring does


def _link(rates, inter):
    bw = (rates.inter_gbps if inter else rates.intra_gbps) * 1e9
    lat = (rates.inter_latency_us if inter else rates.intra_latency_us) * 1e-6
    return lambda nbytes: 0.0 if nbytes == 0 else lat + nbytes / bw


def ulysses_kv_heads(pr, per_node):
    """K/V heads one rank holds under ulysses_ring (shared when Hkv < w)."""
    group, mine = pr.heads // pr.kv_heads, pr.heads // per_node
    return max(1, mine // group)


@dataclass
class Pass:
    time: float          # seconds
    compute: float       # seconds of kernels alone
    network: float       # bytes the busiest GPU sends over the network
    steps: list          # (compute, {link: seconds}) of the overlapped steps, for the threshold

    @property
    def exposed(self):
        return max(0.0, self.time - self.compute)


def _ring(steps, compute, transfer):
    """Time of ``steps`` ring steps that each hide ``transfer`` (the next step's data) behind
    ``compute``; the last step has nothing left to receive."""
    return (steps - 1) * max(compute, transfer) + compute if steps else 0.0


def predict_pass(scheme, pr, cl, rates, backward=False):
    P, N, w = cl.ranks, cl.nodes, cl.per_node
    n = pr.seqlen / P
    F = (rates.bwd_tflops if backward else rates.fwd_tflops) * 1e12
    total = pr.flops(backward) / P / F * pr.imbalance   # the critical path of the kernels
    intra, inter = _link(rates, False), _link(rates, N > 1)
    data, partial = token_bytes(pr, backward)
    shard = pr.batch * n
    if scheme == "ring" or (scheme == "double_ring" and w == 1):   # one rank per node: the flat ring
        steps = pr.steps(P, n)
        c = total / steps
        m = inter(shard * (data + partial))
        time = _ring(steps, c, m) + inter(shard * partial)
        net = shard * ((steps - 1) * data + steps * partial) if N > 1 else 0  # a node's last rank: every hop
        return Pass(time, total, net, [(c, m)])
    if scheme == "double_ring" and w > 1:
        rounds = pr.steps(N, w * n)
        c = total / (rounds * w)
        m_in = intra(shard * (data + partial))
        inner = _ring(w, c, m_in)
        m_out = inter(shard * (data + partial)) if N > 1 else 0.0   # posted after a round's first step
        last = intra(shard * partial) + (inter(shard * partial) if rounds > 1 else 0.0)   # inner hop, home
        time = (rounds - 1) * max(inner, c + m_out) + inner + last
        return Pass(time, total, (rounds - 1) * shard * (data + partial), [(c, m_in), ((w - 1) * c, m_out)])
    if scheme == "ulysses_ring":
        hq, hk = pr.heads // w, ulysses_kv_heads(pr, w)
        d, it = pr.head_dim, pr.itemsize
        if backward:
            into = hq * (2 * d * it + 8) + 2 * hk * d * it
            back = (hq + 2 * hk) * d * 4
        else:
            into, back = (hq + 2 * hk) * d * it, hq * (d * it + 4)
        a2a = intra((w - 1) * shard * into) + intra((w - 1) * shard * back) if w > 1 else 0.0
        data, partial = token_bytes(pr, backward, hq, hk)
        rounds = pr.steps(N, w * n)
        c = total / rounds
        m = inter(w * shard * (data + partial))
        time = a2a + _ring(rounds, c, m) + inter(w * shard * partial)
        net = w * shard * ((rounds - 1) * data + rounds * partial) if N > 1 else 0
        return Pass(time, total, net, [(c, m)])
    raise BurstError(f"unknown scheme {scheme!r}")


@dataclass
class Prediction:
    scheme: str
    fwd: Pass
    bwd: Pass

    @property
    def fwdbwd(self):
        return self.fwd.time + self.bwd.time

    @property
    def exposed_fwdbwd(self):
        return self.fwd.exposed + self.bwd.exposed

    @property
    def network_fwdbwd(self):
        return self.fwd.network + self.bwd.network


def predict(scheme, pr, cl, rates):
    return Prediction(scheme, predict_pass(scheme, pr, cl, rates), predict_pass(scheme, pr, cl, rates, True))


def fits(scheme, pr, cl, layout="zigzag"):
    """None when ``scheme`` runs this problem, else why not (the reason the library gives)."""
    from .schemes import check_node_layout, ulysses_heads

    if scheme == "ring":
        return None
    try:
        check_node_layout(scheme, layout, pr.causal, masked=pr.visible is not None)
        if scheme == "ulysses_ring":
            ulysses_heads(pr.heads, pr.kv_heads, cl.per_node)
    except BurstError as e:
        return str(e)
    return None


def pick(pr, cl, rates, layout="zigzag", backward=True, margin=0.02):
    """The scheme with the least predicted time (forward+backward, or the forward alone), among
    those that fit; the flat ring unless another beats it by more than ``margin``; one node: ring."""
    if cl.nodes == 1:
        return "ring"
    best, best_time = "ring", None
    for scheme in ("ring", "double_ring", "ulysses_ring"):
        if fits(scheme, pr, cl, layout) is not None:
            continue
        p = predict(scheme, pr, cl, rates)
        t = p.fwdbwd if backward else p.fwd.time
        if best_time is None or t < best_time * (1 - margin):
            best, best_time = scheme, t
    return best


def hiding_tokens(scheme, pr, cl, rates, backward=False, within=0.05):
    """The fewest tokens per GPU (a multiple of 64) at which ``scheme`` exposes at most ``within``
    of its compute as communication (None beyond 16M tokens per GPU)."""
    def exposed_share(n):
        p = replace(pr, seqlen=n * cl.ranks)
        passes = [predict_pass(scheme, p, cl, rates)] + ([predict_pass(scheme, p, cl, rates, True)] if backward else [])
        return sum(x.exposed for x in passes) / sum(x.compute for x in passes)

    lo, hi = 1, 1 << 18   # units of 64 tokens
    if exposed_share(hi * 64) > within:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if exposed_share(mid * 64) <= within:
            hi = mid
        else:
            lo = mid + 1
    return lo * 64


def rates_for(backend_name, device_name=None):
    """The built-in rates for this call's device (the GPU model named in ``device_name``, else H100),
    with the network's rate and latency of BURST_HPC_EMULATE_NETWORK when it is set."""
    from .config import emulated_network as setting

    rates = GPU_RATES["cpu"] if backend_name != "cuda" else GPU_RATES["H100"]
    for model in ("H200", "H100"):
        if backend_name == "cuda" and device_name and model in device_name:
            rates = GPU_RATES[model]
    network = setting()
    if network is not None:
        rates = replace(rates, inter_gbps=network[0] / 1e9, inter_latency_us=network[1] * 1e6)
    return rates


def visible_share(mask, size, layout):
    from . import masks

    return sum(masks.rank_work(mask, size, layout)) / float(mask.seqlen) ** 2


def pick_for_call(topo, layout, causal, mask, q_shape, kv_heads, itemsize, backward, backend="numpy"):
    """The pick for one burst_attention call on this rank's shard shape, from this rank's GPU model
    (no collective here: ranks on different GPU models that pick differently get the signature's
    RankMismatchError, never a hang)."""
    device_name = None
    if backend == "cuda":
        import cupy

        device_name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    b, local, hq, d = q_shape
    cl = Cluster(topo.nodes, topo.per_node)
    share = None if mask is None else visible_share(mask, cl.ranks, layout)
    reach = None
    if mask is not None and mask.window is not None and mask.window[0] >= 0 and layout == "contiguous":
        reach = mask.window[0]
    pr = Problem(b, local * cl.ranks, hq, kv_heads, d, itemsize, causal, share, reach, imbalance(mask, cl.ranks, layout))
    return pick(pr, cl, rates_for(backend, device_name), layout, backward)


def imbalance(mask, ranks, layout):
    """Critical path over mean work of the flat ring's schedule of ``mask`` (1 without one)."""
    if mask is None:
        return 1.0
    from .workload import work_of

    work = work_of(mask.seqlen, ranks, mask.causal, mask, layout, "forward")
    return float(work.max(axis=1).sum() * ranks / max(1, work.sum()))


def _schedule(scheme, cl, near, returns):
    """Position 0's schedule under ``scheme`` (every position holds as many buffers)."""
    from .schedule import double_ring_steps, plain_ring_steps

    if scheme == "double_ring":
        return double_ring_steps(0, cl.nodes, cl.per_node, near, returns)
    return plain_ring_steps(0, cl.nodes if scheme == "ulysses_ring" else cl.ranks, near, returns)


def _ring_memory(tokens, heads, kv_heads, d, it, backward, buffers):
    """Bytes one ring call allocates at its peak (inputs excluded): float32 accumulators (float64
    for float64 inputs) and delta (backward), plus the larger of the receive and partial buffers
    the schedule holds at once (``buffers``: {"data": n, "partial": n} of the side that travels)
    and the outputs in the input dtype (made after the ring has given its buffers back)."""
    acc = 8 if it == 8 else 4
    if not backward:
        results = heads * (d + 1) * acc                    # o, lse
        travelling = 2 * kv_heads * d * it                 # k, v
        return tokens * (results + max(buffers["data"] * travelling + buffers["partial"] * results,
                                       heads * (d * it + 4)))
    kv_res, q_res = 2 * kv_heads * d * acc, heads * d * acc                        # dk, dv; dq
    kv_data, q_data = 2 * kv_heads * d * it, heads * (2 * d * it + 4 + acc)        # k, v; q, do, lse, delta
    data, partial = (kv_data, kv_res) if buffers["side"] == "kv" else (q_data, q_res)
    return tokens * (kv_res + q_res + heads * acc + max(buffers["data"] * data + buffers["partial"] * partial,
                                                        (heads + 2 * kv_heads) * d * it))


def peak_memory(scheme, pr, cl, backward=False):
    """Bytes per rank of the inputs and what one call allocates at its peak (the ring's buffers as
    the engine holds them, ring.lifetimes, plus accumulators and outputs). Ulysses adds the node's
    gathered inputs (held twice while they are joined) and runs its ring on w times the tokens
    for 1/w of the heads. Kernel workspace (none on the GPU) is not counted."""
    from .ring import lifetimes

    it, d = pr.itemsize, pr.head_dim
    n = pr.batch * pr.seqlen // cl.ranks
    heads, kv_heads, tokens = pr.heads, pr.kv_heads, n
    inputs = n * (heads + 2 * kv_heads) * d * it * (2 if backward else 1) + (n * heads * 4 if backward else 0)
    extra = 0
    if scheme == "ulysses_ring":
        heads, kv_heads, tokens = pr.heads // cl.per_node, ulysses_kv_heads(pr, cl.per_node), n * cl.per_node
        extra = 2 * tokens * (heads + 2 * kv_heads) * d * it * (2 if backward else 1)
    if backward:
        data, partial = token_bytes(pr, True, heads, kv_heads)
        near = "kv" if data == 2 * kv_heads * d * it else "q"
        returns = ("kv", "q")
    else:
        near, returns = "kv", ("q",)
    buffers = dict(lifetimes(_schedule(scheme, cl, near, returns), 0)[2], side=near)
    return inputs + extra + _ring_memory(tokens, heads, kv_heads, d, it, backward, buffers)


@dataclass(frozen=True)
class StepPrediction:
    """A pass predicted step by step from its schedule (``step_prediction``)."""
    time: float          # seconds: every step the larger of its busiest rank's compute and transfers
    compute: float       # seconds of the critical path's kernels (the busiest rank of every step)
    mean: float          # seconds of the mean rank's kernels
    steps: int

    @property
    def exposed(self):
        """Share of the time spent waiting for transfers."""
        return max(0.0, self.time - self.compute) / self.time if self.time else 0.0

    @property
    def imbalance(self):
        """Critical path over mean work."""
        return self.compute / self.mean if self.mean else 1.0


def step_prediction(pr, ranks, rates, layout, mask, backward=False, per_node=8):
    """The pass over ``ranks`` GPUs (``per_node`` a node) in ``layout``, from its schedule's own
    account (workload.py), step by step as the engine runs it: every rank starts a step's kernels
    when the step before has ended everywhere, and a step ends when its busiest rank's kernels (the
    critical path, not the mean) are done and every transfer due then has arrived. A transfer
    is posted at the start of its step (between nodes the balanced schedule posts some steps before
    they are due) and has arrived when both its sender's outgoing and its receiver's incoming link of
    its class (NVLink inside a node, the network between nodes) have carried it: each link carries
    its transfers one after another in the order they are posted, none before it is posted, a
    latency once per step and link. (Within a step this is the most bytes any rank sends or
    receives; across steps a link's backlog carries over.)"""
    from .accounting import transfer_bytes
    from .workload import schedule_transfers, work_of

    direction = "backward" if backward else "forward"
    work = work_of(pr.seqlen, ranks, pr.causal, mask, layout, direction, per_node)
    F = (rates.bwd_tflops if backward else rates.fwd_tflops) * 1e12
    per_pair = attention_flops(pr.batch, pr.heads, pr.head_dim, 1.0, backward) / F
    sizes = transfer_bytes(pr.heads, pr.kv_heads, pr.head_dim, pr.itemsize, backward)
    links = {False: (rates.intra_gbps * 1e9, rates.intra_latency_us * 1e-6),
             True: (rates.inter_gbps * 1e9, rates.inter_latency_us * 1e-6)}
    transfers = schedule_transfers(pr.seqlen, ranks, pr.causal, mask, layout, direction, per_node)
    posted = {}
    for m in transfers:
        posted.setdefault(m[0], []).append(m)
    free, arrived, time = {}, {}, 0.0   # (rank, far, "out"/"in") -> when that link is next free
    for t in range(work.shape[0]):
        start, paid = time, set()
        for _, due, sender, receiver, what, side, tokens in posted.get(t, ()):
            far = sender // per_node != receiver // per_node
            bandwidth, latency = links[far]
            seconds = sizes[(what, side)] * pr.batch * tokens / bandwidth
            for e in ((sender, far, "out"), (receiver, far, "in")):
                free[e] = max(start, free.get(e, 0.0)) + seconds + (latency if e not in paid else 0.0)
                paid.add(e)
                arrived[due] = max(arrived.get(due, 0.0), free[e])
        time = max(start + work[t].max() * per_pair, arrived.get(t, 0.0))
    return StepPrediction(time, work.max(1).sum() * per_pair, work.sum() / ranks * per_pair, work.shape[0])


@dataclass(frozen=True)
class CallShape:
    """What a call's layout is priced by (masks.default_layout): its shard's batch and heads, the
    bytes per element, whether a backward pass is priced too, the ranks a node (None: one node)
    and the rates. Hashable: the layout decision is cached on it."""
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    itemsize: int
    backward: bool = True
    per_node: int = None
    rates: Rates = GPU_RATES["H100"]

    @classmethod
    def of_call(cls, q_shape, kv_heads, itemsize, backend="numpy", per_node=None, backward=True):
        """The shape of a call on a (batch, tokens, heads, head_dim) query shard, priced with the
        backend's rates (rates_for). A library call prices the forward and the backward pass
        (``backward``): a forward call and the backward call of the same training step must pick
        the same layout, their shards are cut alike; a run job prices the passes it runs."""
        batch, _, heads, head_dim = q_shape
        return cls(batch, heads, kv_heads, head_dim, itemsize, backward, per_node, rates_for(backend))

    def seconds(self, mask, ranks, layout):
        """Predicted seconds of the call's passes over ``ranks`` in ``layout`` (step_prediction)."""
        pr = Problem(self.batch, mask.seqlen, self.heads, self.kv_heads, self.head_dim, self.itemsize, mask.causal)
        per_node = ranks if self.per_node is None else self.per_node
        return sum(step_prediction(pr, ranks, self.rates, layout, mask, backward, per_node).time
                   for backward in ((False, True) if self.backward else (False,)))
