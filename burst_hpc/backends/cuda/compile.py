"""The kernels a call needs, compiled once: per instance, per node and per cache directory
(docs/KERNELS.md, "Compiling").

A *build* is one compile of a source (``Build``): its kernel table alone (every kernel's geometry, and
the source's small helper kernels; about 0.3 s) or one instance with its table row (about 1 s, where the
whole source takes 6 to 13 s with nvcc). The selection is a few ``#define`` lines before the source
(cuda/contract.cuh, "What one compile builds"), so the text compiled covers it; the source's local
``#include "x.cuh"`` headers are pasted in (``#line`` directives keep compiler messages pointing at the
real files), so that text covers every header too.

The compiler (``CupyCompiler``: NVRTC through cupy.RawModule) keeps what it built in CuPy's own cache
(``CUPY_CACHE_DIR``). Next to it, in ``<CUPY_CACHE_DIR>/burst_hpc``, ``KernelCache`` keeps one entry per
build (a small JSON file named by a hash of the code, options, target and compiler versions) and a lock
file per entry: a process compiles only when the entry is missing, under a POSIX lock of its lock file,
and looks again once it holds the lock, so processes sharing the directory (the ranks of a node, or
jobs on a shared file system) compile each build once. ``prepare`` shares a call's builds out among a
node's ranks, which compile their shares in parallel, then agree before any of them loads.
``BURST_HPC_NO_JIT=1`` turns a missing entry into an error naming the ``burst-hpc compile`` command that
builds it. Nothing here but ``CupyCompiler`` needs CuPy.
"""
import contextlib
import hashlib
import json
import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np

from ... import config
from ...device import HOW_TO_GET_CUPY
from ...errors import BackendError, BurstError
from ...locking import lock_exclusive
from .contract import DELTA_SOURCE, SOURCES, KernelTable, cuda_dir, header, instances, table_symbols

ENTRY_SUFFIX = ".json"


def inline_source(name, root):
    """Source of cuda/<name> with its local #include "x.cuh" headers pasted in (once each), with #line
    directives pointing at the real files."""
    seen = set()

    def expand(fname):
        text = (root / fname).read_text()
        out = [f'#line 1 "cuda/{fname}"']
        for i, line in enumerate(text.splitlines(), start=1):
            m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
            if m:
                inc = m.group(1)
                if inc not in seen:
                    seen.add(inc)
                    out.append(expand(inc))
                out.append(f'#line {i + 1} "cuda/{fname}"')
            elif line.strip() == "#pragma once":
                out.append("")
            else:
                out.append(line)
        return "\n".join(out)

    return expand(name)


class Build(NamedTuple):
    """One compile of cuda/<source>: its kernel table alone (``instance`` None), or one of its instances
    (a ``contract.instances`` tuple: dtype, head dim, mask, shape) and that instance's table row."""
    source: str
    instance: tuple = None

    def prelude(self):
        """The #define lines that select what this build compiles (cuda/contract.cuh)."""
        if self.instance is None:
            return "#define BH_TABLE_ONLY\n"
        dtype, _, mask, shape = self.instance
        return (f"#define BH_SELECT_DTYPE {dtype}\n#define BH_SELECT_MASK {mask}\n"
                f"#define BH_SELECT_SHAPE {', '.join(map(str, shape))}\n")

    def code(self, root):
        """The text compiled: the selection, then the source with its headers pasted in."""
        return self.prelude() + inline_source(self.source, root)

    def name(self):
        """A file-name-safe name: 'attn_fwd_sm90-table', 'attn_fwd_sm90-bf16-d128-causal-128x2'."""
        stem = Path(self.source).stem
        if self.instance is None:
            return f"{stem}-table"
        dtype, head_dim, mask, shape = self.instance
        return f"{stem}-{dtype}-d{head_dim}-{mask}-{'x'.join(map(str, shape))}"


def family_of(source):
    """The kernel family of cuda/<source> (None for the delta pre-pass, which both use)."""
    return next((family for (family, _), s in SOURCES.items() if s == source), None)


def call_builds(family, dtypes, head_dims, masks, directions):
    """The builds a call needs: for each of ``directions`` ('fwd', 'bwd') the source's table and its
    instances of the kernel ``dtypes`` ('bf16', 'f16') x native ``head_dims`` x ``masks`` ('full',
    'causal', 'interval'), every tile height of a head dim; the delta pre-pass with a backward."""
    builds = []
    for direction in directions:
        source = SOURCES[family, direction]
        builds.append(Build(source))
        builds += [Build(source, inst) for inst in instances(source)
                   if inst[0] in dtypes and inst[1] in head_dims and inst[2] in masks]
    if "bwd" in directions:
        builds.append(Build(DELTA_SOURCE))
    return builds


