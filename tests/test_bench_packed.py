"""bench/bench_packed.py without a GPU: MagiAttention's document sampling (the same packs as theirs), the uniform
sets, the FLOP count both conventions share, FA3's combined rate, the kernel classes and the argument checks."""
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import bench_packed  # noqa: E402
from bench_packed import (combined_rate, document_sets, is_attention_kernel, magi_packs, outside_share,  # noqa: E402
                          pass_flops, read_length_table)

from burst_hpc.plan import masks  # noqa: E402


def test_length_table_reads_bins_at_their_midpoints():
    lengths, counts = read_length_table()
    assert lengths.size == counts.size == 14
    assert (lengths[0], counts[0]) == (5, 30254)            # "[0, 10]",30254
    assert (lengths[-1], counts[-1]) == (163840, 18284)     # "[131073, 196608]",18284
    assert np.all(np.diff(lengths) > 0)


def test_magi_packs_are_magiattentions_packs():
    """The first two packs MagiAttention's DatasetSampler draws at S = 8192 (pack_len 8192, chunk_ratio 0.25,
    seed 42, their doc_length_distribution.csv), taken from their code on 2026-11-26."""
    first, second = magi_packs(read_length_table(), 8192, 2)
    np.testing.assert_array_equal(np.diff(first), [139, 350, 762, 2048, 350, 762, 762, 1536, 350, 1133])
    np.testing.assert_array_equal(np.diff(second), [518, 2048, 762, 150, 75, 2048, 762, 1024, 762, 43])


def test_magi_packs_cut_documents_into_chunks_and_packs():
    table = (np.array([3, 9, 40]), np.array([50, 20, 5]))   # chunk 8: pieces 3; 8 + 1; 5 x 8
    packs = magi_packs(table, 32, 100, seed=1)
    total = 3 * 50 + 9 * 20 + 40 * 5
    assert len(packs) == total // 32                          # every whole pack of the stream
    for cu in packs:
        lengths = np.diff(cu)
        assert cu[0] == 0 and cu[-1] == 32 and np.all(lengths > 0) and lengths.max() <= 8
        assert set(lengths[1:-1]) <= {3, 8, 1}                # only the ends may be split at a pack's edge
    assert magi_packs(table, 32, 3, seed=1)[0].tolist() == packs[0].tolist()
    assert any(a.tolist() != b.tolist() for a, b in zip(packs, magi_packs(table, 32, 100, seed=2)))
    with pytest.raises(ValueError, match="whole number"):
        magi_packs(table, 30, 1)


@pytest.mark.parametrize("seqlen", [4096, 8192])
def test_uniform_sets_fill_the_sequence_up_to_a_quarter(seqlen):
    sets = document_sets("uniform", seqlen, 3)
    assert len(sets) == 3 and sets[0].tolist() != sets[1].tolist()
    for cu in sets:
        assert cu[0] == 0 and cu[-1] == seqlen and 0 < np.diff(cu).min() and np.diff(cu).max() <= seqlen // 4
    assert [cu.tolist() for cu in sets] == [cu.tolist() for cu in document_sets("uniform", seqlen, 3)]


