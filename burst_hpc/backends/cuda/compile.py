"""The kernel sources, compiled by NVRTC through cupy.RawModule once per backend (CuPy caches the result on
disk), their kernel tables, and their kernels.

A source is compiled with its local ``#include "x.cuh"`` headers pasted in, so the text CuPy hashes for
its compile cache covers the headers too; ``#line`` directives keep compiler messages pointing at the
real files. ``*sm90*`` sources are built for ``sm_90a``, the others for the current GPU.
"""
import re

import numpy as np

from .contract import KernelTable, cuda_dir, header, table_symbols


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


class Modules:
    """The compiled sources of one backend, their kernel tables, and their kernels per device."""

    def __init__(self):
        self._modules = {}
        self._kernels = {}
        self._tables = {}

    def module(self, source):
        """The cupy.RawModule of cuda/<source>, compiled on first use."""
        import cupy

        mod = self._modules.get(source)
        if mod is None:
            options = ("-std=c++17", "-arch=sm_90a") if "sm90" in source else ("-std=c++17",)
            mod = cupy.RawModule(code=inline_source(source, cuda_dir()), options=options)
            self._modules[source] = mod
        return mod

    def kernel(self, source, name, smem):
        """Kernel ``name`` of cuda/<source>, allowed ``smem`` bytes of dynamic shared memory."""
        import cupy

        # keyed by device too: a RawKernel sets the shared-memory limit for the device current at the
        # time, and a launch on another device without it fails (CUDA_ERROR_INVALID_VALUE)
        key = (cupy.cuda.Device().id, source, name)
        kern = self._kernels.get(key)
        if kern is None:
            kern = self.module(source).get_function(name)
            if smem > 48 * 1024:
                kern.max_dynamic_shared_size_bytes = smem
            self._kernels[key] = kern
        return kern

    def table(self, source):
        """The kernel table of cuda/<source> (contract.KernelTable), read from its compiled module once."""
        import cupy

        table = self._tables.get(source)
        if table is None:
            mod = self.module(source)
            rows, count = table_symbols(source)
            n = int(cupy.ndarray((1,), np.int32, memptr=mod.get_global(count)).get()[0])
            data = cupy.ndarray((n * header().row.itemsize,), np.uint8, memptr=mod.get_global(rows)).get()
            table = self._tables[source] = KernelTable.from_bytes(source, data.tobytes())
        return table
