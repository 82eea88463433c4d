"""The run job: `burst-hpc run`, usable from Python, as one linear body.

    inspect the input once -> decide the layout and transport once -> create the output (its path
    checked there) -> read this rank's shards -> check them -> plan the call once -> run the passes
    -> write -> publish -> verify (the published file records the outcome)

Every step that can fail on some ranks agrees on the verdict first (collective.agree), so bad input
ends every rank with the same message; an error inside the passes ends the job from the failing rank
(collective.one_fails_all). From Python, under mpiexec::

    from burst_hpc.job import RunOptions, run
    outcome = run(RunOptions("in.h5", "out.h5", causal=True, backward=True, verify=True))
"""
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from . import config, io, jobsafety, masks, verify
from .accounting import attention_flops, visible_pairs
from .callplan import CallPlan
from .collective import agree, describe, one_fails_all, world
from .device import array_device, gpu_count, gpus_shared, select_device
from .dtypes import dtype_name
from .errors import BackendError, BurstError, say
from .transport import choose_transport


@dataclass
class RunOptions:
    """What a run takes (the `run` verb's options; docs/USAGE.md)."""
    input: str
    output: str
    causal: bool = False
    window: tuple = None
    backward: bool = False
    layout: str = None          # None: the default for the mask
    transport: str = "auto"
    backend: str = "auto"       # "numpy", "cuda" or "auto" (cuda when a GPU is visible)
    scheme: str = "auto"
    ranks_per_node: int = None
    backward_ring: str = "auto"
    scale: float = None         # None: head_dim ** -0.5
    verify: bool = False
    verify_rows: int = None     # None: sized by the budget (verify.BUDGET), at most verify.ROWS
    verify_seed: int = 0
    overwrite: bool = False
    allow_nonfinite: bool = False
    warmup: bool = False
    progress: bool = None       # stage lines on rank 0: None shows them for a large job or on a terminal


@dataclass
class Outcome:
    """How a run ended: ``summary`` the one-line report (rank 0's is complete), ``verified`` None
    (not asked), True or False, and the seconds of each pass."""
    summary: str
    verified: bool = None
    forward_s: float = None
    backward_s: float = None


def run(options, comm=None):
    """Run the job on every rank of ``comm`` (MPI.COMM_WORLD by default); returns the Outcome.
    Raises BurstError on bad input (the same on every rank)."""
    comm = world() if comm is None else comm
    rank, size = comm.rank, comm.size
    names = ("q", "k", "v", "do") if options.backward else ("q", "k", "v")

    # inspect once; decide the layout and the transport once
    error, spec, mask, layout, transport, xp, backend = None, None, None, options.layout, None, np, None
    try:
        xp, backend = setup_backend(options.backend, comm)
        spec = io.inspect_input(options.input, names)
        mask = masks.make(spec.seqlen, options.causal, options.window, spec.cu_seqlens)
        if layout is None:
            layout = masks.call_layout(mask, options.causal, size)
    except Exception as e:  # noqa: BLE001 - agreed below
        error = e
    agree(comm, error)
    shared = gpus_shared(comm, xp.cuda.Device() if backend == "cuda" else None)  # collective: NCCL refuses that
    try:
        transport = choose_transport(options.transport, backend == "cuda", shared)
    except Exception as e:  # noqa: BLE001
        error = e
    agree(comm, error)
    scale = options.scale if options.scale is not None else spec.head_dim ** -0.5
    pairs = visible_pairs(spec.seqlen, options.causal, mask)
    flops = [attention_flops(spec.batch, spec.heads, spec.head_dim, pairs, backward) for backward in (False, True)]
    shown = options.progress if options.progress is not None else flops[0] > 2e11 or sys.stderr.isatty()
    progress = Progress(rank == 0 and shown)

    # create the output (the path is checked there, before any data is read)
    if rank == 0:
        for line in jobsafety.stale_note(options.output):
            sys.stderr.write(line + "\n")
    datasets = io.output_datasets(spec, options.backward)
    attrs = {"kind": "outputs", "causal": bool(options.causal), "scale": float(scale),
             "source": os.path.abspath(options.input), "batch": spec.batch, "seqlen": spec.seqlen,
             "heads": spec.heads, "kv_heads": spec.kv_heads, "head_dim": spec.head_dim,
             "dtype": dtype_name(spec.dtype), "backward": bool(options.backward), "run_ranks": size,
             "run_layout": layout, "run_backend": backend, "run_transport": transport,
             "window": "none" if options.window is None else f"{options.window[0]},{options.window[1]}",
             "documents": 0 if spec.cu_seqlens is None else len(spec.cu_seqlens) - 1}
    attrs.update(verify.pending_attrs(datasets, options.verify))
    out = io.OutputFile.create(options.output, comm, datasets, attrs, inputs=[options.input],
                               overwrite=options.overwrite)
    try:
        # read and check this rank's shards
        _, shards = io.read_shards(options.input, comm, layout, names, spec=spec)
        if not options.allow_nonfinite:
            io.check_finite(options.input, shards, comm, layout, spec.seqlen, scale=scale)
        progress(f"read {options.input}: {spec.describe()}, {size} rank(s), layout {layout}, backend {backend}")
        if mask is not None:
            work = masks.rank_work(mask, size, layout)
            progress(f"{mask}: ring steps {masks.ring_steps(mask, size, layout)} of {size}, "
                     f"per-rank work max/mean {max(work) / (sum(work) / size):.3f}")

        # plan the call once, run its passes
        dev = {name: xp.asarray(a) for name, a in shards.items()}
        del shards
        plan = CallPlan(comm, dev["q"], dev["k"], dev["v"], options.causal, scale, layout, transport,
                        backward=(dev["do"], None, None, options.backward_ring) if options.backward else None,
                        cu_seqlens=spec.cu_seqlens, window=options.window, scheme=options.scheme,
                        ranks_per_node=options.ranks_per_node)
        results, seconds = _passes(plan, dev, options, progress, xp)
        if not options.verify:
            del dev
        host = {name: to_host(a) for name, a in results.items()}
        progress(f"writing {options.output}")
        out.write(host, layout)
        summary = _summary(spec, plan, options, backend, transport, flops, seconds)
        summary += verify.nonfinite_summary(host, comm)  # collective; [] when every output is finite

        # publish: nothing can lose the finished result after this
        out.commit()
    except BaseException:
        out.abort()
        raise
    jobsafety.on_stop_say(f"{options.output} is written and complete")
    verified = None
    if options.verify:
        del host
        verified, line = _verify_published(options, comm, spec, dev, results, layout, scale, seconds, progress)
        summary.append(line)
    summary.append(f"-> {options.output}")
    return Outcome("  ".join(summary), verified, *seconds)


