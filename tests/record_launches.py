"""Run as a script (tests/test_kernel_contract.py does, in a fresh process): drive the CUDA backend over every
family x pass x head dim x input dtype x mask mode on a stand-in for CuPy, and print as JSON what it asked for.

The stand-in holds arrays as NumPy arrays and compiles each kernel source with nvcc to PTX (no GPU): its
modules define the kernels and the constant tables the PTX defines, a launch is recorded (name, grid, block,
shared memory) instead of run, and asking for a kernel the PTX does not define fails as CuPy would, and so does
(here) a launch whose arguments' bytes are not the sizes of the kernel's parameters in the PTX. TMA tensor
maps are not encoded (no driver). Output: {"tables": the kernel tables as the backend decoded them,
"entries": each source's kernels with their launch bounds, "calls": [{"call", "error", "launches"}],
"prepared": {family: what CudaBackend.prepare did for a causal bf16 D = 128 call},
"prepared_again": {family: what it did for the same call again (nothing: it is made ready once)}}.

    python3 tests/record_launches.py
"""
import collections
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
import types
import weakref
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
HEAD_DIMS = (1, 32, 63, 64, 65, 100, 128, 129, 200, 256, 300)
DTYPES = ("bfloat16", "float16", "float32", "uint16")
MODES = ("full", "causal", "interval")
ENTRIES = {}  # source -> {kernel its PTX defines: its launch bound in threads, 0 if none}
ARGUMENTS = []  # each launch's arguments as the bytes the driver would read (hex)


class _Pointer:
    def __init__(self, ptr):
        self.ptr = ptr


class ndarray(np.ndarray):  # noqa: N801 - cupy.ndarray
    def __new__(cls, shape, dtype=float, memptr=None):
        if memptr is None:
            return np.zeros(shape, dtype).view(cls)
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return np.frombuffer(memptr.data[memptr.offset:memptr.offset + n], dtype).reshape(shape).view(cls)

    @property
    def data(self):
        return _Pointer(self.__array_interface__["data"][0])

    def get(self):
        return np.array(self)


class _Global:
    def __init__(self, data, offset=0):
        self.data, self.offset = data, offset

    def __add__(self, n):
        return _Global(self.data, self.offset + n)


class CPointer:  # cupy.cuda.function.CPointer (CuPy >= 14): a host address whose bytes the driver reads
    def __init__(self, p=0):
        self.ptr = int(p)


def _argument(arg, declared):
    """(bytes the driver would read for a kernel argument, those bytes in hex): a device array's address, a
    one-element NumPy array's bytes (a struct by value), a NumPy scalar's bytes, a Python int or float as 8
    bytes, None as a null pointer, a CPointer's ``declared`` bytes at its address."""
    if isinstance(arg, CPointer):
        return declared, ctypes.string_at(arg.ptr, declared).hex()
    if arg is None:
        return 8, "0"
    if isinstance(arg, ndarray) or hasattr(arg, "data") and isinstance(arg.data, _Pointer):
        return 8, hex(arg.data.ptr)
    if isinstance(arg, (int, float)):
        return 8, repr(arg)
    if isinstance(arg, np.ndarray):
        if arg.size != 1:
            raise TypeError(f"a NumPy array of shape {arg.shape} as a kernel argument (CuPy takes size one only)")
        return arg.itemsize, arg.tobytes().hex()
    if isinstance(arg, np.generic):
        return arg.itemsize, arg.tobytes().hex()
    raise TypeError(f"unsupported kernel argument type {type(arg)}")


class _Kernel:
    def __init__(self, name, launches, params):
        self.name, self.launches, self.params = name, launches, params
        self.max_dynamic_shared_size_bytes = 48 * 1024

    def __call__(self, grid, block, args, shared_mem=0):
        if shared_mem > self.max_dynamic_shared_size_bytes:
            raise RuntimeError(f"{self.name}: {shared_mem} bytes of shared memory, limit not raised")
        got = [_argument(arg, n) for arg, n in zip(args, self.params)]
        sizes = [n for n, _ in got]
        if len(args) != len(self.params) or sizes != self.params:  # the driver would read the wrong bytes
            raise TypeError(f"{self.name}: arguments of {sizes} bytes for parameters of {self.params} bytes")
        self.launches.append([self.name, list(grid), list(block), shared_mem])
        ARGUMENTS.append([text for _, text in got])


def _ptx(code, options):
    arch = "compute_90a" if "-arch=sm_90a" in options else "compute_90"
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp, "source.cu"), Path(tmp, "source.ptx")
        src.write_text(code)
        # the tables are the same at any optimisation level; -O0 keeps this quick
        r = subprocess.run(["nvcc", f"-arch={arch}", "-std=c++17", "-ptx", "-Xcicc", "-O0", "-o", str(out), str(src)],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"nvcc failed:\n{r.stderr}")
        return out.read_text()


