"""The kernel contract on the CPU: every kernel the CUDA backend can ask for exists in cuda/*.cu, with the
geometry its launch assumes. No GPU and no CuPy needed; each level runs as far as the machine's tools go:

- the text (always): contract.cuh's codes, instance expansion and table row; each source's shape list; every
  (family, pass, head dim, input dtype, mask mode) routes to an instance its source lists;
- the preprocessed text (``cpp``): each source's kernel table rows name kernels the source defines, one row
  per listed instance, and every family kernel it defines has a row;
- the compiled text (``nvcc``): tests/record_launches.py drives the backend itself over that matrix on a
  stand-in for CuPy whose modules are the PTX of the sources: the tables decode (as at run time) to the
  instances, and every launch asks for a kernel the PTX defines, for the routed head dim, dtype and mask,
  with the threads and shared memory of its table row.
"""
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from burst_hpc.backends import padding
from burst_hpc.backends.cuda import FAMILIES, contract, launch
from burst_hpc.backends.cuda.backend import route
from burst_hpc.errors import BackendError

CUDA = Path(__file__).resolve().parents[1] / "cuda"
INPUT_DTYPES = {"bfloat16": np.dtype("bfloat16"), "float16": np.dtype(np.float16), "float32": np.dtype(np.float32),
                "uint16": np.dtype(np.uint16)}  # uint16: raw bf16 bits
MODES = ("full", "causal", "interval")
PASSES = ("fwd", "bwd")


def routed_width(family, direction, head_dim):
    """The native width a head dim runs at, or None for the wide (tiled, kernel-free) path."""
    widths = contract.native_widths(family, direction)
    how = route(head_dim, widths)
    return None if how == "wide" else padding.native_width(head_dim, widths)


def expected_kernels():
    """{(family, pass, dtype, head dim, mask)} the backend can ask for: every input dtype, mask mode and head dim
    up to past the widest kernel."""
    keys = set()
    for family in FAMILIES:
        for direction in PASSES:
            for d in range(1, 2 * max(contract.native_widths(family, direction)) + 1):
                width = routed_width(family, direction, d)
                if width is not None:
                    keys |= {(family, direction, launch.kernel_dtype(dtype), width, mode)
                             for dtype in INPUT_DTYPES.values() for mode in MODES}
    return keys


# ---- the text ----------------------------------------------------------------------------------------------
def test_header_defines_codes_expansion_and_row():
    head = contract.header()
    assert set(head.dtypes) == {"bf16", "f16", "f32"} and len(set(head.dtypes.values())) == 3
    assert set(head.masks) == set(MODES) and len(set(head.masks.values())) == 3
    assert head.any_code not in head.dtypes.values() and head.any_code not in head.masks.values()
    assert sorted(head.variants) == sorted((dt, m) for dt in ("bf16", "f16") for m in MODES)
    assert head.row.names == contract.Kernel._fields  # the row the launches read, field for field
    for kind in map(launch.dtype_kind, INPUT_DTYPES.values()):  # attn_delta's kind arguments
        assert kind in head.dtypes


def test_every_source_lists_its_shapes_once():
    for (family, direction), source in contract.SOURCES.items():
        assert (CUDA / source).is_file()
        shapes = contract.shapes(source)
        assert shapes and len(set(shapes)) == len(shapes), source
        assert all(shape[0] % 64 == 0 for shape in shapes), f"{source}: head dims of whole 64-column blocks"
        assert contract.native_widths(family, direction) == tuple(sorted({s[0] for s in shapes}))
    assert (CUDA / contract.DELTA_SOURCE).is_file()


def test_every_routed_kernel_is_listed():
    listed = {(family, direction, dtype, d, mask)
              for (family, direction), source in contract.SOURCES.items()
              for dtype, d, mask, _ in contract.instances(source)}
    wanted = expected_kernels()
    assert wanted <= listed, sorted(wanted - listed)
    assert listed <= wanted, f"instances no call reaches: {sorted(listed - wanted)}"


def test_routes():
    assert [route(d, (64, 128)) for d in (32, 64, 100, 128, 129)] == ["padded", "native", "padded", "native", "wide"]
    assert routed_width("sm90", "bwd", 200) == 256 and routed_width("sm80", "bwd", 200) is None


