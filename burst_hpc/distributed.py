"""burst_attention: exact attention over a sequence sharded across the ranks of an MPI communicator.

Each rank passes its own shard (in ``layout``) of q, k, v. The forward pass sends K/V around
the ring and merges partial results (GAO); the backward pass reuses (o, lse) from the forward
pass and sends either the query side (q-ring) or K/V (kv-ring) around, whichever moves fewer
bytes. With the balanced layout and a causal mask, documents or a window the schedule deals
the visible work of every chunk pair to ranks instead (balance.py): a piece of rows runs on a
rank the data travels to, which returns its partials (o, lse), dq or dk, dv to their owners.

Each call is its plan (a layout's name made into the Layout of the shards' sequence, placed by the call's
mask; callplan.checked_call checks the arguments into the Decomposition's request;
callplan.plan_arrays builds the Decomposition of the shards' shapes, agreed by every rank in one
collective, bound to their backend; callplan.plan_call reuses a repeated call's) and its passes
(passes.py), run so that an error on some ranks ends every rank (collective.one_fails_all).
"""
from . import config
from .plan.callplan import Backward, checked_call, plan_call
from .plan.layout import as_layout
from .collective import check_comm, one_fails_all, world
from .device import array_device
from .recent import Recent
from .validate import given_key

_CALLS = Recent(32)   # the checked Calls of recent argument sets (a training step repeats a few: forward, backward)


def named_layout(layout, q, comm, causal, cu_seqlens, window):
    """(the Layout of ``layout``, a name or a Layout, over the call's sequence and ranks, None), or (None, the
    error making it raised): an error the plan's agreement raises on every rank (a rank raising alone would
    leave the others waiting in it). None stays None: the default."""
    if layout is None:
        return None, None
    try:
        return as_layout(layout, q.shape[1] * comm.size, comm.size, causal=causal, cu_seqlens=cu_seqlens,
                         window=window), None
    except Exception as e:  # noqa: BLE001  handed to checked_call, agreed in the plan's collective
        return None, e


def planned(comm, q, k, v, causal, scale, layout, transport, cu_seqlens, window, scheme, ranks_per_node,
            backward=None):
    """Collective: the CallPlan of a library call (callplan.plan_call) from its arguments as given. A call whose
    arguments (the arrays' kinds, shapes and dtypes, every option, the document offsets by value, the plan's
    settings) equal a recent successful call's takes that call's checked Call and key instead of checking and
    naming them again (they are a function of those arguments alone): a short call's host time, which at 8k
    tokens a GPU is a sizable share of it. Ranks still agree on the plan every call (plan_call)."""
    given = _given(comm, (q, k, v) + (() if backward is None else (backward.do, backward.o, backward.lse)),
                   (causal, scale, layout, transport, window, scheme, ranks_per_node,
                    None if backward is None else backward.ring), cu_seqlens)
    kept = None if given is None else _CALLS.get(given)
    if kept is None:
        named, error = named_layout(layout, q, comm, causal, cu_seqlens, window)
        call = checked_call(comm.size, q, k, v, causal, scale, named, transport, backward=backward,
                            cu_seqlens=cu_seqlens, window=window, scheme=scheme, ranks_per_node=ranks_per_node,
                            error=error)
        kept = call, call.key(comm)
        if given is not None and call.error is None:
            _CALLS.put(given, kept)
    return plan_call(comm, q, kept[0], key=kept[1])


def _given(comm, arrays, options, cu_seqlens):
    """validate.given_key of a library call's arguments over ``comm`` with the plan's settings, or None."""
    key = given_key(options, cu_seqlens, arrays)
    return None if key is None else (id(comm), comm.size, key, config.plan_settings())


