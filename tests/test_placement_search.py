"""bench/placement_search.py without a GPU: its swaps keep every rank's count of chunks and every chunk placed
once, and what it reports and saves is a faster prediction than the placement it starts from, or that one."""
import json
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import placement_search  # noqa: E402


def test_the_search_keeps_a_placement_and_never_reports_a_slower_one(tmp_path, capsys):
    saved = tmp_path / "found.json"
    placement_search.main(["--dist", "uniform", "--ranks", "2", "--tokens-per-rank", "2048", "--rounds", "3",
                           "--save", str(saved)])
    out = capsys.readouterr().out
    found = json.loads(saved.read_text())
    chunks = sorted(c for owned in found["owned"] for c in owned)
    assert chunks == list(range(2 * 2048 // found["chunk"]))
    assert len({len(owned) for owned in found["owned"]}) == 1
    totals = [int(m.group(1)) for m in re.finditer(r"(?:start|round \d+): \d+ / \d+ / (\d+)", out)]
    assert totals and totals == sorted(totals)
    assert out.count("  rank ") == 4
