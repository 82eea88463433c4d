"""Randomized differential check of the whole option space against the float64 oracle.

Each case draws, from its seed, every option a call takes: scheme, layout (or the default), causal,
documents (random cuts, one-token documents, cuts on shard and chunk edges), window (left, right;
0 and -1 included), GQA/MQA ratio, head dim (native or not), batch, scale, backward ring, and the
simulated nodes (``ranks_per_node``, 1-4 nodes) over the ranks it is launched on. Every rank draws
the same case. A call must either match the oracle within the FlashAttention tolerance (forward
and backward, burst_hpc.tolerance), or be refused with the same clear message on every rank, one of
the refusals this module lists as legitimate. On several ranks a share of the cases first makes the
call with one rank passing another value of one argument (``Case.disagree``): every rank must then
raise the same RankMismatchError naming it, within DISAGREE_LIMIT_S (a hang ends the job with the
reproducer), before the case runs as drawn. On NumPy a share of the cases (``Case.last_pairs``) then
also runs in bfloat16 with the ring's last-pair path on (BURST_HPC_RING_LAST_PAIRS=1, which acts on
16-bit inputs only) and must match the same run with it off bit for bit. Anything else is a failure,
reported as one line that reproduces the case.

    make test                                  a fixed set of seeds (mpi_tests/test_randomized.py)
    python mpi_tests/randomized.py --cases N   a soak: N cases spread over 1-8 ranks
    mpiexec -n P python -m mpi4py mpi_tests/randomized.py --seed S [--count C]   C cases on P ranks
    ... --last-pairs                           every case with the last-pair path on too

On a GPU (``--backend cuda``) the inputs are CuPy arrays in bfloat16 or float16 (ranks may share the
GPU) and the kernels run; the oracle stays in float64 on the host. There ``--last-pairs`` makes the
calls themselves run with the last-pair path on.
"""
import argparse
import faulthandler
import os
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

SCHEMES = ("auto", "ring", "double_ring", "ulysses_ring", "gather")
BY_NODES = "chunks by nodes"   # the chunks Layout placed by the case's nodes (make_layout's ranks_per_node)
LAYOUTS = (None, "contiguous", "zigzag", "balanced", "chunks", BY_NODES)
HEAD_DIMS = (8, 16, 24, 32, 40, 48, 64, 72)
GPU_HEAD_DIMS = (32, 48, 64, 80, 96, 128, 160, 256)

# the arguments one rank may pass otherwise (Case.disagree), in a share of the cases on several ranks
DISAGREEMENTS = ("scheme", "layout", "causal", "window", "scale", "cu_seqlens", "dtype", "transport", "ranks_per_node",
                 "backward_ring")
DISAGREE_SHARE = 0.3
DISAGREE_LIMIT_S = 60   # they end in milliseconds; a rank still in the call then hangs
# the share of the NumPy cases also run in bfloat16 with the last-pair path on (Case.last_pairs)
LAST_PAIRS_SHARE = 0.25

# the only refusals a drawn case may meet: each names what does not fit and what to use instead
LEGITIMATE = (
    r"works with the zigzag and contiguous layouts; the balanced layout's schedule \(causal, documents, windows\) runs on the flat ring",
    r"splits the \d+ query heads over the \d+ ranks of a node, and \d+ does not divide \d+",
    r"gives each rank \d+ query heads, which neither holds whole GQA groups of \d+ nor divides one",
    r"does not split over \d+ ranks with the \w+ layout: it must be a multiple of \d+",
    r"scheme 'gather' sends keys and values to the queries that see them, and dK/dV home; backward_ring='q' runs",
)


