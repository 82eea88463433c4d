"""Transport choice and the CUDA-awareness guard (no GPU needed)."""
import pytest

from burst_hpc.plan.accounting import backward_ring_bytes
from burst_hpc.plan.decisions import choose_backward_ring
from burst_hpc.errors import TransportError
from burst_hpc import transport
from burst_hpc.transport import choose_transport, cuda_aware_mpi, nccl_available


def test_numpy_arrays_use_host():
    assert choose_transport("auto", on_device=False) == "host"
    assert choose_transport("host", on_device=False) == "host"
    for name in ("mpi", "nccl", "staged"):
        with pytest.raises(TransportError):
            choose_transport(name, on_device=False)


def test_unknown_transport():
    with pytest.raises(TransportError, match="unknown transport"):
        choose_transport("carrier-pigeon", on_device=False)


def test_device_buffers_never_go_to_an_mpi_not_known_cuda_aware(monkeypatch):
    monkeypatch.setenv("BURST_HPC_CUDA_AWARE", "0")
    assert cuda_aware_mpi()[0] is False
    with pytest.raises(TransportError, match="CUDA-aware"):
        choose_transport("mpi", on_device=True)
    assert choose_transport("auto", on_device=True) in ("nccl", "staged")


def test_user_can_declare_cuda_aware(monkeypatch):
    monkeypatch.setenv("BURST_HPC_CUDA_AWARE", "1")
    assert choose_transport("mpi", on_device=True) == "mpi"
    assert choose_transport("auto", on_device=True) == ("nccl" if nccl_available() else "mpi")
    assert choose_transport("auto", on_device=True, gpus_shared=True) == "mpi"   # NCCL refuses a shared GPU


def test_auto_prefers_nccl_over_a_cuda_aware_mpi(monkeypatch):
    """NCCL queues on the stream; MPI makes the host wait for it before each exchange (docs/DESIGN.md)."""
    monkeypatch.setenv("BURST_HPC_CUDA_AWARE", "1")
    monkeypatch.setattr(transport, "nccl_available", lambda: True)
    assert choose_transport("auto", on_device=True) == "nccl"
    monkeypatch.setattr(transport, "nccl_available", lambda: False)
    assert choose_transport("auto", on_device=True) == "mpi"
    monkeypatch.setenv("BURST_HPC_CUDA_AWARE", "0")
    assert choose_transport("auto", on_device=True) == "staged"


def test_library_query_answers_without_override(monkeypatch):
    monkeypatch.delenv("BURST_HPC_CUDA_AWARE", raising=False)
    aware, reason = cuda_aware_mpi()
    assert isinstance(aware, bool) and reason


def test_backward_ring_picks_fewer_bytes():
    # MHA, bf16: the q-ring moves a third less (DESIGN.md); GQA 8:1: the kv-ring moves far less
    q_bytes, kv_bytes = backward_ring_bytes(32, 32, 128, 2)
    assert q_bytes < kv_bytes
    assert choose_backward_ring("auto", 32, 32, 128, 2) == "q"
    assert choose_backward_ring("auto", 32, 4, 128, 2) == "kv"
    assert choose_backward_ring("kv", 32, 32, 128, 2) == "kv"


def test_every_transport_and_wrapper_satisfies_the_protocol():
    import numpy as np

    from burst_hpc.benchmark import NoExchange
    from burst_hpc.transport.base import Transport
    from burst_hpc.transport.emulated import EmulatedNetwork, Nic

    class Loopback:
        xp, rank, size = np, 0, 1

        def exchange(self, sends, recvs):
            return self

        def wait(self):
            pass

    assert isinstance(Loopback(), Transport)
    assert isinstance(NoExchange(Loopback()), Transport)
    assert isinstance(EmulatedNetwork(Loopback(), lambda peer: True, Nic(1.0, 0.0)), Transport)
    assert not isinstance(object(), Transport)
