// Attention forward over one (query block, key block) pair for Hopper (sm_90a), merged into a
// running float32 (o, lse): the same contract as attn_fwd.cu (docs/KERNELS.md).
//
// Persistent: one CTA per SM takes tiles of the schedule below until none is left: its first is blockIdx.x,
// each next one comes from a global counter (the producer takes it while the tile before is loading), so a
// CTA that drew light causal or masked tiles takes more. A tile is up to BM = 64 x (consumer warpgroups) query
// rows of one (batch, query head):
// - the producer (warpgroup 0) gives its registers away and has one thread issue TMA loads: the tile's Q
//   (one buffer, refilled for the next tile as soon as both consumers have issued their last Q K^T, so it
//   lands while they finish the last P V and the epilogue; the tile's index and the tile itself go to the
//   consumers in a shared-memory slot published by the same barrier, so they do not make it again: under
//   interval masks that took dependent global loads on their path), then K and V tiles of BN keys into a
//   STAGES-deep ring of shared-memory buffers that runs on across tiles, each stage with a "full"
//   mbarrier (TMA bytes landed) and an "empty" one (both consumers done reading);
// - consumers (warpgroups 1..), 64 query rows each, run S = Q K^T (wgmma, both operands in shared
//   memory), the online softmax on the accumulator registers, and O += P V (wgmma, P from registers).
//   Inside a consumer the softmax of tile t overlaps the P V product of tile t-1: the loop issues
//   S_t = Q K_t^T and O += P_{t-1} V_{t-1} back to back and waits only for S_t before the softmax.
//   Between consumers (Cfg::PINGPONG), named barriers hand a turn around: a consumer issues a step's two
//   products only in its turn, so the products of one run while the others do their softmax.
// Shapes: D = 64 runs 2 or 3 consumers (BM 128 or 192; the host picks the one whose tile count fills the
// SMs best), D = 128 two consumers and 128-key tiles, D = 256 two consumers and 80-key tiles (its O
// accumulator is 128 registers per thread; 80 keys fill the shared memory and ran faster than 64).
// Schedule: query heads in chunks of `hchunk` (the host sizes a chunk's K/V to stay in L2); inside a
// chunk, query blocks in rank order, each over the chunk's heads: causal ranks run the heaviest block first,
// interval masks take the host's longest-first `order` of query blocks, full attention plain order.
// Causal masking is on global positions (key j hidden from query i when j > i + off, off = q_start -
// k_start); key tiles hidden from every row of the tile are never loaded.
// Interval masks (IV: documents, sliding windows; docs/KERNELS.md "Masks"): local row r sees the keys
// whose global position lies in [mlo[r], mhi[r]), local key c at global kofs + c; both bounds never
// decrease with r, so a tile loads only the key tiles from mlo[first row] (the first key tile starts there,
// on no grid) to mhi[last row], and a warpgroup's key tile needs no mask when mlo[its last row] <= tile start
// and mhi[its first row] >= tile end. The query tiles are the host's (`order`: plan/tiles.forward_tiles): up
// to BM rows [first, end), a long document's starting on its first row, so its key tiles start on its first
// key; rows from `end` on in the tile's BM belong to the next tile and are computed but never written.
// PackGQA (interval masks, argument pack_log2 = lp > 0; FlashAttention-3 packs every varlen call): a tile's BM
// rows are BM >> lp positions x the 1 << lp query heads of one K/V group that share its K/V tiles (row r:
// position first + (r >> lp), head h + (r & ((1 << lp) - 1)); the q tensor map's box is (64, 1 << lp,
// BM >> lp) of (D, H, S), which lands in shared memory in that row order). A short document's last tile
// then wastes at most BM >> lp positions' rows, not BM; each thread's two accumulator rows are 8 >> lp
// positions of one head apart.
// The epilogue merges the block result into the caller's (o, lse) exactly like the sm80 kernel; the old o
// rows are prefetched to L2 two key tiles before it. At the first pair of a query shard's rows (argument
// `first`) the running (o, lse) are not read; at the last (`out`) the final output goes to `out` in the
// input's 16-bit type and o is not written: one pair alone (one GPU) never touches a float32 o.
#include "contract.cuh"
#include "sm90_epilogue.cuh"
#include "sm90_pipeline.cuh"

