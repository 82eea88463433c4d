"""Layout names are compared in the layout module only (issue 35's target): every other module takes a
Layout and asks it (``balances_by_schedule``, ``placed_by_mask``, ``is_default``), so a new placement
touches plan/layout.py, not every module that branches on a name."""
import ast
from pathlib import Path

from burst_hpc.plan.layout import LAYOUTS

PACKAGE = Path(__file__).resolve().parents[1] / "burst_hpc"
HOME = PACKAGE / "plan" / "layout.py"


def names_in(node):
    """The layout names a compared expression spells out: a string, or a tuple, list or set of them."""
    if isinstance(node, ast.Constant) and node.value in LAYOUTS:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [name for item in node.elts for name in names_in(item)]
    return []


def comparisons(source):
    """(line, names) of each comparison (==, !=, in, not in, is) with a layout name on either side."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            named = [name for side in [node.left, *node.comparators] for name in names_in(side)]
            if named:
                found.append((node.lineno, named))
    return found


def test_the_scan_finds_comparisons_of_names():
    source = 'a.kind == "chunks"\nkind in ("zigzag", "balanced")\n"contiguous" != b\nkind == "auto"\n'
    assert comparisons(source) == [(1, ["chunks"]), (2, ["zigzag", "balanced"]), (3, ["contiguous"])]


def test_no_module_outside_the_layout_module_compares_layout_names():
    found = {str(path.relative_to(PACKAGE)): hits for path in sorted(PACKAGE.rglob("*.py")) if path != HOME
             for hits in [comparisons(path.read_text())] if hits}
    assert found == {}
    assert comparisons(HOME.read_text())   # the scan reads the home of the names, which does compare them
