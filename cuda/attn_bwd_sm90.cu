// Attention backward over one (query block, key block) pair for Hopper (sm_90a), added into float32
// (dq, dk, dv): the same contract as attn_bwd.cu (docs/KERNELS.md).
//
// A CTA owns BN keys (128; 64 at D = 256) of one (batch, kv head) and walks every query tile (BM rows: 64 at
// D = 128 and 256, 128 at D = 64) of the query heads it was given (the whole GQA group, or a slice when the
// grid needs more CTAs), in the order WalkStep sets. Warpgroup 0 is the producer, with two jobs:
// - warp 0 loads K and V once (TMA), then streams Q and dO tiles (TMA), each through its own
//   STAGES-deep mbarrier pipeline, with the tile's lse * log2(e) and delta rows (one bulk copy each,
//   from the row table the pre-pass attn_bwd_sm90_rows writes);
// - warp 1 is the dQ writer: it waits until a consumer has staged its dQ part in shared memory (named
//   barrier kDqFull), adds it into the caller's float32 dq with TMA tensor reductions (float32 tensor
//   map, 128-byte swizzle), and frees the staging buffer (kDqEmpty) once the copy engine has read it.
// Two consumer warpgroups own 64 keys each, so the key side is the "M" of every product. A step:
//     S^T = K Q^T, dP^T = V dO^T                (wgmma SS, issued together)
//     P^T = exp2(S^T * scale*log2e - lse*log2e)   (registers; masks on global positions)
//     dS^T = P^T (dP^T - delta)                  (registers)
//     dV += P^T dO                               (wgmma RS; dK, dV stay in registers for the walk)
//     dS^T -> shared memory (stmatrix), barrier kDsReady (the other consumer's keys are needed)
//     dQ part = dS K over all BN keys            (wgmma SS, dS^T read M-major)
//     dK += dS^T Q                               (wgmma RS)
//     wait for dV and dQ, stage scale * dQ for the writer while dK runs, wait for dK.
// A consumer's dQ part is 64 x 64: at D = 128 the tile's 64 rows and head-dim half cw; at D = 64 rows
// 64 cw.. of the 128-row tile and all 64 columns.
// Rows with lse = -inf (nothing visible in the forward) and query rows past the end get P = 0 (a NaN lse
// gives NaN: non-finite inputs propagate); keys past
// the end are masked; causal masks are on global positions, and query tiles hidden from every key of the
// CTA are skipped. Interval masks (IV: documents, sliding windows; docs/KERNELS.md "Masks"): local query
// row r sees the keys at global positions [mlo[r], mhi[r]); the host gives each CTA the query tiles
// that see any of its keys (`ranges`), and each tile's per-row key bounds (local) travel with
// its lse rows, so only tiles on a band edge are masked.
//
// D = 256 (consumer_wide): dK and dV of 64 keys x 256 would be 256 accumulator registers per thread, so the
// two consumers split the work differently. BN = BM = 64; consumer c first takes the tile's query half c
// (rows 32c..):
//     S^T_c = K Q_c^T, dP^T_c = V dO_c^T         (64 keys x 32 queries, wgmma m64n32 SS)
//     P^T, dS^T as above; both -> shared memory (sP, sDS: its 16-byte chunks 4c..4c+3), barrier kDsReady
// then owns head-dim half c (columns 128c..) of every product over the whole tile:
//     dV_c += P^T dO_c, dK_c += dS^T Q_c          (A = sP / sDS, B = the dO / Q tile read MN-major)
//     dQ_c = dS K_c                              (A = sDS read M-major, B = K read MN-major)
// dK_c and dV_c (64 keys x 128: 64 registers each) stay in registers for the walk. Once both consumers are
// done with the stage (barrier kTileRead), consumer c stages scale * dQ_c (64 queries x 128 float32, 32 KB)
// in the stage's Q tile (c = 0) or dO tile (c = 1) itself; the writer adds it into dq and then releases the
// stage to the loader (it arrives on the stage's empty barriers after its reductions have read it).
#include "contract.cuh"
#include "sm90_epilogue.cuh"
#include "sm90_pipeline.cuh"