def _fake_cupy(launches):
    """A module that stands in for cupy, as far as the backend uses it."""
    cupy = types.ModuleType("cupy")

    def wrap(x):
        return x.view(ndarray) if isinstance(x, np.ndarray) else x

    class RawModule:
        def __init__(self, code, options=()):
            text = _ptx(code, options)
            source = re.search(r'#line 1 "cuda/(\S+\.cu)"', code).group(1)
            # each kernel with its launch bound (.maxntid: the threads its __launch_bounds__ allows), or 0
            found = re.findall(r"^\.visible \.entry (\w+)\(([^)]*)\)\s*(?:\.maxntid (\d+), 1, 1)?", text, re.M)
            self.entries = {name: int(bound or 0) for name, _, bound in found}
            # each kernel's parameter sizes in bytes: a struct is .b8 name[bytes], a scalar or pointer .u64, .f32...
            self.params = {name: [int(n) if n else int(bits) // 8 for bits, n in
                                  re.findall(r"\.param (?:\.align \d+ )?\.[a-z](\d+) \w+(?:\[(\d+)\])?", params)]
                           for name, params, _ in found}
            ENTRIES.setdefault(source, {}).update(self.entries)  # a source's builds: its table, one per instance
            self.globals = {}
            for name, size, body in re.findall(r"^\.const \.align \d+ \.b8 (\w+)\[(\d+)\] = \{([^}]*)\}", text, re.M):
                values = [int(v) for v in body.split(",")]
                self.globals[name] = bytes(values + [0] * (int(size) - len(values)))  # PTX drops trailing zeros
            for name, value in re.findall(r"^\.const \.align \d+ \.u32 (\w+) = (\d+);", text, re.M):
                self.globals[name] = np.int32(value).tobytes()

        def get_function(self, name):
            if name not in self.entries:
                raise RuntimeError(f"CUDA_ERROR_NOT_FOUND: no kernel {name}")
            return _Kernel(name, launches, self.params[name])

        def get_global(self, name):
            return _Global(self.globals[name])

    class Device:
        def __init__(self, device=0):
            self.id = device
            self.compute_capability = "90"
            self.attributes = {"MultiProcessorCount": 132}

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    cupy.ndarray, cupy.RawModule, cupy.__version__ = ndarray, RawModule, "14.2.0 (stand-in)"
    stream = types.SimpleNamespace(ptr=0)
    cupy.cuda = types.SimpleNamespace(Device=Device, runtime=types.SimpleNamespace(getDeviceCount=lambda: 1),
                                      nvrtc=types.SimpleNamespace(getVersion=lambda: (0, 0)),
                                      get_current_stream=lambda: stream,
                                      function=types.SimpleNamespace(CPointer=CPointer))
    for name in ("ascontiguousarray", "asarray"):
        setattr(cupy, name, lambda *a, _f=getattr(np, name), **k: wrap(_f(*a, **k)))
    cupy.empty = lambda shape, dtype=float: _pooled(shape, dtype)
    cupy.zeros = lambda shape, dtype=float: _fill(_pooled(shape, dtype), 0)
    cupy.full = lambda shape, value, dtype=None: _fill(
        _pooled(shape, np.asarray(value).dtype if dtype is None else dtype), value)
    cupy.__getattr__ = lambda name: getattr(np, name)  # the tiled path of wide heads: NumPy functions
    return cupy


_FREE = collections.defaultdict(list)   # freed blocks by size, as CuPy's memory pool keeps them


def _pooled(shape, dtype):
    """A new array on a 256-byte aligned block, a freed block of its size where there is one (CuPy's pool hands
    the same block back: a call's scratch has the address it had at the call before)."""
    shape = (shape,) if np.isscalar(shape) else tuple(shape)
    n = max(1, int(np.prod(shape))) * np.dtype(dtype).itemsize
    block = _FREE[n].pop() if _FREE[n] else np.empty(n + 256, np.uint8)
    at = -block.ctypes.data % 256
    # an array over a buffer, not a view of ``block``: every view of it keeps it (not ``block``) as its base, so it
    # lives while any of them does
    root = np.frombuffer(memoryview(block)[at:at + n], np.uint8)
    weakref.finalize(root, _FREE[n].append, block)
    return root.view(dtype)[:int(np.prod(shape))].reshape(shape).view(ndarray)


def _fill(x, value):
    x.fill(value)
    return x


class _Maps:  # the tensor maps: the arrays and box rows only, at a made-up device address
    def __init__(self, pairs):
        self.pairs = pairs
        self.data = _Pointer(1 << 40)


