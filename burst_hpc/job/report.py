"""The facts of a run, in one place for its three readers: the summary line, the ``--json`` object
and the output file's attributes (docs/USAGE.md, "The run's report").

The seconds are wall seconds of the job's phases (PHASES) and in all ("total"), each phase timed
by the run job between barriers with the GPU's queued work finished (job.Phases): rank 0's clock,
which is the slowest rank's time of the phase. A phase that did not run is None (NaN in the file).
"""
import json
import os
import platform
import sys

import numpy as np

from .. import __version__
from ..dtypes import dtype_name
from ..errors import FileError
from ..io.format import fixed_text, modify_attrs

PHASES = ("read", "setup", "forward", "backward", "write", "verify")
SECONDS = PHASES + ("total",)
PASSES = ("forward", "backward")
SCHEME_BYTES = 16   # room for the scheme's name, which is known only once the plan is made

TIMING = ("wall seconds on rank 0 between barriers, the GPU's queued work finished at each (a phase's time is "
          "the slowest rank's); setup: the backend's start (and the input's inspection), the plan, the "
          "rehearsal of the passes (their kernels loaded, communicators connected, buffers allocated) and "
          "the warm-up passes when asked; total: from the job's start to the end of its verification")


def start(options, spec, ranks, choices, device, versions, pairs, flops):
    """The report's facts known before any work: the run's options (job.RunOptions), its sizes
    (``spec``, an io.InputSpec, on ``ranks`` ranks), ``choices`` ({"layout", "transport",
    "backend"}), ``device``, ``versions``, the visible ``pairs`` and the (forward, backward) ``flops``
    (the job's, FlashAttention count). The run adds the scheme, the seconds, the rates and the
    verification."""
    sizes = {"batch": spec.batch, "seqlen": spec.seqlen, "tokens": spec.batch * spec.seqlen, "heads": spec.heads,
             "kv_heads": spec.kv_heads, "head_dim": spec.head_dim, "dtype": dtype_name(spec.dtype), "ranks": ranks,
             "visible_pairs": pairs, "documents": 0 if spec.cu_seqlens is None else len(spec.cu_seqlens) - 1}
    return dict(choices, command="burst-hpc run", input=os.path.abspath(options.input),
                output=os.path.abspath(options.output), timing=TIMING, sizes=sizes, causal=bool(options.causal),
                window=None if options.window is None else list(options.window), backward=bool(options.backward),
                device=device, versions=versions, warmup=bool(options.warmup),
                flops={"forward": flops[0], "backward": flops[1] if options.backward else None})


def rank_entries(measured):
    """The report's ``ranks``: for each rank (``measured``: every rank's {pass: (seconds, seconds in
    its block kernels)}, passes.ComputeClock), per pass ``X_s`` (from the phase's start, a barrier,
    to this rank's end), ``X_compute_s`` (in its block kernels) and ``X_exposed``: the share of
    ``X_s`` outside them (waiting on transfers, i.e. communication not hidden behind compute, and on
    peers still computing; merging partials; the engine's bookkeeping)."""
    entries = []
    for own in measured:
        entry = {}
        for name, (seconds, compute) in own.items():
            entry.update({f"{name}_s": seconds, f"{name}_compute_s": compute,
                          f"{name}_exposed": max(0.0, seconds - compute) / seconds if seconds > 0 else 0.0})
        entries.append(entry)
    return entries


def pending_attrs():
    """The attributes of the report that a ``run`` output is created with: NaN seconds and rates,
    an empty scheme. :func:`record` rewrites their values in place once the run is over (a job
    stopped before leaves them so: not measured)."""
    attrs = {f"seconds_{name}": np.float64(np.nan) for name in SECONDS}
    attrs.update({f"tflops_{name}": np.float64(np.nan) for name in PASSES})
    attrs["run_scheme"] = fixed_text("", SCHEME_BYTES)
    return attrs


def output_attrs(report, scale):
    """The attributes a ``run`` output is created with that say what it holds and how it was made,
    from the report's facts known before any work (:func:`start`, with the device and versions) and
    the softmax ``scale``: the mask (read back by :func:`recorded_mask`), the sizes, the choices, the
    device, the versions, the warm-up."""
    sizes = report["sizes"]
    return {"kind": "outputs", "causal": report["causal"], "scale": float(scale), "source": report["input"],
            **{name: sizes[name] for name in ("batch", "seqlen", "heads", "kv_heads", "head_dim", "dtype")},
            "backward": report["backward"], "run_ranks": sizes["ranks"], "run_layout": report["layout"],
            "run_backend": report["backend"], "run_transport": report["transport"],
            "window": "none" if report["window"] is None else ",".join(map(str, report["window"])),
            "documents": sizes["documents"], "run_device": report["device"],
            "run_versions": json.dumps(report["versions"], sort_keys=True), "run_warmup": bool(report["warmup"])}