namespace bwd90 {
constexpr int STAGES = 2, CONSUMERS = 2;
constexpr int THREADS = 128 * (1 + CONSUMERS);
constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;

template <int D>
struct Cfg {
  static constexpr bool kWide = D == 256;         // the consumer split of consumer_wide
  static constexpr int BN = kWide ? 64 : 128;      // keys per CTA
  static constexpr int BM = D == 64 ? 128 : 64;    // query rows per tile
  // arrivals that release a Q or dO stage: every consumer thread (its reads of the stage), and at D = 256 the
  // dQ writer too (its reductions read the dQ staged in the stage)
  static constexpr int kEmptyArrivals = 128 * CONSUMERS + (kWide ? 1 : 0);
  // kWalkDone: both consumers, and at D = 256 the writer warp (its last reductions have read the stages)
  static constexpr int kWalkDoneThreads = 128 * CONSUMERS + (kWide ? 32 : 0);
  // setmaxnreg split of the launch's 168 registers per thread (3 x 168 = 24 + 2 x 240). At D = 256 the
  // consumers compile without spills from 224 up, so they take 232 and the producer 40: at 24 the interval
  // loader spills (32-36 bytes; the D = 64, 128 interval instances' producers spill 60 and 28, outside the loop)
  static constexpr int kProducerRegs = kWide ? 40 : PRODUCER_REGS, kConsumerRegs = kWide ? 232 : CONSUMER_REGS;
  static_assert(kProducerRegs + CONSUMERS * kConsumerRegs <= (1 + CONSUMERS) * (65536 / THREADS / 8 * 8),
                "setmaxnreg split exceeds the launch's registers");
};

// Named barrier IDs, each defined once (0 is __syncthreads). A hardware ID shared by two barriers with
// different members can release with a mix of both, so no ID appears twice.
enum Barrier : int {
  kDsReady = 1,   // both consumers' dS^T rows (D = 256: P^T, dS^T columns) are in shared memory (256 threads)
  kDqFull = 2,    // consumer cw's dQ part is staged (kDqFull + cw: its 128 threads arrive, the writer warp syncs)
  kDqEmpty = 4,   // the writer has read consumer cw's staging buffer (kDqEmpty + cw: writer arrives, consumer syncs);
                  // D = 256: the writer has taken cw's previous kDqFull (the stage is released by mbarrier)
  kWalkDone = 6,  // both consumers are done with the Q / dO stages, which the epilogue reuses
                  // (Cfg::kWalkDoneThreads: 256 threads; D = 256: + the writer warp)
  kStaged = 7,    // consumer cw's dK or dV rows are staged / its staging buffer is free again (kStaged + cw)
  kTileRead = 9,  // D = 256: both consumers are done reading the stage's Q, dO tiles, sP and sDS (256 threads)
  kBarrierEnd = 10
};
static_assert(kDqFull + CONSUMERS <= kDqEmpty && kDqEmpty + CONSUMERS <= kWalkDone && kWalkDone < kStaged &&
                  kStaged + CONSUMERS <= kTileRead && kTileRead < kBarrierEnd && kBarrierEnd <= 16,
              "named barrier IDs overlap");
constexpr int kWriterSync = 128 + 32;  // a consumer warpgroup and the writer warp

// shared memory, byte offsets from a 1024-aligned base
//
// D = 256 (BN = BM = 64): K, V 32 KB each, two stages of Q and dO (32 KB each), sP and sDS (8 KB each), the
// row stages, barriers and alignment slack: 216136 bytes of the 232448. The dQ staging (2 x 32 KB) goes into
// the stage that was just consumed rather than a buffer of its own: a 16 KB buffer shared in turns (4 rounds
// through the writer per step) misses the budget by 72 bytes and would make the consumers wait for the writer
// every round, and one stage of dO (or Q) leaves no room for 2 x 32 KB either (240 KB). The cost: the
// writer's read of the staged dQ delays the release of the stage by the reduction's read time, a step ahead
// of when the loader needs it; and the staging waits for the stage's dK and dV products (kTileRead).
template <int D>
struct Smem {
  static constexpr int BN = Cfg<D>::BN, BM = Cfg<D>::BM;
  static constexpr u32 kTile = BM * D * 2;                 // one Q or dO tile: [D/64][BM][64]
  static constexpr u32 kDqPart = Cfg<D>::kWide ? 0 : 64 * 64 * 4;  // a consumer's dQ part: [2][64 rows][32 floats]
  static constexpr u32 kK = 0;                             // [D/64][BN][64]
  static constexpr u32 kV = kK + BN * D * 2;               // [D/64][BN][64]
  static constexpr u32 kQ = kV + BN * D * 2;               // STAGES x tile
  static constexpr u32 kDO = kQ + STAGES * kTile;          // STAGES x tile
  static constexpr u32 kDS = kDO + STAGES * kTile;         // 2 x dS^T: [BM/64][BN][64]; D = 256: sP, then sDS
  static constexpr u32 kPt = kDS, kDSt = kDS + BN * BM * 2;  // D = 256: P^T, dS^T (64 keys x 64 queries each)
  static constexpr u32 kDQ = kDS + 2 * BN * BM * 2;        // CONSUMERS x dQ part (none at D = 256)
  static constexpr u32 kLse = kDQ + CONSUMERS * kDqPart;   // STAGES x BM floats: lse * log2(e)
  static constexpr u32 kDelta = kLse + STAGES * BM * 4;    // STAGES x BM floats
  static constexpr u32 kKlo = kDelta + STAGES * BM * 4;     // STAGES x BM ints (IV): first visible key per row
  static constexpr u32 kKhi = kKlo + STAGES * BM * 4;       // STAGES x BM ints (IV): end of the visible keys
  static constexpr u32 kBar = kKhi + STAGES * BM * 4;      // kv_full, then per stage q_full, do_full, q_empty, do_empty
  static constexpr u32 kBytes = kBar + 8 * (1 + 4 * STAGES) + 1024;  // + alignment slack
  __device__ static u32 kv_full(u32 base) { return base + kBar; }
  __device__ static u32 q_full(u32 base, int s) { return base + kBar + 8 * (1 + 4 * s); }
  __device__ static u32 do_full(u32 base, int s) { return q_full(base, s) + 8; }
  __device__ static u32 q_empty(u32 base, int s) { return q_full(base, s) + 16; }
  __device__ static u32 do_empty(u32 base, int s) { return q_full(base, s) + 24; }
};

// What every role of a CTA knows about its walk: the loader, the dQ writer, the consumers and their epilogue.
struct Walk {
  u32 base;                      // shared memory, 1024-byte aligned (Smem offsets)
  const float *s_lse, *s_delta;  // the row stages (generic pointers to base + kLse, kDelta)
  const int *s_klo, *s_khi;      // (IV) base + kKlo, kKhi
  const int* tiles;              // (IV) each query tile's first row (the host's backward_tiles); else tile t's is t BM
  int n0, key_end, b, hk, h_first, hpb;  // first key, one past the last; batch, kv head, first query head, query heads
  int t_lo, t_end, steps;        // the query tiles of each head, and tiles x heads
  bool down;                     // the step order (WalkStep)
};

// The first query row of tile t
template <int BM, bool IV>
__device__ __forceinline__ int tile_row(const Walk& w, int t) {
  return IV ? w.tiles[t] : t * BM;
}

// A step's query head and tile. Walking down (Walk::down, the host's choice per key block under interval masks:
// plan/tiles.walk_down), the walk goes tile by tile from the last (t_end - 1) down to t_lo, every head of the CTA at
// each tile: the CTAs of one document's key blocks, which the host's order starts together, then read the same
// Q, dO rows and add into the same dq rows at about the same time, so those come from L2 (walking up, each CTA
// started at its own diagonal and they met no row at the same time: 1.4x slower on the 8k bench sets).
// Otherwise head by head, each from t_lo up: a causal mask's or a long document's key blocks all share its last
// tiles, and starting a slot's CTAs all there put them on the same dq rows at once (16k: 0.92-0.94x).
struct WalkStep {
  int h, t;
  __device__ __forceinline__ static WalkStep first(const Walk& w) { return {w.h_first, w.down ? w.t_end - 1 : w.t_lo}; }
  __device__ __forceinline__ void next(const Walk& w) {
    if (w.down) {
      if (++h == w.h_first + w.hpb) h = w.h_first, --t;
    } else if (++t == w.t_end) {
      t = w.t_lo, ++h;
    }
  }
};

}  // namespace bwd90

// NCOL columns of a consumer's dK or dV (64 keys, accumulator layout: this thread's keys key0 and key0 + 8,
// columns 8 j + 2 (lane % 4) + {0, 1}) times `scale` into `at` (row of key 0, column 0 of these columns);
// keys at or past key_end (the CTA's end) are not written
template <int NCOL, bool BF16>
__device__ __forceinline__ void store_rows16(u16* at, i64 ss, const float* acc, float scale, int key0, int key_end) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + 8 * r;
    if (key >= key_end) continue;
    u16* const p = at + key * ss + 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < NCOL / 8; ++j)
      *reinterpret_cast<u32*>(p + 8 * j) = pack2<BF16>(acc[4 * j + 2 * r] * scale, acc[4 * j + 2 * r + 1] * scale);
  }
}

// A CTA whose keys [n0, key_end) no query tile sees, at the pair that writes dk_out, dv_out: zeros there (every
// thread)
template <int D>
__device__ __forceinline__ void zero_kv_out(const KvOut& kv, int b, int hk, int n0, int key_end) {
  constexpr int BN = bwd90::Cfg<D>::BN, G = D / 8;
  for (int i = threadIdx.x; i < BN * G; i += blockDim.x) {
    const int key = n0 + i / G;
    if (key >= key_end) continue;
    const i64 at = b * kv.sb + key * kv.ss + hk * kv.sh + 8 * (i % G);
    *reinterpret_cast<uint4*>(kv.dk + at) = make_uint4(0u, 0u, 0u, 0u);
    *reinterpret_cast<uint4*>(kv.dv + at) = make_uint4(0u, 0u, 0u, 0u);
  }
}

static_assert(bwd90::Smem<256>::kBytes <= 227 * 1024, "D = 256 shared memory");

// The query row of row-table entry i (tiles, bm: as attn_bwd_sm90_rows takes them); Sq where none
__device__ __forceinline__ int table_row(const int* tiles, int bm, int i, int Sq) {
  if (tiles == nullptr) return min(i, Sq);
  const int t = i / bm, r = tiles[t] + i % bm;
  return r < tiles[t + 1] ? r : Sq;
}