def compile_command(builds):
    """The ``burst-hpc compile`` command that builds ``builds`` (every mask of each head dim and dtype)."""
    families = sorted({family_of(b.source) for b in builds} - {None})  # the delta pre-pass comes with any
    dims = sorted({b.instance[1] for b in builds if b.instance})
    dtypes = sorted({b.instance[0] for b in builds if b.instance})
    words = ["burst-hpc compile"] + [f"--family {f}" for f in families]
    words += [f"--head-dim {d}" for d in dims] + [f"--dtype {t}" for t in dtypes]
    return " ".join(words)


class Compiler(Protocol):
    """What KernelCache needs of a compiler (``CupyCompiler``; the tests use a fake one)."""

    def options(self, source):
        """The compile options of cuda/<source>."""

    def target(self, source):
        """The architecture cuda/<source> is built for ('sm_90a', or the current GPU's 'sm_90')."""

    def toolchain(self):
        """The compiler's versions (what else changes the code it makes)."""

    def thread_context(self):
        """A context manager factory, taken on the calling thread, under which a worker thread compiles
        for the same device."""

    def compile(self, build, code, options):
        """Compile ``code`` into the compiler's store; the loaded module."""

    def load(self, build, code, options):
        """The module of ``code`` from the compiler's store (compiling it if the store lost it)."""


class CupyCompiler:
    """NVRTC through cupy.RawModule; CuPy's own cache (CUPY_CACHE_DIR) stores the result. ``*sm90*``
    sources are built for sm_90a, the others for the current GPU."""

    def __init__(self):
        try:
            import cupy  # noqa: F401
        except ImportError:
            raise BackendError(f"compiling the CUDA kernels needs CuPy and a GPU; {HOW_TO_GET_CUPY}") from None

    def options(self, source):
        return ("-std=c++17", "-arch=sm_90a") if "sm90" in source else ("-std=c++17",)

    def target(self, source):
        import cupy

        return "sm_90a" if "sm90" in source else f"sm_{cupy.cuda.Device().compute_capability}"

    def toolchain(self):
        import cupy

        return f"cupy {cupy.__version__}, nvrtc {'.'.join(map(str, cupy.cuda.nvrtc.getVersion()))}"

    def thread_context(self):
        import cupy

        device = cupy.cuda.Device().id
        return lambda: cupy.cuda.Device(device)

    def compile(self, build, code, options):
        import cupy

        module = cupy.RawModule(code=code, options=options)
        module.get_global(table_symbols(build.source)[1])  # RawModule compiles (and loads) on first use
        return module

    load = compile


def default_cache():
    """The kernel cache of this process's backends: CUPY_CACHE_DIR's, compiled by NVRTC through CuPy."""
    return KernelCache(CupyCompiler())


