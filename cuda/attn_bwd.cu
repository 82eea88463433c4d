// sm80 family: attention backward over one (query block, key block) pair, added into float32 (dq, dk, dv),
// with mma.sync m16n8k16, ldmatrix and cp.async (the sm90 family's own backward: attn_bwd_sm90.cu).
//
// Layout k4x2: a CTA of 8 warps owns BN = 128 keys of one (batch, kv head) and walks every query tile
// (BM = 64 rows) of the query heads it was given (all of the GQA group, or a slice of it when the grid
// needs more CTAs); K and V stay resident in shared memory, the key side is the MMA "M" dimension:
//   * S^T = K Q^T, dP^T = V dO^T: warp (kb, hh) = (w >> 1, w & 1) computes 32 keys [32 kb, +32) x 32
//     queries [32 hh, +32): per k16 step 2 K and 2 Q fragments feed 8 MMAs (and the same for V, dO),
//     about 0.42 ldmatrix.x4 per MMA.
//   * P^T = exp2(S^T * scale*log2e - lse*log2e), dS^T = P^T (dP^T - delta), packed to 16 bits, kept in
//     registers and also written to swizzled shared memory.
//   * dV += P^T dO and dK += dS^T Q: the same warp owns keys [32 kb, +32) x head-dim half hh; its own
//     32 queries come from registers, the partner warp's (w ^ 1) 32 queries from shared memory.
//     dK, dV (32 keys x D/2 each) stay in registers for the whole walk and are added once at the end
//     (plain read-add-write when this CTA is their only writer, atomics when the group is split).
//   * dQ = dS K: warps re-split 2 (32 queries) x 4 (D/4 columns), float2 atomics into global dq.
// Q, dO, lse, delta for tile it+1 are loaded (cp.async) during tile it; two barriers per tile.
// Rows with lse = -inf (nothing visible in the forward) get P = 0 (a NaN lse gives NaN: non-finite inputs
// propagate; the mask selects P = 0, it never multiplies); out-of-range query rows are
// zero-filled (their dO and delta are 0, so they add nothing); out-of-range keys are masked.
#include "common.cuh"
#include "contract.cuh"

namespace bwd80 {
// Layout k4x2: a CTA of THREADS / 32 warps owns BN keys and walks query tiles of BM rows.
template <int D>
struct Cfg {
  static constexpr int BM = 64, BN = 128, THREADS = 256;
  // shared memory: K and V (BN x D), two stages of Q and of dO tiles (BM x D), P^T and dS^T (BN x BM), all
  // 16-bit; then two stages of lse and of delta rows (BM floats), and with interval masks (IV) two of the
  // rows' key bounds mlo and mhi (BM ints)
  static constexpr int smem_bytes(bool iv) {
    return (2 * BN * D + 4 * BM * D + 2 * BN * BM) * 2 + (iv ? 8 : 4) * BM * 4;
  }
};
}  // namespace bwd80

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

