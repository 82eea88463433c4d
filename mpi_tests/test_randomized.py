"""The randomized differential check (mpi_tests/randomized.py) on a fixed set of seeds, on however many
ranks this runs (make test: 1-5 ranks, then 6 and 8 as simulated nodes), on several ranks with some
cases where the ranks first disagree on one argument, and with some also run in bfloat16 with the
ring's last-pair path on, against it off bit for bit. Each failure is reported as one line that
reproduces it; a soak of any size: ``python mpi_tests/randomized.py --cases N``."""
import os

import numpy as np

from randomized import run_seeds

FIXED_SEEDS = range(int(os.environ.get("BURST_HPC_RANDOM_CASES", "60")))


def test_random_cases_match_the_oracle_or_are_refused_alike(comm):
    counts, failures = run_seeds(comm, FIXED_SEEDS)
    assert not failures, "\n" + "\n".join(failures)
    assert counts["ok"] >= len(FIXED_SEEDS) // 2, counts   # the draw mostly makes cases that run
    if comm.size > 1:   # and some where one rank first passes another value of one argument
        assert counts["disagreed"] >= len(FIXED_SEEDS) // 10, counts
    assert counts["last_pairs"] >= len(FIXED_SEEDS) // 10, counts   # and some with the last-pair path on too


def test_finite_rows_of_a_nonfinite_case_meet_the_flashattention_rule():
    """The case that failed on OpenBLAS's Haswell kernels (issue 37): S=2, window (0, 0), -inf in q. dq and dk
    are 0 in exact arithmetic, so any rounding is their whole error; an error of 1.5e-5 is within the
    FlashAttention rule the finite cases meet (and the plain float32 computation's own), and 1e-3 is not.
    A fixed 1e-5 made the verdict depend on the BLAS build."""
    from burst_hpc.reference import attention_backward_reference, attention_reference
    from randomized import Case, finite_problems, inputs, nonfinite_problems

    case = Case(seed=1, ranks=1, dtype="float32", seqlen=2, heads=12, kv_heads=3, head_dim=64, causal=True,
                window=(0, 0), scale=0.8237104017939345, poison=("q", "-inf", 0, 0, 2, 49))
    q, k, v, do = inputs(case)
    kw = dict(causal=case.causal, scale=case.scale, window=case.window)
    f64 = [x.astype(np.float64) for x in (q, k, v, do)]
    oracle = dict(zip(("o", "lse", "dq", "dk", "dv"),
                      (*attention_reference(*f64[:3], **kw), *attention_backward_reference(f64[3], *f64[:3], **kw))))
    assert not np.isfinite(oracle["lse"]).all() and not np.isfinite(oracle["dk"]).all()   # the case tests the rows

    def off_by(shift):
        return {n: np.where(np.isfinite(x), x + (shift if n in ("dq", "dk") else 0.0), x) for n, x in oracle.items()}

    def same(x, axis=1):
        return x

    assert nonfinite_problems(case, off_by(1.5e-5), q, k, v, do, same) == []
    too_far = nonfinite_problems(case, off_by(1e-3), q, k, v, do, same)
    assert [p.split(" > tol ")[0] for p in too_far] == ["dq: finite rows err 0.001", "dk: finite rows err 0.001"]
    # the same rule as the finite cases: the error is accepted there too
    finite = Case(**{**case.__dict__, "poison": None})
    q, k, v, do = inputs(finite)
    f64 = [x.astype(np.float64) for x in (q, k, v, do)]
    oracle = dict(zip(("o", "lse", "dq", "dk", "dv"),
                      (*attention_reference(*f64[:3], **kw), *attention_backward_reference(f64[3], *f64[:3], **kw))))
    assert finite_problems(finite, off_by(1.5e-5), q, k, v, do, same) == []
