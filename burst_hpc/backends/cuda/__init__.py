"""The CUDA block backend: the raw kernels of cuda/*.cu, compiled with cupy.RawModule (docs/KERNELS.md).

    backend.py   CudaBackend: the kernel family, the route of a head dim (native, zero-padded, wide), delta
    sm90.py      the sm90 family's launches: wgmma / TMA kernels, Hopper only
    sm80.py      the sm80 family's launches: mma.sync kernels, compute capability 8.0 and newer
    launch.py    kernel arguments: 16-bit inputs, float32 accumulators, strides, mask bounds, GPU size
    compile.py   where the sources are; NVRTC compilation once per process; kernels per device
    contract.py  what the sources define: instances, names, tile geometry
    tma.py       TMA tensor maps of the sm90 kernels, made on the host

Every module imports without CuPy (CuPy is imported where a launch needs it), so the family choice and
the kernel contract are checked on machines without a GPU.
"""
from .backend import FAMILIES, CudaBackend, default_family, gpu_capability, kernel_families

__all__ = ["FAMILIES", "CudaBackend", "default_family", "gpu_capability", "kernel_families"]