// The pre-pass: the row table the producer copies per tile. rows[0][b][h][i] = lse * log2(e) (+inf for rows
// past Sq and rows that saw nothing, so their P is 0), rows[1][b][h][i] = delta (0 there); i < Sq_pad. Entry i
// is query row i, or with `tiles` (interval masks: each query tile's first row, then Sq) row tiles[i / bm] +
// i % bm of tile i / bm while that is before the next tile's first (else a row past the end, as above).
// Only lse = -inf is "saw nothing": a NaN lse (the row saw a NaN or Inf) stays NaN, so its P, dS and the
// gradients it feeds are NaN.
// delta is read from `delta`, or with `dout` set computed here as rowsum(do * o) (do, o: the kernels' 16-bit
// type, rows of D contiguous and 16-byte aligned): one pass over do and o at memory bandwidth, D / 8 lanes
// per row and 16 bytes per lane. With `dq` set, the rows of the float32 dq accumulator are zeroed in the same
// pass (the block contract's first pair of these query rows; dq's rows 16-byte aligned).
// With interval bounds (mlo != null) the table goes on with two int rows of Sq_pad: each query row's
// visible keys [klo, khi) as local key indices (empty past Sq, kept nondecreasing there).
extern "C" __global__ void attn_bwd_sm90_rows(const float* lse, const float* delta, float* rows, i64 lsb, i64 lsh,
                                              i64 lss, i64 dsb, i64 dsh, i64 dss, int B, int H, int Sq, int Sq_pad,
                                              const int* tiles, int bm, const int* mlo, const int* mhi, i64 kofs,
                                              int Sk, int D,
                                              const u16* dout, const u16* o, i64 gsb, i64 gss, i64 gsh, i64 osb,
                                              i64 oss, i64 osh, int bf16, float* dq, i64 qsb, i64 qss, i64 qsh) {
  if (mlo != nullptr) {
    int* const bounds = reinterpret_cast<int*>(rows + 2 * static_cast<i64>(B) * H * Sq_pad);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < Sq_pad; i += gridDim.x * blockDim.x) {
      const int r = table_row(tiles, bm, i, Sq);
      bounds[i] = r < Sq ? local_key(mlo[r], kofs, Sk) : Sk + 1;  // rows past the end: empty, and a
      bounds[Sq_pad + i] = r < Sq ? local_key(mhi[r], kofs, Sk) : Sk + 1;  // tile's bounds stay nondecreasing
    }
  }
  // G lanes per (batch, head, row), rows in table order; a warp's lanes run each round together (shuffles)
  const int G = D / 8;
  const i64 n = static_cast<i64>(B) * H * Sq_pad, lanes = n * G;
  const int lane = threadIdx.x % 32;
  for (i64 first = static_cast<i64>(blockIdx.x) * blockDim.x + (threadIdx.x - lane); first < lanes;
       first += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 t = first + lane;
    const i64 idx = t / G;
    const int part = static_cast<int>(t - idx * G);
    const int i = table_row(tiles, bm, static_cast<int>(idx % Sq_pad), Sq);
    const i64 bh = idx / Sq_pad;
    const int h = static_cast<int>(bh % H), b = static_cast<int>(bh / H);
    const bool row = t < lanes && i < Sq;
    const float x = row ? lse[b * lsb + h * lsh + i * lss] : -BH_INF;
    const bool seen = x != -BH_INF;
    float dl = 0.f;
    if (dout != nullptr) {
      if (seen) dl = dot8(dout + b * gsb + i * gss + h * gsh + 8 * part, o + b * osb + i * oss + h * osh + 8 * part,
                          bf16 != 0);
      for (int m = G / 2; m > 0; m >>= 1) dl += __shfl_xor_sync(0xffffffffu, dl, m, G);
    } else if (seen && part == 0) {
      dl = delta[b * dsb + h * dsh + i * dss];
    }
    if (dq != nullptr && row) {
      float4* const z = reinterpret_cast<float4*>(dq + b * qsb + i * qss + h * qsh + 8 * part);
      z[0] = z[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (t < lanes && part == 0) {
      rows[idx] = seen ? x * BH_LOG2E : BH_INF;
      rows[n + idx] = dl;
    }
  }
}

// A float32 accumulator (B, S, H, D: rows of D contiguous and 16-byte aligned) converted once into the block
// contract's output in the kernels' 16-bit type (rows 16-byte aligned): 8 elements per thread.
extern "C" __global__ void attn_bwd_sm90_to16(const float* x, i64 xsb, i64 xss, i64 xsh, u16* y, i64 ysb, i64 yss,
                                              i64 ysh, int B, int S, int H, int D, int bf16) {
  const int G = D / 8;
  const i64 n = static_cast<i64>(B) * S * H * G;
  for (i64 t = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; t < n;
       t += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 r = t / G;
    const int part = static_cast<int>(t - r * G);
    const int h = static_cast<int>(r % H), s = static_cast<int>((r / H) % S), b = static_cast<int>(r / (static_cast<i64>(H) * S));
    const float4* const src = reinterpret_cast<const float4*>(x + b * xsb + s * xss + h * xsh + 8 * part);
    const float4 a = src[0], c = src[1];
    uint4 w;
    if (bf16) w = make_uint4(pack2<true>(a.x, a.y), pack2<true>(a.z, a.w), pack2<true>(c.x, c.y), pack2<true>(c.z, c.w));
    else w = make_uint4(pack2<false>(a.x, a.y), pack2<false>(a.z, a.w), pack2<false>(c.x, c.y), pack2<false>(c.z, c.w));
    *reinterpret_cast<uint4*>(y + b * ysb + s * yss + h * ysh + 8 * part) = w;
  }
}

// The backward's CTA order: which key block of which head slot (batch, kv head, split of the GQA group) CTA lin
// takes: order[lin] = slot * nkb + key block (the host's launch.key_block_order: pieces of key blocks that share
// query rows, heaviest first, every head slot of a piece together), or with a null order lin itself: head slot
// after head slot, key blocks in order.
struct KeyBlockTile {
  int kb, b, hk, split;

  __device__ static KeyBlockTile at(int lin, int nkb, const int* order, int nsplit, int Hkv) {
    const int v = order != nullptr ? order[lin] : lin;
    const int slot = v / nkb, bz = slot / nsplit;
    return {v - slot * nkb, bz / Hkv, bz % Hkv, slot % nsplit};
  }
};

// 64 x N (this consumer's keys x its queries of the tile) = A rows (K or V, K-major: [D/64][BN][64]) . B rows
// (Q or dO, K-major: [D/64][BM][64]); 16 head-dim columns per step: 32 bytes on inside a 64-column block,
// then the next block
template <int D, int N, bool BF16>
__device__ __forceinline__ void keys_by_queries(float* acc, u32 a_lo, u32 b_lo) {
  constexpr int BN = bwd90::Cfg<D>::BN, BM = bwd90::Cfg<D>::BM;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_ss<N, BF16, 0, 0>(acc, desc_at(a_lo, (kk / 4) * BN * 128 + (kk % 4) * 32),
                            desc_at(b_lo, (kk / 4) * BM * 128 + (kk % 4) * 32), kk > 0);
}

// S^T = K Q^T and dP^T = V dO^T of one step, issued together as soon as each stage's tile has landed (NQ query
// columns; a, b: the K / V and Q / dO operands); returns with S^T done (dP^T may still run: wgmma_wait<0> and
// fence_operands(dpt) before reading it)
template <int D, int NQ, bool BF16>
__device__ __forceinline__ void issue_st_dpt(float* st, float* dpt, u32 k_lo, u32 q_lo, u32 v_lo, u32 do_lo,
                                             u32 q_full, u32 do_full, u32 phase) {
  mbar_wait(q_full, phase);
  wgmma_fence();
  keys_by_queries<D, NQ, BF16>(st, k_lo, q_lo);
  wgmma_commit();
  mbar_wait(do_full, phase);
  keys_by_queries<D, NQ, BF16>(dpt, v_lo, do_lo);
  wgmma_commit();
  wgmma_wait<1>();
  fence_operands<NQ / 2>(st);
}

// acc (64 keys x D) += A (registers, 64 keys x BM queries) * B (Q or dO tile, read MN-major)
template <int D, int BM, bool BF16>
__device__ __forceinline__ void keys_by_dim(float* acc, const u32 (*a)[4], u32 b_lo) {
#pragma unroll
  for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs<D, BF16, 1>(acc, a[kk], desc_at(b_lo, kk * 16 * 128), 1);
}

// this consumer's dQ part (64 x 64) = dS (M-major view of dS^T) . K (MN-major), over all BN keys
template <int D, bool BF16>
__device__ __forceinline__ void dq_part(float* acc, u32 ds_lo, u32 k_lo) {
  constexpr int BN = bwd90::Cfg<D>::BN;
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
    wgmma_ss<64, BF16, 1, 1>(acc, desc_at(ds_lo, kk * 16 * 128), desc_at(k_lo, kk * 16 * 128), kk > 0);
}

// P^T = exp2(S^T * scale*log2e - lse*log2e) in place over NQ query columns of S^T (accumulator layout): element
// (j, e) is key key0 + 8 (e >> 1), query q0 + 8 j + qc + (e & 1); l2, klo, khi point at the row of query
// q0 + qc (q0: read only by the causal mask; interval tiles start where the host's table says). With need_mask,
// masked on global positions: keys at or past key_end (the CTA's end), causal (the key after the query's
// position + off), IV (the key outside the row's [klo, khi)).
template <int NQ, bool CAUSAL, bool IV>
__device__ __forceinline__ void probs_t(float* st, const float* l2, const int* klo, const int* khi, bool need_mask,
                                        int key0, int q0, int qc, int key_end, i64 off, float sl2) {
  if (need_mask) {
    const int klim = key_end - key0;
    // hidden when 8 (e >> 1) - 8 j - (e & 1) > dl; clamped so the int compare cannot overflow
    const int dl = static_cast<int>(
        max(static_cast<i64>(-4 * NQ), min(static_cast<i64>(4 * NQ), static_cast<i64>(q0) + off - key0 + qc)));
#pragma unroll
    for (int j = 0; j < NQ / 8; ++j) {
      const float2 lj = *reinterpret_cast<const float2*>(l2 + 8 * j);
      int2 lo2 = make_int2(0, 0), hi2 = make_int2(key_end, key_end);
      if (IV) {
        lo2 = *reinterpret_cast<const int2*>(klo + 8 * j);
        hi2 = *reinterpret_cast<const int2*>(khi + 8 * j);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = fast_exp2(fmaf(st[4 * j + e], sl2, -((e & 1) ? lj.y : lj.x)));
        const int key = key0 + 8 * (e >> 1);
        const bool hidden = 8 * (e >> 1) >= klim || (CAUSAL && 8 * (e >> 1) - 8 * j - (e & 1) > dl) ||
                            (IV && (key < ((e & 1) ? lo2.y : lo2.x) || key >= ((e & 1) ? hi2.y : hi2.x)));
        st[4 * j + e] = hidden ? 0.f : p;
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < NQ / 8; ++j) {
      const float2 lj = *reinterpret_cast<const float2*>(l2 + 8 * j);
#pragma unroll
      for (int e = 0; e < 4; ++e) st[4 * j + e] = fast_exp2(fmaf(st[4 * j + e], sl2, -((e & 1) ? lj.y : lj.x)));
    }
  }
}

// D = 256, the dQ writer (producer warp 1). Consumer c's dQ part (64 queries x head-dim columns 128c..) is
// staged in the step's stage, in the Q tile (c = 0) or the dO tile (c = 1), as four 64 x 32 float32 boxes
// (stage_f32_rows); once the reductions have read a tile, the writer's arrival on its empty barrier lets the
// loader refill it.
template <bool IV>
__device__ __forceinline__ void dq_writer_wide(const bwd90::Walk& w, const unsigned char* tdq, int lane) {
  using namespace bwd90;
  using L = Smem<256>;
  constexpr int BM = Cfg<256>::BM, HD = 256 / CONSUMERS;  // HD: a consumer's head-dim columns
  if (lane == 0) tensormap_acquire(tdq);
  // kDqEmpty only paces the handshake here (no consumer arrives twice on kDqFull before the writer took the
  // first): the staging memory is released through the stage's empty mbarriers
#pragma unroll
  for (int c = 0; c < CONSUMERS; ++c) named_barrier_arrive(kDqEmpty + c, kWriterSync);
  WalkStep at = WalkStep::first(w);
  PipeState<STAGES> pipe;
  for (int n = 0; n < w.steps; ++n) {
    const int s = pipe.stage;
#pragma unroll
    for (int c = 0; c < CONSUMERS; ++c) {
      named_barrier_sync(kDqFull + c, kWriterSync);
      if (n + 1 < w.steps) named_barrier_arrive(kDqEmpty + c, kWriterSync);
      if (lane == 0) {
        const u32 part = w.base + (c == 0 ? L::kQ : L::kDO) + s * L::kTile;
#pragma unroll
        for (int box = 0; box < HD / 32; ++box)
          tma_reduce_add_4d(tdq, part + box * 8192, HD * c + 32 * box, at.h, tile_row<BM, IV>(w, at.t), w.b);
        bulk_commit();
      }
    }
    if (lane == 0) {
      bulk_wait_read_but<1>();  // consumer 0's part, in the Q tile
      mbar_arrive(L::q_empty(w.base, s));
      bulk_wait_read();         // consumer 1's part, in the dO tile
      mbar_arrive(L::do_empty(w.base, s));
    }
    __syncwarp();
    at.next(w);
    pipe.advance();
  }
  // the last parts have been read (lane 0 waited above): the epilogue may reuse the stages
  named_barrier_arrive(kWalkDone, Cfg<256>::kWalkDoneThreads);
  if (lane == 0) bulk_wait_all();
}

// D = 256, consumer warpgroup c's epilogue: dk += scale * dK_c, dv += dV_c (keys n0.., head-dim columns HD c..) by
// TMA tensor reductions, staged in Q tile c and dO tile c (32 KB each), free once both consumers are past their
// last step and the writer's last reductions have read them
template <bool BF16>
__device__ __forceinline__ void store_dkdv_wide(const bwd90::Walk& w, int c, const float* acc_dk, const float* acc_dv,
                                                const unsigned char* tdk, const unsigned char* tdv, float scale,
                                                const KvOut& kv) {
  using namespace bwd90;
  constexpr int D = 256, HD = D / CONSUMERS;
  using L = Smem<D>;
  const u32 base = w.base;
  const int tid = threadIdx.x % 128, lane = tid % 32, warp = tid / 32;
  named_barrier_sync(kWalkDone, Cfg<D>::kWalkDoneThreads);
  if (kv.dk != nullptr) {  // the 16-bit outputs, from the registers
    const i64 at = w.b * kv.sb + w.hk * kv.sh + HD * c;
    const int key0 = w.n0 + 16 * warp + lane / 4;
    store_rows16<HD, BF16>(kv.dk + at, kv.ss, acc_dk, scale, key0, w.key_end);
    store_rows16<HD, BF16>(kv.dv + at, kv.ss, acc_dv, 1.f, key0, w.key_end);
    return;
  }
  const u32 dk_staging = base + L::kQ + c * L::kTile, dv_staging = base + L::kDO + c * L::kTile;
  stage_f32_rows<HD>(dk_staging, acc_dk, scale, warp, lane);
  stage_f32_rows<HD>(dv_staging, acc_dv, 1.f, warp, lane);
  fence_async_shared();
  named_barrier_sync(kStaged + c, 128);
  if (tid == 0) {
#pragma unroll
    for (int box = 0; box < HD / 32; ++box) {
      tma_reduce_add_4d(tdk, dk_staging + box * 8192, HD * c + 32 * box, w.hk, w.n0, w.b);
      tma_reduce_add_4d(tdv, dv_staging + box * 8192, HD * c + 32 * box, w.hk, w.n0, w.b);
    }
    bulk_commit();
    bulk_wait_all();
  }
}

// D = 256, consumer warpgroup c (see the header). Shared-memory operands, all with the 128-byte swizzle:
//   K, V        [4][64 keys][64]      rows are keys, head dim contiguous
//   Q, dO tile  [4][64 queries][64]   rows are queries, head dim contiguous
//   sP, sDS     [64 keys][64 queries] P^T, dS^T: rows are keys, queries contiguous
// A K-major operand (its contraction index contiguous) steps 16 columns by +32 bytes inside a 64-column block;
// an MN-major one steps 16 contraction rows by +16 x 128 bytes, with lbo = the distance between its 64-column
// blocks when its M or N spans two of them.
template <bool BF16, bool CAUSAL, bool IV>
__device__ __forceinline__ void consumer_wide(const bwd90::Walk& w, const unsigned char* tdk, const unsigned char* tdv,
                                              i64 off, float scale, float sl2, const KvOut& kv) {
  using namespace bwd90;
  constexpr int D = 256, BN = Cfg<D>::BN, BM = Cfg<D>::BM;
  constexpr int NQ = BM / CONSUMERS;  // queries of S^T, dP^T per consumer
  constexpr int HD = D / CONSUMERS;   // head-dim columns of dK, dV, dQ per consumer
  using L = Smem<D>;
  const u32 base = w.base;
  const int c = warpgroup_index() - 1, tid = threadIdx.x % 128, lane = tid % 32, warp = tid / 32;
  const int key0 = w.n0 + 16 * warp + lane / 4;  // this thread's keys: key0, key0 + 8
  const int qc = 2 * (lane % 4);                 // this thread's first query column of this consumer's NQ
  // S^T, dP^T: A = K, V (all 64 keys; K-major)
  const u32 k_lo = desc_lo(base + L::kK, 16), v_lo = desc_lo(base + L::kV, 16);
  // dQ: B = K head-dim blocks 2c, 2c + 1 (MN-major: keys are the contraction; N = 128 over two blocks BN * 128
  // bytes apart)
  const u32 kmn_lo = desc_lo(base + L::kK + 2 * c * BN * 128, BN * 128);
  // dV, dK: A = sP, sDS (K-major: queries are the contraction); dQ: A = sDS read M-major (queries are M, one
  // 64-column block, so lbo is unused)
  const u32 p_lo = desc_lo(base + L::kPt, 16), ds_lo = desc_lo(base + L::kDSt, 16);
  // stmatrix address of P^T / dS^T rows (keys) 16 warp + (lane % 16) / 8 * 8 + lane % 8, before the chunk of
  // the 16 columns kk of this consumer: swizzled chunk (4c + 2kk + lane / 16) ^ (row % 8), i.e. the chunk bits
  // of pt_thread, (lane / 16) ^ (lane % 8), xor (4c + 2kk)
  const int pt_row = 16 * warp + 8 * ((lane / 8) % 2) + lane % 8;
  const u32 pt_thread = pt_row * 128 + (((lane / 16) ^ (lane % 8)) << 4);

  if (tid == 0) {  // the epilogue's tensor maps
    tensormap_acquire(tdk);
    tensormap_acquire(tdv);
  }
  float acc_dk[HD / 2], acc_dv[HD / 2];  // 64 keys x head-dim columns HD c..
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;

  mbar_wait(L::kv_full(base), 0);
  WalkStep at = WalkStep::first(w);
  PipeState<STAGES> pipe;
  for (int n = 0; n < w.steps; ++n) {
    const int t = at.t;
    const int m0 = t * BM, s = pipe.stage;  // the causal mask's first row (interval tiles: tiles[t])
    const u32 q_tile = base + L::kQ + s * L::kTile, do_tile = base + L::kDO + s * L::kTile;
    // S^T, dP^T: B = rows NQ c.. of the Q / dO tile (K-major; 32 rows = 4 swizzle atoms on, 1024-aligned)
    const u32 q_lo = desc_lo(q_tile + c * NQ * 128, 16), do_lo = desc_lo(do_tile + c * NQ * 128, 16);
    // dK, dV: B = head-dim blocks 2c, 2c + 1 of the Q / dO tile (MN-major: queries are the contraction; N = 128
    // over two blocks BM * 128 bytes apart)
    const u32 qmn_lo = desc_lo(q_tile + 2 * c * BM * 128, BM * 128);
    const u32 domn_lo = desc_lo(do_tile + 2 * c * BM * 128, BM * 128);

    // S^T_c = K Q_c^T, dP^T_c = V dO_c^T: 64 keys x NQ queries, over D
    float st[NQ / 2], dpt[NQ / 2];
    issue_st_dpt<D, NQ, BF16>(st, dpt, k_lo, q_lo, v_lo, do_lo, L::q_full(base, s), L::do_full(base, s), pipe.phase);

    // P^T: element (j, e) is key key0 + 8 (e >> 1), query q0 + 8 j + qc + (e & 1)
    const int q0 = m0 + NQ * c;
    const float* l2 = w.s_lse + s * BM + NQ * c + qc;
    const int* klo = w.s_klo + s * BM + NQ * c + qc;
    const int* khi = w.s_khi + s * BM + NQ * c + qc;
    // IV: every key of the CTA visible from every row of this consumer's NQ when the last row's band starts at
    // or before n0 and the first row's band ends at or after n0 + BN
    const bool need_mask = (w.n0 + BN > w.key_end) ||
                           (CAUSAL && static_cast<i64>(w.n0 + BN - 1) > static_cast<i64>(q0) + off) ||
                           (IV && !(klo[NQ - 1 - qc] <= w.n0 && khi[-qc] >= w.n0 + BN));
    probs_t<NQ, CAUSAL, IV>(st, l2, klo, khi, need_mask, key0, q0, qc, w.key_end, off, sl2);

    wgmma_wait<0>();
    fence_operands<NQ / 2>(dpt);
    // dS^T = P^T (dP^T - delta); both in the mma A-fragment order that stmatrix_x4 takes (16 x 16 per kk)
    const float* dl = w.s_delta + s * BM + NQ * c + qc;
    u32 pa[NQ / 16][4], dsa[NQ / 16][4];
#pragma unroll
    for (int j = 0; j < NQ / 8; ++j) {
      const float2 dj = *reinterpret_cast<const float2*>(dl + 8 * j);
      pa[j / 2][2 * (j & 1) + 0] = pack2<BF16>(st[4 * j + 0], st[4 * j + 1]);
      pa[j / 2][2 * (j & 1) + 1] = pack2<BF16>(st[4 * j + 2], st[4 * j + 3]);
      dsa[j / 2][2 * (j & 1) + 0] =
          pack2<BF16>(st[4 * j + 0] * (dpt[4 * j + 0] - dj.x), st[4 * j + 1] * (dpt[4 * j + 1] - dj.y));
      dsa[j / 2][2 * (j & 1) + 1] =
          pack2<BF16>(st[4 * j + 2] * (dpt[4 * j + 2] - dj.x), st[4 * j + 3] * (dpt[4 * j + 3] - dj.y));
    }
    // P^T, dS^T columns NQ c.. to sP, sDS (free: both consumers passed kTileRead of the previous step)
#pragma unroll
    for (int kk = 0; kk < NQ / 16; ++kk) {
      const u32 chunk = ((2 * (NQ / 16) * c + 2 * kk) % 8) << 4;
      stmatrix_x4((base + L::kPt + pt_thread) ^ chunk, pa[kk]);
      stmatrix_x4((base + L::kDSt + pt_thread) ^ chunk, dsa[kk]);
    }
    fence_async_shared();
    named_barrier_sync(kDsReady, 128 * CONSUMERS);

    float acc_dq[HD / 2];
    wgmma_fence();
    // dV_c += P^T dO_c: A = sP (64 keys x 64 queries, K-major), B = dO tile blocks 2c, 2c + 1 (MN-major)
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
      wgmma_ss<HD, BF16, 0, 1>(acc_dv, desc_at(p_lo, kk * 32), desc_at(domn_lo, kk * 16 * 128), 1);
    wgmma_commit();
    // dK_c += dS^T Q_c: A = sDS (K-major), B = Q tile blocks 2c, 2c + 1 (MN-major)
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
      wgmma_ss<HD, BF16, 0, 1>(acc_dk, desc_at(ds_lo, kk * 32), desc_at(qmn_lo, kk * 16 * 128), 1);
    wgmma_commit();
    // dQ_c = dS K_c (64 queries x HD): A = sDS read M-major (16 keys = 16 rows per step), B = K blocks 2c, 2c + 1
    // (MN-major)
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      wgmma_ss<HD, BF16, 1, 1>(acc_dq, desc_at(ds_lo, kk * 16 * 128), desc_at(kmn_lo, kk * 16 * 128), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands<HD / 2>(acc_dv);
    fence_operands<HD / 2>(acc_dk);
    fence_operands<HD / 2>(acc_dq);

    // both consumers are done with the stage's tiles and with sP, sDS: stage scale * dQ_c in the Q tile (c = 0)
    // or the dO tile (c = 1) for the writer, once it has taken the previous part
    named_barrier_sync(kTileRead, 128 * CONSUMERS);
    named_barrier_sync(kDqEmpty + c, kWriterSync);
    stage_f32_rows<HD>(c == 0 ? q_tile : do_tile, acc_dq, scale, warp, lane);
    fence_async_shared();
    named_barrier_arrive(kDqFull + c, kWriterSync);
    // every thread releases its reads of the stage (rows, tiles) and its staging writes; the writer arrives too
    mbar_arrive(L::q_empty(base, s));
    mbar_arrive(L::do_empty(base, s));
    at.next(w);
    pipe.advance();
  }

  store_dkdv_wide<BF16>(w, c, acc_dk, acc_dv, tdk, tdv, scale, kv);
}

// The producer's loader (warp 0, one thread): K and V once, then the Q and dO tiles of every step through their
// STAGES-deep pipelines, each with its rows (lse * log2(e); delta; IV: each row's key bounds). rows: the table of
// attn_bwd_sm90_rows (B * Hq * Sq_pad each of lse and delta, then IV bounds).
template <int D, bool IV>
__device__ __forceinline__ void load_walk(const bwd90::Walk& w, const unsigned char* tq, const unsigned char* tk,
                                          const unsigned char* tv, const unsigned char* tdo, const float* rows, int B,
                                          int Hq, int Sq_pad) {
  using namespace bwd90;
  using L = Smem<D>;
  constexpr int BN = Cfg<D>::BN, BM = Cfg<D>::BM;
  const u32 base = w.base;
  tensormap_acquire(tq);
  tensormap_acquire(tk);
  tensormap_acquire(tv);
  tensormap_acquire(tdo);
  mbar_arrive_expect_tx(L::kv_full(base), 2 * BN * D * 2);
#pragma unroll
  for (int db = 0; db < D / 64; ++db) {
    tma_load_4d(base + L::kK + db * BN * 128, tk, L::kv_full(base), db * 64, w.hk, w.n0, w.b);
    tma_load_4d(base + L::kV + db * BN * 128, tv, L::kv_full(base), db * 64, w.hk, w.n0, w.b);
  }
  const i64 delta_rows = static_cast<i64>(B) * Hq * Sq_pad;
  const int* const bounds = reinterpret_cast<const int*>(rows + 2 * delta_rows);
  WalkStep at = WalkStep::first(w);
  PipeState<STAGES> pipe;
  for (int n = 0; n < w.steps; ++n) {
    const int h = at.h, t = at.t;
    const int m0 = tile_row<BM, IV>(w, t), s = pipe.stage;
    // the tile's rows in the row table: entries t BM.. (the pre-pass writes it in tile order)
    const float* row_lse = rows + (static_cast<i64>(w.b) * Hq + h) * Sq_pad + t * BM;
    mbar_wait(L::q_empty(base, s), pipe.phase ^ 1);
    mbar_arrive_expect_tx(L::q_full(base, s), L::kTile + (IV ? 3 : 1) * BM * 4);
#pragma unroll
    for (int db = 0; db < D / 64; ++db)
      tma_load_4d(base + L::kQ + s * L::kTile + db * BM * 128, tq, L::q_full(base, s), db * 64, h, m0, w.b);
    bulk_load(base + L::kLse + s * BM * 4, row_lse, BM * 4, L::q_full(base, s));
    if (IV) {
      bulk_load(base + L::kKlo + s * BM * 4, bounds + t * BM, BM * 4, L::q_full(base, s));
      bulk_load(base + L::kKhi + s * BM * 4, bounds + Sq_pad + t * BM, BM * 4, L::q_full(base, s));
    }
    mbar_wait(L::do_empty(base, s), pipe.phase ^ 1);
    mbar_arrive_expect_tx(L::do_full(base, s), L::kTile + BM * 4);
#pragma unroll
    for (int db = 0; db < D / 64; ++db)
      tma_load_4d(base + L::kDO + s * L::kTile + db * BM * 128, tdo, L::do_full(base, s), db * 64, h, m0, w.b);
    bulk_load(base + L::kDelta + s * BM * 4, row_lse + delta_rows, BM * 4, L::do_full(base, s));
    at.next(w);
    pipe.advance();
  }
}

// D = 64, 128, the dQ writer (producer warp 1): consumer c's dQ part (64 x 64 float32, two 64 x 32 boxes) waits
// in its own staging buffer; the writer adds it into dq and frees the buffer (kDqEmpty + c) once the copy engine
// has read it.
template <int D, bool IV>
__device__ __forceinline__ void dq_writer(const bwd90::Walk& w, const unsigned char* tdq, int lane) {
  using namespace bwd90;
  using L = Smem<D>;
  constexpr int BM = Cfg<D>::BM;
  if (lane == 0) tensormap_acquire(tdq);
#pragma unroll
  for (int c = 0; c < CONSUMERS; ++c) named_barrier_arrive(kDqEmpty + c, kWriterSync);
  WalkStep at = WalkStep::first(w);
  for (int n = 0; n < w.steps; ++n) {
    const int h = at.h, t = at.t;
#pragma unroll
    for (int c = 0; c < CONSUMERS; ++c) {
      named_barrier_sync(kDqFull + c, kWriterSync);
      if (lane == 0) {
        const int col = D == 128 ? 64 * c : 0, row = tile_row<BM, IV>(w, t) + (D == 128 ? 0 : 64 * c);
        const u32 part = w.base + L::kDQ + c * L::kDqPart;
        tma_reduce_add_4d(tdq, part, col, h, row, w.b);
        tma_reduce_add_4d(tdq, part + L::kDqPart / 2, col + 32, h, row, w.b);
        bulk_commit();
      }
    }
    if (lane == 0) bulk_wait_read();
    __syncwarp();
    if (n + 1 < w.steps) {
#pragma unroll
      for (int c = 0; c < CONSUMERS; ++c) named_barrier_arrive(kDqEmpty + c, kWriterSync);
    }
    at.next(w);
  }
  if (lane == 0) bulk_wait_all();
}

// D = 64, 128, consumer warpgroup cw's epilogue: dk += scale * dK, dv += dV (its 64 keys) by TMA tensor
// reductions (adds in L2, so CTAs that share a kv head through a split GQA group need no atomics; keys past Sk
// are not written, keys past the CTA's end get 0: masked, their P and dS are 0). Staged in the Q / dO stages,
// free once both consumers are past their last step; dK first, then dV in the same buffer.
template <int D, bool BF16>
__device__ __forceinline__ void store_dkdv(const bwd90::Walk& w, int cw, const float* acc_dk, const float* acc_dv,
                                           const unsigned char* tdk, const unsigned char* tdv, float scale,
                                           const KvOut& kv) {
  using namespace bwd90;
  using L = Smem<D>;
  const int tid = threadIdx.x % 128, lane = tid % 32, warp = tid / 32;
  named_barrier_sync(kWalkDone, 128 * CONSUMERS);
  if (kv.dk != nullptr) {  // the 16-bit outputs, from the registers
    const i64 at = w.b * kv.sb + w.hk * kv.sh;
    const int key0 = w.n0 + 64 * cw + 16 * warp + lane / 4;
    store_rows16<D, BF16>(kv.dk + at, kv.ss, acc_dk, scale, key0, w.key_end);
    store_rows16<D, BF16>(kv.dv + at, kv.ss, acc_dv, 1.f, key0, w.key_end);
    return;
  }
  const u32 staging = w.base + L::kQ + cw * 64 * D * 4;
#pragma unroll
  for (int which = 0; which < 2; ++which) {
    if (which == 1) {  // the dK reductions have read the buffer
      if (tid == 0) bulk_wait_read();
      named_barrier_sync(kStaged + cw, 128);
    }
    stage_f32_rows<D>(staging, which == 0 ? acc_dk : acc_dv, which == 0 ? scale : 1.f, warp, lane);
    fence_async_shared();
    named_barrier_sync(kStaged + cw, 128);
    if (tid == 0) {
      const unsigned char* map = which == 0 ? tdk : tdv;
#pragma unroll
      for (int box = 0; box < D / 32; ++box)
        tma_reduce_add_4d(map, staging + box * 8192, 32 * box, w.hk, w.n0 + 64 * cw, w.b);
      bulk_commit();
    }
  }
  if (tid == 0) bulk_wait_all();
}

// D = 64, 128, consumer warpgroup cw (see the header): its 64 keys are the M of every product; dK and dV stay in
// registers for the walk.
template <int D, bool BF16, bool CAUSAL, bool IV>
__device__ __forceinline__ void consumer(const bwd90::Walk& w, int cw, const unsigned char* tdk,
                                         const unsigned char* tdv, i64 off, float scale, float sl2, const KvOut& kv) {
  using namespace bwd90;
  using L = Smem<D>;
  constexpr int BN = Cfg<D>::BN, BM = Cfg<D>::BM;
  const u32 base = w.base;
  const int tid = threadIdx.x % 128, lane = tid % 32, warp = tid / 32;
  const int key_lo = w.n0 + 64 * cw;               // first key of this warpgroup
  const int key0 = key_lo + 16 * warp + lane / 4;  // this thread's keys: key0, key0 + 8
  const int qc = 2 * (lane % 4);                   // this thread's first query column in a tile
  const u32 k_lo = desc_lo(base + L::kK + cw * 64 * 128, 16), v_lo = desc_lo(base + L::kV + cw * 64 * 128, 16);
  // dQ part: B = K column block cw (D = 128) or 0; A = dS^T column block cw (D = 64) or 0
  const u32 kdq_lo = desc_lo(base + L::kK + (D == 128 ? cw * BN * 128 : 0), 16);
  const u32 dsdq_off = D == 64 ? cw * BN * 128 : 0;
  // stmatrix address of dS^T rows (keys) 64 cw + 16 warp + (lane % 16) / 8 * 8 + lane % 8, before the
  // chunk of the 16 columns: swizzled chunk (2 kk) ^ (lane / 16) ^ (row % 8) = (2 kk) ^ ds_xor
  const int ds_row = 64 * cw + 16 * warp + 8 * ((lane / 8) % 2) + lane % 8;
  const u32 ds_thread = ds_row * 128 + (((lane / 16) ^ (lane % 8)) << 4);

  if (tid == 0) {  // the epilogue's tensor maps
    tensormap_acquire(tdk);
    tensormap_acquire(tdv);
  }
  float acc_dk[D / 2], acc_dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;

  mbar_wait(L::kv_full(base), 0);
  WalkStep at = WalkStep::first(w);
  PipeState<STAGES> pipe;
  for (int n = 0; n < w.steps; ++n) {
    const int t = at.t;
    const int m0 = t * BM, s = pipe.stage;  // the causal mask's first row (interval tiles: tiles[t])
    const u32 q_lo = desc_lo(base + L::kQ + s * L::kTile, 16), do_lo = desc_lo(base + L::kDO + s * L::kTile, 16);
    const u32 qmn_lo = desc_lo(base + L::kQ + s * L::kTile, BM * 128);
    const u32 domn_lo = desc_lo(base + L::kDO + s * L::kTile, BM * 128);
    const u32 ds_tile = base + L::kDS + (n & 1) * BN * BM * 2;

    float st[BM / 2], dpt[BM / 2];
    issue_st_dpt<D, BM, BF16>(st, dpt, k_lo, q_lo, v_lo, do_lo, L::q_full(base, s), L::do_full(base, s), pipe.phase);

    // P^T (keys x queries), masked on global positions: element (j, e) is key key0 + 8 (e >> 1), query
    // m0 + 8 j + qc + (e & 1)
    const float* l2 = w.s_lse + s * BM + qc;
    const int* klo = w.s_klo + s * BM + qc;
    const int* khi = w.s_khi + s * BM + qc;
    // IV: every key of this consumer visible from every row of the tile when the last row's band starts
    // at or before key_lo and the first row's band ends at or after key_lo + 64
    const bool need_mask = (w.n0 + BN > w.key_end) ||
                           (CAUSAL && static_cast<i64>(key_lo + 63) > static_cast<i64>(m0) + off) ||
                           (IV && !(klo[BM - 1 - qc] <= key_lo && khi[-qc] >= key_lo + 64));
    probs_t<BM, CAUSAL, IV>(st, l2, klo, khi, need_mask, key0, m0, qc, w.key_end, off, sl2);
    u32 pa[BM / 16][4];
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) pa[kk][i] = pack2<BF16>(st[8 * kk + 2 * i], st[8 * kk + 2 * i + 1]);

    wgmma_wait<0>();
    fence_operands<BM / 2>(dpt);
    // dS^T = P^T (dP^T - delta)
    const float* dl = w.s_delta + s * BM + qc;
    u32 dsa[BM / 16][4];
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
      const float2 dj = *reinterpret_cast<const float2*>(dl + 8 * j);
      dsa[j / 2][2 * (j & 1) + 0] = pack2<BF16>(st[4 * j + 0] * (dpt[4 * j + 0] - dj.x), st[4 * j + 1] * (dpt[4 * j + 1] - dj.y));
      dsa[j / 2][2 * (j & 1) + 1] = pack2<BF16>(st[4 * j + 2] * (dpt[4 * j + 2] - dj.x), st[4 * j + 3] * (dpt[4 * j + 3] - dj.y));
    }

    wgmma_fence();
    keys_by_dim<D, BM, BF16>(acc_dv, pa, domn_lo);
    wgmma_commit();
    // dS^T to shared memory for the dQ product: 16 keys x 16 queries per stmatrix
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
      stmatrix_x4(((ds_tile + ds_thread) ^ (((2 * kk) % 8) << 4)) + (kk / 4) * BN * 128, dsa[kk]);
    fence_async_shared();
    named_barrier_sync(kDsReady, 128 * CONSUMERS);
    float acc_dq[32];
    wgmma_fence();
    dq_part<D, BF16>(acc_dq, desc_lo(ds_tile + dsdq_off, 16), kdq_lo);
    wgmma_commit();
    keys_by_dim<D, BM, BF16>(acc_dk, dsa, qmn_lo);
    wgmma_commit();
    wgmma_wait<1>();  // dV and dQ are done; dK may still run
    fence_operands<D / 2>(acc_dv);
    fence_operands<32>(acc_dq);
    mbar_arrive(L::do_empty(base, s));

    // stage scale * dQ for the writer once it has read the previous part
    named_barrier_sync(kDqEmpty + cw, kWriterSync);
    stage_f32_rows<64>(base + L::kDQ + cw * L::kDqPart, acc_dq, scale, warp, lane);
    fence_async_shared();
    named_barrier_arrive(kDqFull + cw, kWriterSync);

    wgmma_wait<0>();
    fence_operands<D / 2>(acc_dk);
    mbar_arrive(L::q_empty(base, s));
    at.next(w);
    pipe.advance();
  }
  store_dkdv<D, BF16>(w, cw, acc_dk, acc_dv, tdk, tdv, scale, kv);
}

// The block index, read afresh (the compiler cannot reuse an earlier read's derived values).
__device__ __forceinline__ int block_index_x() {
  int x;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(x));
  return x;
}