def recorded_mask(attrs):
    """(causal, window, scale) as an output's attributes (:func:`output_attrs`) record them; each None
    where not recorded (an output another program wrote), the window also where none was used."""
    text = str(attrs.get("window", "none"))
    return (bool(attrs["causal"]) if "causal" in attrs else None,
            None if text == "none" else tuple(int(x) for x in text.split(",")),
            float(attrs["scale"]) if "scale" in attrs else None)


def record(path, report):
    """Write the seconds, rates and scheme of ``report`` into the attributes of the published output
    ``path`` (one process; made by :func:`pending_attrs`, only their values change)."""
    values = {f"seconds_{name}": _number(report["seconds"][name]) for name in SECONDS}
    values.update({f"tflops_{name}": _number(report["tflops"][name]) for name in PASSES})
    values["run_scheme"] = fixed_text(report["scheme"], SCHEME_BYTES)
    modify_attrs(path, values)


def seconds_text(seconds):
    """The summary line's part: 'seconds: read 0.012 setup 0.031 ... total 0.300' ('-': not run)."""
    return "seconds: " + " ".join(f"{name} {'-' if seconds[name] is None else f'{seconds[name]:.3f}'}"
                                  for name in SECONDS)


def check_json_path(path, others=()):
    """Refuse a ``--json`` path the job could not write, before any work (one process): it must not
    be a directory nor one of ``others`` (the input, the output), and its directory must take a new
    file (tried: permissions alone do not tell, e.g. for root or a read-only mount). An existing
    file there is replaced when the job ends."""
    if not path:
        raise FileError("--json: no path given")
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise FileError(f"--json {path!r}: it is a directory")
    for other in others:
        if other and os.path.abspath(other) == full:
            raise FileError(f"--json {path!r} is also the input or the output file; choose another name")
    probe = _temporary(full)
    try:
        with open(probe, "x"):
            pass
        os.remove(probe)
    except OSError as e:
        raise FileError(f"--json {path!r} cannot be written: {e.strerror or e}") from None


def write_json(path, report):
    """Write ``report`` to ``path`` as one JSON object (built under a temporary name, then renamed)."""
    full = os.path.abspath(path)
    tmp = _temporary(full)
    try:
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, full)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise FileError(f"--json {path!r} could not be written: {e.strerror or e}") from None


def device_name(xp):
    """The device the passes ran on: 'NVIDIA H100 80GB HBM3 (sm_90)', or the CPU ('cpu x86_64')."""
    if xp is np:
        return f"cpu {platform.machine() or 'unknown'}"
    device = xp.cuda.Device()
    props = xp.cuda.runtime.getDeviceProperties(device.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return f"{name} (sm_{props['major']}{props['minor']})"


def versions(xp=np):
    """The versions that made the numbers: burst-hpc, Python, NumPy, h5py and HDF5, mpi4py and the MPI
    library, and with CuPy arrays CuPy, the CUDA runtime and driver."""
    import h5py

    found = {"burst_hpc": __version__, "python": sys.version.split()[0], "numpy": np.__version__,
             "h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version}
    try:
        import mpi4py
        from mpi4py import MPI

        found["mpi4py"] = mpi4py.__version__
        found["mpi"] = MPI.Get_library_version().replace("\0", "").splitlines()[0].strip()
    except Exception:  # noqa: BLE001 - the run needs MPI; a report without its version still stands
        pass
    if xp is not np:
        found["cupy"] = xp.__version__
        for name, call in (("cuda_runtime", xp.cuda.runtime.runtimeGetVersion),
                           ("cuda_driver", xp.cuda.runtime.driverGetVersion)):
            number = call()
            found[name] = f"{number // 1000}.{number % 1000 // 10}"
    return found


def _number(value):
    return np.float64(np.nan if value is None else value)


def _temporary(full):
    return os.path.join(os.path.dirname(full), f".{os.path.basename(full)}.tmp-{os.getpid()}")