# ---- the kernels' arguments -----------------------------------------------------------------------------------
def compiled_layout(header, structs):
    """{struct: (sizeof, {field path: offset})} of the structs in the C header ``header``, from a host program
    g++ compiles (the layout nvcc gives a kernel parameter is the host's), for the fields ``params_dtype`` names."""
    lines = ["#include <cstdio>", f'#include "{header}"', "int main() {"]
    for struct in structs:
        lines.append(f'  {{ {struct} x; std::printf("{struct} sizeof %zu\\n", sizeof x);')

        def walk(dtype, path):
            for name in dtype.names:
                sub = dtype.fields[name][0]
                if sub.names:
                    walk(sub, f"{path}{name}.")
                else:
                    lines.append(f'    std::printf("{struct} {path}{name} %td\\n", '
                                 f'(char*)&x.{path}{name} - (char*)&x);')

        walk(contract.params_dtype(struct), "")
        lines.append("  }")
    lines.append("}")
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "layout.cpp").write_text("\n".join(lines))
        subprocess.run(["g++", "-std=c++17", "-o", f"{tmp}/layout", f"{tmp}/layout.cpp"], check=True, timeout=120)
        out = subprocess.run([f"{tmp}/layout"], capture_output=True, text=True, check=True).stdout
    layout = {struct: [0, {}] for struct in structs}
    for struct, field, value in (line.split() for line in out.splitlines()):
        if field == "sizeof":
            layout[struct][0] = int(value)
        else:
            layout[struct][1][field] = int(value)
    return {struct: tuple(v) for struct, v in layout.items()}


def record_layout(dtype, at=0, path=""):
    """{field path: offset} of a NumPy record, nested records flattened as a.b."""
    fields = {}
    for name in dtype.names:
        sub, offset = dtype.fields[name][:2]
        fields.update(record_layout(sub, at + offset, f"{path}{name}.") if sub.names
                      else {f"{path}{name}": at + offset})
    return fields


def assert_records_match_the_compiler(header, structs):
    compiled = compiled_layout(header, structs)
    for struct in structs:
        dtype = contract.params_dtype(struct)
        assert compiled[struct] == (dtype.itemsize, record_layout(dtype)), struct


needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (the compiler's struct layout)")


@needs_gxx
def test_kernel_args_records_are_laid_out_as_the_structs():
    assert_records_match_the_compiler(CUDA / contract.HEADER, ["PairParams", "KvOut", *contract.PARAMS.values()])
    for (family, direction), struct in contract.PARAMS.items():  # each family kernel takes its struct by value
        assert f"const __grid_constant__ {struct} args" in (CUDA / contract.SOURCES[family, direction]).read_text()


@needs_gxx
def test_kernel_args_layout_rules(tmp_path, monkeypatch):
    """The layout cases the header may grow into: a base's tail padding (not reused by the derived struct's
    fields), a nested struct, several names to a declaration, 4-byte fields before 8-byte ones."""
    (tmp_path / contract.HEADER).write_text("""typedef long long i64;
struct Tail { i64 a; int b; };          // 12 bytes of fields, sizeof 16
struct Derived : Tail { int c; };       // c at 16, not 12
struct Inner { int x; };
struct Outer : Inner { const unsigned char* p; Inner in; float f, g; int *r, s; i64 t; Derived d; };
""")
    monkeypatch.setenv("BURST_HPC_CUDA_DIR", str(tmp_path))
    assert record_layout(contract.params_dtype("Derived"))["c"] == 16
    assert_records_match_the_compiler(tmp_path / contract.HEADER, ["Tail", "Derived", "Inner", "Outer"])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / contract.HEADER).write_text("struct Bad { char c; };\n")
    monkeypatch.setenv("BURST_HPC_CUDA_DIR", str(tmp_path / "bad"))
    with pytest.raises(BackendError, match="type char"):
        contract.params_dtype("Bad")


class _DeviceArray:
    """What a launch reads of a device array: its address (``data.ptr``), shape, strides and item size."""

    def __init__(self, shape, ptr, itemsize=2):
        self.shape, self.itemsize, self.data = shape, itemsize, type("Pointer", (), {"ptr": ptr})()
        self.strides = tuple(int(np.prod(shape[i + 1:])) * itemsize for i in range(len(shape)))


