"""bench/evidence.py: the seeded inputs are the same for every process that asks with the same seed,
and its per-head float64 reference (run on the GPU by the evidence benchmarks) is the project's oracle."""
import pathlib
import sys

import numpy as np
import pytest

from burst_hpc.reference import attention_backward_reference, attention_reference

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import evidence  # noqa: E402


def test_global_inputs_are_seeded():
    first, again, other = (evidence.global_inputs(seed, 24, 4, 2, 16) for seed in (5, 5, 6))
    assert [x.shape for x in first] == [(1, 24, 4, 16), (1, 24, 2, 16), (1, 24, 2, 16), (1, 24, 4, 16)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(first[0], other[0])


@pytest.mark.parametrize("causal", [True, False])
def test_reference_is_the_oracle(seed, causal):
    q, k, v, do = evidence.global_inputs(seed, 37, 6, 2, 8, batch=2)
    got = evidence.reference(q, k, v, do, causal)
    o, _ = attention_reference(q, k, v, causal=causal)
    for name, want in zip(("o",) + evidence.GRADS, (o, *attention_backward_reference(do, q, k, v, causal=causal))):
        np.testing.assert_allclose(got[name], want, atol=1e-12, err_msg=name)
    errors = evidence.max_errors({"o": o + 0.25}, got)
    assert errors == {"err_o": pytest.approx(0.25)}