def install(launches):
    """Put the stand-in in CuPy's place for the burst_hpc found on sys.path (imported here: its tensor maps
    are not encoded); each launch is appended to ``launches``. Returns the stand-in module."""
    sys.modules["cupy"] = _fake_cupy(launches)
    sys.modules["cupy.cuda.function"] = sys.modules["cupy"].cuda.function
    from burst_hpc.backends.cuda import tma

    tma.device_maps = lambda cupy, pairs: _Maps(pairs)
    return sys.modules["cupy"]


def main():
    launches = []
    sys.path.insert(0, str(REPO))
    install(launches)
    from burst_hpc.plan import masks
    from burst_hpc.backends.cuda import FAMILIES, CudaBackend, contract

    rng = np.random.default_rng(0)

    def array(shape, dtype):
        x = rng.standard_normal(shape).astype(np.dtype("bfloat16") if dtype == "uint16" else dtype)
        return sys.modules["cupy"].asarray(x.view(np.uint16) if dtype == "uint16" else x)

    calls, prepared, again = [], {}, {}
    for family in FAMILIES:
        backend = CudaBackend.instance(family)
        # a causal bf16 D = 128 call's builds, compiled before its launches (which then load them)
        causal = masks.make(1024, True)
        prepared[family] = backend.prepare(None, np.dtype("bfloat16"), 128, causal, ("fwd", "bwd"))
        again[family] = backend.prepare(None, np.dtype("bfloat16"), 128, causal, ("fwd", "bwd"))
        default_order = backend.kernels.heavy_first if family == "sm90" else None
        for d in HEAD_DIMS:
            for dtype in DTYPES:
                for mode in MODES:
                    tile_heights = [None]
                    if family == "sm90" and d in contract.native_widths("sm90", "fwd"):
                        tile_heights += list(backend.kernels.tile_heights(d))
                    for rows in tile_heights:
                        b, sq, sk, hq, hkv = 1, 70, 90, 4, 2
                        q, do = array((b, sq, hq, d), dtype), array((b, sq, hq, d), dtype)
                        k, v = array((b, sk, hkv, d), dtype), array((b, sk, hkv, d), dtype)
                        o, grads = array((b, sq, hq, d), "float32"), [array(x.shape, "float32") for x in (q, k, v)]
                        lse = sys.modules["cupy"].full((b, hq, sq), -np.inf, np.float32)
                        mask = masks.make(sk, True, *(((30, 0), np.array([0, 40, sk])) if mode == "interval" else ()))
                        where = dict(scale=d ** -0.5, masked=mode != "full", mask=mask, q_start=sk - sq)
                        backend.kernels.forced_tile_height = rows
                        if family == "sm90":  # the forced-height runs take the other backward order: both recorded
                            backend.kernels.heavy_first = default_order ^ (rows is not None)
                        for direction, run in (("fwd", lambda: backend.forward_block(q, k, v, o, lse, **where)),
                                               ("bwd", lambda: backend.backward_block(q, k, v, do, lse, lse, *grads,
                                                                                      **where)),
                                               ("delta", lambda: backend.delta(do, o))):
                            launches.clear()
                            try:
                                run()
                                error = None
                            except Exception as exc:  # noqa: BLE001 - reported to the test
                                error = f"{type(exc).__name__}: {exc}"
                            calls.append({"call": [family, direction, d, dtype, mode, rows], "error": error,
                                          "launches": list(launches)})
                        backend.kernels.forced_tile_height = None
                        backend.kernels.heavy_first = default_order
    kept = kept_launches(array)
    tables = {source: [list(kernel) for kernel in CudaBackend.instance(family).modules.table(source).kernels]
              for (family, _), source in contract.SOURCES.items()}
    tables[contract.DELTA_SOURCE] = [list(k) for k in CudaBackend.instance("sm80").modules.table(
        contract.DELTA_SOURCE).kernels]
    json.dump({"tables": tables, "entries": ENTRIES, "calls": calls, "prepared": prepared, "prepared_again": again,
               "kept": kept}, sys.stdout)


