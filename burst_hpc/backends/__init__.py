"""Local block backends: the seam between the ring engine and the device (DESIGN.md layer 5).

Every backend implements the same three calls over one (query block, key block) pair.
Shapes follow BSHD: q (B, Sq, Hq, D); k, v (B, Sk, Hkv, D) with Hq % Hkv == 0, query head h
reading key/value head h // (Hq // Hkv). Inputs may be strided views along S (a zigzag half).

    forward_block(q, k, v, o, lse, *, scale, causal, q_start, k_start, mask=None)
        o   float accumulator (B, Sq, Hq, D), the running *normalised* output
        lse float accumulator (B, Hq, Sq), the running natural-log sum-exp (-inf: nothing yet)
        Attends q to this key block and merges the result into (o, lse) in place (GAO merge).
        causal: the pair needs a mask (False: every key is visible to every query). The mask is
        ``mask`` (a masks.Mask: query q_start + i sees keys mask.intervals[0][.] <= k_start + j <
        mask.intervals[1][.], documents and windows) when given, else plain causal: key position
        k_start + j > query position q_start + i is hidden (global positions).

    backward_block(q, k, v, do, lse, delta, dq, dk, dv, *, scale, causal, q_start, k_start, mask=None)
        lse, delta (B, Hq, Sq): the final forward lse and rowsum(do * o).
        Adds this block pair's gradients into dq (B, Sq, Hq, D) and dk, dv (B, Sk, Hkv, D).

    delta(do, o) -> (B, Hq, S) accumulator-type rowsum(do * o)

Accumulators are float32 (float64 when the inputs are float64, NumPy only).
"""


def get_backend(array, name=None):
    """The backend for ``array``'s kind: NumPy arrays -> numpy, CuPy arrays -> cuda. ``name`` may also
    be a backend object (for example ``CudaBackend.instance(family="sm80")``), used as it is."""
    from ..errors import BackendError

    if name is not None and not isinstance(name, str):
        return name

    is_cupy = type(array).__module__.startswith("cupy")
    if name is None:
        name = "cuda" if is_cupy else "numpy"
    if name == "numpy":
        if is_cupy:
            raise BackendError("the numpy backend takes NumPy arrays; got a CuPy array")
        from .numpy_backend import NumpyBackend

        return NumpyBackend()
    if name == "cuda":
        if not is_cupy:
            raise BackendError("the cuda backend takes CuPy arrays; convert with cupy.asarray first")
        from .cuda import CudaBackend

        return CudaBackend.instance()
    raise BackendError(f"unknown backend {name!r}; use 'numpy' or 'cuda'")
