// Attention backward over one (query block, key block) pair, added into float32 (dq, dk, dv).
//
// A CTA owns BN = 128 keys of one (batch, kv head) and walks every query tile (BM rows) of the
// query heads it was given (all of the GQA group, or a slice of it when the grid needs more CTAs).
// 8 warps each own 16 keys, so the key side is the MMA "M" dimension:
//   S^T = K Q^T, P^T = exp2(S^T * scale*log2e - lse*log2e), dP^T = V dO^T, dS^T = P^T (dP^T - delta)
//   dV += P^T dO and dK += dS^T Q with P^T, dS^T straight from registers (accumulator -> A fragment).
// dS^T goes through swizzled shared memory, then the 8 warps re-split over (query, head-dim) to form
// dQ = dS K, which is added to global dq with float2 atomics. dK, dV stay in registers for the whole
// walk and are added once at the end (plain read-add-write when this CTA is their only writer,
// atomics when the GQA group is split over CTAs).
// Q, dO, lse and delta tiles stream through a two-stage cp.async pipeline; K, V stay resident.
// Rows with lse = -inf (nothing visible in the forward) get P = 0; out-of-range query rows are
// zero-filled (their dO and delta are 0, so they add nothing); out-of-range keys are masked.
#include "common.cuh"

template <int D, int BM, int NW, bool BF16, bool CAUSAL>
__device__ __forceinline__ void attn_bwd(const u16* __restrict__ q, const u16* __restrict__ k,
                                         const u16* __restrict__ v, const u16* __restrict__ dout,
                                         const float* __restrict__ lse, const float* __restrict__ delta, float* dq,
                                         float* dk, float* dv, i64 qsb, i64 qss, i64 qsh, i64 ksb, i64 kss, i64 ksh,
                                         i64 vsb, i64 vss, i64 vsh, i64 gsb, i64 gss, i64 gsh, i64 lsb, i64 lsh,
                                         i64 lss, i64 dsb, i64 dsh, i64 dss, i64 qgsb, i64 qgss, i64 qgsh, i64 kgsb,
                                         i64 kgss, i64 kgsh, i64 vgsb, i64 vgss, i64 vgsh, int Sq, int Sk, int Hkv,
                                         int group, int hpb, float scale, float sl2, i64 off, int atomic_kv) {
  constexpr int NT = NW * 32, BN = 16 * NW;
  constexpr int QG = BM / 16;         // query groups of 16 in the dQ phase
  constexpr int DSPL = NW / QG;       // head-dim splits in the dQ phase
  constexpr int DQN = D / DSPL;       // head-dim columns per warp in the dQ phase
  static_assert(NW % QG == 0 && DQN % 16 == 0, "bad dQ split");
  extern __shared__ __align__(128) unsigned char smem[];
  const u32 sK = smem_u32(smem);
  const u32 sV = sK + BN * D * 2;
  const u32 sQ = sV + BN * D * 2;        // [2][BM][D]
  const u32 sDO = sQ + 2 * BM * D * 2;   // [2][BM][D]
  const u32 sDS = sDO + 2 * BM * D * 2;  // [BN][BM] (dS^T)
  float* sL = reinterpret_cast<float*>(smem + (sDS - sK) + BN * BM * 2);  // [2][BM]
  float* sDl = sL + 2 * BM;                                               // [2][BM]

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int n0 = blockIdx.x * BN;
  const int hs = blockIdx.y;
  const int b = blockIdx.z / Hkv, hk = blockIdx.z % Hkv;
  const int h_first = hk * group + hs * hpb;

  int m_begin = 0;
  if (CAUSAL) {
    const i64 first = static_cast<i64>(n0) - off;  // first query that sees key n0
    if (first >= Sq) return;
    m_begin = first <= 0 ? 0 : static_cast<int>(first / BM) * BM;
  }
  const int nmt = (Sq - m_begin + BM - 1) / BM;
  const int total = nmt * hpb;
  if (total <= 0) return;

  const u16* kg = k + b * ksb + hk * ksh + static_cast<i64>(n0) * kss;
  const u16* vg = v + b * vsb + hk * vsh + static_cast<i64>(n0) * vss;
  load_tile<BN, D, NT>(sK, kg, kss, Sk - n0, tid);
  load_tile<BN, D, NT>(sV, vg, vss, Sk - n0, tid);

  auto load_q = [&](int it, int stage) {
    const int h = h_first + it / nmt;
    const int m0 = m_begin + (it % nmt) * BM;
    load_tile<BM, D, NT>(sQ + stage * BM * D * 2, q + b * qsb + h * qsh + static_cast<i64>(m0) * qss, qss, Sq - m0,
                         tid);
    load_tile<BM, D, NT>(sDO + stage * BM * D * 2, dout + b * gsb + h * gsh + static_cast<i64>(m0) * gss, gss,
                         Sq - m0, tid);
    if (tid < BM) {
      const int r = m0 + tid;
      const bool ok = r < Sq;
      const i64 rr = ok ? r : 0;
      cp_async4(smem_u32(sL + stage * BM + tid), lse + b * lsb + h * lsh + rr * lss, ok);
      cp_async4(smem_u32(sDl + stage * BM + tid), delta + b * dsb + h * dsh + rr * dss, ok);
    }
  };
  load_q(0, 0);
  cp_async_commit();

  float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    dka[i][0] = dka[i][1] = dka[i][2] = dka[i][3] = 0.f;
    dva[i][0] = dva[i][1] = dva[i][2] = dva[i][3] = 0.f;
  }
  const int key_lo = w * 16 + (lane >> 2);  // this thread's key rows (tile-local): key_lo, key_lo + 8
  const int kmax = min(n0 + BN, Sk) - 1;    // last valid key of this CTA

  for (int it = 0; it < total; ++it) {
    const int st = it & 1;
    if (it + 1 < total) load_q(it + 1, st ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    const int h = h_first + it / nmt;
    const int m0 = m_begin + (it % nmt) * BM;
    const u32 sQt = sQ + st * BM * D * 2, sDOt = sDO + st * BM * D * 2;
    const float* sLt = sL + st * BM;
    const float* sDlt = sDl + st * BM;

    // S^T = K_w Q^T and dP^T = V_w dO^T: 16 keys x BM queries per warp
    float sT[BM / 8][4], pT[BM / 8][4];
#pragma unroll
    for (int i = 0; i < BM / 8; ++i) {
      sT[i][0] = sT[i][1] = sT[i][2] = sT[i][3] = 0.f;
      pT[i][0] = pT[i][1] = pT[i][2] = pT[i][3] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      u32 ka[4], va[4];
      ldsm_x4(sK + tile_off<D>(w * 16 + (lane & 15), kk * 2 + (lane >> 4)), ka[0], ka[1], ka[2], ka[3]);
      ldsm_x4(sV + tile_off<D>(w * 16 + (lane & 15), kk * 2 + (lane >> 4)), va[0], va[1], va[2], va[3]);
#pragma unroll
      for (int np = 0; np < BM / 16; ++np) {
        const int row = np * 16 + ((lane >> 4) << 3) + (lane & 7);
        const int ch = kk * 2 + ((lane >> 3) & 1);
        u32 b0, b1, b2, b3;
        ldsm_x4(sQt + tile_off<D>(row, ch), b0, b1, b2, b3);
        mma16816<BF16>(sT[2 * np], ka, b0, b1);
        mma16816<BF16>(sT[2 * np + 1], ka, b2, b3);
        ldsm_x4(sDOt + tile_off<D>(row, ch), b0, b1, b2, b3);
        mma16816<BF16>(pT[2 * np], va, b0, b1);
        mma16816<BF16>(pT[2 * np + 1], va, b2, b3);
      }
    }

    // P^T and dS^T (sT <- P^T, pT <- dS^T)
    const bool need_mask =
        (n0 + BN > Sk) || (CAUSAL && static_cast<i64>(kmax) > static_cast<i64>(m0) + off);
#pragma unroll
    for (int i = 0; i < BM / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = i * 8 + (lane & 3) * 2 + (e & 1);
        float l2 = sLt[qc];
        l2 = (l2 == -BH_INF) ? BH_INF : l2 * BH_LOG2E;
        float p = fast_exp2(sT[i][e] * sl2 - l2);
        if (need_mask) {
          const int gk = n0 + key_lo + (e >> 1) * 8;
          if (gk >= Sk || (CAUSAL && static_cast<i64>(gk) > static_cast<i64>(m0 + qc) + off)) p = 0.f;
        }
        sT[i][e] = p;
        pT[i][e] = p * (pT[i][e] - sDlt[qc]);
      }
    }

    // dV += P^T dO, dK += dS^T Q (queries are the reduction dimension)
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      u32 pa[4], da[4];
      pa[0] = pack2<BF16>(sT[2 * kk][0], sT[2 * kk][1]);
      pa[1] = pack2<BF16>(sT[2 * kk][2], sT[2 * kk][3]);
      pa[2] = pack2<BF16>(sT[2 * kk + 1][0], sT[2 * kk + 1][1]);
      pa[3] = pack2<BF16>(sT[2 * kk + 1][2], sT[2 * kk + 1][3]);
      da[0] = pack2<BF16>(pT[2 * kk][0], pT[2 * kk][1]);
      da[1] = pack2<BF16>(pT[2 * kk][2], pT[2 * kk][3]);
      da[2] = pack2<BF16>(pT[2 * kk + 1][0], pT[2 * kk + 1][1]);
      da[3] = pack2<BF16>(pT[2 * kk + 1][2], pT[2 * kk + 1][3]);
      // dS^T to shared memory (row = key, col = query), for the dQ phase
      {
        u32* base = reinterpret_cast<u32*>(smem + (sDS - sK));
        const int c2 = (lane & 3);  // 32-bit word inside the 16-byte chunk
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int qchunk = 2 * kk + half;
#pragma unroll
          for (int rr = 0; rr < 2; ++rr) {
            const int kr = key_lo + rr * 8;
            base[tile_off<BM>(kr, qchunk) / 4 + c2] = da[half * 2 + rr];
          }
        }
      }
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        const int row = kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7);
        const int ch = dp * 2 + (lane >> 4);
        u32 b0, b1, b2, b3;
        ldsm_x4_t(sDOt + tile_off<D>(row, ch), b0, b1, b2, b3);
        mma16816<BF16>(dva[2 * dp], pa, b0, b1);
        mma16816<BF16>(dva[2 * dp + 1], pa, b2, b3);
        ldsm_x4_t(sQt + tile_off<D>(row, ch), b0, b1, b2, b3);
        mma16816<BF16>(dka[2 * dp], da, b0, b1);
        mma16816<BF16>(dka[2 * dp + 1], da, b2, b3);
      }
    }
    __syncthreads();

    // dQ (BM x D) += dS K: warp -> (16 queries, DQN head-dim columns)
    {
      const int qg = w % QG, dh = w / QG;
      float dqa[DQN / 8][4];
#pragma unroll
      for (int i = 0; i < DQN / 8; ++i) dqa[i][0] = dqa[i][1] = dqa[i][2] = dqa[i][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        u32 a[4];
        ldsm_x4_t(sDS + tile_off<BM>(kk * 16 + ((lane >> 4) << 3) + (lane & 7), qg * 2 + ((lane >> 3) & 1)), a[0],
                  a[1], a[2], a[3]);
#pragma unroll
        for (int dp = 0; dp < DQN / 16; ++dp) {
          u32 b0, b1, b2, b3;
          ldsm_x4_t(sK + tile_off<D>(kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7),
                                     (dh * DQN) / 8 + dp * 2 + (lane >> 4)),
                    b0, b1, b2, b3);
          mma16816<BF16>(dqa[2 * dp], a, b0, b1);
          mma16816<BF16>(dqa[2 * dp + 1], a, b2, b3);
        }
      }
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int row = m0 + qg * 16 + (lane >> 2) + rr * 8;
        if (row < Sq) {
          float* p = dq + b * qgsb + h * qgsh + static_cast<i64>(row) * qgss + dh * DQN + (lane & 3) * 2;
#pragma unroll
          for (int i = 0; i < DQN / 8; ++i)
            atomicAdd(reinterpret_cast<float2*>(p + i * 8),
                      make_float2(dqa[i][2 * rr] * scale, dqa[i][2 * rr + 1] * scale));
        }
      }
    }
  }
  cp_async_wait<0>();

  // dK, dV epilogue
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int key = n0 + key_lo + rr * 8;
    if (key < Sk) {
      float* pk = dk + b * kgsb + hk * kgsh + static_cast<i64>(key) * kgss + (lane & 3) * 2;
      float* pv = dv + b * vgsb + hk * vgsh + static_cast<i64>(key) * vgss + (lane & 3) * 2;
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        const float2 gk = make_float2(dka[i][2 * rr] * scale, dka[i][2 * rr + 1] * scale);
        const float2 gv = make_float2(dva[i][2 * rr], dva[i][2 * rr + 1]);
        float2* ak = reinterpret_cast<float2*>(pk + i * 8);
        float2* av = reinterpret_cast<float2*>(pv + i * 8);
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

#define BH_BWD(NAME, D, BM, NW, BF16, CAUSAL)                                                                        \
  extern "C" __global__ void __launch_bounds__(NW * 32) NAME(                                                    \
      const u16* q, const u16* k, const u16* v, const u16* dout, const float* lse, const float* delta,           \
      float* dq, float* dk, float* dv, i64 qsb, i64 qss, i64 qsh, i64 ksb, i64 kss, i64 ksh, i64 vsb, i64 vss,   \
      i64 vsh, i64 gsb, i64 gss, i64 gsh, i64 lsb, i64 lsh, i64 lss, i64 dsb, i64 dsh, i64 dss, i64 qgsb,        \
      i64 qgss, i64 qgsh, i64 kgsb, i64 kgss, i64 kgsh, i64 vgsb, i64 vgss, i64 vgsh, int Sq, int Sk, int Hkv,   \
      int group, int hpb, float scale, float sl2, i64 off, int atomic_kv) {                                      \
    attn_bwd<D, BM, NW, BF16, CAUSAL>(q, k, v, dout, lse, delta, dq, dk, dv, qsb, qss, qsh, ksb, kss, ksh, vsb, vss, \
                                  vsh, gsb, gss, gsh, lsb, lsh, lss, dsb, dsh, dss, qgsb, qgss, qgsh, kgsb,      \
                                  kgss, kgsh, vgsb, vgss, vgsh, Sq, Sk, Hkv, group, hpb, scale, sl2, off,        \
                                  atomic_kv);                                                                    \
  }

// name: attn_bwd_<dtype>_d<D>_<mask>_w<warps>  (a CTA owns 16 * warps keys)
BH_BWD(attn_bwd_bf16_d128_full_w8, 128, 64, 8, true, false)
BH_BWD(attn_bwd_bf16_d128_causal_w8, 128, 64, 8, true, true)
BH_BWD(attn_bwd_f16_d128_full_w8, 128, 64, 8, false, false)
BH_BWD(attn_bwd_f16_d128_causal_w8, 128, 64, 8, false, true)
BH_BWD(attn_bwd_bf16_d128_full_w4, 128, 64, 4, true, false)
BH_BWD(attn_bwd_bf16_d128_causal_w4, 128, 64, 4, true, true)
BH_BWD(attn_bwd_f16_d128_full_w4, 128, 64, 4, false, false)
BH_BWD(attn_bwd_f16_d128_causal_w4, 128, 64, 4, false, true)
BH_BWD(attn_bwd_bf16_d64_full_w8, 64, 64, 8, true, false)
BH_BWD(attn_bwd_bf16_d64_causal_w8, 64, 64, 8, true, true)
BH_BWD(attn_bwd_f16_d64_full_w8, 64, 64, 8, false, false)
BH_BWD(attn_bwd_f16_d64_causal_w8, 64, 64, 8, false, true)
BH_BWD(attn_bwd_bf16_d64_full_w4, 64, 64, 4, true, false)
BH_BWD(attn_bwd_bf16_d64_causal_w4, 64, 64, 4, true, true)
BH_BWD(attn_bwd_f16_d64_full_w4, 64, 64, 4, false, false)
BH_BWD(attn_bwd_f16_d64_causal_w4, 64, 64, 4, false, true)

// ---------------------------------------------------------------------------------------------------
// first r in [0, n) with a[r] > x, n if none (a never decreases); every thread gets the same answer
__device__ __forceinline__ int first_above(const int* __restrict__ a, int n, i64 x) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (static_cast<i64>(a[mid]) > x) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

// Layout k4x2 (default): BN = 128 keys, BM = 64 queries, 8 warps. Less shared-memory traffic per MMA
// than the layout above (about 0.42 ldmatrix.x4 per MMA instead of 0.57):
//   * S^T, dP^T: warp (kb, hh) = (w >> 1, w & 1) computes 32 keys [32 kb, +32) x 32 queries [32 hh, +32):
//     per k16 step 2 K and 2 Q fragments feed 8 MMAs (and the same for V, dO).
//   * P^T and dS^T are packed to 16 bits, kept in registers and also written to shared memory.
//   * dV += P^T dO and dK += dS^T Q: the same warp owns keys [32 kb, +32) x head-dim half hh; its own
//     32 queries come from registers, the partner warp's (w ^ 1) 32 queries from shared memory.
//     dK, dV (32 keys x D/2 each) stay in registers for the whole walk.
//   * dQ = dS K: warps re-split 2 (32 queries) x 4 (D/4 columns), float2 atomics into global dq.
// Q, dO, lse, delta for tile it+1 are loaded (cp.async) during tile it; two barriers per tile.
// Interval masks (IV: documents, windows; see attn_fwd.cu and docs/KERNELS.md "Masks"): local query
// row r sees global keys [mlo[r], mhi[r]), local key c sits at global kofs + c. A CTA walks only the
// query tiles whose rows see one of its keys (two binary searches: both bounds never decrease with r),
// and each tile's bounds travel with its lse/delta through shared memory.
template <int D, bool BF16, bool CAUSAL, bool IV, int VAR>
__device__ __forceinline__ void attn_bwd_k4x2(const u16* __restrict__ q, const u16* __restrict__ k,
                                              const u16* __restrict__ v, const u16* __restrict__ dout,
                                              const float* __restrict__ lse, const float* __restrict__ delta,
                                              float* dq, float* dk, float* dv, i64 qsb, i64 qss, i64 qsh, i64 ksb,
                                              i64 kss, i64 ksh, i64 vsb, i64 vss, i64 vsh, i64 gsb, i64 gss, i64 gsh,
                                              i64 lsb, i64 lsh, i64 lss, i64 dsb, i64 dsh, i64 dss, i64 qgsb,
                                              i64 qgss, i64 qgsh, i64 kgsb, i64 kgss, i64 kgsh, i64 vgsb, i64 vgss,
                                              i64 vgsh, int Sq, int Sk, int Hkv, int group, int hpb, float scale,
                                              float sl2, i64 off, int atomic_kv, int order_g,
                                              const int* __restrict__ mlo, const int* __restrict__ mhi, i64 kofs) {
  constexpr int BM = 64, BN = 128, NT = 256;
  constexpr int DH = D / 2;   // dK/dV head-dim columns per warp
  constexpr int DQC = D / 4;  // dQ head-dim columns per warp
  static_assert(DH % 16 == 0 && DQC % 16 == 0, "bad head dim");
  extern __shared__ __align__(128) unsigned char smem[];
  const u32 sK = smem_u32(smem);
  const u32 sV = sK + BN * D * 2;
  const u32 sQ = sV + BN * D * 2;        // [2][BM][D]
  const u32 sDO = sQ + 2 * BM * D * 2;   // [2][BM][D]
  const u32 sP = sDO + 2 * BM * D * 2;   // [BN][BM] P^T
  const u32 sDS = sP + BN * BM * 2;      // [BN][BM] dS^T
  float* sL = reinterpret_cast<float*>(smem + (sDS - sK) + BN * BM * 2);  // [2][BM]
  float* sDl = sL + 2 * BM;                                               // [2][BM]
  int* sLo = reinterpret_cast<int*>(sDl + 2 * BM);                        // IV: [2][BM] mlo, then mhi
  int* sHi = sLo + 2 * BM;

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int kb = w >> 1, hh = w & 1;
  // 1-D grid over (key block, head slot): heads in chunks of order_g, key blocks slowest inside a chunk, so
  // under causal masks the heavy key blocks (they see the most queries) of a chunk start first, and a
  // chunk's Q, dO and dq stay few enough to share L2. order_g = 1: head after head, key blocks in order.
  const int nkb = (Sk + BN - 1) / BN, nsplit = group / hpb;
  const int nh = static_cast<int>(gridDim.x) / nkb;  // (batch, kv head, split) slots
  const int lin = blockIdx.x;
  const int chunk = lin / (order_g * nkb);
  const int rem = lin - chunk * order_g * nkb;
  const int gc = min(order_g, nh - chunk * order_g);
  const int slot = chunk * order_g + rem % gc;
  const int n0 = (rem / gc) * BN;
  const int hs = slot % nsplit;
  const int bz = slot / nsplit;
  const int b = bz / Hkv, hk = bz % Hkv;
  const int h_first = hk * group + hs * hpb;

  int m_begin = 0, m_end = Sq;
  if (CAUSAL) {
    const i64 first = static_cast<i64>(n0) - off;  // first query that sees key n0
    if (first >= Sq) return;
    m_begin = first <= 0 ? 0 : static_cast<int>(first / BM) * BM;
  }
  if (IV) {
    // the rows that see a key of [n0, n_last]: mhi[r] > n0 and mlo[r] <= n_last (global positions)
    const int first = first_above(mhi, Sq, kofs + n0);
    m_end = first_above(mlo, Sq, kofs + min(n0 + BN, Sk) - 1);
    if (first >= m_end) return;
    m_begin = (first / BM) * BM;
  }
  const int nmt = (m_end - m_begin + BM - 1) / BM;
  const int total = nmt * hpb;
  if (total <= 0) return;

  load_tile<BN, D, NT>(sK, k + b * ksb + hk * ksh + static_cast<i64>(n0) * kss, kss, Sk - n0, tid);
  load_tile<BN, D, NT>(sV, v + b * vsb + hk * vsh + static_cast<i64>(n0) * vss, vss, Sk - n0, tid);

  auto load_q = [&](int it, int stage) {
    const int h = h_first + it / nmt;
    const int m0 = m_begin + (it % nmt) * BM;
    load_tile<BM, D, NT>(sQ + stage * BM * D * 2, q + b * qsb + h * qsh + static_cast<i64>(m0) * qss, qss, Sq - m0,
                         tid);
    load_tile<BM, D, NT>(sDO + stage * BM * D * 2, dout + b * gsb + h * gsh + static_cast<i64>(m0) * gss, gss,
                         Sq - m0, tid);
    if (tid < BM) {
      const int r = m0 + tid;
      const bool ok = r < Sq;
      const i64 rr = ok ? r : 0;
      cp_async4(smem_u32(sL + stage * BM + tid), lse + b * lsb + h * lsh + rr * lss, ok);
      cp_async4(smem_u32(sDl + stage * BM + tid), delta + b * dsb + h * dsh + rr * dss, ok);
      if (IV) {  // rows past Sq read 0, 0: nothing visible
        cp_async4(smem_u32(sLo + stage * BM + tid), mlo + rr, ok);
        cp_async4(smem_u32(sHi + stage * BM + tid), mhi + rr, ok);
      }
    }
  };
  load_q(0, 0);
  cp_async_commit();

  float dka[2][DH / 8][4], dva[2][DH / 8][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < DH / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) dka[i][j][e] = dva[i][j][e] = 0.f;

  const int wk_lo = kb * 32;                        // this warp's first key (tile-local)
  const int wk_max = n0 + wk_lo + 31;               // its last key (global within the block)
  u32* const sPw = reinterpret_cast<u32*>(smem + (sP - sK));
  // VAR bit 0 (XA): swizzled offsets as base ^ (column step): the XOR swizzle c ^ (r & 7) with r & 7 fixed
  // per thread and the column step on bits the in-row chunk index does not use, so each ldmatrix address
  // is one XOR (+ a row immediate) from a handful of per-thread bases.
  constexpr bool XA = (VAR & 1) != 0;
  constexpr bool MS = (VAR & 2) != 0;
  static_assert(!IV || MS, "interval masks are applied in the separate mask pass");
  const u32 oK0 = tile_off<D>(wk_lo + (lane & 15), lane >> 4);
  const u32 oQ0 = tile_off<D>(hh * 32 + ((lane >> 4) << 3) + (lane & 7), (lane >> 3) & 1);
  const u32 oW0 = tile_off<BM>(wk_lo + (lane >> 2), hh * 4);
  const u32 oA0 = tile_off<BM>(wk_lo + (lane & 15), lane >> 4);
  const u32 oB0 = tile_off<D>((((lane >> 3) & 1) << 3) + (lane & 7), lane >> 4);
  const u32 oQA0 = tile_off<BM>(((lane >> 4) << 3) + (lane & 7), (lane >> 3) & 1);
  u32* const sDSw = reinterpret_cast<u32*>(smem + (sDS - sK));

  for (int it = 0; it < total; ++it) {
    const int st = it & 1;
    cp_async_wait<0>();
    __syncthreads();  // tile it landed; every warp is done with tile it-1 (its stage, P^T, dS^T)
    if (it + 1 < total) load_q(it + 1, st ^ 1);
    cp_async_commit();

    const int h = h_first + it / nmt;
    const int m0 = m_begin + (it % nmt) * BM;
    const u32 sQt = sQ + st * BM * D * 2, sDOt = sDO + st * BM * D * 2;
    const float* sLt = sL + st * BM;
    const float* sDlt = sDl + st * BM;
    const int* sLot = sLo + st * BM;
    const int* sHit = sHi + st * BM;

    // ---- S^T = K Q^T, dP^T = V dO^T: 32 keys x 32 queries per warp
    float sT[2][4][4], pT[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) sT[i][j][e] = pT[i][j][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      u32 ka[2][4], va[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const u32 o = XA ? (oK0 ^ (kk * 32)) + i * 16 * D * 2 : tile_off<D>(wk_lo + i * 16 + (lane & 15), kk * 2 + (lane >> 4));
        ldsm_x4(sK + o, ka[i][0], ka[i][1], ka[i][2], ka[i][3]);
        ldsm_x4(sV + o, va[i][0], va[i][1], va[i][2], va[i][3]);
      }
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        const u32 o = XA ? (oQ0 ^ (kk * 32)) + np * 16 * D * 2
                         : tile_off<D>(hh * 32 + np * 16 + ((lane >> 4) << 3) + (lane & 7), kk * 2 + ((lane >> 3) & 1));
        u32 b0, b1, b2, b3;
        ldsm_x4(sQt + o, b0, b1, b2, b3);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          mma16816<BF16>(sT[i][2 * np], ka[i], b0, b1);
          mma16816<BF16>(sT[i][2 * np + 1], ka[i], b2, b3);
        }
        ldsm_x4(sDOt + o, b0, b1, b2, b3);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          mma16816<BF16>(pT[i][2 * np], va[i], b0, b1);
          mma16816<BF16>(pT[i][2 * np + 1], va[i], b2, b3);
        }
      }
    }

    // ---- P^T, dS^T = P^T (dP^T - delta); pack to 16 bits (A fragments) and store to shared memory
    const int qw0 = m0 + hh * 32;  // this warp's first query
    const i64 kw0 = kofs + n0 + wk_lo;  // IV: global position of this warp's first key
    const bool need_mask = (wk_max >= Sk) || (CAUSAL && static_cast<i64>(wk_max) > static_cast<i64>(qw0) + off) ||
                           (IV && !(sLot[hh * 32 + 31] <= kw0 && sHit[hh * 32] >= kw0 + 32));
    // Mask by constant offsets: key (tile-local) kl = kt + i*16 + (e>>1)*8 and query qw0 + qt + nt*8 + (e&1),
    // with this thread's kt = wk_lo + (lane>>2), qt = (lane&3)*2. Hidden when n0 + kl >= Sk, or (causal)
    // n0 + kl > query + off  <=>  i*16 + (e>>1)*8 - nt*8 - (e&1) > cthr. Both thresholds fit an int after
    // clamping (the left sides lie in [-32, 32)).
    const int kthr = Sk - n0 - wk_lo - (lane >> 2);
    int cthr = 0;
    if (CAUSAL) {
      const i64 t = static_cast<i64>(qw0) + (lane & 3) * 2 + off - n0 - wk_lo - (lane >> 2);
      cthr = static_cast<int>(t < -64 ? -64 : (t > 64 ? 64 : t));
    }
    u32 pa[2][2][4], da[2][2][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      float l2[2], dl[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int qc = hh * 32 + nt * 8 + (lane & 3) * 2 + e;
        const float x = sLt[qc];
        l2[e] = (x == -BH_INF) ? BH_INF : x * BH_LOG2E;
        dl[e] = sDlt[qc];
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float p = fast_exp2(sT[i][nt][e] * sl2 - l2[e & 1]);
          if (!MS && need_mask) {
            const int kc = i * 16 + (e >> 1) * 8;
            if (kc >= kthr || (CAUSAL && kc - nt * 8 - (e & 1) > cthr)) p = 0.f;
          }
          sT[i][nt][e] = p;
          if (!MS) pT[i][nt][e] = p * (pT[i][nt][e] - dl[e & 1]);
        }
      }
    }
    if (MS) {
      // VAR bit 1 (MS): the mask as its own warp-uniform pass, so tiles off the diagonal skip it entirely
      if (need_mask) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          // IV: query column qc sees this thread's keys kc = i*16 + (e>>1)*8 in [klo, khi)
          int klo[2] = {0, 0}, khi[2] = {0, 0};
          if (IV) {
            const i64 kt = kw0 + (lane >> 2);
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int qc = hh * 32 + nt * 8 + (lane & 3) * 2 + e;
              klo[e] = static_cast<int>(max(static_cast<i64>(-1), min(static_cast<i64>(64), sLot[qc] - kt)));
              khi[e] = static_cast<int>(max(static_cast<i64>(-1), min(static_cast<i64>(64), sHit[qc] - kt)));
            }
          }
