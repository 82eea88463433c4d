// The passes at memory bandwidth around the block calls: the delta pre-pass of both kernel families' backward
// (rowsum(do * o) per (batch, head, query row), in float32, before the backward walks its block pairs), the
// packed backward's sum of its keys' gradients from every rank (attn_rows_sum), and the packed passes' row moves
// (attn_rows_copy).
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

// The packed backward's float32 dK or dV brought home (engine/packed.py): each of a rank's own key rows r is its
// slot own[r] of the packed buffer plus the partials the other ranks computed for it, added and converted once:
//   out[b, r, :] = src[b, own[r], :] + sum over j in [ptr[r], ptr[r+1]) of parts[at[j] + b * step[j], :]
// Rows are `width` contiguous floats (Hkv * D): src (B, K, width), parts (rows, width), out (B, S, width), each
// contiguous and 16-byte aligned; kind: out's dtype (BH_DTYPE_*). With vec (width % 8 == 0) each thread takes 8
// elements with 16-byte loads, else one.
extern "C" __global__ void __launch_bounds__(256)
    attn_rows_sum(const float* src, i64 K, const i64* own, const int* ptr, const i64* at, const int* step,
                  const float* parts, void* out, int B, int S, int width, int kind, int vec) {
  const int per = vec ? 8 : 1, G = width / per;
  const i64 n = static_cast<i64>(B) * S * G;
  for (i64 t = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; t < n;
       t += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 row = t / G;
    const int c = static_cast<int>(t - row * G) * per, r = static_cast<int>(row % S), b = static_cast<int>(row / S);
    float acc[8];
    const float* const s = src + (static_cast<i64>(b) * K + own[r]) * width + c;
    if (vec) {
      const float4 x = reinterpret_cast<const float4*>(s)[0], y = reinterpret_cast<const float4*>(s)[1];
      acc[0] = x.x, acc[1] = x.y, acc[2] = x.z, acc[3] = x.w, acc[4] = y.x, acc[5] = y.y, acc[6] = y.z, acc[7] = y.w;
    } else {
      acc[0] = s[0];
    }
    for (int j = ptr[r]; j < ptr[r + 1]; ++j) {
      const float* const p = parts + (at[j] + static_cast<i64>(b) * step[j]) * width + c;
      if (vec) {
        const float4 x = reinterpret_cast<const float4*>(p)[0], y = reinterpret_cast<const float4*>(p)[1];
        acc[0] += x.x, acc[1] += x.y, acc[2] += x.z, acc[3] += x.w, acc[4] += y.x, acc[5] += y.y, acc[6] += y.z,
            acc[7] += y.w;
      } else {
        acc[0] += p[0];
      }
    }
    const i64 o = row * width + c;
    if (kind == BH_DTYPE_f32) {
      float* const y = static_cast<float*>(out) + o;
      if (vec) {
        reinterpret_cast<float4*>(y)[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        reinterpret_cast<float4*>(y)[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
      } else {
        y[0] = acc[0];
      }
    } else {
      const bool bf16 = kind == BH_DTYPE_bf16;
      u16* const y = static_cast<u16*>(out) + o;
      if (vec) {
        *reinterpret_cast<uint4*>(y) =
            bf16 ? make_uint4(pack2<true>(acc[0], acc[1]), pack2<true>(acc[2], acc[3]), pack2<true>(acc[4], acc[5]),
                              pack2<true>(acc[6], acc[7]))
                 : make_uint4(pack2<false>(acc[0], acc[1]), pack2<false>(acc[2], acc[3]),
                              pack2<false>(acc[4], acc[5]), pack2<false>(acc[6], acc[7]));
      } else {
        y[0] = static_cast<u16>((bf16 ? pack2<true>(acc[0], 0.f) : pack2<false>(acc[0], 0.f)) & 0xffffu);
      }
    }
  }
}

// Rows moved between arrays of rows (the packed passes' placing and gathering of keys and gradients, as one
// launch each): dst[b, dst_rows[i], :] = src[b, src_rows[i], :] for i < n, a null index meaning row i itself.
// src (B, src_len, bytes) and dst (B, dst_len, bytes) contiguous; a CTA a row at a time, its threads along it;
// vec: rows a multiple of 16 bytes and both arrays 16-byte aligned (16 bytes a thread), else a byte a thread.
extern "C" __global__ void __launch_bounds__(256)
    attn_rows_copy(const unsigned char* src, i64 src_len, const i64* src_rows, unsigned char* dst, i64 dst_len,
                   const i64* dst_rows, int B, i64 n, int bytes, int vec) {
  for (i64 row = blockIdx.x; row < B * n; row += gridDim.x) {
    const i64 i = row % n, b = row / n;
    const unsigned char* const from = src + (b * src_len + (src_rows != nullptr ? src_rows[i] : i)) * bytes;
    unsigned char* const to = dst + (b * dst_len + (dst_rows != nullptr ? dst_rows[i] : i)) * bytes;
    if (vec) {
      for (int c = threadIdx.x; c < bytes / 16; c += blockDim.x)
        reinterpret_cast<uint4*>(to)[c] = reinterpret_cast<const uint4*>(from)[c];
    } else {
      for (int c = threadIdx.x; c < bytes; c += blockDim.x) to[c] = from[c];
    }
  }
}