namespace fwd90 {
constexpr int STAGES = 2;
// named barrier ids (0 is __syncthreads): kTurn + c, consumer c's turn to issue its products; kMerge + c,
// consumer c's threads around a locked merge (key splits)
constexpr int kTurn = 1, kMerge = 4;
// CONSUMERS warpgroups of 64 query rows; keys per tile and register split per head dim
template <int D, int CONSUMERS>
struct Cfg {
  static_assert((D == 64 && (CONSUMERS == 2 || CONSUMERS == 3)) || ((D == 128 || D == 256) && CONSUMERS == 2),
                "instantiated shapes");
  static constexpr int BM = 64 * CONSUMERS;
  static constexpr int BN = D == 256 ? 80 : 128;
  static constexpr int THREADS = 128 * (1 + CONSUMERS);
  // setmaxnreg moves registers within the CTA's launch allocation (the per-thread count ptxas gives a
  // 1-CTA-per-SM kernel, a multiple of 8, times THREADS): asking for more than it holds hangs the CTA
  static constexpr int PRODUCER_REGS = CONSUMERS == 3 ? 32 : D == 256 ? 24 : 40,
                       CONSUMER_REGS = CONSUMERS == 3 ? 160 : D == 256 ? 240 : 232;
  // ping-pong between the consumers (FlashAttention-3's warp scheduler barriers): consumer c issues a step's
  // products only after consumer c - 1 (cyclically) has issued its own, so one warpgroup's products run on
  // the tensor cores while the others do their softmax. D = 256 runs without (as FlashAttention-3 does
  // with intra-warpgroup overlap at that width).
  static constexpr bool PINGPONG = D <= 128;
  // Q buffers: two where the shared memory holds them (D <= 128) and the registers hold two tiles' state
  // (two consumers: three at 160 registers spill with the cross-tile step), so the next tile's Q lands
  // while this tile runs. With two, the host may ask for the cross-tile step (argument cross_tile): the
  // step at a tile's end issues the next tile's first Q K^T with this tile's last P V, and the merge runs
  // while the other consumers' products do. Otherwise the plain order: last P V, merge, then the next
  // tile's first Q K^T.
  static constexpr int QSTAGES = D <= 128 && CONSUMERS == 2 ? 2 : 1;
  static_assert(128 * (PRODUCER_REGS + CONSUMERS * CONSUMER_REGS) <= (65536 / THREADS) / 8 * 8 * THREADS,
                "register split exceeds the launch allocation");
};

// shared memory, byte offsets from a 1024-aligned base: Q stages | K stages | V stages | barriers | slots
constexpr int kSlotInts = 9;
template <int D, int CONSUMERS>
struct Smem {
  static constexpr int BM = Cfg<D, CONSUMERS>::BM, BN = Cfg<D, CONSUMERS>::BN, QSTAGES = Cfg<D, CONSUMERS>::QSTAGES;
  static constexpr u32 kTile = BN * D * 2;  // one K or V tile
  static constexpr u32 kQTile = BM * D * 2;
  static constexpr u32 kQ = 0;
  static constexpr u32 kK = kQ + QSTAGES * kQTile;
  static constexpr u32 kV = kK + STAGES * kTile;
  // per Q stage q_full, q_empty, then per K/V stage k_full, v_full, k_empty, v_empty
  static constexpr u32 kBar = kV + STAGES * kTile;
  // per Q stage, its tile: the index, then the Tile's fields (kSlotInts ints)
  static constexpr u32 kSlot = kBar + 8 * (2 * QSTAGES + 4 * STAGES);
  static constexpr u32 kBytes = kSlot + 4 * kSlotInts * QSTAGES + 1024;  // + alignment slack
  __device__ static u32 q_full(u32 base, int q) { return base + kBar + 16 * q; }
  __device__ static u32 q_empty(u32 base, int q) { return q_full(base, q) + 8; }
  __device__ static u32 k_full(u32 base, int s) { return base + kBar + 8 * (2 * QSTAGES + 4 * s); }
  __device__ static u32 v_full(u32 base, int s) { return k_full(base, s) + 8; }
  __device__ static u32 k_empty(u32 base, int s) { return k_full(base, s) + 16; }
  __device__ static u32 v_empty(u32 base, int s) { return k_full(base, s) + 24; }
};

// One tile of the schedule: query rows [m0, m_end) of (batch b, query head h; PackGQA: positions [m0, m_end)
// of query heads h .. h + (1 << lp) - 1), ntiles key tiles from key k0
// (ntiles <= 0: nothing visible, the tile is skipped); with key splits, part `split` of the key tiles of
// query tile `id`.
struct Tile {
  int m0, m_end, h, b, k0, ntiles, id, split;
};
static_assert(sizeof(Tile) == 4 * (kSlotInts - 1), "a Q stage's slot holds the index and a Tile's fields");

// The tile order of one launch (the schedule above): a CTA's first tile index is blockIdx.x, each next one
// comes from the global counter; an index >= count() is the end mark. The counter is two ints, 0 at launch
// and 0 again when the last CTA retires. Key splits (nsplit > 1, the host's choice when the query tiles
// leave SMs idle): each query tile's key tiles are cut into nsplit parts of equal count, the parts of one
// query tile next to each other in the order; each part merges its result into (o, lse) on its own.
template <int BM, int BN, bool CAUSAL, bool IV>
struct TileScheduler {
  int nmb, Hq, BH, hchunk, nsplit, Sq, Sk;  // Hq, BH, hchunk: in packs of 1 << lp query heads
  int lp;
  const int *order, *mlo, *mhi;
  i64 off, kofs;
  int* counter;