#pragma unroll
          for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int kc = i * 16 + (e >> 1) * 8;
              if (kc >= kthr || (CAUSAL && kc - nt * 8 - (e & 1) > cthr) ||
                  (IV && (kc < klo[e & 1] || kc >= khi[e & 1])))
                sT[i][nt][e] = 0.f;
            }
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      float dl[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) dl[e] = sDlt[hh * 32 + nt * 8 + (lane & 3) * 2 + e];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (MS) {
#pragma unroll
          for (int e = 0; e < 4; ++e) pT[i][nt][e] = sT[i][nt][e] * (pT[i][nt][e] - dl[e & 1]);
        }
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const u32 pw = pack2<BF16>(sT[i][nt][2 * rr], sT[i][nt][2 * rr + 1]);
          const u32 dw = pack2<BF16>(pT[i][nt][2 * rr], pT[i][nt][2 * rr + 1]);
          pa[i][nt >> 1][(nt & 1) * 2 + rr] = pw;
          da[i][nt >> 1][(nt & 1) * 2 + rr] = dw;
          const u32 widx = (XA ? (oW0 ^ (nt * 16)) + (i * 16 + rr * 8) * BM * 2
                                : tile_off<BM>(wk_lo + i * 16 + (lane >> 2) + rr * 8, hh * 4 + nt)) / 4 + (lane & 3);
          sPw[widx] = pw;
          sDSw[widx] = dw;
        }
      }
    }
    __syncthreads();  // P^T, dS^T of every warp visible

    // ---- dV += P^T dO, dK += dS^T Q: keys [32 kb, +32) x head-dim half hh, over all 64 queries
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool own = j < 2;
      const int c = own ? 2 * hh + (j & 1) : 2 * (1 - hh) + (j & 1);  // 16-query chunk
      u32 A[2][4], Ad[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (own) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            A[i][e] = pa[i][j & 1][e];
            Ad[i][e] = da[i][j & 1][e];
          }
        } else {
          const u32 o = XA ? (oA0 ^ (c * 32)) + i * 16 * BM * 2 : tile_off<BM>(wk_lo + i * 16 + (lane & 15), c * 2 + (lane >> 4));
          ldsm_x4(sP + o, A[i][0], A[i][1], A[i][2], A[i][3]);
          ldsm_x4(sDS + o, Ad[i][0], Ad[i][1], Ad[i][2], Ad[i][3]);
        }
      }