def burst_attention(q, k, v, comm=None, causal=False, scale=None, layout=None, transport="auto", cu_seqlens=None,
                    window=None, scheme="auto", ranks_per_node=None, on_step=None):
    """This rank's (o, lse) of exact attention over the whole sequence sharded across ``comm``.

    Parameters
    ----------
    q : array (B, S/P, Hq, D)
        This rank's query shard in ``layout`` (NumPy runs on the CPU, CuPy on this rank's GPU).
    k, v : array (B, S/P, Hkv, D)
        Its key and value shards; Hq a multiple of Hkv (GQA/MQA). Same kind and dtype as ``q``.
    comm : mpi4py communicator, optional
        The ranks holding the sequence (default MPI.COMM_WORLD).
    causal : bool
        Key j visible from query i only when j <= i (global positions).
    scale : float, optional
        Score scale (default D ** -0.5).
    layout : Layout or {'contiguous', 'zigzag', 'balanced', 'chunks'}, optional
        How the shards were cut (burst_hpc.shard; a name is made into a Layout of the call's sequence
        and ranks, 'chunks' placed by the call's mask, before the ranks agree: a bad one is refused
        on every rank). Default: zigzag when causal, contiguous otherwise,
        whatever ``cu_seqlens`` and ``window`` hold (a default never changes with the data). The
        layout the cost model predicts fastest for this call is ``burst_hpc.choose_layout(...)``:
        shard by it and pass it here. 'balanced' shards are contiguous ones (natural token order)
        with the visible work (causal, documents, windows) balanced by the schedule; 'chunks' shards
        are chunks placed by the mask (``burst_hpc.shard(..., causal=, cu_seqlens=, window=)``).
    transport : {'auto', 'host', 'mpi', 'nccl', 'staged'}
        How shards travel (auto: the fastest available, logged).
    cu_seqlens : 1-D integer array, optional
        Global document offsets [0, ..., S] of a packed sequence, the same on every rank.
    window : (int, int), optional
        (left, right) sliding window, -1 unbounded (flash-attn's meaning).
    scheme : {'auto', 'ring', 'double_ring', 'ulysses_ring', 'gather'}
        How shards move: across nodes, or 'gather' (each rank receives only the keys and values its
        queries see). auto: 'gather' for the chunks layout, else 'ring' on one node, else the cost
        model's pick.
    ranks_per_node : int, optional
        Overrides the node detection (or BURST_HPC_RANKS_PER_NODE): one host can act as several nodes.
    on_step : callable, optional
        ``on_step(done, total)`` after each of this rank's ring steps (progress reports).

    Returns
    -------
    o : array like q
        This rank's rows of the output.
    lse : float32 array (B, Hq, S/P)
        Their natural-log sum-exp (-inf for a row that sees nothing, where o is 0).

    Raises
    ------
    BurstError
        On bad input, with the same message on every rank, before any exchange: ranks that pass
        different arguments (any of the above but ``on_step``, and the arrays' kind, shapes and dtype)
        get a RankMismatchError naming the first that differs. An error inside the pass on some ranks
        ends the job from there (collective.one_fails_all), never a hang. A ``comm`` that is not an
        mpi4py communicator is refused on the rank that passes it.

    Notes
    -----
    NaN or Inf inputs are not refused: they reach exactly the rows that see them (DESIGN.md).

    Examples
    --------
    ``mpiexec -n 4 python job.py`` with, in job.py::

        from mpi4py import MPI
        import burst_hpc
        r, P = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
        mine = lambda x: burst_hpc.shard(x, r, P, "zigzag")   # causal: the default layout
        o, lse = burst_hpc.burst_attention(mine(q), mine(k), mine(v), causal=True)
        # packed documents: the layout predicted fastest, the same on every rank
        layout = burst_hpc.choose_layout(S, P, causal=True, cu_seqlens=cu, heads=q.shape[2], kv_heads=k.shape[2])
        fast = lambda x: layout.shard(x, r)
        o, lse = burst_hpc.burst_attention(fast(q), fast(k), fast(v), causal=True, cu_seqlens=cu, layout=layout)
    """
    comm = world() if comm is None else check_comm(comm)
    plan = planned(comm, q, k, v, causal, scale, layout, transport, cu_seqlens, window, scheme, ranks_per_node)
    with array_device(q), one_fails_all(comm, "burst_attention"):
        return plan.passes.forward(q, k, v, on_step=on_step)


def burst_attention_backward(do, q, k, v, o, lse, comm=None, causal=False, scale=None, layout=None,
                             transport="auto", backward_ring="auto", cu_seqlens=None, window=None, scheme="auto",
                             ranks_per_node=None, on_step=None):
    """This rank's (dq, dk, dv) of the loss sum(do * o), reusing (o, lse) from burst_attention (the
    forward is never recomputed across ranks).

    Parameters
    ----------
    do : array like q
        This rank's output gradient.
    q, k, v, o, lse :
        As burst_attention took and returned them.
    backward_ring : {'auto', 'q', 'kv'}
        Which side travels (auto: the one moving fewer bytes over the steps that have work).
    comm, causal, scale, layout, transport, cu_seqlens, window, scheme, ranks_per_node, on_step :
        As burst_attention's, and the same as its call.

    Returns
    -------
    dq : array like q
    dk, dv : arrays like k
        This rank's gradients, in the input dtype (float32 accumulation).

    Raises
    ------
    BurstError
        As burst_attention's.

    Examples
    --------
    ::

        o, lse = burst_hpc.burst_attention(q, k, v, causal=True)
        dq, dk, dv = burst_hpc.burst_attention_backward(do, q, k, v, o, lse, causal=True)
    """
    comm = world() if comm is None else check_comm(comm)
    plan = planned(comm, q, k, v, causal, scale, layout, transport, cu_seqlens, window, scheme, ranks_per_node,
                   backward=Backward(do, o, lse, backward_ring))
    with array_device(q), one_fails_all(comm, "burst_attention_backward"):
        return plan.passes.backward(plan.ring, do, q, k, v, o, lse, on_step=on_step)


__all__ = ["burst_attention", "burst_attention_backward"]