def test_kernel_args_fill_their_record_by_name_without_reading_the_header(monkeypatch):
    fill, sm80_fill = launch.KernelArgs("Bwd90Params"), launch.KernelArgs("Fwd80Params")
    record = contract.params_dtype("Bwd90Params")

    def unread():
        raise AssertionError("a launch read the kernel sources: the record is read once, at KernelArgs()")

    monkeypatch.setattr(contract, "cuda_dir", unread)  # per launch the host only fills (short pairs feel its time)
    q, k = _DeviceArray((2, 70, 8, 64), 0x1000), _DeviceArray((2, 90, 4, 64), 0x2000)
    dk, dv = _DeviceArray((2, 90, 4, 64), 0x3000), _DeviceArray((2, 90, 4, 64), 0x4000)
    args = fill(q, k, scale=0.125, q_start=90, k_start=10, mask=None, hpb=2, Sq_pad=128, order=None, tmaps=q,
                kv=launch.array_fields(("dk", dk, "sb ss sh"), ("dv", dv, "")))
    assert args.shape == (1,) and args.dtype == record
    row = args[0]
    assert [int(row[f]) for f in ("Sq", "Sk", "B", "Hq", "Hkv", "group", "off", "hpb", "Sq_pad")] == [
        70, 90, 2, 8, 4, 2, 80, 2, 128]
    assert row["scale"] == np.float32(0.125) and row["sl2"] == np.float32(0.125 * launch.LOG2E)
    assert (row["tmaps"], row["order"], row["rows"], row["mlo"]) == (0x1000, 0, 0, 0)
    assert [int(row["kv"][f]) for f in ("dk", "dv", "sb", "ss", "sh")] == [0x3000, 0x4000, 90 * 4 * 64, 4 * 64, 64]
    with pytest.raises(BackendError, match="Bwd90Params have no field hbp"):
        fill(q, k, scale=1.0, q_start=0, k_start=0, mask=None, hbp=2)
    with pytest.raises(BackendError, match=r"Bwd90Params\.kv have no field dq"):
        fill(q, k, scale=1.0, q_start=0, k_start=0, mask=None, kv={"dq": dk})
    sm80 = sm80_fill(q, k, scale=1.0, q_start=0, k_start=0, mask=None,  # fields named q, k as the call's q, k
                     **launch.array_fields(("q", q, "qsb qss qsh"), ("o", None, "osb oss osh")))
    assert (sm80[0]["q"], sm80[0]["qsh"], sm80[0]["o"], sm80[0]["osb"]) == (0x1000, 64, 0, 0)


# ---- the preprocessed text ------------------------------------------------------------------------------------
def _preprocessed(source):
    return subprocess.run(["cpp", "-P", "-x", "c++", f"-I{CUDA}", str(CUDA / source)], capture_output=True,
                          text=True, check=True).stdout


@pytest.mark.skipif(shutil.which("cpp") is None, reason="needs the C preprocessor (cpp)")
@pytest.mark.parametrize("source", [*contract.SOURCES.values(), contract.DELTA_SOURCE])
def test_tables_name_the_listed_kernels(source):
    text = _preprocessed(source)
    symbol, _ = contract.table_symbols(source)
    table = re.search(r"KernelRow %s\[\] = \{(.*?)\};" % symbol, text, re.S)
    assert table, f"{source} exports no {symbol}"
    rows = re.findall(r'\{"(\w+)", (-?\d+), (-?\d+), (-?\d+),', table.group(1))
    defined = set(re.findall(r'extern "C" __global__ void\s+(?:__launch_bounds__\([^()]*\)\s+)?(\w+)\(', text))
    head = contract.header()
    codes = [(head.dtypes[dt], d, head.masks[m]) for dt, d, m, _ in contract.instances(source)] \
        if source != contract.DELTA_SOURCE else [(head.any_code,) * 3]
    assert sorted((int(a), int(b), int(c)) for _, a, b, c in rows) == sorted(codes)
    names = [name for name, *_ in rows]
    assert len(set(names)) == len(names) and set(names) <= defined, sorted(set(names) - defined)
    # the sm90 helpers and the packed passes' row moves and sums run by name, outside the tables
    families = {name for name in defined if not name.endswith(("_rows", "_to16", "_rows_sum", "_rows_copy"))}
    assert families == set(names), sorted(families ^ set(names))


# ---- the compiled text: the backend's own launches ----------------------------------------------------------------
@pytest.fixture(scope="module")
def recorded():
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("record_launches.py"))], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout)


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (PTX of the sources)")