// Interval masks (IV: documents, windows; see attn_fwd.cu and docs/KERNELS.md "Masks"): local query
// row r sees global keys [mlo[r], mhi[r]), local key c sits at global kofs + c. A CTA walks only the
// query tiles whose rows see one of its keys (two binary searches: both bounds never decrease with r),
// and each tile's bounds travel with its lse/delta through shared memory.
template <int D, bool BF16, bool CAUSAL, bool IV>
__device__ __forceinline__ void attn_bwd_k4x2(const Bwd80Params args) {
  using C = bwd80::Cfg<D>;
  constexpr int BM = C::BM, BN = C::BN, NT = C::THREADS;
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
  const int nkb = (args.Sk + BN - 1) / BN, nsplit = args.group / args.hpb;
  const int nh = static_cast<int>(gridDim.x) / nkb;  // (batch, kv head, split) slots
  const int lin = blockIdx.x;
  const int chunk = lin / (args.order_g * nkb);
  const int rem = lin - chunk * args.order_g * nkb;
  const int gc = min(args.order_g, nh - chunk * args.order_g);
  const int slot = chunk * args.order_g + rem % gc;
  const int n0 = (rem / gc) * BN;
  const int hs = slot % nsplit;
  const int bz = slot / nsplit;
  const int b = bz / args.Hkv, hk = bz % args.Hkv;
  const int h_first = hk * args.group + hs * args.hpb;

  int m_begin = 0, m_end = args.Sq;
  if (CAUSAL) {
    const i64 first = static_cast<i64>(n0) - args.off;  // first query that sees key n0
    if (first >= args.Sq) return;
    m_begin = first <= 0 ? 0 : static_cast<int>(first / BM) * BM;
  }
  if (IV) {
    // the rows that see a key of [n0, n_last]: mhi[r] > n0 and mlo[r] <= n_last (global positions)
    const int first = first_above(args.mhi, args.Sq, args.kofs + n0);
    m_end = first_above(args.mlo, args.Sq, args.kofs + min(n0 + BN, args.Sk) - 1);
    if (first >= m_end) return;
    m_begin = (first / BM) * BM;
  }
  const int nmt = (m_end - m_begin + BM - 1) / BM;
  const int total = nmt * args.hpb;
  if (total <= 0) return;

  load_tile<BN, D, NT>(sK, args.k + b * args.ksb + hk * args.ksh + static_cast<i64>(n0) * args.kss, args.kss,
                       args.Sk - n0, tid);
  load_tile<BN, D, NT>(sV, args.v + b * args.vsb + hk * args.vsh + static_cast<i64>(n0) * args.vss, args.vss,
                       args.Sk - n0, tid);

  auto load_q = [&](int it, int stage) {
    const int h = h_first + it / nmt;
    const int m0 = m_begin + (it % nmt) * BM;
    load_tile<BM, D, NT>(sQ + stage * BM * D * 2,
                         args.q + b * args.qsb + h * args.qsh + static_cast<i64>(m0) * args.qss, args.qss, args.Sq - m0,
                         tid);
    load_tile<BM, D, NT>(sDO + stage * BM * D * 2,
                         args.dout + b * args.gsb + h * args.gsh + static_cast<i64>(m0) * args.gss, args.gss,
                         args.Sq - m0, tid);
    if (tid < BM) {
      const int r = m0 + tid;
      const bool ok = r < args.Sq;
      const i64 rr = ok ? r : 0;
      cp_async4(smem_u32(sL + stage * BM + tid), args.lse + b * args.lsb + h * args.lsh + rr * args.lss, ok);
      cp_async4(smem_u32(sDl + stage * BM + tid), args.delta + b * args.dsb + h * args.dsh + rr * args.dss, ok);
      if (IV) {  // rows past Sq read 0, 0: nothing visible
        cp_async4(smem_u32(sLo + stage * BM + tid), args.mlo + rr, ok);
        cp_async4(smem_u32(sHi + stage * BM + tid), args.mhi + rr, ok);
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
  // Swizzled offsets as base ^ (column step): the XOR swizzle c ^ (r & 7) with r & 7 fixed per thread and
  // the column step on bits the in-row chunk index does not use, so each ldmatrix address is one XOR
  // (+ a row immediate) from a handful of per-thread bases (fewer live registers than tile_off per load).
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
        const u32 o = (oK0 ^ (kk * 32)) + i * 16 * D * 2;
        ldsm_x4(sK + o, ka[i][0], ka[i][1], ka[i][2], ka[i][3]);
        ldsm_x4(sV + o, va[i][0], va[i][1], va[i][2], va[i][3]);
      }
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        const u32 o = (oQ0 ^ (kk * 32)) + np * 16 * D * 2;
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
    const i64 kw0 = args.kofs + n0 + wk_lo;  // IV: global position of this warp's first key
    // IV: the bounds of rows past Sq read as 0 and break their order, so the test uses the warp's last valid row
    const int last_row = min(hh * 32 + 31, args.Sq - 1 - m0);
    const bool need_mask = (wk_max >= args.Sk) ||
                           (CAUSAL && static_cast<i64>(wk_max) > static_cast<i64>(qw0) + args.off) ||
                           (IV && !(last_row >= hh * 32 && sLot[last_row] <= kw0 && sHit[hh * 32] >= kw0 + 32));
    // Mask by constant offsets: key (tile-local) kl = kt + i*16 + (e>>1)*8 and query qw0 + qt + nt*8 + (e&1),
    // with this thread's kt = wk_lo + (lane>>2), qt = (lane&3)*2. Hidden when n0 + kl >= Sk, or (causal)
    // n0 + kl > query + off  <=>  i*16 + (e>>1)*8 - nt*8 - (e&1) > cthr. Both thresholds fit an int after
    // clamping (the left sides lie in [-32, 32)).
    const int kthr = args.Sk - n0 - wk_lo - (lane >> 2);
    int cthr = 0;
    if (CAUSAL) {
      const i64 t = static_cast<i64>(qw0) + (lane & 3) * 2 + args.off - n0 - wk_lo - (lane >> 2);
      cthr = static_cast<int>(t < -64 ? -64 : (t > 64 ? 64 : t));
    }
    u32 pa[2][2][4], da[2][2][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      float l2[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = sLt[hh * 32 + nt * 8 + (lane & 3) * 2 + e];
        l2[e] = (x == -BH_INF) ? BH_INF : x * BH_LOG2E;
      }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) sT[i][nt][e] = fast_exp2(sT[i][nt][e] * args.sl2 - l2[e & 1]);
    }
    // the mask as its own warp-uniform pass, so tiles off the diagonal and the tail skip it entirely
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
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      float dl[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) dl[e] = sDlt[hh * 32 + nt * 8 + (lane & 3) * 2 + e];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) pT[i][nt][e] = sT[i][nt][e] * (pT[i][nt][e] - dl[e & 1]);
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const u32 pw = pack2<BF16>(sT[i][nt][2 * rr], sT[i][nt][2 * rr + 1]);
          const u32 dw = pack2<BF16>(pT[i][nt][2 * rr], pT[i][nt][2 * rr + 1]);
          pa[i][nt >> 1][(nt & 1) * 2 + rr] = pw;
          da[i][nt >> 1][(nt & 1) * 2 + rr] = dw;
          const u32 widx = ((oW0 ^ (nt * 16)) + (i * 16 + rr * 8) * BM * 2) / 4 + (lane & 3);
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
          const u32 o = (oA0 ^ (c * 32)) + i * 16 * BM * 2;
          ldsm_x4(sP + o, A[i][0], A[i][1], A[i][2], A[i][3]);
          ldsm_x4(sDS + o, Ad[i][0], Ad[i][1], Ad[i][2], Ad[i][3]);
        }
      }
