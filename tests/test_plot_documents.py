"""bench/plot_documents.py on synthetic rows: one panel for each (GPUs, tokens per GPU, distribution, device), and a
PNG that reads back as an image of that many panels' height."""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import plot_documents  # noqa: E402


def row(P, tokens, dist, layout, scale=1.0):
    values = {f"{p}_tflops_per_gpu": 100 * scale * (i + 1) for i, p in enumerate(plot_documents.PASSES)}
    values.update({f"{p}_predicted_tflops_per_gpu": 110 * scale for p in plot_documents.PASSES})
    return dict(P=P, tokens=tokens, dist=dist, layout=layout, scheme="ring", device="GPU", default=layout == "zigzag",
                **values)


def test_panels_and_png(tmp_path):
    rows = [row(4, 32768, dist, layout) for dist in ("uniform", "magi") for layout in ("contiguous", "zigzag")]
    rows += [row(1, 8192, "uniform", "zigzag", 2.0)]
    found = plot_documents.panels(rows)
    assert sorted(found) == [(1, 8192, "uniform", "GPU"), (4, 8192, "magi", "GPU"), (4, 8192, "uniform", "GPU")]
    assert [r["layout"] for r in found[(4, 8192, "magi", "GPU")]] == ["contiguous", "zigzag"]
    data = tmp_path / "rows.jsonl"
    data.write_text("a log line\n" + "\n".join(json.dumps(r) for r in rows) + "\n")
    png = tmp_path / "plots" / "documents.png"
    plot_documents.main([str(data), "--png", str(png)])
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 2 * 200 and image.shape[1] > 600   # three stacked panels
