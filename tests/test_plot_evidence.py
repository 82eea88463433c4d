"""bench/plot_evidence.py on synthetic JSON lines: the tables compute the ratios they claim, and the
plots are written as PNG files that read back as images."""
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import plot_evidence  # noqa: E402

SHAPE = {"heads": 32, "kv_heads": 8, "head_dim": 128, "causal": True}


def timing(method, P, tokens, pass_, seconds, tflops, transport="nccl", **extra):
    return {"kind": "time", "method": method, "P": P, "tokens": tokens, "pass": pass_, "full": seconds,
            "tflops_per_gpu": tflops, "transport": transport, "peak_gib": 3.0, **SHAPE, **extra}


def accuracy(method, P, errors):
    return {"kind": "accuracy", "method": method, "P": P, "tokens": 16384, **SHAPE,
            **dict(zip(plot_evidence.ERRORS, errors))}


ROWS = [
    timing("burst", 1, 32768, "fwdbwd", 0.112, 275.0),     # weak base
    timing("burst", 2, 65536, "fwdbwd", 0.225, 270.0),     # weak: 270 / 275
    timing("burst", 1, 262144, "fwdbwd", 6.8, 294.0),      # strong base
    timing("burst", 2, 262144, "fwdbwd", 3.4, 291.0),      # strong: 6.8 / (2 * 3.4)
    timing("torch-cp-cudnn", 2, 65536, "fwdbwd", 0.150, 480.0),
    {"kind": "time", "method": "ulysses", "P": 3, "tokens": 3 * 8192, "pass": "fwdbwd", **SHAPE,
     "error": "Ulysses splits heads over the ranks"},
    # bytes: one forward and both backward rings (bench_ring.py's rows carry ring and bytes_design)
    timing("burst", 2, 16384, "fwd", 0.01, 100.0, ring="kv", bytes_sent=1000, bytes_design=1000),
    timing("burst", 2, 16384, "fwdbwd", 0.03, 100.0, ring="q", bytes_sent=3000, bytes_design=2800),
    timing("burst", 2, 16384, "fwdbwd", 0.03, 100.0, ring="kv", bytes_sent=5000, bytes_design=4500),
    accuracy("burst", 1, [1e-3, 2e-3, 4e-3, 4e-3]),
    accuracy("burst", 2, [1e-3, 2.2e-3, 4e-3, 4e-3]),
    accuracy("torch-cp-flash", 1, [2e-3, 2e-3, 4e-3, 4e-3]),
    accuracy("torch-cp-flash", 2, [3e-3, 2e-3, 4e-3, 4e-3]),
]


@pytest.fixture
def lines(tmp_path):
    path = tmp_path / "evidence.jsonl"
    path.write_text("a log line\n" + "\n".join(json.dumps(r) for r in ROWS) + "\n")
    return path


def test_tables(lines, capsys):
    plot_evidence.main(["--table", "all", str(lines)])
    out = capsys.readouterr().out
    assert f"| weak | H=32 Hkv=8 D=128 | nccl | fwdbwd | 2 | 65536 | {270 / 275:.1%} |" in out
    assert f"| strong | H=32 Hkv=8 D=128 | nccl | fwdbwd | 2 | 262144 | {6.8 / 6.8:.1%} |" in out
    assert f"| {0.150 / 0.225:.2f}x |" in out  # torch CP's time over ours, same case
    assert "Did not run: ulysses, 3 GPU(s), 24576 tokens" in out
    # backward bytes = fwdbwd - fwd: q-ring 2000, kv-ring 4000 (DESIGN: 1800, 3500)
    assert f"| {2000 / 1800:.3f} | 0.500 |" in out and f"| {4000 / 3500:.3f} | 0.500 |" in out
    assert "| burst | 2 | 16384 | H=32 Hkv=8 D=128 | 1.00e-03 | 2.20e-03 | 4.00e-03 | 4.00e-03 | 1.10x |" in out
    assert "| torch-cp-flash | 2 | 16384 | H=32 Hkv=8 D=128 | 3.00e-03 | 2.00e-03 | 4.00e-03 | 4.00e-03 | 1.50x |" in out


def test_plots_are_png_images(lines, tmp_path):
    matplotlib = pytest.importorskip("matplotlib")  # the test extra installs it
    import matplotlib.image

    written = plot_evidence.plot(plot_evidence.read([lines]), tmp_path / "png")
    names = sorted(p.name for p in written)
    assert names == ["accuracy_vs_world_size.png", "scaling_efficiency.png", "time_H32_Hkv8_D128.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(path)
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200
