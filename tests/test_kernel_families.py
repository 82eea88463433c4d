"""Choice of the CUDA kernel family (CPU only: the capability is passed in, no GPU or CuPy needed)."""
import pytest

from burst_hpc.backends import cuda
from burst_hpc.errors import BackendError


@pytest.mark.parametrize("capability,families", [
    ((9, 0), ("sm90", "sm80")),  # Hopper: the sm_90a family first
    ((8, 0), ("sm80",)),
    ((8, 9), ("sm80",)),
    ((10, 0), ("sm80",)),  # sm_90a code is Hopper-only; newer GPUs run the mma.sync family
    ((7, 5), ()),
])
def test_kernel_families(capability, families):
    assert cuda.kernel_families(capability) == families


@pytest.mark.parametrize("capability,family", [((9, 0), "sm90"), ((8, 0), "sm80")])
def test_default_family_is_the_newest(monkeypatch, capability, family):
    monkeypatch.delenv("BURST_HPC_KERNELS", raising=False)
    assert cuda.default_family(capability) == family


@pytest.mark.parametrize("forced", ["sm80", "sm90"])
def test_default_family_forced(monkeypatch, forced):
    monkeypatch.setenv("BURST_HPC_KERNELS", forced)
    assert cuda.default_family((9, 0)) == forced


def test_default_family_rejects_unknown_name(monkeypatch):
    monkeypatch.setenv("BURST_HPC_KERNELS", "sm70")
    with pytest.raises(BackendError, match="BURST_HPC_KERNELS must be one of"):
        cuda.default_family((9, 0))


@pytest.mark.parametrize("capability", [(8, 0), (10, 0)])
def test_default_family_rejects_family_the_gpu_cannot_run(monkeypatch, capability):
    monkeypatch.setenv("BURST_HPC_KERNELS", "sm90")
    with pytest.raises(BackendError, match="does not run on this GPU"):
        cuda.default_family(capability)


def test_default_family_needs_compute_capability_8(monkeypatch):
    monkeypatch.delenv("BURST_HPC_KERNELS", raising=False)
    with pytest.raises(BackendError, match="8.0 or newer"):
        cuda.default_family((7, 5))
    monkeypatch.setenv("BURST_HPC_KERNELS", "sm80")
    with pytest.raises(BackendError, match="does not run on this GPU"):
        cuda.default_family((7, 5))