// CTA lin's walk (its tile from KeyBlockTile, then the query tiles it sees); steps <= 0: nothing visible.
template <int D, bool CAUSAL, bool IV>
__device__ __forceinline__ bwd90::Walk walk_of(int lin, u32 base, unsigned char* smem_raw, const Bwd90Params args) {
  using namespace bwd90;
  using L = Smem<D>;
  constexpr int BN = Cfg<D>::BN, BM = Cfg<D>::BM;
  unsigned char* const at = smem_raw + (base - smem_u32(smem_raw));
  const int nsplit = args.group / args.hpb;
  const KeyBlockTile tile = KeyBlockTile::at(lin, args.nkb, args.order, nsplit, args.Hkv);
  int n0 = tile.kb * BN, key_end = min(n0 + BN, args.Sk);  // this CTA's keys
  int t_lo = 0, t_end = args.Sq_pad / BM;                  // the query tiles it walks
  if (CAUSAL) {  // query tiles in which no row sees key n0 or later are skipped
    const i64 first_q = static_cast<i64>(n0) - args.off;  // the first query that sees key n0
    t_lo = first_q <= 0 ? 0 : static_cast<int>(min(static_cast<i64>(t_end), first_q / BM));
  }
  bool down = false;
  if (IV) {
    const int* const r = args.ranges + 5 * tile.kb;
    t_lo = r[0], t_end = r[1], down = r[2], n0 = r[3], key_end = r[4];
  }
  // step order: WalkStep (down: tile by tile from the last, every head at each; up: head by head)
  const int steps = n0 < args.Sk ? (t_end - t_lo) * args.hpb : 0;
  return {base, reinterpret_cast<const float*>(at + L::kLse), reinterpret_cast<const float*>(at + L::kDelta),
          reinterpret_cast<const int*>(at + L::kKlo), reinterpret_cast<const int*>(at + L::kKhi), args.tiles, n0,
          key_end, tile.b, tile.hk, tile.hk * args.group + tile.split * args.hpb, args.hpb, t_lo, t_end, steps, down};
}

