// Shared device helpers for the burst-hpc attention kernels (sm_80+ instructions, built for sm_90).
// No CUDA headers are included: half-precision data is handled as raw 16-bit words and converted
// with PTX, so the source compiles the same under nvcc and NVRTC (cupy.RawModule).
#pragma once
#include "contract.cuh"

#define BH_INF __int_as_float(0x7f800000)
#define BH_LOG2E 1.4426950408889634f
#define BH_LN2 0.6931471805599453f

__device__ __forceinline__ u32 smem_u32(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; pred false zero-fills the 16 bytes and reads nothing.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool pred) {
  int sz = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(sz) : "memory");
}
// 4-byte async copy (lse / delta rows); zero-fill when pred is false.
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, bool pred) {
  int sz = pred ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(sz) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// D += A * B, m16n8k16, fp32 accumulators; BF16 picks bf16 or fp16 operands.
template <bool BF16>
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
  if (BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// (lo, hi) floats -> one 32-bit register of two 16-bit values, lo in the low half.
template <bool BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  if (BF16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float half_bits_to_float(u16 h) {
  float f;
  asm("{ .reg .f16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }\n" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ float bf16_bits_to_float(u16 h) { return __int_as_float(static_cast<int>(h) << 16); }

// 8 elements of a 16-bit row at p (16-byte aligned) dotted with 8 of q, in float32
__device__ __forceinline__ float dot8(const u16* p, const u16* q, bool bf16) {
  const uint4 g = *reinterpret_cast<const uint4*>(p), y = *reinterpret_cast<const uint4*>(q);
  const u32 gw[4] = {g.x, g.y, g.z, g.w}, yw[4] = {y.x, y.y, y.z, y.w};
  float acc = 0.f;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const u16 g0 = gw[w] & 0xffffu, g1 = gw[w] >> 16, y0 = yw[w] & 0xffffu, y1 = yw[w] >> 16;
    acc += bf16 ? bf16_bits_to_float(g0) * bf16_bits_to_float(y0) + bf16_bits_to_float(g1) * bf16_bits_to_float(y1)
                : half_bits_to_float(g0) * half_bits_to_float(y0) + half_bits_to_float(g1) * half_bits_to_float(y1);
  }
  return acc;
}

// Shared-memory tiles are ROWS x D 16-bit elements, row-major, in 16-byte chunks; chunk c of row r
// lives at chunk (c ^ (r & 7)) of that row, so ldmatrix over 8 rows of one logical chunk hits 8
// different bank groups (conflict-free), and so do the cp.async writes.
template <int D>
__device__ __forceinline__ u32 tile_off(int r, int c) {
  return static_cast<u32>((r * (D / 8) + (c ^ (r & 7))) * 16);
}

// Async-load rows [0, rows_valid) of a ROWS x D tile from global (row stride in elements, D
// contiguous); rows past rows_valid are zero-filled. NT threads take part.
template <int ROWS, int D, int NT>
__device__ __forceinline__ void load_tile(u32 s, const u16* g, i64 row_stride, int rows_valid, int tid) {
  constexpr int C = D / 8;
  static_assert((ROWS * C) % NT == 0, "tile not divisible by the thread count");
#pragma unroll
  for (int it = 0; it < ROWS * C / NT; ++it) {
    const int i = it * NT + tid;
    const int r = i / C, c = i % C;
    const bool ok = r < rows_valid;
    const u16* src = ok ? g + r * row_stride + c * 8 : g;
    cp_async16(s + tile_off<D>(r, c), src, ok);
  }
}

// a global key bound as a block-local key index, clamped to [-1, Sk + 1] (fits an int)
__device__ __forceinline__ int local_key(int bound, i64 kofs, int Sk) {
  const i64 c = static_cast<i64>(bound) - kofs;
  return static_cast<int>(c < -1 ? -1 : (c > Sk + 1 ? Sk + 1 : c));
}

// The keys [*n_begin, *n_end) some row of the query tile m0 .. m0 + BM - 1 sees (causal with the key offset
// ``off``; interval masks by the tile's first and last rows' bounds, which never decrease with the row)
template <bool CAUSAL, bool IV>
__device__ __forceinline__ void tile_keys(int m0, int BM, int Sq, int Sk, i64 off, const int* mlo, const int* mhi,
                                          i64 kofs, int* n_begin, int* n_end) {
  *n_begin = 0, *n_end = Sk;
  if (CAUSAL) {
    const i64 lim = static_cast<i64>(min(m0 + BM, Sq)) + off;  // keys j < lim are visible to some row
    *n_end = static_cast<int>(max(static_cast<i64>(0), min(static_cast<i64>(Sk), lim)));
  }
  if (IV) {
    *n_begin = max(0, local_key(mlo[m0], kofs, Sk));
    *n_end = min(Sk, local_key(mhi[min(m0 + BM, Sq) - 1], kofs, Sk));
  }
}