def _passes(plan, dev, options, progress, xp):
    """({name: result}, (forward seconds, backward seconds or None)): the passes between barriers,
    each after an untimed warm-up when asked."""
    comm, passes = plan.comm, plan.passes

    def timed(what, call):
        comm.Barrier()
        start = time.perf_counter()
        with array_device(dev["q"]), one_fails_all(comm, what):
            result = call()
            sync(xp)
        comm.Barrier()
        return result, time.perf_counter() - start

    def forward(on_step=None):
        return passes.forward(dev["q"], dev["k"], dev["v"], on_step=on_step)

    def backward(o, lse, on_step=None):
        return passes.backward(plan.ring, dev["do"], dev["q"], dev["k"], dev["v"], o, lse, on_step=on_step)

    if options.warmup:
        progress("warm-up pass (kernel compilation, transport set-up), not timed")
        o, lse = timed("the forward warm-up", forward)[0]
        if options.backward:
            timed("the backward warm-up", lambda: backward(o, lse))
    progress("forward")
    (o, lse), t_fwd = timed("the forward pass", lambda: forward(progress.ring("forward", xp)))
    results, t_bwd = {"o": o, "lse": lse}, None
    if options.backward:
        progress(f"forward done in {t_fwd:.3f}s; backward")
        (dq, dk, dv), t_bwd = timed("the backward pass", lambda: backward(o, lse, progress.ring("backward", xp)))
        results.update(dq=dq, dk=dk, dv=dv)
    return results, (t_fwd, t_bwd)


def _summary(spec, plan, options, backend, transport, flops, seconds):
    (t_fwd, t_bwd), (fwd_flops, bwd_flops) = seconds, flops
    parts = [f"burst-hpc run: tokens={spec.batch * spec.seqlen} ({spec.describe()})", f"ranks={plan.size}",
             f"layout={plan.layout}", "causal" if options.causal else "non-causal"]
    if options.window is not None:
        parts.append(f"window={options.window[0]},{options.window[1]}")
    if options.scheme != "auto" or options.ranks_per_node is not None:
        per_node = "" if options.ranks_per_node is None else f"({options.ranks_per_node}/node)"
        parts.append(f"scheme={plan.scheme.name}{per_node}")
    parts += [f"backend={backend}", f"transport={transport}",
              f"fwd {t_fwd:.3f}s {fwd_flops / max(t_fwd, 1e-12) / 1e12:.3g} TFLOP/s"]
    if t_bwd is not None:
        parts.append(f"bwd {t_bwd:.3f}s {bwd_flops / max(t_bwd, 1e-12) / 1e12:.3g} TFLOP/s")
    return parts


