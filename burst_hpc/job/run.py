"""The run job: `burst-hpc run`, usable from Python, as one linear body.

    inspect the input once -> its Decomposition (plan/decomposition.py: layout, topology, scheme,
    transport and backward ring, decided once in one agreement) -> create the output (its path
    checked there) -> read this rank's shards -> check them -> bind the decomposition to the backend
    and set up the passes -> run the passes -> write -> publish -> verify (the published file
    records the outcome) -> the report (report.py: the summary line, the output's attributes, the
    --json file)

Each phase (report.PHASES) is timed between barriers (:class:`Phases`); the set-up rehearses the
passes (passes.py) so the timed passes do not pay for first use (kernel loads, communicators,
allocations).

The ranks first agree on the options (RunOptions.shaping: ranks that differ in one get one
RankMismatchError naming it, before anything is read or created). Every step that can fail on some
ranks agrees on the verdict first (collective.agree), so bad input ends every rank with the same
message; an error inside the passes ends the job from the failing rank (collective.one_fails_all).
From Python, under mpiexec::

    from burst_hpc.job.run import RunOptions, run
    outcome = run(RunOptions("in.h5", "out.h5", causal=True, backward=True, verify=True))
"""
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .. import config, io
from . import leftovers, report, safety, verify
from ..plan import masks
from ..plan.accounting import attention_flops, visible_pairs
from ..collective import agree, describe, one_fails_all, world
from ..plan.decomposition import Decomposition
from ..device import HOW_TO_GET_CUPY, array_device, array_module, gpu_count, select_device, sync, to_host
from ..errors import BackendError, BurstError, say
from ..engine.passes import ComputeClock
from .progress import Progress


@dataclass
class RunOptions:
    """What a run takes (the `run` verb's options; docs/USAGE.md)."""
    input: str
    output: str
    causal: bool = False
    window: tuple = None
    backward: bool = False
    layout: str = None          # None: the one predicted fastest (costmodel.choose_layout)
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
    json: str = None            # write the report to this file (rank 0), as one JSON object

    def shaping(self):
        """The options every rank of a job must pass alike, by name: all but ``progress`` (rank 0's
        lines), the paths absolute (ranks in different directories may name one file differently)."""
        paths = ("input", "output", "json")
        return {name: os.path.abspath(value) if name in paths and value is not None else value
                for name, value in vars(self).items() if name != "progress"}


@dataclass
class Outcome:
    """How a run ended: ``summary`` the one-line report (rank 0's is complete), ``verified`` None
    (not asked), True or False, and ``report`` the facts of the run (the --json object: ``seconds``
    of each phase and in all, ``tflops``, sizes, choices, device, versions; rank 0's clock)."""
    summary: str
    verified: bool = None
    report: dict = None

    @property
    def forward_s(self):
        """Seconds of the forward pass."""
        return self.report["seconds"]["forward"]

    @property
    def backward_s(self):
        """Seconds of the backward pass (None without one)."""
        return self.report["seconds"]["backward"]


class Phases:
    """The wall seconds of the job's phases (report.PHASES) on this rank's clock. A phase starts and
    ends at a barrier with the GPU's queued work finished, so every rank times the same interval,
    the slowest rank's time of it. Use only where every rank gets through or the job ends (an
    agreed error raises on every rank before the closing barrier; one_fails_all aborts)."""

    def __init__(self, comm):
        self.comm, self.xp = comm, np
        self.seconds = dict.fromkeys(report.PHASES)
        self.start = self.mark()

    def mark(self):
        """The clock, read once every rank's queued work is done and every rank is here."""
        sync(self.xp)
        self.comm.Barrier()
        return time.perf_counter()

    def add(self, phase, seconds):
        self.seconds[phase] = (self.seconds[phase] or 0.0) + seconds

    @contextmanager
    def __call__(self, phase):
        start = self.mark()
        yield
        self.add(phase, self.mark() - start)

    def total(self):
        """Every phase's seconds and, "total", the seconds since the job started."""
        return dict(self.seconds, total=self.mark() - self.start)


