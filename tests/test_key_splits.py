"""The sm90 forward's choice of key splits (Sm90Kernels.key_split), on the host: no GPU needed."""
import pytest

from burst_hpc.backends.cuda import launch, sm90


@pytest.fixture
def kernels(monkeypatch):
    monkeypatch.setattr(launch, "sm_count", lambda: 132)
    k = sm90.Sm90Kernels(None)
    k.key_splits = True
    return k


@pytest.mark.parametrize("heads,s,causal,want", [
    (32, 4096, False, 1),  # 1024 query tiles: the SMs are full
    (8, 2048, False, 1),   # 128 equal tiles on 132 SMs: parts would only add rounds
    (8, 1024, False, 2),   # 64 tiles: half the SMs idle
    (8, 2048, True, 2),    # 128 causal tiles, the longest twice the mean
    (1, 4096, False, 4),   # 32 tiles of 32 key tiles
])
def test_key_split_fills_idle_sms(kernels, heads, s, causal, want):
    assert kernels.key_split(128, 128, heads, s, s, causal, 0, None) == want


def test_key_split_off_masked_or_forced(kernels):
    assert kernels.key_split(128, 128, 1, 4096, 4096, False, 0, object()) == 1  # interval masks: never
    kernels.key_splits = False
    assert kernels.key_split(128, 128, 1, 4096, 4096, False, 0, None) == 1
    kernels.forced_key_splits = 3
    assert kernels.key_split(128, 128, 32, 4096, 4096, False, 0, None) == 3


def test_key_split_nothing_visible(kernels):
    # a causal block pair whose keys all lie after the queries: no key tile to split
    assert kernels.key_split(128, 128, 1, 256, 256, True, -1000, None) == 1