def _verify_published(options, comm, spec, inputs, results, layout, scale, seconds, progress):
    """--verify after the output is published, on the shards the job holds (on its GPU for CuPy runs with
    BURST_HPC_VERIFY_ON_GPU=1, else on host copies):
    the output's attributes say verify = 'not finished' until rank 0 records the outcome (a job stopped
    meanwhile keeps its complete output, so marked). Without --verify-rows the sample is sized to
    cost at most verify.BUDGET of the passes' time. Returns (passed, the summary's verify entry)."""
    from .layout import layout_indices

    jobsafety.on_stop_say(f"{options.output} is written and complete, but its verification did not finish "
                          "(its attribute verify says 'not finished')")
    _test_hook_verify_pause()
    if not isinstance(inputs["q"], np.ndarray) and not config.verify_on_gpu():
        inputs, results = ({name: to_host(a) for name, a in arrays.items()} for arrays in (inputs, results))
    where = "numpy" if isinstance(inputs["q"], np.ndarray) else "cuda"
    budget = None if options.verify_rows is not None else verify.BUDGET[where] * sum(s for s in seconds if s)
    announce = Progress(comm.rank == 0 and options.progress is not False)  # the predicted cost, unless --quiet
    announce.t0 = progress.t0
    try:
        report = verify.verify_resident(inputs, results, layout_indices(spec.seqlen, comm.rank, comm.size, layout),
                                        spec, comm, options.causal, scale, options.window,
                                        rows=options.verify_rows or verify.ROWS, seed=options.verify_seed,
                                        budget_s=budget, announce=announce, progress=progress)
    except BurstError as e:
        error = BurstError(f"{e}; {options.output} is written and complete, its verification did not finish")
        error.agreed = getattr(e, "agreed", False)
        raise error from None
    outcome = "pass" if report["ok"] else "fail"
    if comm.rank == 0:
        try:
            verify.record(options.output, report)
        except Exception as e:  # noqa: BLE001 - the result stands; only its mark could not be written
            outcome = "not finished"
            say(f"verification {'passed' if report['ok'] else 'failed'} but {options.output} could not be "
                f"marked so (its attribute verify still says 'not finished'): {describe(e).splitlines()[0]}", "note")
    jobsafety.on_stop_say(f"{options.output} is written and complete (verify = '{outcome}')")
    errs = " ".join(f"{name}={report['err'][name]:.2e}/{report['tol'][name]:.1e}" for name in report["err"])
    return report["ok"], (f"verify={'PASS' if report['ok'] else 'FAIL'}({report['mode']}) {report['seconds']:.2f}s "
                          f"max_err/tol {errs}")


def _test_hook_verify_pause():
    seconds = config.test_hook_verify_pause()
    if seconds > 0:
        time.sleep(seconds)


def setup_backend(name, comm):
    """(xp, backend name): NumPy, or CuPy with this rank on a GPU (local rank mod GPU count)."""
    if name == "auto":
        name = "cuda" if gpu_count() else "numpy"
    if name == "numpy":
        return np, "numpy"
    try:
        import cupy
    except Exception as e:  # noqa: BLE001
        raise BackendError(f"--backend cuda needs CuPy ({type(e).__name__}: {e}); install it with "
                           "pip install cupy-cuda12x (or cupy-cuda13x), or use --backend numpy") from None
    if gpu_count() == 0:
        raise BackendError("--backend cuda: no GPU visible to this rank; use --backend numpy")
    select_device(comm)
    return cupy, "cuda"


def to_host(x):
    """A NumPy array of ``x`` (a copy from the GPU for CuPy arrays)."""
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy.asnumpy(x)
    return x


def sync(xp):
    """Wait for the GPU's queued work (nothing on NumPy)."""
    if xp is not np:
        xp.cuda.Device().synchronize()


class Progress:
    """Stage lines on stderr when enabled (the CLI enables them on rank 0): '[burst-hpc   1.2s] forward'."""

    def __init__(self, enabled):
        self.enabled = enabled
        self.t0 = time.perf_counter()

    def __call__(self, message):
        if self.enabled:
            sys.stderr.write(f"[burst-hpc {time.perf_counter() - self.t0:7.1f}s] {message}\n")
            sys.stderr.flush()

    def ring(self, stage, xp, lines=20):
        """An ``on_step`` callback for one pass: 'forward: ring step 3/8, ETA 12.0s', at most about
        ``lines`` lines a pass (None when disabled). On the GPU it waits for the queued kernels first,
        so the count and the ETA are of finished work."""
        if not self.enabled:
            return None
        start = time.perf_counter()

        def on_step(done, total):
            if done < total and done * lines // total == (done - 1) * lines // total:
                return
            sync(xp)
            elapsed = time.perf_counter() - start
            self(f"{stage}: ring step {done}/{total}, {elapsed:.1f}s, ETA {elapsed / done * (total - done):.1f}s")

        return on_step