def run(options, comm=None):
    """Run the job on every rank of ``comm`` (MPI.COMM_WORLD by default); returns the Outcome.
    Raises BurstError on bad input (the same on every rank)."""
    comm = world() if comm is None else comm
    agree(comm, None, options.shaping())   # before any collective that an option decides (which ones, how many)
    rank, size = comm.rank, comm.size
    names = ("q", "k", "v", "do") if options.backward else ("q", "k", "v")
    clock = Phases(comm)

    # inspect once
    error, spec, xp, backend = None, None, np, None
    interval = device = versions = None
    try:
        if rank == 0 and options.json is not None:
            report.check_json_path(options.json, (options.input, options.output))
        interval = config.progress_seconds()
        xp, backend = setup_backend(options.backend, comm)
        device, versions = report.device_name(xp), report.versions(xp)
        spec = io.inspect_input(options.input, names)
    except Exception as e:  # noqa: BLE001 - agreed below
        error = e
    agree(comm, error)
    clock.xp = xp
    clock.add("setup", time.perf_counter() - clock.start)  # the backend's start; agree() met every rank

    # the decomposition: layout, topology, scheme, transport and backward ring, decided once
    with clock("setup"):
        d = decomposition_of(comm, spec, options, backend)
    layout, transport, scale, mask = d.layout, d.transport_name, d.scale, d.mask
    pairs = visible_pairs(mask)
    flops = [attention_flops(spec.batch, spec.heads, spec.head_dim, pairs, backward) for backward in (False, True)]
    shown = options.progress if options.progress is not None else flops[0] > 2e11 or sys.stderr.isatty()
    progress = Progress(rank == 0 and shown, interval)
    facts = report.start(options, spec, size, {"layout": layout.kind, "transport": transport, "backend": backend},
                         device, versions, pairs, flops)

    # create the output (the path is checked there, before any data is read)
    if rank == 0:
        for line in leftovers.stale_note(options.output):
            sys.stderr.write(line + "\n")
    datasets = io.output_datasets(spec, options.backward)
    attrs = report.output_attrs(facts, scale)
    attrs.update(verify.pending_attrs(datasets, options.verify))
    attrs.update(report.pending_attrs())
    out = io.OutputFile.create(options.output, comm, datasets, attrs, inputs=[options.input],
                               overwrite=options.overwrite)
    try:
        # read and check this rank's shards, onto the device
        with clock("read"):
            _, shards = io.read_shards(options.input, comm, layout, names, spec=spec)
            if not options.allow_nonfinite:
                io.check_finite(options.input, shards, comm, layout, scale=scale)
            dev = {name: xp.asarray(a) for name, a in shards.items()}
            del shards
        progress(f"read {options.input}: {spec.describe()}, {size} rank(s), layout {layout.kind}, backend {backend}")
        if mask.kind == "intervals" and progress.enabled:   # documents or a window: each rank's share of the work
            work = d.work()
            steps = "" if d.scheme.name == "gather" else f", ring steps {masks.ring_steps(mask, layout)} of {size}"
            progress(f"{mask}: per-rank work max/mean {max(work) / (sum(work) / size):.3f} ({d.scheme.name}){steps}")

        # bind the decomposition to the backend, set up its passes (and --verify's costs), run them
        with clock("setup"):
            plan = d.bind(dev["q"], ("fwd", "bwd") if options.backward else ("fwd",))
            rates = _verify_rates(options, spec, scale, xp, comm) if options.verify else None
        facts.update(scheme=plan.scheme.name, backward_ring=plan.ring)
        results, ranks = _passes(plan, dev, options, progress, xp, clock)
        facts["ranks"] = report.rank_entries(ranks)
        if not options.verify:
            del dev
        progress(f"writing {options.output}")
        with clock("write"):
            host = {name: to_host(a) for name, a in results.items()}
            out.write(host, layout)
        summary = _summary(spec, plan, options, backend, transport, flops, clock.seconds)
        summary += verify.nonfinite_summary(results, comm)  # collective, on the device; [] when all finite

        # publish: nothing can lose the finished result after this
        out.commit()
    except BaseException:
        out.abort()
        raise
    safety.on_stop_say(f"{options.output} is written and complete")
    verified, checked = None, None
    if options.verify:
        del host
        with clock("verify"):
            passes_s = (clock.seconds["forward"], clock.seconds["backward"])
            checked, line = _verify_published(options, comm, spec, dev, results, d, passes_s, progress, rates)
        verified = checked["ok"]
        summary.append(line)
    facts.update(_outcome(clock.total(), flops, checked, size))
    summary += [report.seconds_text(facts["seconds"]), f"-> {options.output}"]
    _publish_report(options, comm, facts)
    return Outcome("  ".join(summary), verified, facts)