#pragma unroll
      for (int dp = 0; dp < DH / 16; ++dp) {
        const u32 o = XA ? (oB0 ^ (hh * DH * 2 + dp * 32)) + c * 16 * D * 2
                         : tile_off<D>(c * 16 + (((lane >> 3) & 1) << 3) + (lane & 7), hh * (DH / 8) + dp * 2 + (lane >> 4));
        u32 b0, b1, b2, b3;
        ldsm_x4_t(sDOt + o, b0, b1, b2, b3);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          mma16816<BF16>(dva[i][2 * dp], A[i], b0, b1);
          mma16816<BF16>(dva[i][2 * dp + 1], A[i], b2, b3);
        }
        ldsm_x4_t(sQt + o, b0, b1, b2, b3);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          mma16816<BF16>(dka[i][2 * dp], Ad[i], b0, b1);
          mma16816<BF16>(dka[i][2 * dp + 1], Ad[i], b2, b3);
        }
      }
    }

    // ---- dQ (BM x D) += dS K: warp -> 32 queries [32 wq, +32) x DQC columns [DQC wd, +DQC)
    {
      const int wq = w & 1, wd = w >> 1;
      float dqa[2][DQC / 8][4];
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int t = 0; t < DQC / 8; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) dqa[i][t][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        u32 a[2][4];
#pragma unroll
        for (int i = 0; i < 2; ++i)
          ldsm_x4_t(sDS + (XA ? (oQA0 ^ ((wq * 4 + i * 2) * 16)) + kk * 16 * BM * 2
                              : tile_off<BM>(kk * 16 + ((lane >> 4) << 3) + (lane & 7), wq * 4 + i * 2 + ((lane >> 3) & 1))),
                    a[i][0], a[i][1], a[i][2], a[i][3]);
#pragma unroll
        for (int dp = 0; dp < DQC / 16; ++dp) {
          u32 b0, b1, b2, b3;
          ldsm_x4_t(sK + (XA ? (oB0 ^ ((wd * (DQC / 8) + dp * 2) * 16)) + kk * 16 * D * 2
                             : tile_off<D>(kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7),
                                           wd * (DQC / 8) + dp * 2 + (lane >> 4))),
                    b0, b1, b2, b3);
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            mma16816<BF16>(dqa[i][2 * dp], a[i], b0, b1);
            mma16816<BF16>(dqa[i][2 * dp + 1], a[i], b2, b3);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int row = m0 + wq * 32 + i * 16 + (lane >> 2) + rr * 8;
          if (row < Sq) {
            float* p = dq + b * qgsb + h * qgsh + static_cast<i64>(row) * qgss + wd * DQC + (lane & 3) * 2;
#pragma unroll
            for (int t = 0; t < DQC / 8; ++t)
              atomicAdd(reinterpret_cast<float2*>(p + t * 8),
                        make_float2(dqa[i][t][2 * rr] * scale, dqa[i][t][2 * rr + 1] * scale));
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  // ---- dK, dV epilogue: keys [32 kb, +32) x columns [DH hh, +DH)
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int key = n0 + wk_lo + i * 16 + (lane >> 2) + rr * 8;
      if (key < Sk) {
        float* pk = dk + b * kgsb + hk * kgsh + static_cast<i64>(key) * kgss + hh * DH + (lane & 3) * 2;
        float* pv = dv + b * vgsb + hk * vgsh + static_cast<i64>(key) * vgss + hh * DH + (lane & 3) * 2;
#pragma unroll
        for (int t = 0; t < DH / 8; ++t) {
          const float2 gk = make_float2(dka[i][t][2 * rr] * scale, dka[i][t][2 * rr + 1] * scale);
          const float2 gv = make_float2(dva[i][t][2 * rr], dva[i][t][2 * rr + 1]);
          float2* ak = reinterpret_cast<float2*>(pk + t * 8);
          float2* av = reinterpret_cast<float2*>(pv + t * 8);
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
}

#define BH_BWD_K4(NAME, D, BF16, CAUSAL, IV, VAR)                                                                     \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                                          \
      const u16* q, const u16* k, const u16* v, const u16* dout, const float* lse, const float* delta,           \
      float* dq, float* dk, float* dv, i64 qsb, i64 qss, i64 qsh, i64 ksb, i64 kss, i64 ksh, i64 vsb, i64 vss,   \
      i64 vsh, i64 gsb, i64 gss, i64 gsh, i64 lsb, i64 lsh, i64 lss, i64 dsb, i64 dsh, i64 dss, i64 qgsb,        \
      i64 qgss, i64 qgsh, i64 kgsb, i64 kgss, i64 kgsh, i64 vgsb, i64 vgss, i64 vgsh, int Sq, int Sk, int Hkv,   \
      int group, int hpb, float scale, float sl2, i64 off, int atomic_kv, int order_g, const int* mlo,           \
      const int* mhi, i64 kofs) {                                                                                 \
    attn_bwd_k4x2<D, BF16, CAUSAL, IV, VAR>(q, k, v, dout, lse, delta, dq, dk, dv, qsb, qss, qsh, ksb, kss, ksh, vsb,  \
                                   vss, vsh, gsb, gss, gsh, lsb, lsh, lss, dsb, dsh, dss, qgsb, qgss, qgsh, kgsb, \
                                   kgss, kgsh, vgsb, vgss, vgsh, Sq, Sk, Hkv, group, hpb, scale, sl2, off,       \
                                   atomic_kv, order_g, mlo, mhi, kofs);                                          \
  }

// name: attn_bwd_<dtype>_d<D>_<mask>_k4x2  (a CTA owns 128 keys)
// code variant bits (see attn_bwd_k4x2): 1 = XOR-step addressing, 2 = separate mask pass; 3 measured best
#ifndef BH_K4_VAR
#define BH_K4_VAR 3
#endif
BH_BWD_K4(attn_bwd_bf16_d128_full_k4x2, 128, true, false, false, BH_K4_VAR)
BH_BWD_K4(attn_bwd_bf16_d128_causal_k4x2, 128, true, true, false, BH_K4_VAR)
BH_BWD_K4(attn_bwd_bf16_d128_interval_k4x2, 128, true, false, true, BH_K4_VAR)
BH_BWD_K4(attn_bwd_f16_d128_full_k4x2, 128, false, false, false, BH_K4_VAR)
BH_BWD_K4(attn_bwd_f16_d128_causal_k4x2, 128, false, true, false, BH_K4_VAR)
BH_BWD_K4(attn_bwd_f16_d128_interval_k4x2, 128, false, false, true, BH_K4_VAR)
BH_BWD_K4(attn_bwd_bf16_d64_full_k4x2, 64, true, false, false, BH_K4_VAR)
BH_BWD_K4(attn_bwd_bf16_d64_causal_k4x2, 64, true, true, false, BH_K4_VAR)
BH_BWD_K4(attn_bwd_bf16_d64_interval_k4x2, 64, true, false, true, BH_K4_VAR)
BH_BWD_K4(attn_bwd_f16_d64_full_k4x2, 64, false, false, false, BH_K4_VAR)
BH_BWD_K4(attn_bwd_f16_d64_causal_k4x2, 64, false, true, false, BH_K4_VAR)
BH_BWD_K4(attn_bwd_f16_d64_interval_k4x2, 64, false, false, true, BH_K4_VAR)

// delta[b, h, s] = sum_d do[b, s, h, d] * o[b, s, h, d]; one warp per (b, s, h) row.
// kinds: 0 = bf16, 1 = fp16, 2 = fp32 (for do and o independently).
__device__ __forceinline__ float load_kind(const void* p, i64 i, int kind) {
  if (kind == 2) return static_cast<const float*>(p)[i];
  const u16 bits = static_cast<const u16*>(p)[i];
  return kind == 0 ? bf16_bits_to_float(bits) : half_bits_to_float(bits);
}

extern "C" __global__ void __launch_bounds__(256)
    attn_delta(const void* dout, const void* o, float* delta, i64 gsb, i64 gss, i64 gsh, i64 osb, i64 oss, i64 osh,
               int B, int S, int H, int D, int gkind, int okind) {
  const i64 row = static_cast<i64>(blockIdx.x) * 8 + (threadIdx.x >> 5);
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