  __device__ __forceinline__ int count() const { return nmb * BH * nsplit; }
  __device__ __forceinline__ int first() const { return blockIdx.x; }
  __device__ __forceinline__ int next() const { return gridDim.x + atomicAdd(counter, 1); }
  // the first index from idx on whose tile has a visible key tile (its tile in *t), or an end mark
  __device__ __forceinline__ int first_visible(int idx, Tile* t) const {
    while (idx < count() && (*t = tile(idx)).ntiles <= 0) idx = next();
    return idx;
  }
  // a CTA that drew the end mark counts itself out; the last one zeroes the counter for the next launch
  // (every other CTA has drawn its last index before it counted itself out), so the host needs no memset
  __device__ __forceinline__ void retire() const {
    __threadfence();
    if (atomicAdd(counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
      atomicExch(counter, 0);
      atomicExch(counter + 1, 0);
    }
  }
  __device__ __forceinline__ Tile tile(int split_idx) const {
    const int idx = split_idx / nsplit;
    const int chunk = idx / (hchunk * nmb), in_chunk = idx - chunk * hchunk * nmb;
    const int heads = min(hchunk, BH - chunk * hchunk);  // the last chunk may hold fewer
    const int rank = in_chunk / heads, bh = chunk * hchunk + in_chunk % heads;
    Tile t;
    if (IV) {
      t.m0 = order[2 * rank];
      t.m_end = order[2 * rank + 1];
    } else {
      t.m0 = (CAUSAL ? nmb - 1 - rank : rank) * BM;
      t.m_end = min(t.m0 + BM, Sq);
    }
    t.b = bh / Hq;
    t.h = (bh - t.b * Hq) << lp;
    int n_begin, n_end;
    tile_keys<CAUSAL, IV>(t.m0, t.m_end - t.m0, Sq, Sk, off, mlo, mhi, kofs, &n_begin, &n_end);
    t.k0 = n_begin;  // 0 unless IV
    t.ntiles = n_end > n_begin ? (n_end - n_begin + BN - 1) / BN : 0;
    t.id = idx;
    t.split = split_idx - idx * nsplit;
    if (nsplit > 1) {
      const int part = (t.ntiles + nsplit - 1) / nsplit;
      t.k0 += t.split * part * BN;
      t.ntiles = min(part, t.ntiles - t.split * part);
    }
    return t;
  }
};
}  // namespace fwd90

// S (this warpgroup's 64 query rows x BN keys) = Q rows . K tile, over D
template <int D, int BM, int BN, bool BF16>
__device__ __forceinline__ void qk_issue(float* s, u32 q_lo, u32 k_lo) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_ss<BN, BF16, 0, 0>(s, desc_at(q_lo, (kk / 4) * BM * 128 + (kk % 4) * 32),
                             desc_at(k_lo, (kk / 4) * BN * 128 + (kk % 4) * 32), kk > 0);
}

// O (64 x D) += P (registers, 64 x BN) . V tile (read MN-major), in products of at most 128 columns (two
// 64-column blocks of V each; accumulator registers 64 per 128 columns, in column order)
template <int D, int BN, bool BF16>
__device__ __forceinline__ void pv_issue(float* o, const u32 (*p)[4], u32 v_lo) {
  constexpr int PN = D < 128 ? D : 128;
#pragma unroll
  for (int n0 = 0; n0 < D; n0 += PN)
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      wgmma_rs<PN, BF16, 1>(o + n0 / 2, p[kk], desc_at(v_lo, (n0 / 64) * BN * 128 + kk * 16 * 128), 1);
}

// Mask (if needed), then turn the scores s of one tile into probabilities exp2(s * mul - m_new) in place;
// returns alpha = exp2(m_old - m_new) per row half and adds the tile's row sums into l.
template <int BN, bool CAUSAL, bool IV>
__device__ __forceinline__ void softmax_tile(float* s, float* m, float* l, float* alpha, float sl2, bool need_mask,
                                             int col0, int row0, int Sk, i64 off, const int* klo, const int* khi) {
  float mul = sl2;
  if (!(sl2 > 0.f)) {  // a non-positive scale is applied up front: the max must be taken of the scaled scores
    mul = 1.f;
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s[i] *= sl2;
  }
  if (need_mask) {
    // element (j, e): column col0 + 8j + (e & 1), row row0 + 8 (e >> 1); hidden past Sk, when col - row > off
    // (causal) or col outside [klo, khi) of its row (IV: khi <= Sk, so that bound covers Sk)
    const int klim = Sk - col0;
    const i64 dlim = off - static_cast<i64>(col0) + row0;
    const int dl = static_cast<int>(max(static_cast<i64>(-4 * BN), min(static_cast<i64>(4 * BN), dlim)));
    const int rlo[2] = {klo[0] - col0, klo[1] - col0}, rhi[2] = {khi[0] - col0, khi[1] - col0};
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = 8 * j + (e & 1);
        if ((!IV && c >= klim) || (CAUSAL && c - 8 * (e >> 1) > dl) || (IV && (c < rlo[e >> 1] || c >= rhi[e >> 1])))
          s[4 * j + e] = -BH_INF;
      }
  }
  float mx[2] = {-BH_INF, -BH_INF};
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    mx[0] = fmaxf(mx[0], fmaxf(s[4 * j], s[4 * j + 1]));
    mx[1] = fmaxf(mx[1], fmaxf(s[4 * j + 2], s[4 * j + 3]));
  }
  float mu[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float m_new = fmaxf(m[r], mx[r] * mul);  // running max in scaled base-2 units
    mu[r] = (m_new == -BH_INF) ? 0.f : m_new;
    alpha[r] = fast_exp2(m[r] - mu[r]);
    m[r] = m_new;
  }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float p = fast_exp2(fmaf(s[4 * j + e], mul, -mu[e >> 1]));
      s[4 * j + e] = p;
      sum[e >> 1] += p;
    }
  l[0] = l[0] * alpha[0] + sum[0];
  l[1] = l[1] * alpha[1] + sum[1];
}

