// Hopper (sm_90a) primitives shared by the sm90 kernel family: mbarriers, TMA tile loads, wgmma
// shared-memory descriptors and the wgmma instructions, warpgroup register reallocation and named
// barriers. Like common.cuh this needs no CUDA header, so NVRTC builds it (-arch=sm_90a).
//
// Shared-memory tiles use the 128-byte swizzle that TMA writes and wgmma reads: a tile of R rows x C
// 16-bit columns is stored as C/64 column blocks, each R rows x 128 bytes, and inside a block the 16-byte
// chunk c of row r sits at chunk c ^ (r % 8). Every block starts 1024-byte aligned.
#pragma once
#include "common.cuh"

typedef unsigned long long u64;

// ---- mbarrier -------------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// make initialised barriers visible to the async (TMA) proxy before first use
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// arrive once and announce `bytes` of asynchronous transfer that will complete this phase
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
  u32 done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// wait until the phase of parity `parity` has completed (a fresh barrier counts parity 1 as completed)
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// ---- TMA ------------------------------------------------------------------------------------------
// Tensor maps live in global memory (written by the host before the launch); acquire them for the
// tensormap proxy once before their first use.
__device__ __forceinline__ void tensormap_acquire(const void* tmap) {
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(tmap) : "memory");
}
// one box of a 4-d tensor map into shared memory; completion is counted on `bar` in bytes.
// Elements outside the tensor are written as zeros.
__device__ __forceinline__ void tma_load_4d(u32 dst, const void* tmap, u32 bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(dst),
      "l"(tmap), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// one contiguous run of `bytes` (a multiple of 16, both ends 16-byte aligned) global -> shared,
// counted on `bar` like a tensor load
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// global box += shared box (float32 add in L2) through a 4-d tensor map; elements outside the tensor are
// not written. Tracked per thread as a bulk group.
__device__ __forceinline__ void tma_reduce_add_4d(const void* tmap, u32 src, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          tmap),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// Shared memory written by ordinary stores, then read by wgmma (the async proxy): fence in between.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// bulk groups (copies and reductions issued by this thread)
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// wait until the shared-memory sources of this thread's bulk groups have been read
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// the same for all but this thread's N most recently committed bulk groups
template <int N>
__device__ __forceinline__ void bulk_wait_read_but() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// wait until this thread's bulk groups have completed (their global writes done)
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// four 8 x 8 16-bit matrices from registers (mma fragment layout) to shared memory; lane l gives the
// address of row l % 8 of matrix l / 8
__device__ __forceinline__ void stmatrix_x4(u32 addr, const u32* r) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
}

// ---- warpgroups -----------------------------------------------------------------------------------
template <int N>
__device__ __forceinline__ void warpgroup_reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void warpgroup_reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- wgmma ----------------------------------------------------------------------------------------
// Shared-memory matrix descriptors, 128-byte swizzle. K-major operands (the contraction dimension is
// contiguous: Q and K rows) use sbo = 1024 (next 8 rows) and an unused lbo; MN-major operands (V, whose
// rows are keys) use sbo = 1024 (next 8 keys) and lbo = the distance between 64-column blocks.
// The same descriptor in two words: the high word (stride 1024 = the next 8 rows, 128-byte swizzle) is
// one constant for every operand here; the low word holds address >> 4 and the leading byte offset, so a
// descriptor is built once per tile and advanced by adding (byte offset >> 4) to its low word.
constexpr u32 kDescHi128B = (1024u >> 4) | (1u << 30);
__device__ __forceinline__ u32 desc_lo(u32 addr, u32 lbo) { return ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16); }
__device__ __forceinline__ u64 desc_at(u32 lo, u32 byte_off) {
  return (static_cast<u64>(kDescHi128B) << 32) | (lo + (byte_off >> 4));
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keep the compiler from moving accesses of wgmma accumulators across the asynchronous MMA.
template <int N>
__device__ __forceinline__ void fence_operands(float* d) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_operands(u32* d) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// D (64 x N, f32, N/2 registers per thread) (+)= A (64 x 16) * B (16 x N).
// Accumulator fragment: thread t of the warpgroup holds rows 16*(t/32) + (t%32)/4 + {0, 8} and columns
// 8*j + 2*(t%4) + {0, 1}: d[4*j + 2*half + c]. A from registers uses the same per-warp layout as the
// m16n8k16 A fragment of mma.sync. wgmma_ss: A and B from shared memory (descriptors); wgmma_rs: A from
// registers. TRANS_A / TRANS_B = 1 read A / B as MN-major (the M or N index contiguous) instead of
// K-major. accumulate = 0 overwrites D. N is 64 or 128 (wgmma_ss also 32 and 80); the element type is bf16 or f16.
// The accumulator operand lists, written once (inline asm takes no loops):
#define BH_ACC16_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define BH_ACC32_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define BH_ACC64_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define BH_ACC16_OPS "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define BH_ACC32_OPS "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define BH_ACC64_OPS "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define BH_ACC40_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}"
#define BH_ACC40_OPS "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
// one wgmma of each operand form; I0.. are the operand numbers after the accumulators, whose
// constraint list comes last
#define BH_WGMMA_SS_(SHAPE, TYPE, REGS, I0, I1, I2, I3, I4, ...)                                             \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" I2 ", 0;\nwgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE  \
               "." TYPE " " REGS ", %" I0 ", %" I1 ", p, 1, 1, %" I3 ", %" I4 ";\n}\n"                          \
               : __VA_ARGS__                                                                                    \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B))
