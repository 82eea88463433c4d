// Attention backward over one (query block, key block) pair for Hopper (sm_90a), added into float32
// (dq, dk, dv): the same contract as attn_bwd.cu (docs/KERNELS.md).
//
// A CTA owns BN = 128 keys of one (batch, kv head) and walks every query tile (BM rows: 64 at D = 128,
// 128 at D = 64) of the query heads it was given (the whole GQA group, or a slice when the grid needs
// more CTAs). Warpgroup 0 is the producer, with two jobs:
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
// Rows with lse = -inf (nothing visible in the forward) and query rows past the end get P = 0; keys past
// the end are masked; causal masks are on global positions, and query tiles hidden from every key of the
// CTA are skipped. Interval masks (IV: documents, sliding windows; docs/KERNELS.md "Masks"): local query
// row r sees the keys at global positions [mlo[r], mhi[r]); the pre-pass attn_bwd_sm90_ranges gives each
// CTA the query tiles that see any of its keys, and each tile's per-row key bounds (local) travel with
// its lse rows, so only tiles on a band edge are masked.
#include "sm90_epilogue.cuh"
#include "sm90_pipeline.cuh"

namespace bwd90 {
constexpr int BN = 128, STAGES = 2, CONSUMERS = 2;
constexpr int THREADS = 128 * (1 + CONSUMERS);
constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;

template <int D>
struct Cfg {
  static constexpr int BM = D == 64 ? 128 : 64;  // query rows per tile
};

// Named barrier IDs, each defined once (0 is __syncthreads). A hardware ID shared by two barriers with
// different members can release with a mix of both, so no ID appears twice.
enum Barrier : int {
  kDsReady = 1,   // both consumers' dS^T rows are in shared memory (256 threads)
  kDqFull = 2,    // consumer cw's dQ part is staged (kDqFull + cw: its 128 threads arrive, the writer warp syncs)
  kDqEmpty = 4,   // the writer has read consumer cw's staging buffer (kDqEmpty + cw: writer arrives, consumer syncs)
  kWalkDone = 6,  // both consumers are done with the Q / dO stages, which the epilogue reuses (256 threads)
  kStaged = 7,    // consumer cw's dK or dV rows are staged / its staging buffer is free again (kStaged + cw)
  kBarrierEnd = 9
};
static_assert(kDqFull + CONSUMERS <= kDqEmpty && kDqEmpty + CONSUMERS <= kWalkDone && kWalkDone < kStaged &&
                  kStaged + CONSUMERS <= kBarrierEnd && kBarrierEnd <= 16,
              "named barrier IDs overlap");
constexpr int kWriterSync = 128 + 32;  // a consumer warpgroup and the writer warp

// shared memory, byte offsets from a 1024-aligned base
template <int D>
struct Smem {
  static constexpr int BM = Cfg<D>::BM;
  static constexpr u32 kTile = BM * D * 2;                 // one Q or dO tile: [D/64][BM][64]
  static constexpr u32 kDqPart = 64 * 64 * 4;              // one consumer's dQ part: [2][64 rows][32 floats]
  static constexpr u32 kK = 0;                             // [D/64][BN][64]
  static constexpr u32 kV = kK + BN * D * 2;               // [D/64][BN][64]
  static constexpr u32 kQ = kV + BN * D * 2;               // STAGES x tile
  static constexpr u32 kDO = kQ + STAGES * kTile;          // STAGES x tile
  static constexpr u32 kDS = kDO + STAGES * kTile;         // 2 x dS^T: [BM/64][BN][64]
  static constexpr u32 kDQ = kDS + 2 * BN * BM * 2;        // CONSUMERS x dQ part
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
}  // namespace bwd90

// Tile geometry read by the host (cuda_backend.py), so it is written down once: per head dim (64, 128)
// {keys per CTA, queries per tile, threads, dynamic shared memory bytes}.
extern "C" __constant__ int attn_bwd_sm90_geometry[2][4] = {
    {bwd90::BN, bwd90::Cfg<64>::BM, bwd90::THREADS, static_cast<int>(bwd90::Smem<64>::kBytes)},
    {bwd90::BN, bwd90::Cfg<128>::BM, bwd90::THREADS, static_cast<int>(bwd90::Smem<128>::kBytes)}};

// The pre-pass: the row table the producer copies per tile. rows[0][b][h][i] = lse * log2(e) (+inf for rows
// past Sq and rows that saw nothing, so their P is 0), rows[1][b][h][i] = delta (0 there); i < Sq_pad.
// With interval bounds (mlo != null) the table goes on with two int rows of Sq_pad: each query row's
// visible keys [klo, khi) as local key indices (empty past Sq, kept nondecreasing there).
extern "C" __global__ void attn_bwd_sm90_rows(const float* lse, const float* delta, float* rows, i64 lsb, i64 lsh,
                                              i64 lss, i64 dsb, i64 dsh, i64 dss, int B, int H, int Sq, int Sq_pad,
                                              const int* mlo, const int* mhi, i64 kofs, int Sk) {
  if (mlo != nullptr) {
    int* const bounds = reinterpret_cast<int*>(rows + 2 * static_cast<i64>(B) * H * Sq_pad);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < Sq_pad; i += gridDim.x * blockDim.x) {
      bounds[i] = i < Sq ? local_key(mlo[i], kofs, Sk) : Sk + 1;  // rows past the end: empty, and the
      bounds[Sq_pad + i] = i < Sq ? local_key(mhi[i], kofs, Sk) : Sk + 1;  // bounds stay nondecreasing
    }
  }
  const i64 n = static_cast<i64>(B) * H * Sq_pad;
  for (i64 idx = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<i64>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(idx % Sq_pad);
    const i64 bh = idx / Sq_pad;
    const int h = static_cast<int>(bh % H), b = static_cast<int>(bh / H);
    float l2 = BH_INF, dl = 0.f;
    if (i < Sq) {
      const float x = lse[b * lsb + h * lsh + i * lss];
      if (x > -BH_INF) {
        l2 = x * BH_LOG2E;
        dl = delta[b * dsb + h * dsh + i * dss];
      }
    }
    rows[idx] = l2;
    rows[n + idx] = dl;
  }
}