// probabilities (accumulator layout) -> A fragments of the P V product, one per 16 keys
template <int BN, bool BF16>
__device__ __forceinline__ void pack_p(const float* s, u32 (*p)[4]) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    p[kk][0] = pack2<BF16>(s[8 * kk + 0], s[8 * kk + 1]);
    p[kk][1] = pack2<BF16>(s[8 * kk + 2], s[8 * kk + 3]);
    p[kk][2] = pack2<BF16>(s[8 * kk + 4], s[8 * kk + 5]);
    p[kk][3] = pack2<BF16>(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

// this thread's o rows (row0, row0 + step: D floats each, from column 0) and the warp's lse entries into L2,
// ahead of the merge that reads them
template <int D>
__device__ __forceinline__ void prefetch_rows(const float* o_rows, i64 oss, const float* lse_rows, i64 lss, int row0,
                                              int step, int Sq, int lane) {
  if (lane % 4 != 0) return;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + step * r;
    if (row >= Sq) continue;
#pragma unroll
    for (int c = 0; c < D; c += 32) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(o_rows + row * oss + c));
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(lse_rows + row * lss));
  }
}

// What a consumer warpgroup needs of its tile: the tile, its Q buffer, its rows and (IV) their key ranges.
// The ranges come in two steps: the constructor loads the rows' global bounds, resolve() makes them local
// keys. A tile's first products are issued in between, so the loads' latency passes under them (made at
// once, the compiler put the dependent arithmetic, and its wait, before the products).
template <int BM, int BN, bool IV>
struct ConsumerTile {
  fwd90::Tile tl;
  int qs;     // the Q stage holding the tile's queries
  u32 q_lo;   // descriptor low word of this warpgroup's 64 rows of Q
  int mw0;    // first query row (position) of this warpgroup
  int row0;   // this thread's rows: row0, row0 + step (PackGQA: positions of one head)
  int step;
  // IV: the key range [klo, khi) (local, within [0, Sk]) of this thread's rows, and of the warpgroup's first
  // and last rows (global bounds until resolve())
  int klo[2], khi[2], wg_lo_last, wg_hi_first;

  __device__ __forceinline__ ConsumerTile(const fwd90::Tile& t, int q_stage, u32 q_addr, int cw, int tid, int lp,
                                          int Sq, int Sk, const int* mlo, const int* mhi)
      : tl(t), qs(q_stage), q_lo(desc_lo(q_addr + cw * 64 * 128, 16)) {
    mw0 = tl.m0 + ((64 * cw) >> lp);
    row0 = tl.m0 + ((64 * cw + 16 * (tid / 32) + (tid % 32) / 4) >> lp);
    step = 8 >> lp;
    klo[0] = klo[1] = 0;
    khi[0] = khi[1] = Sk;
    wg_lo_last = 0;
    wg_hi_first = Sk;
    if (IV) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = min(row0 + step * r, Sq - 1);
        klo[r] = mlo[row];
        khi[r] = mhi[row];
      }
      wg_lo_last = mlo[min(tl.m0 + ((64 * cw + 63) >> lp), tl.m_end - 1)];  // rows from m_end on are never written
      wg_hi_first = mhi[min(mw0, Sq - 1)];
    }
  }
  __device__ __forceinline__ void resolve(i64 kofs, int Sk) {
    if (!IV) return;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      klo[r] = local_key(klo[r], kofs, Sk);
      khi[r] = min(Sk, local_key(khi[r], kofs, Sk));  // keys past Sk need no mask of their own
    }
    wg_lo_last = local_key(wg_lo_last, kofs, Sk);
    wg_hi_first = local_key(wg_hi_first, kofs, Sk);
  }
  template <bool CAUSAL>
  __device__ __forceinline__ bool needs_mask(int t, int Sk, i64 off) const {
    const int n0 = tl.k0 + t * BN;
    return (n0 + BN > Sk) || (CAUSAL && static_cast<i64>(n0 + BN - 1) > static_cast<i64>(mw0) + off) ||
           (IV && !(wg_lo_last <= n0 && wg_hi_first >= n0 + BN));
  }
  __device__ __forceinline__ int col0(int t, int lane) const { return tl.k0 + t * BN + 2 * (lane % 4); }
};