@dataclass
class Case:
    seed: int
    ranks: int
    backend: str = "numpy"
    dtype: str = "float64"
    batch: int = 1
    seqlen: int = 8
    heads: int = 1
    kv_heads: int = 1
    head_dim: int = 8
    causal: bool = False
    layout: str = None
    scheme: str = "ring"
    ranks_per_node: int = None
    cu_seqlens: list = None
    window: tuple = None
    scale: float = None
    backward_ring: str = "auto"
    poison: tuple = None   # (tensor, value, batch, token, head, dim): one non-finite input element
    disagree: tuple = None  # (rank, argument, value): that rank first passes this value instead
    last_pairs: bool = False  # also with BURST_HPC_RING_LAST_PAIRS=1 (run_case)
    receive: int = 0   # BY_NODES' weight of a received key row (make_layout's receive)

    def line(self):
        """The one-line reproducer."""
        script = "mpi_tests/randomized.py"
        extra = "" if self.backend == "numpy" else f" --backend {self.backend} --dtype {self.dtype}"
        extra += " --last-pairs" if self.last_pairs else ""
        return (f"mpiexec -n {self.ranks} python -m mpi4py {script} --seed {self.seed}{extra}   # "
                f"B={self.batch} S={self.seqlen} Hq={self.heads} Hkv={self.kv_heads} D={self.head_dim} "
                f"{self.dtype} causal={self.causal} layout={self.layout} scheme={self.scheme} "
                f"ranks_per_node={self.ranks_per_node} cu_seqlens={self.cu_seqlens} window={self.window} "
                f"scale={self.scale} backward_ring={self.backward_ring} poison={self.poison} disagree={self.disagree} "
                f"receive={self.receive}")