// Interval masks: the query tiles [first, end) that see any key of each key block (both bounds never
// decrease with the row, so two binary searches); ranges[2 kb], ranges[2 kb + 1].
extern "C" __global__ void attn_bwd_sm90_ranges(const int* mlo, const int* mhi, i64 kofs, int Sq, int Sk, int BN_,
                                                int BM_, int nkb, int* ranges) {
  const int kb = blockIdx.x * blockDim.x + threadIdx.x;
  if (kb >= nkb) return;
  const i64 k_first = kofs + static_cast<i64>(kb) * BN_, k_last = kofs + min((kb + 1) * BN_, Sk) - 1;
  int lo = 0, hi = Sq;  // the first row with mhi > k_first
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (static_cast<i64>(mhi[mid]) > k_first) hi = mid; else lo = mid + 1;
  }
  const int r_first = lo;
  lo = r_first, hi = Sq;  // the first row with mlo > k_last
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (static_cast<i64>(mlo[mid]) > k_last) hi = mid; else lo = mid + 1;
  }
  const int r_end = lo;
  ranges[2 * kb] = r_first / BM_;
  ranges[2 * kb + 1] = r_end > r_first ? (r_end + BM_ - 1) / BM_ : r_first / BM_;
}

// 64 x BM (this consumer's keys x the tile's queries) = A rows (K or V, K-major) . B rows (Q or dO)
template <int D, int BM, bool BF16>
__device__ __forceinline__ void keys_by_queries(float* acc, u32 a_lo, u32 b_lo) {
  using namespace bwd90;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_ss<BM, BF16, 0, 0>(acc, desc_at(a_lo, (kk / 4) * BN * 128 + (kk % 4) * 32),
                             desc_at(b_lo, (kk / 4) * BM * 128 + (kk % 4) * 32), kk > 0);
}

// acc (64 keys x D) += A (registers, 64 keys x BM queries) * B (Q or dO tile, read MN-major)
template <int D, int BM, bool BF16>
__device__ __forceinline__ void keys_by_dim(float* acc, const u32 (*a)[4], u32 b_lo) {
#pragma unroll
  for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs<D, BF16, 1>(acc, a[kk], desc_at(b_lo, kk * 16 * 128), 1);
}

// this consumer's dQ part (64 x 64) = dS (M-major view of dS^T) . K (MN-major), over all BN keys
template <bool BF16>
__device__ __forceinline__ void dq_part(float* acc, u32 ds_lo, u32 k_lo) {
  using namespace bwd90;
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
    wgmma_ss<64, BF16, 1, 1>(acc, desc_at(ds_lo, kk * 16 * 128), desc_at(k_lo, kk * 16 * 128), kk > 0);
}