template <int D, int CONSUMERS, bool BF16, bool CAUSAL, bool IV>
__device__ __forceinline__ void attn_fwd_sm90(const Fwd90Params args) {
  using namespace fwd90;
  using C = Cfg<D, CONSUMERS>;
  using L = Smem<D, CONSUMERS>;
  constexpr int BM = C::BM, BN = C::BN, QSTAGES = C::QSTAGES;
  extern __shared__ unsigned char smem_raw[];
  const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  volatile int* const slot = reinterpret_cast<volatile int*>(smem_raw + (base - smem_u32(smem_raw)) + L::kSlot);
  const int lp = IV ? args.pack_log2 : 0;  // PackGQA: 1 << lp query heads of a K/V group in a tile's rows
  const TileScheduler<BM, BN, CAUSAL, IV> sched{args.nq, args.Hq >> lp, (args.B * args.Hq) >> lp, args.hchunk,
                                                args.nsplit, args.Sq, args.Sk, lp, args.order, args.mlo, args.mhi,
                                                args.off, args.kofs, args.next_tile};

  if (threadIdx.x == 0) {
    for (int q = 0; q < QSTAGES; ++q) {
      mbar_init(L::q_full(base, q), 1);
      mbar_init(L::q_empty(base, q), 128 * CONSUMERS);  // every consumer thread has read the slot and issued its Q K^T
    }
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(L::k_full(base, s), 1);
      mbar_init(L::v_full(base, s), 1);
      mbar_init(L::k_empty(base, s), CONSUMERS);
      mbar_init(L::v_empty(base, s), CONSUMERS);
    }
    mbar_fence_init();
  }
  __syncthreads();

  const int wg = warpgroup_index();
  if (wg == 0) {  // ---------------------------------------------------------------- producer
    warpgroup_reg_dealloc<C::PRODUCER_REGS>();
    if (threadIdx.x == 0) {
      const unsigned char *tq = args.tmaps, *tk = args.tmaps + 128, *tv = args.tmaps + 256;
      tensormap_acquire(tq);
      tensormap_acquire(tk);
      tensormap_acquire(tv);
      PipeState<QSTAGES> q_pipe;
      PipeState<STAGES> pipe;
      Tile tl;
      int idx = sched.first_visible(sched.first(), &tl);
      for (;;) {
        const int qs = q_pipe.stage;
        mbar_wait(L::q_empty(base, qs), q_pipe.phase ^ 1);
        volatile int* const s = slot + kSlotInts * qs;
        s[0] = idx;
        if (idx >= sched.count()) {  // no tile left: the consumers read the end mark and stop
          mbar_arrive(L::q_full(base, qs));
          sched.retire();
          break;
        }
        // the tile itself, so the consumers need not make it again (interval masks: global loads on their path)
        s[1] = tl.m0, s[2] = tl.m_end, s[3] = tl.h, s[4] = tl.b, s[5] = tl.k0, s[6] = tl.ntiles, s[7] = tl.id,
        s[8] = tl.split;
        const int hk = tl.h / args.group;
        mbar_arrive_expect_tx(L::q_full(base, qs), BM * D * 2);
#pragma unroll
        for (int db = 0; db < D / 64; ++db)
          tma_load_4d(base + L::kQ + qs * L::kQTile + db * BM * 128, tq, L::q_full(base, qs), db * 64, tl.h,
                      tl.m0, tl.b);
        q_pipe.advance();
        int nidx = sched.next();  // the next tile, drawn while this one loads
        Tile ntl;
        for (int t = 0; t < tl.ntiles; ++t, pipe.advance()) {
          const int s = pipe.stage, n0 = tl.k0 + t * BN;
          const u32 empty_parity = pipe.phase ^ 1;
          const u32 k_dst = base + L::kK + s * L::kTile, v_dst = base + L::kV + s * L::kTile;
          mbar_wait(L::k_empty(base, s), empty_parity);
          mbar_arrive_expect_tx(L::k_full(base, s), L::kTile);
#pragma unroll
          for (int db = 0; db < D / 64; ++db) tma_load_4d(k_dst + db * BN * 128, tk, L::k_full(base, s), db * 64, hk, n0, tl.b);
          mbar_wait(L::v_empty(base, s), empty_parity);
          mbar_arrive_expect_tx(L::v_full(base, s), L::kTile);
#pragma unroll
          for (int db = 0; db < D / 64; ++db) tma_load_4d(v_dst + db * BN * 128, tv, L::v_full(base, s), db * 64, hk, n0, tl.b);
          // the next tile: under interval masks it takes dependent global loads (order, then the rows' bounds),
          // so they go out after this tile's first K / V, while the ring's next stage is still being read;
          // otherwise after its last (the counter's value is there by then, and nothing delays a K / V)
          if (IV && t == 0) nidx = sched.first_visible(nidx, &ntl);
        }
        if (!IV) nidx = sched.first_visible(nidx, &ntl);
        idx = nidx;
        tl = ntl;
      }
    }
    return;
  }

  // ------------------------------------------------------------------------------------ consumers
  warpgroup_reg_alloc<C::CONSUMER_REGS>();
  const int cw = wg - 1, tid = threadIdx.x % 128, lane = tid % 32;
  const bool leader = tid == 0;  // arrives on the "empty" barriers for its warpgroup
  using CT = ConsumerTile<BM, BN, IV>;
  // ping-pong: consumer cw waits for its turn (barrier kTurn + cw, 256 threads: its own 128 and the 128 of
  // the consumer before it that arrive) and passes the turn on; consumer 0 takes the first turn. Every
  // consumer takes the same turns (one per step that issues two products), so the turns stay in step.
  auto take_turn = [&] {
    if (C::PINGPONG) named_barrier_sync(kTurn + cw, 256);
  };
  auto pass_turn = [&] {
    if (C::PINGPONG) named_barrier_arrive(kTurn + (cw + 1) % CONSUMERS, 256);
  };
  if (C::PINGPONG && cw == 0) named_barrier_arrive(kTurn, 256);
  PipeState<QSTAGES> q_pipe;
  PipeState<STAGES> k_pipe, v_pipe;  // the K tile of step t, the V tile of step t - 1
  // the tile in the next Q stage (its index, or the end mark), waited for
  auto next_index = [&] {
    mbar_wait(L::q_full(base, q_pipe.stage), q_pipe.phase);
    return slot[kSlotInts * q_pipe.stage];
  };
  auto consumer_tile = [&] {  // the producer's Tile of the next Q stage
    const volatile int* const s = slot + kSlotInts * q_pipe.stage;
    const Tile tl{s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8]};
    const CT ct(tl, q_pipe.stage, base + L::kQ + q_pipe.stage * L::kQTile, cw, tid, lp, args.Sq, args.Sk, args.mlo,
                args.mhi);
    q_pipe.advance();
    return ct;
  };
  // this thread's query head in a tile: the tile's first, plus (PackGQA) its rows' place in the pack
  const int hoff = (64 * cw + 16 * (tid / 32) + lane / 4) & ((1 << lp) - 1);
  auto o_rows_of = [&](const Tile& tl) { return args.o + tl.b * args.osb + (tl.h + hoff) * args.osh; };
  auto lse_rows_of = [&](const Tile& tl) { return args.lse + tl.b * args.lsb + (tl.h + hoff) * args.lsh; };
  // where the epilogue writes a tile's rows (out: this thread's first column as well)
  auto rows_of = [&](const Tile& tl) {
    u16* const out_rows =
        args.out == nullptr ? nullptr : args.out + tl.b * args.tsb + (tl.h + hoff) * args.tsh + 2 * (lane % 4);
    return FwdRows{o_rows_of(tl) + 2 * (lane % 4), args.oss, out_rows, args.tss,
                   lse_rows_of(tl), args.lss, args.first != 0};
  };

  float acc[D / 2];
  float m[2], l[2], alpha[2];
  float s[BN / 2];
  u32 p[BN / 16][4];
  // the epilogue: GAO merge of acc into the running (o, lse) or the final output (merge_rows). With key splits
  // (never with `first` or `out`: the host's rule), the parts of a query tile merge the same rows: one warpgroup
  // at a time holds its rows' lock.
  auto merge = [&](const CT& ct, const float* mm, float* ll) {
    int* const lock = args.locks + ct.tl.id * CONSUMERS + cw;
    if (args.nsplit > 1) {
      if (leader)
        while (atomicCAS(lock, 0, 1) != 0) __nanosleep(100);
      __threadfence();
      named_barrier_sync(kMerge + cw, 128);
    }
    if (args.nsplit > 1)
      merge_rows<D, true, BF16>(rows_of(ct.tl), acc, mm, ll, ct.row0, ct.step, ct.tl.m_end);
    else if (args.first && args.out != nullptr)
      store_rows<D, BF16>(rows_of(ct.tl), acc, mm, ll, ct.row0, ct.step, ct.tl.m_end);
    else
      merge_rows<D, false, BF16>(rows_of(ct.tl), acc, mm, ll, ct.row0, ct.step, ct.tl.m_end);
    if (args.nsplit > 1) {
      __threadfence();
      named_barrier_sync(kMerge + cw, 128);
      if (leader) atomicExch(lock, 0);
    }
  };
  // a tile's first step: S_0 = Q K_0^T alone, then its softmax (nothing to rescale yet)
  auto first_step = [&](CT& ct) {
    m[0] = m[1] = -BH_INF;
    l[0] = l[1] = 0.f;
    mbar_wait(L::k_full(base, k_pipe.stage), k_pipe.phase);
    wgmma_fence();
    qk_issue<D, BM, BN, BF16>(s, ct.q_lo, desc_lo(base + L::kK + k_pipe.stage * L::kTile, 16));
    wgmma_commit();
    ct.resolve(args.kofs, args.Sk);
    wgmma_wait<0>();
    fence_operands<BN / 2>(s);
    if (leader) mbar_arrive(L::k_empty(base, k_pipe.stage));
    if (ct.tl.ntiles == 1) mbar_arrive(L::q_empty(base, ct.qs));  // Q is read: the producer may refill it
    k_pipe.advance();
    softmax_tile<BN, CAUSAL, IV>(s, m, l, alpha, args.sl2, ct.template needs_mask<CAUSAL>(0, args.Sk, args.off),
                                 ct.col0(0, lane), ct.row0, args.Sk, args.off, ct.klo, ct.khi);
    pack_p<BN, BF16>(s, p);
  };
  auto zero_acc = [&] {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc[i] = 0.f;
  };
  auto prefetch = [&](const CT& ct) {  // the running (o, lse), unless the pair is the first to write them
    if (!args.first)
      prefetch_rows<D>(o_rows_of(ct.tl), args.oss, lse_rows_of(ct.tl), args.lss, ct.row0, ct.step, ct.tl.m_end, lane);
  };

  int idx = next_index();
  if (idx >= sched.count()) return;
  CT cur = consumer_tile();
  zero_acc();
  if (cur.tl.ntiles <= 2) prefetch(cur);
  first_step(cur);
  for (;;) {
    const int ntiles = cur.tl.ntiles;
    for (int t = 1; t < ntiles; ++t, k_pipe.advance(), v_pipe.advance()) {
      const int st = k_pipe.stage, sp = v_pipe.stage;
      if (t + 2 == ntiles) prefetch(cur);
      mbar_wait(L::k_full(base, st), k_pipe.phase);
      mbar_wait(L::v_full(base, sp), v_pipe.phase);
      take_turn();
      wgmma_fence();
      qk_issue<D, BM, BN, BF16>(s, cur.q_lo, desc_lo(base + L::kK + st * L::kTile, 16));
      wgmma_commit();
      pv_issue<D, BN, BF16>(acc, p, desc_lo(base + L::kV + sp * L::kTile, BN * 128));
      wgmma_commit();
      pass_turn();
      wgmma_wait<1>();  // S_t is ready; P_{t-1} V_{t-1} may still run
      fence_operands<BN / 2>(s);
      if (leader) mbar_arrive(L::k_empty(base, st));
      if (t + 1 == ntiles) mbar_arrive(L::q_empty(base, cur.qs));
      softmax_tile<BN, CAUSAL, IV>(s, m, l, alpha, args.sl2, cur.template needs_mask<CAUSAL>(t, args.Sk, args.off),
                                   cur.col0(t, lane), cur.row0, args.Sk, args.off, cur.klo, cur.khi);
      wgmma_wait<0>();
      fence_operands<D / 2>(acc);
      if (leader) mbar_arrive(L::v_empty(base, sp));
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        acc[4 * j + 0] *= alpha[0];
        acc[4 * j + 1] *= alpha[0];
        acc[4 * j + 2] *= alpha[1];
        acc[4 * j + 3] *= alpha[1];
      }
      pack_p<BN, BF16>(s, p);
    }
    // ---- the tile's end: its last P V, then the epilogue
    const int sp = v_pipe.stage;
    const bool cross = QSTAGES == 2 && args.cross_tile != 0;
    const int nidx = cross ? next_index() : 0;
    if (cross && nidx < sched.count()) {
      // the next tile's S_0 = Q K_0^T with this tile's last P V in one turn; the next tile's softmax runs
      // while the P V does, and this tile's merge while the other consumers' products do
      CT nxt = consumer_tile();
      const int st = k_pipe.stage;
      if (nxt.tl.ntiles <= 2) prefetch(nxt);
      mbar_wait(L::k_full(base, st), k_pipe.phase);
      mbar_wait(L::v_full(base, sp), v_pipe.phase);
      take_turn();
      wgmma_fence();
      qk_issue<D, BM, BN, BF16>(s, nxt.q_lo, desc_lo(base + L::kK + st * L::kTile, 16));
      wgmma_commit();
      pv_issue<D, BN, BF16>(acc, p, desc_lo(base + L::kV + sp * L::kTile, BN * 128));
      wgmma_commit();
      pass_turn();
      nxt.resolve(args.kofs, args.Sk);
      wgmma_wait<1>();
      fence_operands<BN / 2>(s);
      if (leader) mbar_arrive(L::k_empty(base, st));
      if (nxt.tl.ntiles == 1) mbar_arrive(L::q_empty(base, nxt.qs));
      k_pipe.advance();
      const float m_last[2] = {m[0], m[1]};
      float l_last[2] = {l[0], l[1]};
      m[0] = m[1] = -BH_INF;
      l[0] = l[1] = 0.f;
      softmax_tile<BN, CAUSAL, IV>(s, m, l, alpha, args.sl2, nxt.template needs_mask<CAUSAL>(0, args.Sk, args.off),
                                   nxt.col0(0, lane), nxt.row0, args.Sk, args.off, nxt.klo, nxt.khi);
      wgmma_wait<0>();
      fence_operands<D / 2>(acc);
      if (leader) mbar_arrive(L::v_empty(base, sp));
      v_pipe.advance();
      pack_p<BN, BF16>(s, p);
      merge(cur, m_last, l_last);
      zero_acc();
      cur = nxt;
      continue;
    }
    mbar_wait(L::v_full(base, sp), v_pipe.phase);
    wgmma_fence();
    pv_issue<D, BN, BF16>(acc, p, desc_lo(base + L::kV + sp * L::kTile, BN * 128));
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands<D / 2>(acc);
    if (leader) mbar_arrive(L::v_empty(base, sp));
    v_pipe.advance();
    merge(cur, m, l);
    if (cross) break;  // the end mark was read above
    idx = next_index();
    if (idx >= sched.count()) break;
    cur = consumer_tile();
    zero_acc();
    if (cur.tl.ntiles <= 2) prefetch(cur);
    first_step(cur);
  }
}