class KernelCache:
    """The builds compiled so far, as entries of ``directory`` (default ``config.kernel_cache_dir()``),
    each compiled once by whichever process sharing the directory needs it first.

    ``compiler``: a ``Compiler``; ``sources``: the directory of the kernel sources (``cuda_dir()``)."""

    def __init__(self, compiler, directory=None, sources=None):
        self.compiler = compiler
        self.directory = Path(directory or config.kernel_cache_dir())
        self.sources = Path(sources or cuda_dir())
        self._entries = {}
        self._inside = {}  # an in-process lock per entry: a POSIX lock does not exclude the process's threads
        self._inside_guard = threading.Lock()

    def entry(self, build):
        """(path of ``build``'s entry, its code, its options)."""
        if build in self._entries:
            return self._entries[build]
        code, options = build.code(self.sources), self.compiler.options(build.source)
        what = [code, list(options), self.compiler.target(build.source), self.compiler.toolchain()]
        key = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:24]
        found = self._entries[build] = (self.directory / f"{build.name()}-{key}{ENTRY_SUFFIX}", code, options)
        return found

    def compiled(self, build):
        """True when ``build`` is in the cache."""
        return self.entry(build)[0].exists()

    def missing_error(self, builds):
        """The error of BURST_HPC_NO_JIT=1 when ``builds`` are not in the cache."""
        names = ", ".join(b.name() for b in builds[:4]) + (f" and {len(builds) - 4} more" if len(builds) > 4 else "")
        return BackendError(f"BURST_HPC_NO_JIT=1 and the kernel cache {self.directory} lacks {names}; build them "
                            f"first (same CUPY_CACHE_DIR, on a GPU node of this kind) with: {compile_command(builds)}")

    def ensure(self, build):
        """Make sure ``build`` is compiled: 'cached', 'compiled', or 'waited' (another process compiled
        it while this one waited for the lock). Returns (that word, the module when this call compiled)."""
        path, code, options = self.entry(build)
        if path.exists():
            return "cached", None
        if config.no_jit():
            raise self.missing_error([build])
        self.directory.mkdir(parents=True, exist_ok=True)
        with self._locked(path):
            if path.exists():  # the second look: another process compiled it while this one waited
                return "waited", None
            t0 = time.perf_counter()
            module = self.compiler.compile(build, code, options)
            record = {"build": build.name(), "source": build.source, "options": list(options),
                      "target": self.compiler.target(build.source), "toolchain": self.compiler.toolchain(),
                      "seconds": round(time.perf_counter() - t0, 3), "host": socket.gethostname(),
                      "compiled": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            tmp = path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}")
            tmp.write_text(json.dumps(record) + "\n")
            os.replace(tmp, path)  # atomic: an entry is whole or absent
            log_compile(self.directory, record)
            return "compiled", module

    def module(self, build):
        """The loaded module of ``build``, compiled first when the cache lacks it."""
        how, module = self.ensure(build)
        if module is not None:
            return module
        _, code, options = self.entry(build)
        return self.compiler.load(build, code, options)

    @contextlib.contextmanager
    def _locked(self, path):
        """Hold the lock of ``path``'s entry: a POSIX lock of ``<entry>.lock`` (coherent across hosts
        on NFS, Lustre with -o flock, GPFS), held by one thread of this process at a time. Where the
        file system has no locks, nothing is held (a build may then be compiled twice, never torn)."""
        with self._inside_guard:
            inside = self._inside.setdefault(path, threading.Lock())
        with inside:
            fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                # backing off to 0.5 s spares a shared file system's lock server the polls of a thousand
                # waiting nodes
                lock_exclusive(fd, longest_pause=0.5)
                yield
            finally:
                os.close(fd)  # drops the lock


COMPILE_LOG = "compiles.log"