template <int D, bool BF16, bool CAUSAL, bool IV>
__device__ __forceinline__ void attn_bwd_sm90(const Bwd90Params args) {
  using namespace bwd90;
  using L = Smem<D>;
  extern __shared__ unsigned char smem_raw[];
  const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const Walk walk = walk_of<D, CAUSAL, IV>(blockIdx.x, base, smem_raw, args);
  if (walk.steps <= 0) {  // nothing visible: dq, dk, dv stay as they are; dk_out, dv_out get zeros
    if (args.kv.dk != nullptr) zero_kv_out<D>(args.kv, walk.b, walk.hk, walk.n0, walk.key_end);
    return;
  }

  if (threadIdx.x == 0) {
    mbar_init(L::kv_full(base), 1);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(L::q_full(base, s), 1);
      mbar_init(L::do_full(base, s), 1);
      // every consumer thread arrives: each releases its own reads of the stage (lse, delta rows); at D = 256
      // the dQ writer too
      mbar_init(L::q_empty(base, s), Cfg<D>::kEmptyArrivals);
      mbar_init(L::do_empty(base, s), Cfg<D>::kEmptyArrivals);
    }
    mbar_fence_init();
  }
  __syncthreads();

  const int wg = warpgroup_index(), lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
  const unsigned char* const maps = args.tmaps;
  const unsigned char *tq = maps, *tk = maps + 128, *tv = maps + 256, *tdo = maps + 384, *tdq = maps + 512,
                      *tdk = maps + 640, *tdv = maps + 768;
  if (wg == 0) {  // ---------------------------------------------------------------- producer
    warpgroup_reg_dealloc<Cfg<D>::kProducerRegs>();
    // the walk again, from a fresh read of the block index: cheaper for the 24-register producer than holding
    // the prologue's values across the role split
    const Walk pw = walk_of<D, CAUSAL, IV>(block_index_x(), base, smem_raw, args);
    if (warp == 0 && lane == 0) load_walk<D, IV>(pw, tq, tk, tv, tdo, args.rows, args.B, args.Hq, args.Sq_pad);
    else if (warp == 1) {
      if constexpr (Cfg<D>::kWide) dq_writer_wide<IV>(pw, tdq, lane);
      else dq_writer<D, IV>(pw, tdq, lane);
    }
    return;
  }
  // ------------------------------------------------------------------------------------ consumers
  warpgroup_reg_alloc<Cfg<D>::kConsumerRegs>();
  if constexpr (Cfg<D>::kWide)
    consumer_wide<BF16, CAUSAL, IV>(walk, tdk, tdv, args.off, args.scale, args.sl2, args.kv);
  else
    consumer<D, BF16, CAUSAL, IV>(walk, wg - 1, tdk, tdv, args.off, args.scale, args.sl2, args.kv);
}

