// The delta pre-pass of both kernel families' backward: rowsum(do * o) per (batch, head, query row), in
// float32, before the backward walks its block pairs.
#include "common.cuh"
#include "contract.cuh"

constexpr int DELTA_THREADS = 256, DELTA_ROWS = DELTA_THREADS / 32;  // one warp per row

// delta[b, h, s] = sum_d do[b, s, h, d] * o[b, s, h, d]; one warp per (b, s, h) row.
// kinds (for do and o independently): BH_DTYPE_bf16, BH_DTYPE_f16 or BH_DTYPE_f32.
__device__ __forceinline__ float load_kind(const void* p, i64 i, int kind) {
  if (kind == BH_DTYPE_f32) return static_cast<const float*>(p)[i];
  const u16 bits = static_cast<const u16*>(p)[i];
  return kind == BH_DTYPE_bf16 ? bf16_bits_to_float(bits) : half_bits_to_float(bits);
}

extern "C" __global__ void __launch_bounds__(DELTA_THREADS)
    attn_delta(const void* dout, const void* o, float* delta, i64 gsb, i64 gss, i64 gsh, i64 osb, i64 oss, i64 osh,
               int B, int S, int H, int D, int gkind, int okind) {
  const i64 row = static_cast<i64>(blockIdx.x) * DELTA_ROWS + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
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
