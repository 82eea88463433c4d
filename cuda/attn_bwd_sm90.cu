// Attention backward over one (query block, key block) pair for Hopper (sm_90a), added into float32
// (dq, dk, dv): the same contract as attn_bwd.cu (docs/KERNELS.md).
//
// A CTA owns BN = 128 keys of one (batch, kv head) and walks every query tile (BM = 64 rows) of the
// query heads it was given (the whole GQA group, or a slice when the grid needs more CTAs). Warpgroups:
// - the producer (warpgroup 0) loads K and V once by TMA, then streams Q and dO tiles (TMA) and the
//   tiles' lse and delta (plain loads by 64 of its threads) through a STAGES-deep mbarrier pipeline;
// - two consumers, 64 keys each, so the key side is the "M" of every product:
//     S^T = K Q^T and dP^T = V dO^T          (wgmma, both operands in shared memory)
//     P^T = exp2(S^T * scale*log2e - lse*log2e), dS^T = P^T (dP^T - delta)   (registers)
//     dV += P^T dO and dK += dS^T Q           (wgmma, P^T / dS^T from registers; dK, dV stay in
//                                              registers for the whole walk)
//     dQ = dS K                               (wgmma, dS^T from shared memory read M-major), staged in
//                                              shared memory and added to global dq one row per
//                                              bulk reduction (cp.reduce.async.bulk .add.f32) while
//                                              the next step's S^T and dP^T run.
//   At D = 128 each consumer forms dQ for one half of the head dim over all 128 keys (the two
//   consumers meet at a named barrier once per tile); at D = 64 each forms a partial dQ over its own
//   64 keys, so no barrier is needed.
// Rows with lse = -inf (nothing visible in the forward) and query rows past the end get P = 0; keys
// past the end are masked; causal masks are on global positions, and query tiles hidden from every key
// of the CTA are skipped.
#include "sm90_primitives.cuh"

namespace bwd90 {
constexpr int BN = 128, BM = 64, STAGES = 2, CONSUMERS = 2;
constexpr int THREADS = 128 * (1 + CONSUMERS);
constexpr int DQ_PITCH = 64 + 4;  // floats per staged dQ row: 16-byte aligned rows, conflict-free float2 writes
// Named barrier IDs, each defined once (0 is __syncthreads). A hardware ID shared by two barriers with
// different members can release with a mix of both, so no ID appears twice.
enum Barrier : int {
  kDsBoth = 1,      // D = 128: both consumers' halves of dS^T are in shared memory (256 threads)
  kDsOwn = 2,       // D = 64: consumer cw's dS^T is in shared memory (kDsOwn + cw, 128 threads)
  kDqStaging = 4,   // consumer cw's dQ staging buffer is free / filled (kDqStaging + cw, 128 threads)
};
static_assert(kDsOwn + CONSUMERS <= kDqStaging, "named barrier IDs overlap");

// shared memory, byte offsets from a 1024-aligned base
template <int D>
struct Smem {
  static constexpr u32 kK = 0;                              // [D/64][BN][64]
  static constexpr u32 kV = kK + BN * D * 2;                // [D/64][BN][64]
  static constexpr u32 kQ = kV + BN * D * 2;                // STAGES x [D/64][BM][64]
  static constexpr u32 kDO = kQ + STAGES * BM * D * 2;      // STAGES x [D/64][BM][64]
  static constexpr u32 kDS = kDO + STAGES * BM * D * 2;     // 2 x dS^T [BN][BM]
  static constexpr u32 kLse = kDS + 2 * BN * BM * 2;        // STAGES x BM floats: lse * log2(e)
  static constexpr u32 kDelta = kLse + STAGES * BM * 4;     // STAGES x BM floats
  static constexpr u32 kDQ = kDelta + STAGES * BM * 4;      // per consumer: 64 rows x DQ_PITCH floats of dQ
  static constexpr u32 kBar = kDQ + CONSUMERS * BM * DQ_PITCH * 4;  // kv_full, then per stage full, empty
  static constexpr u32 kBytes = kBar + 8 * (1 + 2 * STAGES) + 1024;  // + alignment slack
  static constexpr u32 kQTile = BM * D * 2;
  __device__ static u32 kv_full(u32 base) { return base + kBar; }
  __device__ static u32 full(u32 base, int s) { return base + kBar + 8 * (1 + 2 * s); }
  __device__ static u32 empty(u32 base, int s) { return full(base, s) + 8; }
};
}  // namespace bwd90