#pragma unroll
      for (int dp = 0; dp < DH / 16; ++dp) {
        const u32 o = (oB0 ^ (hh * DH * 2 + dp * 32)) + c * 16 * D * 2;
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
          ldsm_x4_t(sDS + (oQA0 ^ ((wq * 4 + i * 2) * 16)) + kk * 16 * BM * 2, a[i][0], a[i][1], a[i][2], a[i][3]);
#pragma unroll
        for (int dp = 0; dp < DQC / 16; ++dp) {
          u32 b0, b1, b2, b3;
          ldsm_x4_t(sK + (oB0 ^ ((wd * (DQC / 8) + dp * 2) * 16)) + kk * 16 * D * 2, b0, b1, b2, b3);
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
          if (row < args.Sq) {
            float* p = args.dq + b * args.qgsb + h * args.qgsh + static_cast<i64>(row) * args.qgss + wd * DQC +
                       (lane & 3) * 2;
#pragma unroll
            for (int t = 0; t < DQC / 8; ++t)
              atomicAdd(reinterpret_cast<float2*>(p + t * 8),
                        make_float2(dqa[i][t][2 * rr] * args.scale, dqa[i][t][2 * rr + 1] * args.scale));
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
      if (key < args.Sk) {
        float* pk =
            args.dk + b * args.kgsb + hk * args.kgsh + static_cast<i64>(key) * args.kgss + hh * DH + (lane & 3) * 2;
        float* pv =
            args.dv + b * args.vgsb + hk * args.vgsh + static_cast<i64>(key) * args.vgss + hh * DH + (lane & 3) * 2;
#pragma unroll
        for (int t = 0; t < DH / 8; ++t) {
          const float2 gk = make_float2(dka[i][t][2 * rr] * args.scale, dka[i][t][2 * rr + 1] * args.scale);
          const float2 gv = make_float2(dva[i][t][2 * rr], dva[i][t][2 * rr + 1]);
          float2* ak = reinterpret_cast<float2*>(pk + t * 8);
          float2* av = reinterpret_cast<float2*>(pv + t * 8);
          if (args.atomic_kv) {
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

#define BH_BWD80_NAME(DT, MASK, D) attn_bwd_##DT##_d##D##_##MASK##_k4x2
#define BH_BWD80_KERNEL(DT, MASK, D)                                                  \
  extern "C" __global__ void __launch_bounds__(bwd80::Cfg<D>::THREADS)                \
      BH_BWD80_NAME(DT, MASK, D)(const __grid_constant__ Bwd80Params args) {          \
    attn_bwd_k4x2<D, BH_IS_BF16(DT), BH_IS_CAUSAL(MASK), BH_IS_INTERVAL(MASK)>(args); \
  }
#define BH_BWD80_ROW(DT, MASK, D)                                                                          \
  {BH_STR(BH_BWD80_NAME(DT, MASK, D)), BH_DTYPE_##DT, D, BH_MASK_##MASK, bwd80::Cfg<D>::BM,              \
   bwd80::Cfg<D>::BN, bwd80::Cfg<D>::THREADS, bwd80::Cfg<D>::smem_bytes(BH_IS_INTERVAL(MASK))},
#define BH_BWD80_KERNELS(D) BH_EACH_DTYPE_AND_MASK(BH_BWD80_KERNEL, D)
#define BH_BWD80_ROWS(D) BH_EACH_DTYPE_AND_MASK(BH_BWD80_ROW, D)

// The instances, listed once: each head dim X(D) in bf16 and f16 with the full, causal and interval masks,
// named attn_bwd_<dtype>_d<D>_<mask>_k4x2; the kernel table attn_bwd_kernels lists them with their geometry.
#define BH_BWD80_SHAPES(X) X(128) X(64)
BH_INSTANCES(BH_BWD80_SHAPES, BH_BWD80_KERNELS)
BH_KERNEL_TABLE(attn_bwd, BH_TABLE_ROWS(BH_BWD80_SHAPES, BH_BWD80_ROWS))