static_assert(fwd90::Smem<256, 2>::kBytes <= 227 * 1024 && fwd90::Smem<128, 2>::kBytes <= 227 * 1024 &&
                  fwd90::Smem<64, 3>::kBytes <= 227 * 1024,
              "forward shared memory");

#define BH_FWD90_NAME(DT, MASK, D, C) attn_fwd_sm90_##DT##_d##D##_m##C##_##MASK
#define BH_FWD90_KERNEL(DT, MASK, D, C)                                                                            \
  extern "C" __global__ void __launch_bounds__(fwd90::Cfg<D, C>::THREADS, 1)                                       \
      BH_FWD90_NAME(DT, MASK, D, C)(const __grid_constant__ Fwd90Params args) {                                    \
    attn_fwd_sm90<D, C, BH_IS_BF16(DT), BH_IS_CAUSAL(MASK), BH_IS_INTERVAL(MASK)>(args);                           \
  }
#define BH_FWD90_ROW(DT, MASK, D, C)                                                                         \
  {BH_STR(BH_FWD90_NAME(DT, MASK, D, C)), BH_DTYPE_##DT, D, BH_MASK_##MASK, fwd90::Cfg<D, C>::BM,          \
   fwd90::Cfg<D, C>::BN, fwd90::Cfg<D, C>::THREADS, static_cast<int>(fwd90::Smem<D, C>::kBytes)},
