"""The kernel contract: where the sources in cuda/ are and what they define, read from them
(docs/KERNELS.md, "The kernel contract"). Nothing here needs CuPy or a GPU.

Each fact has one home, in cuda/:
- ``contract.cuh``: the dtype and mask codes, the expansion of a shape into its instances (both 16-bit
  dtypes, the three masks), and the row of a kernel table;
- each family source's shape list, ``#define <FAMILY>_SHAPES(X) X(D, ...) ...`` (head dim first): its
  instances, so the head dims its family runs natively;
- each source's kernel table ``<source>_kernels`` (``<source>_kernel_count`` rows), built by the compiler
  from the same list: every kernel's name and geometry (tile rows and keys, threads, shared memory);
- each family kernel's arguments, one struct in ``contract.cuh`` passed by value (``params_dtype``: its NumPy
  record, laid out as the compiler lays out the struct).
The header and the shape lists are read as text; a table comes from the compiled module
(``compile.Modules.table``) as bytes, decoded by ``KernelTable.from_bytes``.
"""
import functools
import re
from importlib import resources
from pathlib import Path, PurePath
from typing import NamedTuple

import numpy as np

from ... import config
from ...errors import BackendError

# the source of each (family, pass), and of the delta pre-pass both families' backward use
SOURCES = {("sm80", "fwd"): "attn_fwd.cu", ("sm80", "bwd"): "attn_bwd.cu",
           ("sm90", "fwd"): "attn_fwd_sm90.cu", ("sm90", "bwd"): "attn_bwd_sm90.cu"}
DELTA_SOURCE = "attn_delta.cu"
HEADER = "contract.cuh"
# the arguments (a struct of contract.cuh, passed by value) of each (family, pass)'s kernels
PARAMS = {("sm80", "fwd"): "Fwd80Params", ("sm80", "bwd"): "Bwd80Params",
          ("sm90", "fwd"): "Fwd90Params", ("sm90", "bwd"): "Bwd90Params"}


def cuda_dir():
    """Directory holding the kernel sources: $BURST_HPC_CUDA_DIR, else the package's kernels/
    (the repository's cuda/, which the wheel installs as burst_hpc/kernels), else the cuda/ of the
    source tree this module runs from (a checkout on PYTHONPATH, an editable install)."""
    env = config.cuda_dir()
    if env:
        return Path(env)
    installed = resources.files("burst_hpc") / "kernels"
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parents[3] / "cuda"


def mask_mode(masked, mask):
    """The kernel instance of a block pair: 'full' when it is not ``masked``, else by its masks.Mask's
    kind: 'causal' (the closed form) or 'interval' (each row's bounds: documents, windows, ...)."""
    if not masked:
        return "full"
    return "causal" if mask.kind == "causal" else "interval"


class Header(NamedTuple):
    """What contract.cuh defines."""
    dtypes: dict  # dtype token -> code ('bf16': 0, ...)
    masks: dict  # mask token -> code ('full': 0, ...)
    any_code: int  # the code of a column a kernel does not fix
    variants: tuple  # the (dtype, mask) instances of every shape, in the sources' order
    row: np.dtype  # one row of a kernel table


def header():
    """contract.cuh of the sources in use (``cuda_dir()``)."""
    return _header(cuda_dir())


@functools.lru_cache(maxsize=None)
def _header(root):
    text = _read(root, HEADER)
    defines = {name: int(value) for name, value in re.findall(r"^#define (BH_\w+) (-?\d+)\b", text, re.M)}
    expansion = re.search(r"^#define BH_ALL_DTYPES_AND_MASKS\(K, \.\.\.\)((?:.*\\\n)*.*)$", text, re.M)
    fields = re.search(r"struct KernelRow \{\s*char name\[BH_NAME_BYTES\];\s*int ([\w, ]+);\s*\};", text)
    if expansion is None or fields is None:
        raise BackendError(f"cuda/{HEADER}: no BH_ALL_DTYPES_AND_MASKS or struct KernelRow")
    return Header(
        dtypes={name[len("BH_DTYPE_"):].lower(): code for name, code in defines.items() if name.startswith("BH_DTYPE_")},
        masks={name[len("BH_MASK_"):].lower(): code for name, code in defines.items() if name.startswith("BH_MASK_")},
        any_code=defines["BH_ANY"],
        variants=tuple(re.findall(r"K\((\w+), (\w+), __VA_ARGS__\)", expansion.group(1))),
        row=np.dtype([("name", f"S{defines['BH_NAME_BYTES']}")]
                     + [(field.strip(), "<i4") for field in fields.group(1).split(",")]))


# ---- kernel arguments --------------------------------------------------------------------------------------
_SCALARS = {"int": np.dtype("<i4"), "float": np.dtype("<f4"), "i64": np.dtype("<i8")}
_POINTER = np.dtype("<u8")


def params_dtype(struct):
    """The NumPy record of contract.cuh's ``struct`` (a kernel's arguments): its fields by name, at the offsets
    the compiler gives them (natural alignment, a base struct's fields first, then its own from the base's
    size on), pointers as uint64 device addresses, a struct field as a nested record. CuPy passes a one-element
    array of it by value (its bytes) for the kernel's struct parameter."""
    return _params(cuda_dir(), struct)[0]


@functools.lru_cache(maxsize=None)
def _struct_bodies(root):
    text = re.sub(r"//[^\n]*", "", _read(root, HEADER))
    return {name: (base, body) for name, base, body in
            re.findall(r"^struct (\w+)(?:\s*:\s*(\w+))?\s*\{([^}]*)\};", text, re.M)}