def decomposition_of(comm, spec, options, backend):
    """Collective: the Decomposition of the input ``spec`` with the run's options: the layout named,
    or the one predicted fastest (the job shards the file itself)."""
    return Decomposition(comm, seqlen=spec.seqlen, heads=spec.heads, kv_heads=spec.kv_heads, head_dim=spec.head_dim,
                         dtype=spec.dtype, batch=spec.batch, causal=options.causal, scale=options.scale,
                         cu_seqlens=spec.cu_seqlens, window=options.window,
                         layout="auto" if options.layout is None else options.layout, scheme=options.scheme,
                         transport=options.transport, backward_ring=options.backward_ring,
                         ranks_per_node=options.ranks_per_node, backend=backend, backward=options.backward)


def _passes(plan, dev, options, progress, xp, clock):
    """({name: result}, every rank's {pass: (seconds, seconds in its block kernels)}): the set-up of the
    passes (their rehearsal, then the warm-up passes when asked), then the passes, each a phase of
    ``clock``; a rank's seconds of a pass run from the phase's start to its own end."""
    comm, passes = plan.comm, plan.passes
    own = {}

    @contextmanager
    def phase(name, what):
        with array_device(dev["q"]), one_fails_all(comm, what), clock(name):
            yield

    def forward(**mode):
        return passes.forward(dev["q"], dev["k"], dev["v"], **mode)

    def backward(o, lse, **mode):
        return passes.backward(plan.ring, dev["do"], dev["q"], dev["k"], dev["v"], o, lse, **mode)

    def both(**mode):
        o, lse = forward(**mode)
        if options.backward:
            backward(o, lse, **mode)

    progress("set-up: rehearsing the passes (kernels, communicators, buffers)")
    with phase("setup", "the set-up of the passes"):
        both(rehearse=True)
        if options.warmup:
            progress("warm-up passes (counted in set-up)")
            both()
    def timed(name, run):
        compute, began = ComputeClock(xp), time.perf_counter()
        out = run(meter=progress.meter(name, xp), clock=compute)
        sync(xp)
        own[name] = (time.perf_counter() - began, compute.seconds())
        return out

    progress(f"set-up done in {clock.seconds['setup']:.3f}s; forward")
    with phase("forward", "the forward pass"):
        o, lse = timed("forward", forward)
    results = {"o": o, "lse": lse}
    if options.backward:
        progress(f"forward done in {clock.seconds['forward']:.3f}s; backward")
        with phase("backward", "the backward pass"):
            results.update(zip(("dq", "dk", "dv"), timed("backward", lambda **mode: backward(o, lse, **mode))))
    return results, comm.allgather(own)


def _outcome(seconds, flops, checked, ranks):
    """The report's entries known at the end: seconds, TFLOP/s (the job's, FlashAttention count, and
    per rank: per GPU) and the verification (None when not asked)."""
    rates = {name: None if seconds[name] is None else flops[i] / max(seconds[name], 1e-12) / 1e12
             for i, name in enumerate(report.PASSES)}
    per_rank = {name: None if rate is None else rate / ranks for name, rate in rates.items()}
    found = None
    if checked is not None:
        found = {"outcome": "pass" if checked["ok"] else "fail", "mode": checked["mode"],
                 "rows": checked["rows"], "predicted_s": checked["predicted_s"],
                 "max_err": {name: float(e) for name, e in checked["err"].items()},
                 "tol": {name: float(t) for name, t in checked["tol"].items()}}
    return {"seconds": seconds, "tflops": rates, "tflops_per_rank": per_rank, "verify": found}


def _publish_report(options, comm, facts):
    """Rank 0 records the report in the output's attributes (a failure is a note: the output stands)
    and writes it to --json (a failure ends the job, on every rank, after the output is complete)."""
    error = None
    if comm.rank == 0:
        try:
            report.record(options.output, facts)
        except Exception as e:  # noqa: BLE001 - the result stands; only its report could not be written
            say(f"{options.output} is written and complete, but its report attributes (seconds_*, tflops_*) "
                f"could not be recorded: {describe(e).splitlines()[0]}", "note")
        if options.json is not None:
            try:
                report.write_json(options.json, facts)
            except BurstError as e:
                error = BurstError(f"{e}; {options.output} is written and complete")
    agree(comm, error)