// dQ half / partial formed by consumer cw: A = dS (M-major view of dS^T), B = K rows (MN-major)
template <int D, bool BF16>
__device__ __forceinline__ void dq_issue(float* acc, u32 ds_tile, u32 k_tile, int cw) {
  using namespace bwd90;
  if (D == 128) {  // head-dim half cw, over all BN keys
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      wgmma_ss_n64<BF16, 1, 1>(acc, smem_desc(ds_tile + kk * 16 * 128, 16, 1024),
                               smem_desc(k_tile + cw * BN * 128 + kk * 16 * 128, 16, 1024), kk > 0);
  } else {  // all 64 columns, over this consumer's 64 keys
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_ss_n64<BF16, 1, 1>(acc, smem_desc(ds_tile + (cw * 64 + kk * 16) * 128, 16, 1024),
                               smem_desc(k_tile + (cw * 64 + kk * 16) * 128, 16, 1024), kk > 0);
  }
}

// acc (64 rows x N of this warpgroup) += A (registers) * B (MN-major tile of BM rows, 64-column blocks)
template <int D, bool BF16>
__device__ __forceinline__ void rs_issue(float* acc, const u32 (*a)[4], u32 b_tile) {
  using namespace bwd90;
#pragma unroll
  for (int kk = 0; kk < BM / 16; ++kk) {
    const u64 db = smem_desc(b_tile + kk * 16 * 128, BM * 128, 1024);
    if (D == 128)
      wgmma_rs_n128<BF16, 1>(acc, a[kk], db, 1);
    else
      wgmma_rs_n64<BF16, 1>(acc, a[kk], db, 1);
  }
}

// 64 x 64 (this consumer's keys x the tile's queries) = A rows (K or V) . B rows (Q or dO), over D
template <int D, bool BF16>
__device__ __forceinline__ void ss_issue(float* acc, u32 a_rows, u32 b_tile) {
  using namespace bwd90;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_ss_n64<BF16, 0, 0>(acc, smem_desc(a_rows + (kk / 4) * BN * 128 + (kk % 4) * 32, 16, 1024),
                             smem_desc(b_tile + (kk / 4) * BM * 128 + (kk % 4) * 32, 16, 1024), kk > 0);
}