#define BH_WGMMA_RS_(SHAPE, TYPE, REGS, I0, I1, I2, I3, I4, I5, I6, ...)                                     \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" I5 ", 0;\nwgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE  \
               "." TYPE " " REGS ", {%" I0 ", %" I1 ", %" I2 ", %" I3 "}, %" I4 ", p, 1, 1, %" I6 ";\n}\n"        \
               : __VA_ARGS__                                                                                    \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(TRANS_B))
// (the operand list arrives as one macro argument: one more expansion splits it)
#define BH_WGMMA_SS(SHAPE, TYPE, ...) BH_WGMMA_SS_(SHAPE, TYPE, __VA_ARGS__)
#define BH_WGMMA_RS(SHAPE, TYPE, ...) BH_WGMMA_RS_(SHAPE, TYPE, __VA_ARGS__)
#define BH_SS16 BH_ACC16_REGS, "16", "17", "18", "19", "20", BH_ACC16_OPS
#define BH_SS32 BH_ACC32_REGS, "32", "33", "34", "35", "36", BH_ACC32_OPS
#define BH_SS40 BH_ACC40_REGS, "40", "41", "42", "43", "44", BH_ACC40_OPS
#define BH_SS64 BH_ACC64_REGS, "64", "65", "66", "67", "68", BH_ACC64_OPS
#define BH_RS32 BH_ACC32_REGS, "32", "33", "34", "35", "36", "37", "38", BH_ACC32_OPS
#define BH_RS64 BH_ACC64_REGS, "64", "65", "66", "67", "68", "69", "70", BH_ACC64_OPS

template <int N, bool BF16, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_ss(float* d, u64 desc_a, u64 desc_b, int accumulate) {
  static_assert(N == 32 || N == 64 || N == 80 || N == 128, "wgmma width");
  if constexpr (N == 80 && BF16)
    BH_WGMMA_SS("m64n80k16", "bf16", BH_SS40);
  else if constexpr (N == 80)
    BH_WGMMA_SS("m64n80k16", "f16", BH_SS40);
  else if constexpr (N == 32 && BF16)
    BH_WGMMA_SS("m64n32k16", "bf16", BH_SS16);
  else if constexpr (N == 32)
    BH_WGMMA_SS("m64n32k16", "f16", BH_SS16);
  else if constexpr (N == 64 && BF16)
    BH_WGMMA_SS("m64n64k16", "bf16", BH_SS32);
  else if constexpr (N == 64)
    BH_WGMMA_SS("m64n64k16", "f16", BH_SS32);
  else if constexpr (BF16)
    BH_WGMMA_SS("m64n128k16", "bf16", BH_SS64);
  else
    BH_WGMMA_SS("m64n128k16", "f16", BH_SS64);
}

template <int N, bool BF16, int TRANS_B>
__device__ __forceinline__ void wgmma_rs(float* d, const u32* a, u64 desc_b, int accumulate) {
  static_assert(N == 64 || N == 128, "wgmma width");
  if constexpr (N == 64 && BF16)
    BH_WGMMA_RS("m64n64k16", "bf16", BH_RS32);
  else if constexpr (N == 64)
    BH_WGMMA_RS("m64n64k16", "f16", BH_RS32);
  else if constexpr (BF16)
    BH_WGMMA_RS("m64n128k16", "bf16", BH_RS64);
  else
    BH_WGMMA_RS("m64n128k16", "f16", BH_RS64);
}

// the warpgroup index, warp-uniform (the compiler cannot prove threadIdx.x / 128 uniform)
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0); }