def _summary(spec, plan, options, backend, transport, flops, seconds):
    (t_fwd, t_bwd), (fwd_flops, bwd_flops) = (seconds["forward"], seconds["backward"]), flops
    parts = [f"burst-hpc run: tokens={spec.batch * spec.seqlen} ({spec.describe()})", f"ranks={plan.size}",
             f"layout={plan.layout.kind}", "causal" if options.causal else "non-causal"]
    if options.window is not None:
        parts.append(f"window={options.window[0]},{options.window[1]}")
    if options.scheme != "auto" or options.ranks_per_node is not None:
        per_node = "" if options.ranks_per_node is None else f"({options.ranks_per_node}/node)"
        parts.append(f"scheme={plan.scheme.name}{per_node}")
    unit = "GPU" if backend == "cuda" else "rank"

    def rate(name, seconds, count):
        tflops = count / max(seconds, 1e-12) / 1e12
        return f"{name} {seconds:.3f}s {tflops:.3g} TFLOP/s ({tflops / plan.size:.3g}/{unit})"

    parts += [f"backend={backend}", f"transport={transport}", rate("fwd", t_fwd, fwd_flops)]
    if t_bwd is not None:
        parts.append(rate("bwd", t_bwd, bwd_flops))
    return parts


def _verify_xp(xp):
    """Where --verify runs: on the passes' GPU (CuPy) unless BURST_HPC_VERIFY_ON_GPU is off, else NumPy."""
    return xp if xp is not np and config.verify_on_gpu() else np


def _verify_rates(options, spec, scale, xp, comm):
    """Collective, in the set-up: --verify's costs on this rank's device (verify.calibrate; its first go
    loads what the check uses), so the check's budget and prediction are its own and it pays no first
    use; a failure on any rank ends the job on every rank."""
    error, rates = None, None
    try:
        rates = verify.calibrate(spec, scale, options.backward, _verify_xp(xp))
    except Exception as e:  # noqa: BLE001
        error = e if isinstance(e, BurstError) else BurstError(f"--verify could not measure its cost: {describe(e)}")
    agree(comm, error)
    return rates


def _verify_published(options, comm, spec, inputs, results, decomposition, seconds, progress, rates):
    """--verify after the output is published, on the shards the job holds (``decomposition``'s: on its GPU
    for CuPy runs, on host copies with BURST_HPC_VERIFY_ON_GPU=0), under the run's mask:
    the output's attributes say verify = 'not finished' until rank 0 records the outcome (a job stopped
    meanwhile keeps its complete output, so marked). Without --verify-rows the sample is sized to
    cost at most verify.BUDGET of the passes' time (``seconds``), by ``rates`` (verify.Rates, from the
    set-up). Returns (verify's report, the summary's verify entry)."""
    safety.on_stop_say(f"{options.output} is written and complete, but its verification did not finish "
                          "(its attribute verify says 'not finished')")
    _test_hook_verify_pause()
    if _verify_xp(array_module(inputs["q"])) is np:
        inputs, results = ({name: to_host(a) for name, a in arrays.items()} for arrays in (inputs, results))
    where = "numpy" if isinstance(inputs["q"], np.ndarray) else "cuda"
    budget = None if options.verify_rows is not None else verify.BUDGET[where] * sum(s for s in seconds if s)
    announce = Progress(comm.rank == 0 and options.progress is not False)  # the predicted cost, unless --quiet
    announce.t0 = progress.t0
    try:
        d = decomposition
        report = verify.verify_resident(inputs, results, d.indices(), spec, comm, d.mask, d.scale,
                                        rows=options.verify_rows or verify.ROWS, seed=options.verify_seed,
                                        budget_s=budget, announce=announce, progress=progress, rates=rates)
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
    safety.on_stop_say(f"{options.output} is written and complete (verify = '{outcome}')")
    errs = " ".join(f"{name}={report['err'][name]:.2e}/{report['tol'][name]:.1e}" for name in report["err"])
    return report, (f"verify={'PASS' if report['ok'] else 'FAIL'}({report['mode']}) {report['seconds']:.2f}s "
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
        raise BackendError(f"--backend cuda needs CuPy ({type(e).__name__}: {e}); {HOW_TO_GET_CUPY}, "
                           "or use --backend numpy") from None
    if gpu_count() == 0:
        raise BackendError("--backend cuda: no GPU visible to this rank; use --backend numpy")
    select_device(comm)
    return cupy, "cuda"
