// The delta pre-pass of both kernel families' backward: rowsum(do * o) per (batch, head, query row), in
// float32, before the backward walks its block pairs.
#include "common.cuh"
#include "contract.cuh"

constexpr int DELTA_THREADS = 256, DELTA_ROWS = DELTA_THREADS / 32;  // one warp per row

__device__ __forceinline__ float load_kind(const void* p, i64 i, int kind) {
  if (kind == BH_DTYPE_f32) return static_cast<const float*>(p)[i];
  const u16 bits = static_cast<const u16*>(p)[i];
  return kind == BH_DTYPE_bf16 ? bf16_bits_to_float(bits) : half_bits_to_float(bits);
}

// delta[b, h, s] = sum_d do[b, s, h, d] * o[b, s, h, d].
// kinds (for do and o independently): BH_DTYPE_bf16, BH_DTYPE_f16 or BH_DTYPE_f32.
// lanes = 0: one warp per (b, s, h) row, element by element (any dtypes, head dims and strides). lanes > 0 (the
// host's pick where do and o share a 16-bit dtype, D is a multiple of 8 lanes x 8 and rows are 16-byte aligned):
// `lanes` lanes per row, 16 bytes of each input per lane and step, rows in memory order (h fastest): one pass
// over do and o at memory bandwidth.
extern "C" __global__ void __launch_bounds__(DELTA_THREADS)
    attn_delta(const void* dout, const void* o, float* delta, i64 gsb, i64 gss, i64 gsh, i64 osb, i64 oss, i64 osh,
               int B, int S, int H, int D, int gkind, int okind, int lanes) {
  const int lane = threadIdx.x & 31;
  if (lanes > 0) {
    const i64 rows = static_cast<i64>(B) * S * H, n = rows * lanes;
    const bool bf16 = gkind == BH_DTYPE_bf16;
    for (i64 first = static_cast<i64>(blockIdx.x) * blockDim.x + (threadIdx.x - lane); first < n;
         first += static_cast<i64>(gridDim.x) * blockDim.x) {
      const i64 t = first + lane, row = t / lanes;
      const int part = static_cast<int>(t - row * lanes);
      const int h = static_cast<int>(row % H), s = static_cast<int>((row / H) % S);
      const int b = static_cast<int>(row / (static_cast<i64>(H) * S));
      float acc = 0.f;
      if (t < n) {
        const u16* const g = static_cast<const u16*>(dout) + b * gsb + s * gss + h * gsh;
        const u16* const y = static_cast<const u16*>(o) + b * osb + s * oss + h * osh;
        for (int d = 8 * part; d < D; d += 8 * lanes) acc += dot8(g + d, y + d, bf16);
      }
      for (int m = lanes / 2; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m, lanes);
      if (t < n && part == 0) delta[(static_cast<i64>(b) * H + h) * S + s] = acc;
    }
    return;
  }
  const i64 row = static_cast<i64>(blockIdx.x) * DELTA_ROWS + (threadIdx.x >> 5);
  if (row >= static_cast<i64>(B) * S * H) return;
  const int h = static_cast<int>(row % H);
  const int s = static_cast<int>((row / H) % S);
  const int b = static_cast<int>(row / (static_cast<i64>(H) * S));
  const i64 g0 = b * gsb + s * gss + h * gsh, o0 = b * osb + s * oss + h * osh;
  float acc = 0.f;
  for (int d = lane; d < D; d += 32) acc += load_kind(dout, g0 + d, gkind) * load_kind(o, o0 + d, okind);
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (lane == 0) delta[(static_cast<i64>(b) * H + h) * S + s] = acc;
}

// its row: any dtype, head dim and mask; DELTA_ROWS rows of (b, s, h) per CTA of DELTA_THREADS threads
BH_KERNEL_TABLE(attn_delta, {"attn_delta", BH_ANY, BH_ANY, BH_ANY, DELTA_ROWS, 0, DELTA_THREADS, 0})