def test_flops_count_each_document_as_magiattention_does():
    cu = np.array([0, 5, 12, 20])
    area = sum(n * (n + 1) // 2 for n in np.diff(cu))     # their rectangle area: (q, k) points with k <= q
    flops = pass_flops(masks.make(20, True, None, cu), heads=4, head_dim=8)
    assert flops["fwd"] == 4 * area * 4 * 8
    assert flops["bwd"] == pytest.approx(2.5 * flops["fwd"])
    assert flops["fwd+bwd"] == pytest.approx(3.5 * flops["fwd"])


def test_fa3_forward_and_backward_give_its_combined_rate():
    assert combined_rate(483, 318) == pytest.approx(352, abs=0.5)   # issue 34's ~352 at 8k
    assert combined_rate(400, 400) == pytest.approx(400)
    assert bench_packed.fa3_published(8192)["fwd+bwd"] == pytest.approx(combined_rate(483, 318))
    assert bench_packed.fa3_published(4096) == {}


def test_attention_kernels_are_the_tile_loops():
    for name in ("attn_fwd_sm90_bf16_d128_m2_docs", "attn_bwd_sm90_bf16_d128_docs", "attn_fwd_bf16_d128_docs",
                 "attn_bwd_bf16_d64_docs_k4x2"):
        assert is_attention_kernel(name), name
    for name in ("attn_delta", "attn_bwd_sm90_rows", "attn_bwd_sm90_to16",
                 "cupy_copy__float32_bfloat16", "Memset (Device)", "attn_fwd_prepare"):
        assert not is_attention_kernel(name), name
    kernels = {"attn_fwd_sm90_bf16_d128_m2_docs": 900.0, "attn_delta": 50.0, "Memset (Device)": 10.0}
    assert outside_share(kernels, 1000.0) == pytest.approx(0.1)


def test_dry_run_needs_no_gpu(capsys):
    sets = bench_packed.main(["--dry-run", "--seqs", "64,128", "--dists", "uniform", "--sets", "2"])
    assert sorted(sets) == [(64, "uniform"), (128, "uniform")]
    out = capsys.readouterr().out
    assert out.count("| uniform |") == 4 and "| 128 | uniform | 1 |" in out


@pytest.mark.parametrize("argv", [["--impls", "varlen_attn"], ["--impls", "ours,sdpa"], ["--dists", "lognormal"],
                                  ["--seqs", "8190"], ["--sets", "0"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        bench_packed.parse_args(argv)


def test_report_leaves_a_wrong_peer_out_of_the_ratios():
    args = bench_packed.parse_args(["--seqs", "8192", "--dists", "magi", "--sets", "1", "--reps", "3"])
    rates = {"ours": {"fwd": 200.0, "bwd": 150.0, "fwd+bwd": 160.0},
             "varlen_attn": {"fwd": 100.0, "bwd": 100.0, "fwd+bwd": 100.0},
             "flex": {"fwd": 400.0, "bwd": 400.0, "fwd+bwd": 400.0}}
    row = {"tflops": rates, "ok": {"varlen_attn": True, "flex": False},
           "diffs": {"varlen_attn": {"o": (0.01, 0.004)}, "flex": {"o": (3.0, 0.9)}},
           "outside": {"fwd": 0.5, "bwd": 0.25, "fwd+bwd": 0.2}, "describe": {"documents": 10},
           "gpu_tflops": {"fwd": 380.0, "bwd": 260.0, "fwd+bwd": 290.0},
           "split": {"fwd": (0.21, 0.43), "bwd": (0.3, 2.0), "fwd+bwd": (0.5, 2.4)},
           "magi_tflops": {"fwd": 450.0, "bwd": 300.0, "fwd+bwd": 330.0},
           "kernels": {"fwd": {"attn_fwd_sm90_bf16_d128_m2_interval": 475.0, "cupy_copy__float32_bfloat16": 319.0},
                       "bwd": {"attn_delta": 256.0}}}
    md = bench_packed.report({(8192, "magi"): [row]}, args, "H100", "torch x")
    fwd = next(line for line in md.splitlines() if "| fwd |" in line).split(" | ")
    # S, documents, pass, ours, varlen, flex, FA3, ours/varlen, ours/flex, ours/FA3, outside, alone, GPU alone, host,
    # as MagiAttention times, that / FA3
    assert fwd[3:7] == ["200", "100", "-", "483"]
    assert fwd[7:10] == ["2.00x", "-", "0.41x"]
    assert fwd[10:16] == ["50%", "400", "380", "0.21", "450", "0.93x |"]
    assert "WRONG: flex at (8192, 'magi')" in md
    assert "| fwd | *`attn_fwd_sm90_bf16_d128_m2_interval` | 475 |" in md


def test_the_kernels_tiles_waste_less_than_a_grid_on_documents_off_it():
    """The forward's own tiles (a long document's from its first row) compute fewer pairs than a grid of 128-row
    tiles when documents of whole tiles start off the grid, the same on the grid."""
    import numpy as np

    off = masks.make(4096, True, None, np.array([0, 64, 1088, 2112, 3136, 4096]))   # 86% against 74%
    assert bench_packed.kernel_tile_use(off) > bench_packed.tile_use(off, 128, 128)
    on = masks.make(4096, True, None, np.array([0, 1024, 4096]))
    assert bench_packed.kernel_tile_use(on) == pytest.approx(bench_packed.tile_use(on, 128, 128))


def test_tile_use_counts_whole_tiles_of_visible_blocks():
    from burst_hpc.plan import masks

    # plain causal 8k in 128 x 128 tiles: 64 * 65 / 2 tiles computed, S (S + 1) / 2 pairs visible
    causal = masks.Mask(8192, True, None, None)
    assert bench_packed.tile_use(causal, 128, 128) == pytest.approx(8192 * 8193 / 2 / (2080 * 128 * 128))
    # documents of 100, 100 and 56 tokens in one 256-key tile: each block of 16 rows computes the whole tile
    docs = masks.make(256, True, None, np.array([0, 100, 200, 256]))
    visible = 100 * 101 + 56 * 57 // 2
    assert bench_packed.tile_use(docs, 16, 256) == pytest.approx(visible / (16 * 16 * 256))
    assert bench_packed.tile_use(docs, 16, 8) > bench_packed.tile_use(docs, 16, 256)
    assert bench_packed.tile_use(docs, 128, 96) is None   # 96 does not divide 256