def kept_launches(array):
    """Second calls of the sm90 launches, each after a first call of the same shapes on other arrays, against the
    same second call worked out anew: {case: {"first", "kept", "anew"}: each call's launches as their argument
    bytes (hex); "addresses": {"first", "kept"}: the addresses of the arrays the case writes, 8 bytes in hex}. The
    plain cases repeat a call; the others change one thing a launch depends on between the two calls."""
    from burst_hpc.plan import masks
    from burst_hpc.backends.cuda import CudaBackend
    from burst_hpc.recent import Recent

    backend, cupy = CudaBackend.instance("sm90"), sys.modules["cupy"]
    b, s, hq, hkv, d = 1, 300, 2, 2, 128   # one head a K/V group: the backward writes dK, dV itself
    n = s + 100   # the masks' sequence: room for the offsets below
    causal = masks.make(n, True)
    docs = masks.make(n, True, (100, 0), np.array([0, 130, n]))
    other = masks.make(n, True, None, np.array([0, 70, 200, n]))

    def arrays():
        q, do, o16 = (array((b, s, hq, d), "bfloat16") for _ in range(3))
        k, v = array((b, s, hkv, d), "bfloat16"), array((b, s, hkv, d), "bfloat16")
        return dict(q=q, k=k, v=v, do=do, o16=o16, lse=cupy.full((b, hq, s), -np.inf, np.float32),
                    o=cupy.zeros((b, s, hq, d), np.float32), out=cupy.empty(q.shape, q.dtype),
                    dq=cupy.zeros(q.shape, np.float32), dk=cupy.zeros(k.shape, np.float32),
                    dv=cupy.zeros(v.shape, np.float32), dk_out=cupy.empty(k.shape, k.dtype),
                    dv_out=cupy.empty(v.shape, v.dtype))

    def fwd(x, mask, q_start=0, k_start=0, first=True, into="out", cross_tile=True):
        backend.kernels.cross_tile = cross_tile
        backend.forward_block(x["q"], x["k"], x["v"], None if into == "out" else x["o"], x["lse"], scale=d ** -0.5,
                              masked=True, mask=mask, q_start=q_start, k_start=k_start, first=first,
                              out=x["out"] if into == "out" else None)
        backend.kernels.cross_tile = True

    def bwd(x, mask, q_start=0, first_kv=True, grads=False):
        # the outputs given (a last pair): dK, dV written straight from the kernel at a first pair too; ``grads``:
        # float32 accumulators given as well
        acc = (x["dq"], x["dk"], x["dv"]) if grads else (None, None, None)
        backend.backward_block(x["q"], x["k"], x["v"], x["do"], x["lse"], None, *acc, scale=d ** -0.5, masked=True,
                               mask=mask, q_start=q_start, o=x["o16"], first_q=True, first_kv=first_kv,
                               dq_out=x["out"], dk_out=x["dk_out"], dv_out=x["dv_out"])

    cases = {}
    for name, mask in (("causal", causal), ("interval", docs)):
        cases[f"{name} fwd"] = (fwd, dict(mask=mask), dict(mask=mask), ("lse", "out"))
        cases[f"{name} fwd into o"] = (fwd, dict(mask=mask, first=False, into="o"),
                                       dict(mask=mask, first=False, into="o"), ("lse", "o"))
        cases[f"{name} bwd"] = (bwd, dict(mask=mask), dict(mask=mask), ("dk_out", "dv_out"))
        cases[f"{name} fwd q_start"] = (fwd, dict(mask=mask), dict(mask=mask, q_start=64), ())
        cases[f"{name} fwd k_start"] = (fwd, dict(mask=mask, q_start=64), dict(mask=mask, q_start=64, k_start=32), ())
        cases[f"{name} fwd first"] = (fwd, dict(mask=mask, into="o"), dict(mask=mask, into="o", first=False), ())
        cases[f"{name} fwd cross_tile"] = (fwd, dict(mask=mask), dict(mask=mask, cross_tile=False), ())
        cases[f"{name} bwd q_start"] = (bwd, dict(mask=mask), dict(mask=mask, q_start=64), ())
        cases[f"{name} bwd first_kv"] = (bwd, dict(mask=mask, grads=True), dict(mask=mask, grads=True, first_kv=False),
                                         ())
    cases["fwd mask"] = (fwd, dict(mask=docs), dict(mask=other), ())
    cases["bwd mask"] = (bwd, dict(mask=docs), dict(mask=other), ())
    out = {}
    for case, (call, first, second, written) in cases.items():
        one, two = arrays(), arrays()
        got = {}
        backend.kernels.launches = Recent(256, tags=16)
        for label, x, kw in (("first", one, first), ("kept", two, second)):
            ARGUMENTS.clear()
            call(x, **kw)
            got[label] = list(ARGUMENTS)
        backend.kernels.launches = Recent(256, tags=16)
        ARGUMENTS.clear()
        call(two, **second)
        got["anew"] = list(ARGUMENTS)
        got["addresses"] = {label: {n: np.uint64(x[n].data.ptr).tobytes().hex() for n in written}
                            for label, x in (("first", one), ("kept", two))}
        out[case] = got
    return out


if __name__ == "__main__":
    os.environ.pop("BURST_HPC_KERNELS", None)
    with tempfile.TemporaryDirectory() as cache:  # the kernel cache's entries, of this run only
        os.environ["CUPY_CACHE_DIR"] = cache
        main()