@needs_nvcc
def test_compiled_tables_are_the_listed_instances(recorded):
    for (family, direction), source in contract.SOURCES.items():
        rows = [contract.Kernel(*row) for row in recorded["tables"][source]]
        assert sorted((k.dtype, k.head_dim, k.mask) for k in rows) == sorted(
            (dt, d, m) for dt, d, m, _ in contract.instances(source))
        for k in rows:
            assert recorded["entries"][source][k.name] == k.threads, f"{k}: the kernel's __launch_bounds__"
            assert 0 < k.smem_bytes <= 227 * 1024 and k.threads % 128 == 0, k
            # whole tiles: 64-row warpgroup products, P V in steps of 16 keys (the sm90 D = 256 forward: 80)
            assert k.query_rows % 64 == 0 and k.keys % 16 == 0, k
            if family == "sm90":
                assert max(k.query_rows, k.keys) <= 256, k  # a TMA box holds at most 256 rows
    (delta,) = [contract.Kernel(*row) for row in recorded["tables"][contract.DELTA_SOURCE]]
    assert recorded["entries"][contract.DELTA_SOURCE][delta.name] == delta.threads == 32 * delta.query_rows


@needs_nvcc
def test_a_call_prepares_its_builds_which_its_launches_then_load(recorded):
    from burst_hpc.backends.cuda.backend import kernel_builds

    done = set()
    for family in FAMILIES:  # in this order, on one cache: the delta pre-pass is compiled once for both
        wanted = kernel_builds(family, {"bf16"}, [128], ("full", "causal"), ("fwd", "bwd"))
        assert len(wanted) == 7  # two tables, two instances per pass, the delta pre-pass
        assert recorded["prepared"][family] == {b.name(): "cached" if b in done else "compiled" for b in wanted}
        assert recorded["prepared_again"][family] == {}  # the next call of the kind looks nothing up
        done |= set(wanted)


@needs_nvcc
def test_every_launch_asks_for_a_kernel_with_its_table_geometry(recorded):
    tables = {source: {row[0]: contract.Kernel(*row) for row in table} for source, table in recorded["tables"].items()}
    (delta,) = tables[contract.DELTA_SOURCE].values()
    launched = set()
    for call in recorded["calls"]:
        family, direction, d, dtype, mode, tile_height = call["call"]
        assert call["error"] is None, call
        if direction == "delta":  # any head dim, dtype and mask
            assert call["launches"] == [[delta.name, call["launches"][0][1], [delta.threads], 0]], call
            continue
        width = routed_width(family, direction, d)
        if width is None:  # the tiled path: no kernel
            assert call["launches"] == [], call
            continue
        source = contract.SOURCES[family, direction]
        ours = [entry for entry in call["launches"] if entry[0] in tables[source]]
        assert len(ours) == 1, call
        for name, _, _, smem in call["launches"]:
            if name not in tables[source]:  # the sm90 backward's pre-passes: no dynamic shared memory
                assert (family, direction, smem) == ("sm90", "bwd", 0) and name in recorded["entries"][source], call
        ((name, _, block, smem),) = ours
        kernel = tables[source][name]
        assert name in recorded["entries"][source] and block == [kernel.threads] and smem == kernel.smem_bytes, call
        assert (kernel.dtype, kernel.head_dim, kernel.mask) == (
            launch.kernel_dtype(INPUT_DTYPES[dtype]), width, mode), call
        assert tile_height is None or direction == "bwd" or kernel.query_rows == tile_height, call
        launched.add((family, direction, kernel.dtype, kernel.head_dim, kernel.mask, kernel.query_rows))
    assert {key[:5] for key in launched} == expected_kernels()
    forward = tables[contract.SOURCES["sm90", "fwd"]].values()
    assert {(k.dtype, k.head_dim, k.mask, k.query_rows) for k in forward} == {
        key[2:] for key in launched if key[:2] == ("sm90", "fwd")}, "every sm90 forward tile height runs"


@needs_nvcc
def test_a_kept_launch_passes_what_a_launch_worked_out_anew_would(recorded):
    """A call of the shapes of an earlier one reuses its launch (Sm90Kernels.launches) with its own arrays'
    addresses: every argument of every launch equals that of the same call worked out anew, whether the earlier
    call was the same call on other arrays or differed in an offset, a first flag, the mask or a knob; and the
    record holds the second call's outputs, not the first's (read through the pointer the launch passes)."""
    kept = recorded["kept"]
    assert {"causal fwd", "interval bwd first_kv", "fwd mask", "bwd mask"} <= set(kept)
    for case, got in kept.items():
        assert len(got["kept"]) == len(got["anew"]) >= 1, case
        assert got["kept"] == got["anew"], case
        # the record: the forward's one launch; the backward's main launch, after its row pre-pass
        record = [args[0] for args in got["kept"] if len(args) == 1][0]
        for name, address in got["addresses"]["kept"].items():
            assert address in record, f"{case}: {name} of the second call not in its record"
            assert got["addresses"]["first"][name] not in record, f"{case}: {name} of the first call in the second's"