@functools.lru_cache(maxsize=None)
def _params(root, struct):
    """(record dtype, alignment) of ``struct``, from its declarations in contract.cuh."""
    bodies = _struct_bodies(root)
    if struct not in bodies:
        raise BackendError(f"cuda/{HEADER} defines no struct {struct}")
    base, body = bodies[struct]
    names, formats, offsets, offset, align = [], [], [], 0, 1
    if base:
        record, align = _params(root, base)
        for name in record.names:
            names.append(name)
            formats.append(record.fields[name][0])
            offsets.append(record.fields[name][1])
        offset = record.itemsize
    for declaration in filter(None, (d.strip() for d in body.split(";"))):
        m = re.fullmatch(r"(?:const\s+)?((?:unsigned\s+)?\w+)\s*((?:\*?\s*\w+\s*,\s*)*\*?\s*\w+)", declaration)
        if m is None:
            raise BackendError(f"cuda/{HEADER}, struct {struct}: cannot read the declaration {declaration!r}")
        kind, declarators = m.groups()
        for declarator in declarators.split(","):
            name = declarator.strip().lstrip("*").strip()
            if declarator.strip().startswith("*"):
                field, field_align = _POINTER, _POINTER.itemsize
            elif kind in _SCALARS:
                field, field_align = _SCALARS[kind], _SCALARS[kind].itemsize
            elif kind in bodies:
                field, field_align = _params(root, kind)
            else:
                raise BackendError(f"cuda/{HEADER}, struct {struct}: field {name} has type {kind}, which is not "
                                   f"int, float, i64, a pointer or a struct defined before it")
            offset = -(-offset // field_align) * field_align
            names.append(name)
            formats.append(field)
            offsets.append(offset)
            offset += field.itemsize
            align = max(align, field_align)
    size = -(-offset // align) * align
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": size}), align


def shapes(source):
    """The shapes cuda/<source> lists once (its ``_SHAPES(X)`` macro): [(head dim, ...)]."""
    return _shapes(cuda_dir(), source)


@functools.lru_cache(maxsize=None)
def _shapes(root, source):
    lists = re.findall(r"^#define \w+_SHAPES\(X\)((?:.*\\\n)*.*)$", _read(root, source), re.M)
    if len(lists) != 1:
        raise BackendError(f"cuda/{source} must list its shapes once (#define <FAMILY>_SHAPES(X) X(D, ...) ...); "
                           f"found {len(lists)} lists")
    return tuple(tuple(int(v) for v in item.split(",")) for item in re.findall(r"\bX\(([^()]*)\)", lists[0]))


def instances(source):
    """Every kernel instance cuda/<source> defines: [(dtype, head dim, mask, shape)]."""
    return [(dtype, shape[0], mask, shape) for shape in shapes(source) for dtype, mask in header().variants]


def native_widths(family, direction):
    """The head dims the ``family``'s kernels of ``direction`` ('fwd' or 'bwd') run natively, ascending."""
    return tuple(sorted({shape[0] for shape in shapes(SOURCES[family, direction])}))


def _read(root, source):
    try:
        return (root / source).read_text()
    except OSError as exc:
        raise BackendError(f"the cuda backend cannot read its kernel source {root / source}: {exc}") from exc


# ---- kernel tables ---------------------------------------------------------------------------------------
def table_symbols(source):
    """(rows, row count) symbols of cuda/<source>'s kernel table."""
    stem = PurePath(source).stem
    return f"{stem}_kernels", f"{stem}_kernel_count"


class Kernel(NamedTuple):
    """One row of a kernel table. dtype, head_dim, mask: None where the kernel takes any."""
    name: str
    dtype: str
    head_dim: int
    mask: str
    query_rows: int  # per tile
    keys: int  # per tile (forward) or per CTA (backward)
    threads: int  # per CTA
    smem_bytes: int  # dynamic shared memory


class KernelTable:
    """The kernels one source defines, found by what they run."""

    def __init__(self, source, kernels):
        self.source = source
        self.kernels = tuple(kernels)
        self._index, self._heights = {}, {}
        for kern in self.kernels:
            self._index.setdefault((kern.dtype, kern.head_dim, kern.mask), []).append(kern)
            self._heights.setdefault(kern.head_dim, {})[kern.query_rows] = None

    @classmethod
    def from_bytes(cls, source, data):
        """The table of cuda/<source> from the bytes of its ``<source>_kernels`` rows."""
        head = header()
        dtype_of = {code: name for name, code in head.dtypes.items()}
        mask_of = {code: name for name, code in head.masks.items()}
        kernels = []
        for row in np.frombuffer(data, dtype=head.row):
            fixed = {f: int(row[f]) for f in ("dtype", "head_dim", "mask") if int(row[f]) != head.any_code}
            kernels.append(Kernel(row["name"].decode(), dtype_of.get(fixed.get("dtype")), fixed.get("head_dim"),
                                  mask_of.get(fixed.get("mask")), *(int(row[f]) for f in Kernel._fields[4:])))
        return cls(source, kernels)

    def find(self, dtype=None, head_dim=None, mask=None, query_rows=None):
        """The kernel for (dtype, head_dim, mask), of ``query_rows`` rows per tile where the source has
        several; BackendError when the source defines none."""
        found = [k for k in self._index.get((dtype, head_dim, mask), ())
                 if query_rows is None or k.query_rows == query_rows]
        if len(found) != 1:
            what = f"dtype {dtype}, head_dim {head_dim}, mask {mask}, query rows {query_rows}"
            raise BackendError(f"cuda/{self.source} defines {len(found)} kernels for {what} (one expected)")
        return found[0]

    def tile_heights(self, head_dim):
        """The query rows per tile of ``head_dim``'s kernels, in table order."""
        return tuple(self._heights.get(head_dim, ()))