template <int D, bool BF16, bool CAUSAL, bool IV>
__device__ __forceinline__ void attn_bwd_sm90(const unsigned char* tmaps, const float* rows, int Sq, int Sq_pad,
                                              int Sk, int Hq, int Hkv, int group, int hpb, float scale, float sl2,
                                              i64 off, const int* ranges) {
  using namespace bwd90;
  using L = Smem<D>;
  constexpr int BM = Cfg<D>::BM;
  extern __shared__ unsigned char smem_raw[];
  const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const float* const s_lse = reinterpret_cast<const float*>(smem_raw + (base - smem_u32(smem_raw)) + L::kLse);
  const float* const s_delta = reinterpret_cast<const float*>(smem_raw + (base - smem_u32(smem_raw)) + L::kDelta);
  const int* const s_klo = reinterpret_cast<const int*>(smem_raw + (base - smem_u32(smem_raw)) + L::kKlo);
  const int* const s_khi = reinterpret_cast<const int*>(smem_raw + (base - smem_u32(smem_raw)) + L::kKhi);

  // grid: (key blocks, splits of the GQA group, batch x kv heads)
  const int n0 = blockIdx.x * BN;
  const int b = blockIdx.z / Hkv, hk = blockIdx.z % Hkv;
  const int h_first = hk * group + blockIdx.y * hpb;
  int t_lo = 0, t_end = Sq_pad / BM;  // the query tiles this CTA walks
  if (CAUSAL) {  // query tiles in which no row sees key n0 or later are skipped
    const i64 first_q = static_cast<i64>(n0) - off;  // the first query that sees key n0
    t_lo = first_q <= 0 ? 0 : static_cast<int>(min(static_cast<i64>(t_end), first_q / BM));
  }
  if (IV) t_lo = ranges[2 * blockIdx.x], t_end = ranges[2 * blockIdx.x + 1];
  const int tiles = t_end - t_lo;
  if (tiles <= 0 || n0 >= Sk) return;  // nothing visible: dq, dk, dv stay as they are
  const int steps = tiles * hpb;        // step order: query tiles t_lo.. of head h_first, then the next head

  if (threadIdx.x == 0) {
    mbar_init(L::kv_full(base), 1);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(L::q_full(base, s), 1);
      mbar_init(L::do_full(base, s), 1);
      // every consumer thread arrives: each releases its own reads of the stage (lse, delta rows)
      mbar_init(L::q_empty(base, s), 128 * CONSUMERS);
      mbar_init(L::do_empty(base, s), 128 * CONSUMERS);
    }
    mbar_fence_init();
  }
  __syncthreads();

  const int wg = warpgroup_index(), tid = threadIdx.x % 128, lane = tid % 32, warp = tid / 32;
  const unsigned char *tq = tmaps, *tk = tmaps + 128, *tv = tmaps + 256, *tdo = tmaps + 384, *tdq = tmaps + 512,
                      *tdk = tmaps + 640, *tdv = tmaps + 768;
  if (wg == 0) {  // ---------------------------------------------------------------- producer
    warpgroup_reg_dealloc<PRODUCER_REGS>();
    if (warp == 0 && lane == 0) {  // loads
      tensormap_acquire(tq);
      tensormap_acquire(tk);
      tensormap_acquire(tv);
      tensormap_acquire(tdo);
      mbar_arrive_expect_tx(L::kv_full(base), 2 * BN * D * 2);
#pragma unroll
      for (int db = 0; db < D / 64; ++db) {
        tma_load_4d(base + L::kK + db * BN * 128, tk, L::kv_full(base), db * 64, hk, n0, b);
        tma_load_4d(base + L::kV + db * BN * 128, tv, L::kv_full(base), db * 64, hk, n0, b);
      }
      const i64 delta_rows = static_cast<i64>(gridDim.z / Hkv) * Hq * Sq_pad;  // B * Hq * Sq_pad
      const int* const bounds = reinterpret_cast<const int*>(rows + 2 * delta_rows);
      int h = h_first, t = t_lo;
      PipeState<STAGES> pipe;
      for (int n = 0; n < steps; ++n) {
        const int m0 = t * BM, s = pipe.stage;
        const float* row_lse = rows + (static_cast<i64>(b) * Hq + h) * Sq_pad + m0;
        mbar_wait(L::q_empty(base, s), pipe.phase ^ 1);
        mbar_arrive_expect_tx(L::q_full(base, s), L::kTile + (IV ? 3 : 1) * BM * 4);
#pragma unroll
        for (int db = 0; db < D / 64; ++db)
          tma_load_4d(base + L::kQ + s * L::kTile + db * BM * 128, tq, L::q_full(base, s), db * 64, h, m0, b);
        bulk_load(base + L::kLse + s * BM * 4, row_lse, BM * 4, L::q_full(base, s));
        if (IV) {
          bulk_load(base + L::kKlo + s * BM * 4, bounds + m0, BM * 4, L::q_full(base, s));
          bulk_load(base + L::kKhi + s * BM * 4, bounds + Sq_pad + m0, BM * 4, L::q_full(base, s));
        }
        mbar_wait(L::do_empty(base, s), pipe.phase ^ 1);
        mbar_arrive_expect_tx(L::do_full(base, s), L::kTile + BM * 4);
#pragma unroll
        for (int db = 0; db < D / 64; ++db)
          tma_load_4d(base + L::kDO + s * L::kTile + db * BM * 128, tdo, L::do_full(base, s), db * 64, h, m0, b);
        bulk_load(base + L::kDelta + s * BM * 4, row_lse + delta_rows, BM * 4, L::do_full(base, s));
        if (++t == t_end) t = t_lo, ++h;
        pipe.advance();
      }
    } else if (warp == 1) {  // the dQ writer
      if (lane == 0) tensormap_acquire(tdq);
#pragma unroll
      for (int c = 0; c < CONSUMERS; ++c) named_barrier_arrive(kDqEmpty + c, kWriterSync);
      int h = h_first, t = t_lo;
      for (int n = 0; n < steps; ++n) {
#pragma unroll
        for (int c = 0; c < CONSUMERS; ++c) {
          named_barrier_sync(kDqFull + c, kWriterSync);
          if (lane == 0) {
            const int col = D == 128 ? 64 * c : 0, row = t * BM + (D == 128 ? 0 : 64 * c);
            const u32 part = base + L::kDQ + c * L::kDqPart;
            tma_reduce_add_4d(tdq, part, col, h, row, b);
            tma_reduce_add_4d(tdq, part + L::kDqPart / 2, col + 32, h, row, b);
            bulk_commit();
          }
        }
        if (lane == 0) bulk_wait_read();
        __syncwarp();
        if (n + 1 < steps) {
#pragma unroll
          for (int c = 0; c < CONSUMERS; ++c) named_barrier_arrive(kDqEmpty + c, kWriterSync);
        }
        if (++t == t_end) t = t_lo, ++h;
      }
      if (lane == 0) bulk_wait_all();
    }
    return;
  }

  // ------------------------------------------------------------------------------------ consumers
  warpgroup_reg_alloc<CONSUMER_REGS>();
  const int cw = wg - 1;
  const int key_lo = n0 + 64 * cw;                 // first key of this warpgroup
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
  int t = t_lo;
  PipeState<STAGES> pipe;
  for (int n = 0; n < steps; ++n) {
    const int m0 = t * BM, s = pipe.stage;
    const u32 q_lo = desc_lo(base + L::kQ + s * L::kTile, 16), do_lo = desc_lo(base + L::kDO + s * L::kTile, 16);
    const u32 qmn_lo = desc_lo(base + L::kQ + s * L::kTile, BM * 128);
    const u32 domn_lo = desc_lo(base + L::kDO + s * L::kTile, BM * 128);
    const u32 ds_tile = base + L::kDS + (n & 1) * BN * BM * 2;

    float st[BM / 2], dpt[BM / 2];
    mbar_wait(L::q_full(base, s), pipe.phase);
    wgmma_fence();
    keys_by_queries<D, BM, BF16>(st, k_lo, q_lo);
    wgmma_commit();
    mbar_wait(L::do_full(base, s), pipe.phase);
    keys_by_queries<D, BM, BF16>(dpt, v_lo, do_lo);
    wgmma_commit();
    wgmma_wait<1>();
    fence_operands<BM / 2>(st);

    // P^T (keys x queries), masked on global positions: element (j, e) is key key0 + 8 (e >> 1), query
    // m0 + 8 j + qc + (e & 1)
    const float* l2 = s_lse + s * BM + qc;
    const int* klo = s_klo + s * BM + qc;
    const int* khi = s_khi + s * BM + qc;
    // IV: every key of this consumer visible from every row of the tile when the last row's band starts
    // at or before key_lo and the first row's band ends at or after key_lo + 64
    const bool need_mask = (n0 + BN > Sk) ||
                           (CAUSAL && static_cast<i64>(key_lo + 63) > static_cast<i64>(m0) + off) ||
                           (IV && !(klo[BM - 1 - qc] <= key_lo && khi[-qc] >= key_lo + 64));
    if (need_mask) {
      const int klim = Sk - key0;
      // hidden when 8 (e >> 1) - 8 j - (e & 1) > dl; clamped so the int compare cannot overflow
      const int dl = static_cast<int>(
          max(static_cast<i64>(-4 * BM), min(static_cast<i64>(4 * BM), static_cast<i64>(m0) + off - key0 + qc)));
#pragma unroll
      for (int j = 0; j < BM / 8; ++j) {
        const float2 lj = *reinterpret_cast<const float2*>(l2 + 8 * j);
        int2 lo2 = make_int2(0, 0), hi2 = make_int2(Sk, Sk);
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
      for (int j = 0; j < BM / 8; ++j) {
        const float2 lj = *reinterpret_cast<const float2*>(l2 + 8 * j);
#pragma unroll
        for (int e = 0; e < 4; ++e) st[4 * j + e] = fast_exp2(fmaf(st[4 * j + e], sl2, -((e & 1) ? lj.y : lj.x)));
      }
    }
    u32 pa[BM / 16][4];
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) pa[kk][i] = pack2<BF16>(st[8 * kk + 2 * i], st[8 * kk + 2 * i + 1]);

    wgmma_wait<0>();
    fence_operands<BM / 2>(dpt);
    // dS^T = P^T (dP^T - delta)
    const float* dl = s_delta + s * BM + qc;
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
    dq_part<BF16>(acc_dq, desc_lo(ds_tile + dsdq_off, 16), kdq_lo);
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
    if (++t == t_end) t = t_lo;
    pipe.advance();
  }

  // ---- epilogue: dk += scale * dK, dv += dV by TMA tensor reductions (adds in L2, so CTAs that share a kv
  // head through a split GQA group need no atomics; keys past Sk are not written). Staged in the Q / dO
  // stages, free once both consumers are past their last step; dK first, then dV in the same buffer.
  named_barrier_sync(kWalkDone, 128 * CONSUMERS);
  const u32 staging = base + L::kQ + cw * 64 * D * 4;
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
      for (int box = 0; box < D / 32; ++box) tma_reduce_add_4d(map, staging + box * 8192, 32 * box, hk, key_lo, b);
      bulk_commit();
    }
  }
  if (tid == 0) bulk_wait_all();
}