template <int D, bool BF16, bool CAUSAL>
__device__ __forceinline__ void attn_bwd_sm90(const unsigned char* tmaps, const float* lse, const float* delta,
                                              float* dq, float* dk, float* dv, i64 lsb, i64 lsh, i64 lss, i64 dsb,
                                              i64 dsh, i64 dss, i64 qgsb, i64 qgss, i64 qgsh, i64 kgsb, i64 kgss,
                                              i64 kgsh, i64 vgsb, i64 vgss, i64 vgsh, int Sq, int Sk, int Hkv,
                                              int group, int hpb, float scale, float sl2, i64 off, int atomic_kv) {
  using namespace bwd90;
  using L = Smem<D>;
  extern __shared__ unsigned char smem_raw[];
  const u32 base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  float* const s_lse = reinterpret_cast<float*>(smem_raw + (base - smem_u32(smem_raw)) + L::kLse);
  float* const s_delta = reinterpret_cast<float*>(smem_raw + (base - smem_u32(smem_raw)) + L::kDelta);
  float* const s_dq_all = reinterpret_cast<float*>(smem_raw + (base - smem_u32(smem_raw)) + L::kDQ);

  // grid: (key blocks, splits of the GQA group, batch x kv heads)
  const int n0 = blockIdx.x * BN;
  const int b = blockIdx.z / Hkv, hk = blockIdx.z % Hkv;
  const int h_first = hk * group + blockIdx.y * hpb;
  const int ntq = (Sq + BM - 1) / BM;
  int t_lo = 0;
  if (CAUSAL) {  // query tiles in which no row sees key n0 or later are skipped
    const i64 first_q = static_cast<i64>(n0) - off;  // the first query that sees key n0
    t_lo = first_q <= 0 ? 0 : static_cast<int>(min(static_cast<i64>(ntq), first_q / BM));
  }
  const int tiles = ntq - t_lo;
  if (tiles <= 0 || n0 >= Sk) return;  // nothing visible: dq, dk, dv stay as they are
  const int steps = tiles * hpb;        // step n: head h_first + n / tiles, query tile t_lo + n % tiles

  if (threadIdx.x == 0) {
    mbar_init(L::kv_full(base), 1);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(L::full(base, s), 1 + BM);  // the TMA arrival plus one per lse/delta row
      mbar_init(L::empty(base, s), CONSUMERS);
    }
    mbar_fence_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  if (wg == 0) {  // ---------------------------------------------------------------- producer
    warpgroup_reg_dealloc<24>();
    const unsigned char *tq = tmaps, *tk = tmaps + 128, *tv = tmaps + 256, *tdo = tmaps + 384;
    if (tid == 0) {
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
    }
    if (tid < BM) {
      for (int n = 0; n < steps; ++n) {
        const int s = n % STAGES, h = h_first + n / tiles, m0 = (t_lo + n % tiles) * BM;
        mbar_wait(L::empty(base, s), ((n / STAGES) & 1) ^ 1);
        if (tid == 0) {
          mbar_arrive_expect_tx(L::full(base, s), 2 * L::kQTile);
#pragma unroll
          for (int db = 0; db < D / 64; ++db) {
            tma_load_4d(base + L::kQ + s * L::kQTile + db * BM * 128, tq, L::full(base, s), db * 64, h, m0, b);
            tma_load_4d(base + L::kDO + s * L::kQTile + db * BM * 128, tdo, L::full(base, s), db * 64, h, m0, b);
          }
        }
        const int row = m0 + tid;
        float l2 = BH_INF, dl = 0.f;  // rows past the end, and rows that saw nothing, get P = 0
        if (row < Sq) {
          const float x = lse[b * lsb + h * lsh + row * lss];
          if (x > -BH_INF) {
            l2 = x * BH_LOG2E;
            dl = delta[b * dsb + h * dsh + row * dss];
          }
        }
        s_lse[s * BM + tid] = l2;
        s_delta[s * BM + tid] = dl;
        mbar_arrive(L::full(base, s));
      }
    }
    return;
  }

  // ------------------------------------------------------------------------------------ consumers
  warpgroup_reg_alloc<240>();
  const int cw = wg - 1, lane = tid % 32, warp = tid / 32;
  const bool leader = tid == 0;
  const int key_lo = n0 + 64 * cw;                       // first key of this warpgroup
  const int key0 = key_lo + 16 * warp + lane / 4;        // this thread's keys: key0, key0 + 8
  const int qc = 2 * (lane % 4);                         // this thread's first query column in a tile
  const u32 k_rows = base + L::kK + cw * 64 * 128, v_rows = base + L::kV + cw * 64 * 128;
  float* const s_dq = s_dq_all + cw * BM * DQ_PITCH;

  float acc_dk[D / 2], acc_dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;

  // dQ of step n is staged in shared memory at the end of step n and handed to the bulk reductions at the
  // start of step n + 1, after that step's S^T and dP^T are issued, so the tensor cores are busy meanwhile
  const int dq_col = D == 128 ? 64 * cw : 0;
  auto reduce_staged_dq = [&](int n) {  // add the staged dQ rows of step n to dq
    const int h = h_first + n / tiles, m0 = (t_lo + n % tiles) * BM;
    fence_async_shared();
    named_barrier_sync(kDqStaging + cw, 128);
    if (tid < BM && m0 + tid < Sq) {
      bulk_reduce_add_f32(dq + b * qgsb + h * qgsh + static_cast<i64>(m0 + tid) * qgss + dq_col,
                          smem_u32(s_dq + tid * DQ_PITCH), 64 * 4);
      bulk_commit();
    }
  };
  mbar_wait(L::kv_full(base), 0);
  for (int n = 0; n < steps; ++n) {
    const int s = n % STAGES, m0 = (t_lo + n % tiles) * BM;
    const u32 q_tile = base + L::kQ + s * L::kQTile, do_tile = base + L::kDO + s * L::kQTile;
    const u32 ds_tile = base + L::kDS + (n & 1) * BN * BM * 2;
    mbar_wait(L::full(base, s), (n / STAGES) & 1);

    float st[BM / 2], dpt[BM / 2];
    wgmma_fence();
    ss_issue<D, BF16>(st, k_rows, q_tile);
    wgmma_commit();
    ss_issue<D, BF16>(dpt, v_rows, do_tile);
    wgmma_commit();
    if (n > 0) reduce_staged_dq(n - 1);
    wgmma_wait<1>();
    fence_operands<BM / 2>(st);

    // P^T (keys x queries), masked on global positions
    const float* l2 = s_lse + s * BM;
    const bool need_mask = (n0 + BN > Sk) || (CAUSAL && static_cast<i64>(key_lo + 63) > static_cast<i64>(m0) + off);
#pragma unroll
    for (int j = 0; j < BM / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * j + qc + (e & 1);
        float p = fast_exp2(fmaf(st[4 * j + e], sl2, -l2[col]));
        if (need_mask) {
          const int key = key0 + 8 * (e >> 1);
          if (key >= Sk || (CAUSAL && static_cast<i64>(key) > static_cast<i64>(m0 + col) + off)) p = 0.f;
        }
        st[4 * j + e] = p;
      }
    u32 pa[BM / 16][4];
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      pa[kk][0] = pack2<BF16>(st[8 * kk + 0], st[8 * kk + 1]);
      pa[kk][1] = pack2<BF16>(st[8 * kk + 2], st[8 * kk + 3]);
      pa[kk][2] = pack2<BF16>(st[8 * kk + 4], st[8 * kk + 5]);
      pa[kk][3] = pack2<BF16>(st[8 * kk + 6], st[8 * kk + 7]);
    }

    wgmma_wait<0>();
    fence_operands<BM / 2>(dpt);
    // dS^T = P^T (dP^T - delta): to registers (A of dK) and to shared memory (A of dQ, read M-major)
    const float* dl = s_delta + s * BM;
    u32 dsa[BM / 16][4];
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
      const float d0 = dl[8 * j + qc], d1 = dl[8 * j + qc + 1];
      const u32 lo = pack2<BF16>(st[4 * j + 0] * (dpt[4 * j + 0] - d0), st[4 * j + 1] * (dpt[4 * j + 1] - d1));
      const u32 hi = pack2<BF16>(st[4 * j + 2] * (dpt[4 * j + 2] - d0), st[4 * j + 3] * (dpt[4 * j + 3] - d1));
      dsa[j / 2][2 * (j & 1) + 0] = lo;
      dsa[j / 2][2 * (j & 1) + 1] = hi;
      // row r of dS^T holds 64 queries (128 bytes); 16-byte chunk j sits at chunk j ^ (r % 8)
      const int r = 64 * cw + 16 * warp + lane / 4;
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(ds_tile + r * 128 + ((j ^ (r & 7)) * 16) + 2 * qc), "r"(lo));
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(ds_tile + (r + 8) * 128 + ((j ^ ((r + 8) & 7)) * 16) + 2 * qc),
                   "r"(hi));
    }
    fence_async_shared();

    wgmma_fence();
    rs_issue<D, BF16>(acc_dv, pa, do_tile);
    rs_issue<D, BF16>(acc_dk, dsa, q_tile);
    wgmma_commit();
    if (D == 128)
      named_barrier_sync(kDsBoth, 256);  // both halves of dS^T are in shared memory
    else
      named_barrier_sync(kDsOwn + cw, 128);
    float acc_dq[32];
    dq_issue<D, BF16>(acc_dq, ds_tile, base + L::kK, cw);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands<D / 2>(acc_dv);
    fence_operands<D / 2>(acc_dk);
    fence_operands<32>(acc_dq);
    if (leader) mbar_arrive(L::empty(base, s));

    // stage scale * dQ (64 x 64: rows m0 + .., columns dq_col + ..) once the last step's rows have left
    if (tid < BM) bulk_wait_read();
    named_barrier_sync(kDqStaging + cw, 128);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float* row_p = s_dq + (16 * warp + lane / 4 + 8 * r) * DQ_PITCH + qc;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        *reinterpret_cast<float2*>(row_p + 8 * j) =
            make_float2(acc_dq[4 * j + 2 * r] * scale, acc_dq[4 * j + 2 * r + 1] * scale);
    }
  }
  reduce_staged_dq(steps - 1);
  if (tid < BM) bulk_wait_read();  // shared memory must outlive the reads of the last reductions

  // ---- epilogue: dk += scale * dK, dv += dV (atomics when the GQA group is split over CTAs)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + 8 * r;
    if (key < Sk) {
      float* pk = dk + b * kgsb + hk * kgsh + static_cast<i64>(key) * kgss + qc;
      float* pv = dv + b * vgsb + hk * vgsh + static_cast<i64>(key) * vgss + qc;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        const float2 gk = make_float2(acc_dk[4 * j + 2 * r] * scale, acc_dk[4 * j + 2 * r + 1] * scale);
        const float2 gv = make_float2(acc_dv[4 * j + 2 * r], acc_dv[4 * j + 2 * r + 1]);
        float2* ak = reinterpret_cast<float2*>(pk + 8 * j);
        float2* av = reinterpret_cast<float2*>(pv + 8 * j);
        if (atomic_kv) {
          atomicAdd(ak, gk);
          atomicAdd(av, gv);
        } else {
          float2 x = *ak, y = *av;
          x.x += gk.x;
          x.y += gk.y;
          y.x += gv.x;
          y.y += gv.y;
          *ak = x;
          *av = y;
        }
      }
    }
  }
}