#define BH_FWD90_KERNELS(D, C) BH_EACH_DTYPE_AND_MASK(BH_FWD90_KERNEL, D, C)
#define BH_FWD90_ROWS(D, C) BH_EACH_DTYPE_AND_MASK(BH_FWD90_ROW, D, C)

// The instances, listed once: each shape X(D, consumer warpgroups) in bf16 and f16 with the full, causal and
// interval masks, named attn_fwd_sm90_<dtype>_d<D>_m<consumer warpgroups>_<mask>; the kernel table
// attn_fwd_sm90_kernels lists them with their geometry (the host picks among a head dim's tile heights).
// The arguments (Fwd90Params, contract.cuh): tmaps: the q, k, v tensor maps (128 bytes each, global memory);
// grid: one CTA per SM at most;
// hchunk, order, nq: the schedule (order: interval only, nq (first, end) row pairs, the query tiles with the most
// key tiles first; nq: the query tiles, ceil(Sq / BM), or under interval masks the order's pairs); nsplit: the parts of
// each query tile's key range (1: none); cross_tile: 1 for the cross-tile step (shapes with two Q buffers);
// mlo, mhi, kofs: the interval bounds (null for full and causal);
// next_tile: the tile counter and the count of CTAs done, two ints that are 0 at launch and 0 again when the
// kernel ends; locks (nsplit > 1): (query tiles) x (consumer warpgroups) ints, 0 at launch and at the end;
// first (the block contract's `first`): the running (o, lse) hold nothing yet and are written, never read (every
// query tile must see a key tile: the host fills the rows of tiles that see none); out (the contract's `out`),
// null or the final output in the kernel's dtype with strides tsb, tss, tsh (elements), written instead of o.
// Neither with key splits.
#define BH_FWD90_SHAPES(X) X(64, 2) X(64, 3) X(128, 2) X(256, 2)
BH_INSTANCES(BH_FWD90_SHAPES, BH_FWD90_KERNELS)
BH_KERNEL_TABLE(attn_fwd_sm90, BH_TABLE_ROWS(BH_FWD90_SHAPES, BH_FWD90_ROWS))