#define BH_BWD90(NAME, D, BF16, CAUSAL, IV)                                                                       \
  extern "C" __global__ void __launch_bounds__(bwd90::THREADS, 1)                                                \
      NAME(const unsigned char* tmaps, const float* rows, int Sq, int Sq_pad, int Sk, int Hq, int Hkv, int group, \
           int hpb, float scale, float sl2, i64 off, const int* ranges) {                                        \
    attn_bwd_sm90<D, BF16, CAUSAL, IV>(tmaps, rows, Sq, Sq_pad, Sk, Hq, Hkv, group, hpb, scale, sl2, off, ranges); \
  }

// name: attn_bwd_sm90_<dtype>_d<D>_<mask>, mask: full | causal | interval; tmaps: the q, k, v, do (16-bit)
// and dq, dk, dv (float32) tensor maps, 128 bytes each; rows: the table of attn_bwd_sm90_rows; ranges (interval
// only): the query tiles of each key block from attn_bwd_sm90_ranges
BH_BWD90(attn_bwd_sm90_bf16_d128_full, 128, true, false, false)
BH_BWD90(attn_bwd_sm90_bf16_d128_causal, 128, true, true, false)
BH_BWD90(attn_bwd_sm90_bf16_d128_interval, 128, true, false, true)
BH_BWD90(attn_bwd_sm90_f16_d128_full, 128, false, false, false)
BH_BWD90(attn_bwd_sm90_f16_d128_causal, 128, false, true, false)
BH_BWD90(attn_bwd_sm90_f16_d128_interval, 128, false, false, true)
BH_BWD90(attn_bwd_sm90_bf16_d64_full, 64, true, false, false)
BH_BWD90(attn_bwd_sm90_bf16_d64_causal, 64, true, true, false)
BH_BWD90(attn_bwd_sm90_bf16_d64_interval, 64, true, false, true)
BH_BWD90(attn_bwd_sm90_f16_d64_full, 64, false, false, false)
BH_BWD90(attn_bwd_sm90_f16_d64_causal, 64, false, true, false)
BH_BWD90(attn_bwd_sm90_f16_d64_interval, 64, false, false, true)
