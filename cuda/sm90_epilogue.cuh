// The sm90 kernels' epilogues: accumulator registers (wgmma fragment layout: this thread's rows
// row0 and row0 + 8, columns 8 j + 2 (lane % 4) + {0, 1}) into the caller's float32 arrays. The forward's
// rows may hold several query heads (PackGQA, attn_fwd_sm90.cu): its two accumulator rows are then `step`
// (8 / heads) positions of one head apart.
#pragma once
#include "sm90_primitives.cuh"

// global loads that bypass L1 (L2 = true; the forward's key splits merge the same rows from different SMs in
// turn) or plain ones (L2 = false: the compiler may schedule them freely)
__device__ __forceinline__ float load_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ float2 load_cg2(const float* p) {
  float2 v;
  asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "l"(p));
  return v;
}

template <bool L2>
__device__ __forceinline__ float load_f32(const float* p) {
  return L2 ? load_cg(p) : *p;
}
template <bool L2>
__device__ __forceinline__ float2 load_f32x2(const float* p) {
  return L2 ? load_cg2(p) : *reinterpret_cast<const float2*>(p);
}

// Where the forward's epilogue writes one (batch, head): the running float32 (o, lse), or at the last pair
// of these query rows (the block contract's ``out``) the final output in the kernels' 16-bit type. `first`:
// the pair is the first to write these rows, so the running (o, lse) hold nothing and are not read.
struct FwdRows {
  float* o;       // row 0, column 2 (lane % 4) of the running o (unused when out is set)
  i64 oss;
  u16* out;       // row 0, column 2 (lane % 4) of the final output, or null
  i64 tss;
  float* lse;     // the lse entry of row 0
  i64 lss;
  bool first;
};

// Forward: GAO merge of this thread's two rows (scores already in base-2 units: running max m, row sums
// l, unnormalised output acc) into the running (o, lse), or into the final output (FwdRows). Rows with
// nothing visible (l = 0) keep the running (o, lse): untouched, or written when the pair is the first (o = 0,
// lse = -inf) or the last (out = o); rows past Sq are never written. A running lse of -inf means nothing was
// merged yet, so the old o is ignored. Only those exact values mean "nothing": a NaN l or running lse (a NaN
// or Inf input reached the row, and exp2 of a NaN score made its sum NaN even where fmaxf dropped it from
// the max) makes the row NaN.
// L2: read the running (o, lse) from L2, not L1 (rows another SM merged into since this one last read them).
template <int D, bool L2, bool BF16>
__device__ __forceinline__ void merge_rows(const FwdRows& to, const float* acc, const float* m, float* l, int row0,
                                           int step, int Sq) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  float l_old[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + step * r;
    l_old[r] = (row < Sq && !to.first) ? load_f32<L2>(to.lse + row * to.lss) : -BH_INF;
  }
  __syncwarp();  // every lane of a quad has read lse before its first lane writes it
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + step * r;
    const bool seen = l[r] != 0.f;  // a NaN l (the row saw a NaN or Inf) is merged: lb, ln and o are NaN
    if (row >= Sq || !(seen || to.first || to.out != nullptr)) continue;
    const float lo = l_old[r];
    const bool fresh = lo == -BH_INF;  // nothing merged yet (a NaN lse is merged: the row stays NaN)
    float ln = lo, wo = fresh ? 0.f : 1.f, wb = 0.f;
    if (seen) {
      const float lb = (m[r] + __log2f(l[r])) * BH_LN2;
      ln = fresh ? lb : fmaxf(lo, lb) + log1pf(__expf(-fabsf(lo - lb)));
      wo = fresh ? 0.f : __expf(lo - ln);
      wb = __expf(lb - ln) / l[r];
    }
    const float* op = to.o + row * to.oss;
    // the old o in batches of loads issued together (L2 loads are volatile: the compiler keeps their
    // order, so a load written after a store would wait for the store's row to go out first)
    constexpr int BATCH = 4;
#pragma unroll
    for (int j0 = 0; j0 < D / 8; j0 += BATCH) {
      float2 old[BATCH];
      if (!fresh) {
#pragma unroll
        for (int j = 0; j < BATCH; ++j) old[j] = load_f32x2<L2>(op + 8 * (j0 + j));
      }
#pragma unroll
      for (int j = 0; j < BATCH; ++j) {
        const int c = j0 + j;
        float2 val = seen ? make_float2(acc[4 * c + 2 * r] * wb, acc[4 * c + 2 * r + 1] * wb) : make_float2(0.f, 0.f);
        if (!fresh) {
          val.x += old[j].x * wo;
          val.y += old[j].y * wo;
        }
        if (to.out != nullptr)
          *reinterpret_cast<u32*>(to.out + row * to.tss + 8 * c) = pack2<BF16>(val.x, val.y);
        else
          *reinterpret_cast<float2*>(to.o + row * to.oss + 8 * c) = val;
      }
    }
    if (lane % 4 == 0) to.lse[row * to.lss] = ln;
  }
}

// merge_rows for a pair that is both the first and the last of its rows (one GPU): no running (o, lse) to
// read or keep, so the final output is acc / l and lse is the block's own. The same results as merge_rows
// there, in about half the instructions: a row that saw nothing gets o = 0 and lse = -inf (even where
// acc holds 0 * Inf = NaN), a NaN l makes the row NaN.
template <int D, bool BF16>
__device__ __forceinline__ void store_rows(const FwdRows& to, const float* acc, const float* m, float* l, int row0,
                                           int step, int Sq) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int row = row0 + step * r;
    if (row >= Sq) continue;
    const bool seen = l[r] != 0.f;
    const float wb = 1.f / l[r];
    u16* const out = to.out + row * to.tss;
#pragma unroll
    for (int c = 0; c < D / 8; ++c) {
      const float x = seen ? acc[4 * c + 2 * r] * wb : 0.f, y = seen ? acc[4 * c + 2 * r + 1] * wb : 0.f;
      *reinterpret_cast<u32*>(out + 8 * c) = pack2<BF16>(x, y);
    }
    if (lane % 4 == 0) to.lse[row * to.lss] = seen ? (m[r] + __log2f(l[r])) * BH_LN2 : -BH_INF;
  }
}

// scale * acc (64 rows x NCOL columns, accumulator layout) into shared memory as NCOL / 32 float32 boxes of
// 64 rows x 32 columns with the 128-byte swizzle (what a float32 tensor map with that swizzle reads): box
// c / 32 at part + (c / 32) * 8192, element (row, c) at row * 128 + (((c % 32) / 4) ^ (row % 8)) * 16 +
// (c % 4) * 4. `part` is 1024-byte aligned. 16-byte chunks of a quad's rows land in distinct banks.
template <int NCOL>
__device__ __forceinline__ void stage_f32_rows(u32 part, const float* acc, float scale, int warp, int lane) {
  const u32 thread = part + (16 * warp + lane / 4) * 128 + ((((lane % 4) / 2) ^ (lane / 4)) << 4) + (lane % 2) * 8;
#pragma unroll
  for (int j = 0; j < NCOL / 8; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const u32 addr = (thread + (j / 4) * 8192 + r * 8 * 128) ^ ((2 * (j % 4)) << 4);
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(acc[4 * j + 2 * r] * scale),
                   "f"(acc[4 * j + 2 * r + 1] * scale)
                   : "memory");
    }
}