def draw(seed, ranks, backend="numpy", dtype=None, last_pairs=False):
    """The case of ``seed`` on ``ranks`` ranks (the same on every rank); ``last_pairs``: with the last-pair
    path on too, whatever the draw."""
    rng = np.random.default_rng([seed, ranks])
    c = Case(seed, ranks, backend)
    c.dtype = dtype or str(rng.choice(["float64", "float32"]))
    c.scheme = str(rng.choice(SCHEMES))
    c.layout = LAYOUTS[rng.integers(len(LAYOUTS))]
    c.causal = bool(rng.random() < 0.6)
    nodes_choices = [ranks // w for w in range(1, ranks + 1) if ranks % w == 0 and ranks // w <= 4]
    c.ranks_per_node = None if rng.random() < 0.15 else ranks // int(rng.choice(nodes_choices))
    c.kv_heads = int(rng.choice([1, 1, 2, 3, 4]))
    c.heads = c.kv_heads * int(rng.choice([1, 2, 3, 4]))
    if c.scheme in ("ulysses_ring", "auto") and c.ranks_per_node and rng.random() < 0.7:
        w = c.ranks_per_node  # mostly heads that split over a node, so the scheme runs
        c.heads = w * int(rng.integers(1, 4))
        c.kv_heads = int(rng.choice([h for h in range(1, c.heads + 1) if c.heads % h == 0]))
    c.head_dim = int(rng.choice(GPU_HEAD_DIMS if backend == "cuda" else HEAD_DIMS))
    c.batch = int(rng.choice([1, 1, 2]))
    parts = 2 * ranks if rng.random() < 0.9 else ranks   # a length zigzag cannot split, now and then
    c.seqlen = parts * int(rng.integers(1, 9 if backend == "numpy" else 40))
    if backend == "cuda" or rng.random() < 0.08:   # now and then shards of several kernel tiles
        c.seqlen += parts * int(rng.choice([0, 16, 40]) if backend == "cuda" else rng.integers(16, 80))
    c.scale = None if rng.random() < 0.8 else float(rng.uniform(0.05, 1.0))
    c.backward_ring = str(rng.choice(["auto", "q", "kv"]))
    gathers = c.scheme == "gather" or (c.scheme == "auto" and c.layout in ("chunks", BY_NODES))
    if gathers and c.backward_ring == "q" and rng.random() < 0.8:   # mostly a ring it runs (q is refused)
        c.backward_ring = "auto"
    if rng.random() < 0.45:
        c.cu_seqlens = documents(rng, c.seqlen, ranks)
    if rng.random() < 0.4:
        c.window = (window_side(rng, c.seqlen), 0 if c.causal else window_side(rng, c.seqlen))
    if rng.random() < 0.15:
        tensor = str(rng.choice(["q", "k", "v"]))
        heads = c.heads if tensor == "q" else c.kv_heads
        c.poison = (tensor, str(rng.choice(["nan", "inf", "-inf"])), int(rng.integers(c.batch)),
                    int(rng.integers(c.seqlen)), int(rng.integers(heads)), int(rng.integers(c.head_dim)))
    other = np.random.default_rng([seed, ranks, 2])   # its own stream: the cases drawn above stay as they were
    if ranks > 1 and other.random() < DISAGREE_SHARE:
        c.disagree = disagreement(other, c)
    path = np.random.default_rng([seed, ranks, 3])   # its own stream too
    c.last_pairs = last_pairs or (backend == "numpy" and path.random() < LAST_PAIRS_SHARE)
    weigh = np.random.default_rng([seed, ranks, 4])   # and this
    c.receive = int(weigh.choice([0, 1, 4, 16])) * c.seqlen // 8
    return c


def disagreement(rng, c):
    """(rank, argument, value): an argument of case ``c`` and a value of it that changes the call."""
    from burst_hpc import config
    from burst_hpc.plan import masks

    name = str(rng.choice(DISAGREEMENTS))
    if name == "scheme":
        value = str(rng.choice([s for s in SCHEMES if s != c.scheme]))
    elif name == "layout":   # the chunks placed by nodes are the chunks layout itself on one node (or by chance)
        others = [layout for layout in LAYOUTS if layout != c.layout and not same_chunks(layout, c.layout, c)]
        value = others[rng.integers(len(others))]
    elif name == "causal":
        value = not c.causal
    elif name == "window":   # (-1, -1) is no window
        value = None if masks.check_window(c.window) is not None else (int(rng.integers(0, c.seqlen)), 0)
    elif name == "scale":
        value = float(rng.uniform(0.05, 1.0)) if c.scale is None else None
    elif name == "cu_seqlens":
        value = None if c.cu_seqlens is not None else [0, int(rng.integers(1, c.seqlen)), c.seqlen]
    elif name == "dtype":
        value = {"float64": "float32", "float32": "float64", "bfloat16": "float16", "float16": "bfloat16"}[c.dtype]
    elif name == "transport":
        value = "host" if c.backend == "numpy" else "staged"
    elif name == "ranks_per_node":
        setting = c.ranks_per_node or config.ranks_per_node()
        value = int(rng.choice([w for w in range(1, c.ranks + 1) if c.ranks % w == 0 and w != setting]))
    else:
        value = str(rng.choice([ring for ring in ("auto", "q", "kv") if ring != c.backward_ring]))
    return int(rng.integers(c.ranks)), name, value


def documents(rng, seqlen, ranks):
    """Document offsets: random cuts, with one-token documents and cuts on shard and chunk edges."""
    edges = {seqlen * i // (2 * ranks) for i in range(1, 2 * ranks)}
    cuts = set(int(x) for x in rng.integers(1, seqlen, size=int(rng.integers(0, 6)))) if seqlen > 1 else set()
    if rng.random() < 0.4 and edges:
        cuts |= set(int(x) for x in rng.choice(sorted(edges), size=min(len(edges), 2), replace=False))
    if rng.random() < 0.3 and seqlen > 2:
        one = int(rng.integers(1, seqlen - 1))
        cuts |= {one, one + 1}                       # a one-token document
    if rng.random() < 0.2 and seqlen > 1:
        cuts |= {1}                                  # one-token documents at the edges
    if rng.random() < 0.2 and seqlen > 1:
        cuts |= {seqlen - 1}
    return [0] + sorted(c for c in cuts if 0 < c < seqlen) + [seqlen]


def window_side(rng, seqlen):
    return int(rng.choice([-1, 0, int(rng.integers(0, max(1, seqlen // 3))), int(rng.integers(0, seqlen + 2))]))


# ------------------------------------------------------------------------------------------- checking

def called_layout(name, case):
    """The layout argument a call of ``case`` passes for the drawn ``name``: BY_NODES is the chunks Layout placed
    by the case's nodes, received keys weighing the case's ``receive`` (a name cannot say either), or the name
    'chunks' where the sequence does not split so (the same refusal); other names as they are."""
    import burst_hpc

    if name != BY_NODES:
        return name
    mask = burst_hpc.plan.masks.make(case.seqlen, case.causal, case.window,
                                     None if case.cu_seqlens is None else np.array(case.cu_seqlens))
    try:
        return burst_hpc.make_layout("chunks", case.seqlen, case.ranks, mask,
                                     ranks_per_node=case.ranks_per_node or case.ranks, receive=case.receive)
    except burst_hpc.LayoutError:
        return "chunks"


def same_chunks(a, b, case):
    """Whether layout names ``a`` and ``b`` are 'chunks' and BY_NODES placing the case's tokens alike."""
    import burst_hpc

    if {a, b} != {"chunks", BY_NODES}:
        return False
    mask = burst_hpc.plan.masks.make(case.seqlen, case.causal, case.window,
                                     None if case.cu_seqlens is None else np.array(case.cu_seqlens))
    try:
        return called_layout(BY_NODES, case) == burst_hpc.make_layout("chunks", case.seqlen, case.ranks, mask)
    except burst_hpc.LayoutError:
        return True   # both refused alike


def shard_layout(case):
    """The layout the inputs are sharded in: the case's, or the call's default (never the mask's)."""
    from burst_hpc.plan.layout import default_kind

    return default_kind(case.causal) if case.layout is None else case.layout


def inputs(case):
    """Global q, k, v, do in the case's dtype (host arrays; float64 copies for the oracle)."""
    from burst_hpc.dtypes import parse_dtype

    rng = np.random.default_rng([case.seed, case.ranks, 1])
    shapes = [(case.batch, case.seqlen, h, case.head_dim) for h in (case.heads, case.kv_heads, case.kv_heads,
                                                                   case.heads)]
    arrays = [rng.standard_normal(s).astype(parse_dtype(case.dtype)) for s in shapes]
    if case.poison is not None:
        tensor, value, *where = case.poison
        arrays["qkv".index(tensor)][tuple(where)] = float(value)
    return arrays


def expected(case, q, k, v, do):
    """(oracle, plain): float64 oracle and the plain same-precision results, global."""
    from burst_hpc import tolerance as rule

    kw = dict(causal=case.causal, scale=case.scale, window=case.window,
              cu_seqlens=None if case.cu_seqlens is None else np.array(case.cu_seqlens))
    f64 = [x.astype(np.float64) for x in (q, k, v, do)]
    oracle = rule.plain_attention(*f64[:3], do=f64[3], **kw)
    plain = rule.plain_attention(*f64[:3], do=f64[3], lowp=np.dtype(q.dtype), **kw)
    return oracle, plain


def refusal(comm, error):
    """None when no rank failed; else the agreed message, after checking every rank has the same one
    and that it is one of the LEGITIMATE refusals (AssertionError otherwise)."""
    from burst_hpc.errors import BurstError

    mine = None if error is None else (type(error).__name__, str(error), isinstance(error, BurstError))
    every = comm.allgather(mine)
    if all(e is None for e in every):
        return None
    assert all(e == every[0] for e in every), f"ranks disagree on the refusal: {every}"
    name, message, ours = every[0]
    assert ours, f"not a clear refusal: {name}: {message}"
    assert any(re.search(p, message) for p in LEGITIMATE), f"unexpected refusal: {name}: {message}"
    return message


def run_case(comm, case, xp=np):
    """Check one case on every rank of ``comm``. Returns 'ok' or 'refused: ...'; raises AssertionError
    (on every rank: verdicts are agreed) when a result is wrong."""
    import burst_hpc
    from burst_hpc.device import to_host

    P, r = comm.size, comm.rank
    assert P == case.ranks
    layout = called_layout(shard_layout(case), case)
    q, k, v, do = inputs(case)
    placed = dict(causal=case.causal, window=case.window,   # the chunks layout places tokens by the mask
                  cu_seqlens=None if case.cu_seqlens is None else np.array(case.cu_seqlens))
    try:
        burst_hpc.plan.layout.as_layout(layout, case.seqlen, P, burst_hpc.plan.masks.make(case.seqlen, **placed))
    except burst_hpc.LayoutError:
        layout_for_shards = "contiguous"   # the call must refuse the case's layout
    else:
        layout_for_shards = layout

    def mine(x, axis=1):
        return burst_hpc.shard(x, r, P, layout_for_shards, axis=axis, **placed)

    kw = dict(comm=comm, causal=case.causal, scale=case.scale, layout=called_layout(case.layout, case),
              scheme=case.scheme,
              ranks_per_node=case.ranks_per_node, window=case.window,
              cu_seqlens=None if case.cu_seqlens is None else np.array(case.cu_seqlens))
    dev = [xp.asarray(mine(x)) for x in (q, k, v, do)]
    backward_kw = dict(kw, backward_ring=case.backward_ring)
    if case.disagree is not None and case.disagree[1] != "backward_ring":
        refused_alike(comm, case, dev, kw, lambda arrays, args: burst_hpc.burst_attention(*arrays[:3], **args),
                      layout_refused=layout_for_shards != layout)
    error, got = None, None
    try:
        got = burst_hpc.burst_attention(*dev[:3], **kw)
    except Exception as e:  # noqa: BLE001 - judged by refusal()
        error = e
    message = refusal(comm, error)
    if message is not None:
        return f"refused: {message}"
    if case.disagree is not None and case.disagree[1] == "backward_ring":
        refused_alike(comm, case, dev, backward_kw,
                      lambda arrays, args: burst_hpc.burst_attention_backward(arrays[3], *arrays[:3], *got, **args))
    try:
        grads = burst_hpc.burst_attention_backward(dev[3], *dev[:3], *got, **backward_kw)
    except Exception as e:  # noqa: BLE001 - judged by refusal() (the gather scheme refuses the q-ring)
        error = e
    message = refusal(comm, error)
    if message is not None:
        return f"refused: {message}"
    ours = dict(zip(("o", "lse", "dq", "dk", "dv"), [to_host(x) for x in (*got, *grads)]))
    if case.poison is not None:
        problems = nonfinite_problems(case, ours, q, k, v, do, mine)
    else:
        problems = finite_problems(case, ours, q, k, v, do, mine)
    if case.last_pairs and case.backend == "numpy":
        problems += last_pairs_problems(case, [mine(x) for x in (q, k, v, do)], kw)
    every = comm.allgather(problems)
    bad = [f"rank {rank}: " + ", ".join(p) for rank, p in enumerate(every) if p]
    assert not bad, "; ".join(bad)
    return "ok"


def last_pairs_problems(case, shards, kw):
    """Where the call (arguments ``kw``) on this rank's ``shards`` (q, k, v, do) in bfloat16 with the last-pair
    path on differs from the same call with it off (both backwards take the latter's o and lse). They must
    be the same bit for bit: the path only moves the one rounding of each output to where its rows are last
    written. NaN matches NaN (a non-finite case's payloads may differ). Not against float32 on the same
    values: those runs differ from bfloat16's now and then in float32 rounding, path or not (seed 930054
    on 8 ranks: lse in 45 of 192 elements)."""
    import burst_hpc
    from burst_hpc.dtypes import bfloat16

    q, k, v, do = (x.astype(bfloat16) for x in shards)
    results, base = [], None
    try:
        for on in (False, True):
            with last_pairs_path(on):
                o, lse = burst_hpc.burst_attention(q, k, v, **kw)
                if base is None:
                    base = o, lse
                grads = burst_hpc.burst_attention_backward(do, q, k, v, *base, backward_ring=case.backward_ring, **kw)
            results.append([o, lse, *grads])
    except Exception as e:  # noqa: BLE001 - the drawn call ran, so this one must too
        return [f"last pairs: {type(e).__name__}: {e}"]
    problems = []
    for name, off, on in zip(("o", "lse", "dq", "dk", "dv"), *results):
        bits = f"u{off.dtype.itemsize}"
        differ = (off.view(bits) != on.view(bits)) & ~(np.isnan(off) & np.isnan(on))
        if differ.any():
            problems.append(f"last pairs: {name} differs from the path off in {int(differ.sum())} of {differ.size} "
                            "elements")
    return problems


@contextmanager
def last_pairs_path(on):
    """BURST_HPC_RING_LAST_PAIRS on or off inside, as it was after."""
    name = "BURST_HPC_RING_LAST_PAIRS"
    before = os.environ.get(name)
    os.environ[name] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def refused_alike(comm, case, arrays, kw, call, layout_refused=False):
    """``call(arrays, kw)`` with the case's disagreement on its rank must raise, on every rank and within
    DISAGREE_LIMIT_S, the same RankMismatchError naming the argument (AssertionError otherwise; a rank
    still in the call then prints the reproducer and ends the job). ``layout_refused``: the case's layout
    cannot hold its sequence, so the same LayoutError on every rank, met before the agreement, is right too;
    so is the LayoutError of the disagreeing rank's own layout, where that one cannot hold it."""
    from burst_hpc.device import to_host
    from burst_hpc.dtypes import parse_dtype

    rank, name, value = case.disagree
    if comm.rank == rank:
        if name == "dtype":   # cast on the host, then onto the device as inputs() does
            xp = sys.modules[type(arrays[0]).__module__.split(".")[0]]
            arrays = [xp.asarray(to_host(x).astype(parse_dtype(value))) for x in arrays]
        else:
            value = called_layout(value, case) if name == "layout" else value
            kw = dict(kw, **{name: np.array(value) if name == "cu_seqlens" and value is not None else value})

    def hung():
        sys.stdout.write(f"FAIL {case.line()}\n     rank {comm.rank}: still in the call after {DISAGREE_LIMIT_S} s "
                         f"(a hang); where each thread is:\n")
        sys.stdout.flush()
        faulthandler.dump_traceback(sys.stdout)
        os._exit(1)

    watchdog = threading.Timer(DISAGREE_LIMIT_S, hung)
    watchdog.start()
    error = None
    try:
        call(arrays, kw)
    except Exception as e:  # noqa: BLE001 - judged below
        error = e
    finally:
        watchdog.cancel()
    every = comm.allgather(None if error is None else (type(error).__name__, str(error)))
    ran = [r for r, e in enumerate(every) if e is None]
    assert not ran, f"rank {rank} passed {name}={value!r}, yet the call ran on rank(s) {ran}: {every}"
    assert all(e == every[0] for e in every), f"ranks disagree on the refusal: {every}"
    kind, message = every[0]
    if layout_refused and kind == "LayoutError":
        return
    if name == "layout" and kind == "LayoutError" and message.endswith(f"(rank {rank})"):
        return   # the other layout cannot hold the sequence: that rank's own refusal, told on every rank
    assert kind == "RankMismatchError" and message.startswith(f"ranks disagree on {name}: "), \
        f"not the refusal of the disagreement on {name}: {kind}: {message}"


def finite_problems(case, ours, q, k, v, do, mine):
    """What is out of tolerance against the float64 oracle."""
    from burst_hpc import tolerance as rule

    oracle, plain = expected(case, q, k, v, do)
    grad_scale = max(rule.max_abs(g) for g in oracle[2:])
    problems = []
    for index, name in enumerate(("o", "lse", "dq", "dk", "dv")):
        axis = 2 if name == "lse" else 1
        problems += out_of_tolerance(name, ours[name], mine(oracle[index], axis), mine(plain[index], axis),
                                     grad_scale, case)
    return problems


def nonfinite_problems(case, ours, q, k, v, do, mine):
    """A non-finite input element: the rows whose outputs are not finite must be the oracle's
    (burst_hpc.reference: IEEE arithmetic over the visible pairs), and the finite rows within the
    tolerance the finite cases meet (:func:`tolerance`), the plain computation's error taken on the
    rows where it is finite too. The CUDA kernels promise the exact rows for o and lse with the element
    in q or k; elsewhere (v, the gradients) at least the oracle's rows, since a partly masked tile
    multiplies a hidden pair's weight 0 by its operand (docs/KERNELS.md, "Non-finite inputs")."""
    from burst_hpc import tolerance as rule
    from burst_hpc.reference import attention_backward_reference, attention_reference

    kw = dict(causal=case.causal, scale=case.scale, window=case.window,
              cu_seqlens=None if case.cu_seqlens is None else np.array(case.cu_seqlens))
    f64 = [x.astype(np.float64) for x in (q, k, v, do)]
    oracle = (*attention_reference(*f64[:3], **kw), *attention_backward_reference(f64[3], *f64[:3], **kw))
    # the plain computation multiplies a hidden pair's weight 0 by its operand: NaN where the oracle has
    # a number, which says nothing of rounding (tolerance.plain_error, which job.verify shares)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        plain = rule.plain_attention(*f64[:3], do=f64[3], lowp=np.dtype(q.dtype), **kw)
    grad_scale = max(rule.max_abs(g) for g in oracle[2:])
    problems = []
    for index, name in enumerate(("o", "lse", "dq", "dk", "dv")):
        axis = 2 if name == "lse" else 1
        ref, got = mine(oracle[index], axis), np.asarray(ours[name], np.float64)
        low = np.asarray(mine(plain[index], axis), np.float64)
        bad_ref, bad_got = _nonfinite_rows(ref, name), _nonfinite_rows(got, name)
        exact = case.backend == "numpy" or (name in ("o", "lse") and case.poison[0] != "v")
        if exact and not np.array_equal(bad_ref, bad_got):
            problems.append(f"{name}: {int((bad_ref != bad_got).sum())} rows differ in finiteness from the oracle")
        elif not exact and (bad_ref & ~bad_got).any():
            problems.append(f"{name}: {int((bad_ref & ~bad_got).sum())} rows finite where the oracle's are not")
        both = ~_expand_rows(bad_ref | bad_got, ref, name) & ~(np.isneginf(ref) & np.isneginf(got))
        ref_rows = np.where(both, ref, 0.0)
        problems += out_of_tolerance(name, np.where(both, got, 0.0), ref_rows,
                                     np.where(both, low, ref_rows), grad_scale, case,
                                     what=f"{name}: finite rows")
    return problems


def out_of_tolerance(name, got, ref, low, grad_scale, case, what=None):
    """['WHAT err E > tol T'] when output ``name`` ``got`` is farther from the oracle ``ref`` than
    :func:`tolerance` allows, given the plain same-precision result ``low``; [] when within."""
    from burst_hpc import tolerance as rule

    tol = tolerance(name, rule.plain_error(name, low, ref, case.dtype), rule.max_abs(ref), grad_scale, case)
    err = rule.max_err(got, ref)
    return [] if rule.passes(err, tol) else [f"{what or name} err {err:.3g} > tol {tol:.3g}"]


def _nonfinite_rows(x, name):
    """Which rows hold a non-finite value: (B, S, H) over D, or lse's (B, H, S) itself (-inf is a row
    that sees nothing, finite in that sense)."""
    if name == "lse":
        return np.isnan(x) | np.isposinf(x)
    return ~np.isfinite(x).all(-1)


def _expand_rows(rows, like, name):
    return rows if name == "lse" else np.broadcast_to(rows[..., None], like.shape)


def tolerance(name, plain_err, ref_max, grad_scale, case):
    """burst_hpc.tolerance.tolerance (FlashAttention's rule), with two floors for what the plain computation can get
    right by luck: gradients are judged against the scale of all three (a window of (0, 0) makes dk
    exactly 0 in the plain formulas, from rounding errors ours need not share), dk and dv sum over a
    GQA group; and float64 inputs meet a float32 lse."""
    from burst_hpc import tolerance as rule

    dtype = np.dtype(case.dtype)
    tol = rule.tolerance(name, plain_err, ref_max, dtype)
    if name in ("dq", "dk", "dv"):
        group = case.heads // case.kv_heads if name != "dq" else 1
        floor = rule.ATOL["float32" if dtype == np.float64 else case.dtype]
        tol += floor * np.sqrt(group) * max(1.0, grad_scale)
    elif name == "o" and dtype == np.float64:
        tol += rule.LSE_ATOL * max(1.0, ref_max)
    return tol


def run_seeds(comm, seeds, backend="numpy", dtype=None, log=None, last_pairs=False):
    """Run the cases of ``seeds`` (``last_pairs``: each with the last-pair path on too); returns (counts,
    failures) with one reproducer line per failure."""
    xp = np
    if backend == "cuda":
        import cupy as xp
        import burst_hpc

        burst_hpc.select_device(comm)
    counts, failures = {"ok": 0, "refused": 0, "disagreed": 0, "last_pairs": 0, "ran": {}, "refusals": {}}, []
    for seed in seeds:
        case = draw(seed, comm.size, backend, dtype, last_pairs)
        if log is not None and comm.rank == 0:
            log(f"case {case.line()}")
        try:
            outcome = run_case(comm, case, xp)
        except AssertionError as e:
            failures.append(f"FAIL {case.line()}\n     {e}")
            continue
        counts["ok" if outcome == "ok" else "refused"] += 1
        counts["disagreed"] += case.disagree is not None
        counts["last_pairs"] += outcome == "ok" and case.last_pairs
        tally = counts["ran"] if outcome == "ok" else counts["refusals"]
        what = f"{case.scheme}/{shard_layout(case)}" if outcome == "ok" else outcome[len("refused: "):][:60]
        tally[what] = tally.get(what, 0) + 1
    return counts, failures


# ------------------------------------------------------------------------------------------- soak

def soak(cases, first_seed, max_ranks, timeout, backend, dtype, batch, last_pairs=False):
    """``cases`` cases spread over 1..max_ranks ranks, in mpiexec launches of ``batch`` cases each
    (``last_pairs``: each with the last-pair path on too)."""
    here = os.path.dirname(os.path.abspath(__file__))
    mpiexec = os.environ.get("MPIEXEC") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = "mpiexec"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
               OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(here), os.environ.get("PYTHONPATH")])))
    done, refused, last, failed, seed, start = 0, 0, 0, [], first_seed, time.time()
    tallies = {"ran": {}, "refusals": {}}
    ranks = 1
    while done < cases:
        count = min(batch, cases - done)
        cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py", os.path.join(here, "randomized.py"),
               "--seed", str(seed), "--count", str(count), "--backend", backend]
        if dtype:
            cmd += ["--dtype", dtype]
        if last_pairs:
            cmd += ["--last-pairs"]
        try:
            result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            out, code = result.stdout + result.stderr, result.returncode
        except subprocess.TimeoutExpired as e:
            out, code = f"{e.stdout or ''}{e.stderr or ''}\nTIMEOUT after {timeout}s (a hang)", -1
        summary = re.search(r"randomized: (\d+) ok, (\d+) refused, (\d+) failed", out)
        if summary:
            refused += int(summary.group(2))
            last += int(re.search(r"(\d+) with the last-pair path on too", out).group(1))
        for name, items in re.findall(r"^randomized (ran|refusals): (.*)$", out, re.M):
            for item in filter(None, items.split(" | ")):
                what, _, n = item.rpartition(" ")
                tallies[name][what] = tallies[name].get(what, 0) + int(n)
        failed += [line for line in out.splitlines() if line.startswith("FAIL") or line.startswith("     ")]
        if code != 0 and not summary:   # an abort or a hang: the last case started is the reproducer
            started = [line for line in out.splitlines() if line.startswith("case ")]
            failed.append(f"FAIL (exit {code}) {started[-1][5:] if started else cmd}\n     "
                          + " | ".join(out.strip().splitlines()[-6:]))
        done += count
        seed += count
        print(f"soak: {done}/{cases} cases, {ranks} rank(s), {refused} refused, {last} with the last-pair path, "
              f"{len(failed)} failure lines, "
              f"{time.time() - start:.0f}s", flush=True)
        ranks = ranks % max_ranks + 1
    for name, tally in tallies.items():
        print(f"soak {name}: " + " | ".join(f"{k} {n}" for k, n in sorted(tally.items(), key=lambda kv: -kv[1])))
    return failed


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=None, help="first seed (under mpiexec: run from here)")
    parser.add_argument("--count", type=int, default=1, help="cases from --seed, under mpiexec")
    parser.add_argument("--cases", type=int, default=None, help="soak: this many cases over 1..--max-ranks ranks")
    parser.add_argument("--max-ranks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=25, help="soak: cases per mpiexec launch")
    parser.add_argument("--timeout", type=int, default=900, help="soak: seconds per launch before it counts as a hang")
    parser.add_argument("--backend", choices=("numpy", "cuda"), default="numpy")
    parser.add_argument("--dtype", default=None, help="input dtype (numpy: float64/float32 drawn; cuda: bfloat16)")
    parser.add_argument("--last-pairs", action="store_true",
                        help="every case with the ring's last-pair path on too (numpy: against it off, bit for bit; "
                             "cuda: the calls themselves)")
    args = parser.parse_args()
    dtype = args.dtype or ("bfloat16" if args.backend == "cuda" else None)
    if args.cases is not None:
        failed = soak(args.cases, args.seed or int(time.time()) % 100000 * 1000, args.max_ranks, args.timeout,
                      args.backend, dtype, args.batch, args.last_pairs)
        print("\n".join(failed) if failed else "soak: no failures")
        return 1 if failed else 0
    if args.last_pairs and args.backend == "cuda":   # the inputs are 16-bit there: the path acts on the calls
        os.environ["BURST_HPC_RING_LAST_PAIRS"] = "1"
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    seed = 0 if args.seed is None else args.seed
    log = (lambda s: print(s, flush=True))
    counts, failures = run_seeds(comm, range(seed, seed + args.count), args.backend, dtype, log, args.last_pairs)
    if comm.rank == 0:
        for f in failures:
            print(f, flush=True)
        print(f"randomized: {counts['ok']} ok, {counts['refused']} refused, {len(failures)} failed "
              f"on {comm.size} rank(s); {counts['disagreed']} with ranks disagreeing first, refused alike; "
              f"{counts['last_pairs']} with the last-pair path on too",
              flush=True)
        for name in ("ran", "refusals"):
            print(f"randomized {name}: " + " | ".join(f"{k} {n}" for k, n in sorted(counts[name].items())), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