def log_compile(directory, record):
    """Append one line (build, seconds, host, pid, time) to the cache directory's compile log: what was
    compiled when and by whom (O_APPEND: whole lines from any number of processes)."""
    line = f"{record['build']} {record['seconds']} {record['host']} {os.getpid()} {record['compiled']}\n"
    fd = os.open(Path(directory, COMPILE_LOG), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def compiles(directory=None):
    """The compile log of the kernel cache ``directory``: [(build, seconds, host, pid)], oldest first."""
    path = Path(directory or config.kernel_cache_dir(), COMPILE_LOG)
    if not path.exists():
        return []
    return [(w[0], float(w[1]), w[2], int(w[3])) for w in (line.split() for line in path.read_text().splitlines())]


def entries(directory=None):
    """The entries of the kernel cache ``directory`` (default ``config.kernel_cache_dir()``), as dicts
    (build, source, target, toolchain, seconds, host, compiled), by name."""
    directory = Path(directory or config.kernel_cache_dir())
    found = []
    for path in sorted(directory.glob(f"*{ENTRY_SUFFIX}")):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return found


def describe_cache(directory=None):
    """Lines naming the kernel cache directory and what it holds, a line per source and target
    (``burst-hpc info``)."""
    directory = Path(directory or config.kernel_cache_dir())
    found = entries(directory)
    lines = [f"kernel cache: {directory} ({len(found)} build(s); CUPY_CACHE_DIR sets it; burst-hpc compile fills it"
             f"{'; BURST_HPC_NO_JIT=1: no compiling' if config.no_jit() else ''})"]
    groups = {}
    for entry in found:
        groups.setdefault((entry.get("source", "?"), entry.get("target", "?"), entry.get("toolchain", "?")),
                          []).append(entry.get("build", "?"))
    for (source, target, toolchain), names in sorted(groups.items()):
        stem = Path(source).stem + "-"
        lines.append(f"  {source} for {target} ({toolchain}): "
                     + ", ".join(sorted(n[len(stem):] if n.startswith(stem) else n for n in names)))
    return lines


def node_share(comm, ranks_per_node=None):
    """Collective: (this rank's place among its node's ranks, the node's ranks); (0, 1) alone."""
    if comm is None or comm.size == 1:
        return 0, 1
    from ...plan.topology import topology

    try:
        topo = topology(comm, ranks_per_node)
    except BurstError:  # uneven nodes: every rank takes every build (the locks still compile each once)
        return 0, 1
    return topo.local, topo.per_node


def prepare(cache, builds, comm=None, ranks_per_node=None):
    """Collective on ``comm`` (None: this process alone): every one of ``builds`` compiled into
    ``cache``, once per node and per cache directory. The node's ranks share the builds out (its i-th
    rank takes builds i, i + n, ...) and each compiles its share in parallel threads, under the cache's
    lock with a second look; then the ranks agree (an error on any rank is raised on every rank), so none
    loads a module before its compile is done. With BURST_HPC_NO_JIT=1 a missing build is an error on
    every rank before anything compiles. Returns this rank's {build name: 'cached' | 'compiled' | 'waited'}."""
    from ...collective import agree

    local, per_node = node_share(comm, ranks_per_node)
    error, done = None, {}
    try:
        if config.no_jit():
            missing = [b for b in builds if not cache.compiled(b)]
            if missing:
                raise cache.missing_error(missing)
        mine = list(dict.fromkeys(builds))[local::per_node]
        if mine:
            context = cache.compiler.thread_context()

            def ensure(build):
                with context():
                    return cache.ensure(build)[0]

            workers = max(1, min(len(mine), (os.cpu_count() or 1) // per_node))
            with ThreadPoolExecutor(max_workers=workers) as pool:
                done = dict(zip((b.name() for b in mine), pool.map(ensure, mine)))
    except Exception as e:  # noqa: BLE001 - agreed below, so no rank is left waiting
        error = e if isinstance(e, BurstError) else BackendError(f"compiling kernels failed: {type(e).__name__}: {e}")
    agree(comm, error)
    return done


class Modules:
    """The compiled builds of one backend, their kernel tables, and their kernels per device: the
    kernels of a source come from its table build (helpers) or from one build per instance."""

    def __init__(self, cache=None):
        self.cache = cache or default_cache()
        self._modules = {}
        self._kernels = {}
        self._tables = {}
        self._builds = {}  # source -> {kernel name: its Build}

    def module(self, build):
        """The loaded module of ``build``, compiled on first use when the cache lacks it."""
        mod = self._modules.get(build)
        if mod is None:
            mod = self._modules[build] = self.cache.module(build)
        return mod

    def prepare(self, builds, comm=None):
        """Collective: compile ``builds`` (see ``prepare``) before a call's first launch."""
        return prepare(self.cache, builds, comm)

    def kernel(self, source, name, smem):
        """Kernel ``name`` of cuda/<source>, allowed ``smem`` bytes of dynamic shared memory."""
        import cupy

        # keyed by device too: a RawKernel sets the shared-memory limit for the device current at the
        # time, and a launch on another device without it fails (CUDA_ERROR_INVALID_VALUE)
        key = (cupy.cuda.Device().id, source, name)
        kern = self._kernels.get(key)
        if kern is None:
            self.table(source)
            build = self._builds[source].get(name, Build(source))
            kern = self.module(build).get_function(name)
            if smem > 48 * 1024:
                kern.max_dynamic_shared_size_bytes = smem
            self._kernels[key] = kern
        return kern

    def table(self, source):
        """The kernel table of cuda/<source> (contract.KernelTable), read once from its table build."""
        import cupy

        table = self._tables.get(source)
        if table is None:
            mod = self.module(Build(source))
            rows, count = table_symbols(source)
            n = int(cupy.ndarray((1,), np.int32, memptr=mod.get_global(count)).get()[0])
            data = cupy.ndarray((n * header().row.itemsize,), np.uint8, memptr=mod.get_global(rows)).get()
            table = KernelTable.from_bytes(source, data.tobytes())
            self._builds[source] = instance_builds(source, table)
            self._tables[source] = table
        return table


def instance_builds(source, table):
    """{kernel name: its Build} of cuda/<source>'s instances: the table lists them in the order of
    ``contract.instances`` (shapes in list order, each in contract.cuh's dtype and mask order)."""
    listed = [] if source == DELTA_SOURCE else instances(source)
    if listed and len(listed) != len(table.kernels):
        raise BackendError(f"cuda/{source}: its table has {len(table.kernels)} rows for {len(listed)} instances")
    builds = {}
    for kern, inst in zip(table.kernels, listed):
        if (kern.dtype, kern.head_dim, kern.mask) != inst[:3]:
            raise BackendError(f"cuda/{source}: table row {kern.name} is not instance {inst[:3]}")
        builds[kern.name] = Build(source, inst)
    return builds