#define BH_BWD90_NAME(DT, MASK, D) attn_bwd_sm90_##DT##_d##D##_##MASK
#define BH_BWD90_KERNEL(DT, MASK, D)                                                                              \
  extern "C" __global__ void __launch_bounds__(bwd90::THREADS, 1)                                                 \
      BH_BWD90_NAME(DT, MASK, D)(const __grid_constant__ Bwd90Params args) {                                      \
    attn_bwd_sm90<D, BH_IS_BF16(DT), BH_IS_CAUSAL(MASK), BH_IS_INTERVAL(MASK)>(args);                             \
  }
#define BH_BWD90_ROW(DT, MASK, D)                                                                      \
  {BH_STR(BH_BWD90_NAME(DT, MASK, D)), BH_DTYPE_##DT, D, BH_MASK_##MASK, bwd90::Cfg<D>::BM,          \
   bwd90::Cfg<D>::BN, bwd90::THREADS, static_cast<int>(bwd90::Smem<D>::kBytes)},
#define BH_BWD90_KERNELS(D) BH_EACH_DTYPE_AND_MASK(BH_BWD90_KERNEL, D)
#define BH_BWD90_ROWS(D) BH_EACH_DTYPE_AND_MASK(BH_BWD90_ROW, D)

// The instances, listed once: each head dim X(D) in bf16 and f16 with the full, causal and interval masks,
// named attn_bwd_sm90_<dtype>_d<D>_<mask>; the kernel table attn_bwd_sm90_kernels lists them with their
// geometry. The arguments (Bwd90Params, contract.cuh): tmaps: the q, k, v, do (16-bit) and dq, dk, dv (float32)
// tensor maps, 128 bytes each; rows: the table of attn_bwd_sm90_rows (Sq_pad rows per head); ranges (interval
// only): per key block kb five ints (the host's plan/tiles.backward_tiles): the query tiles [r[0], r[1]) it walks,
// whether it walks them down (r[2] != 0: WalkStep; plan/tiles.walk_down) and its keys [r[3], r[4]); tiles
// (interval only): each query tile's first row, then Sq (else tile t's first row is t BM); nkb: key blocks;
// order: null or the CTA order (KeyBlockTile) over the 1-D grid of key blocks x head slots; hpb: query heads per CTA; kv: KvOut
#define BH_BWD90_SHAPES(X) X(128) X(64) X(256)
BH_INSTANCES(BH_BWD90_SHAPES, BH_BWD90_KERNELS)
BH_KERNEL_TABLE(attn_bwd_sm90, BH_TABLE_ROWS(BH_BWD90_SHAPES, BH_BWD90_ROWS))