#define BH_BWD90(NAME, D, BF16, CAUSAL)                                                                          \
  extern "C" __global__ void __launch_bounds__(bwd90::THREADS, 1)                                               \
      NAME(const unsigned char* tmaps, const float* lse, const float* delta, float* dq, float* dk, float* dv,    \
           i64 lsb, i64 lsh, i64 lss, i64 dsb, i64 dsh, i64 dss, i64 qgsb, i64 qgss, i64 qgsh, i64 kgsb,         \
           i64 kgss, i64 kgsh, i64 vgsb, i64 vgss, i64 vgsh, int Sq, int Sk, int Hkv, int group, int hpb,        \
           float scale, float sl2, i64 off, int atomic_kv) {                                                    \
    attn_bwd_sm90<D, BF16, CAUSAL>(tmaps, lse, delta, dq, dk, dv, lsb, lsh, lss, dsb, dsh, dss, qgsb, qgss, qgsh, \
                                   kgsb, kgss, kgsh, vgsb, vgss, vgsh, Sq, Sk, Hkv, group, hpb, scale, sl2, off,  \
                                   atomic_kv);                                                                 \
  }

// name: attn_bwd_sm90_<dtype>_d<D>_<mask>; tmaps: the q, k, v, do tensor maps (128 bytes each)
BH_BWD90(attn_bwd_sm90_bf16_d128_full, 128, true, false)
BH_BWD90(attn_bwd_sm90_bf16_d128_causal, 128, true, true)
BH_BWD90(attn_bwd_sm90_f16_d128_full, 128, false, false)
BH_BWD90(attn_bwd_sm90_f16_d128_causal, 128, false, true)
BH_BWD90(attn_bwd_sm90_bf16_d64_full, 64, true, false)
BH_BWD90(attn_bwd_sm90_bf16_d64_causal, 64, true, true)
BH_BWD90(attn_bwd_sm90_f16_d64_full, 64, false, false)
BH_BWD90(attn_bwd_sm90_f16_d64_causal, 64, false, true)
