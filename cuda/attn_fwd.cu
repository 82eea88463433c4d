// Attention forward over one (query block, key block) pair, merged into a running (o, lse).
//
// FlashAttention-2 layout: a CTA owns BM = 128 query rows of one (batch, query head); 4 warps each
// own 32 rows (two m16 tiles), so the softmax state never leaves a warp. Q is loaded once (cp.async -> swizzled
// shared memory -> ldmatrix -> registers); K and V tiles of BN keys stream through a two-stage
// cp.async pipeline. S = Q K^T and O += P V run on mma.sync m16n8k16 (bf16 or fp16, fp32 accumulate),
// the online softmax runs in base 2 (ex2.approx). The epilogue merges the block result into the
// caller's float32 (o, lse) in place (GAO), so no separate pass over o is needed.
//
// Non-finite inputs: fmaxf drops a NaN score from the running max, but exp2 of it is NaN, so the row
// sum, then lse and o, are NaN; the epilogue reads only a row sum of exactly 0 as "nothing visible",
// and only a running lse of -inf as "nothing merged yet", so a NaN row stays NaN through every merge.
//
// Causal masking is on global positions: key j is hidden from query i when j > i + off, with
// off = q_start - k_start. Key tiles wholly hidden are never loaded, tiles wholly visible skip the
// mask, and only tiles that straddle the diagonal (or the key tail) are masked.
//
// Interval masks (IV: documents, sliding windows; docs/KERNELS.md "Masks"): local query row r sees
// the keys whose global position lies in [mlo[r], mhi[r]); local key c sits at global kofs + c.
// Both bounds never decrease with r, so a CTA's keys run from mlo[first row] to mhi[last row] and a
// warp's tile needs no mask when mlo[its last row] <= tile start and mhi[its first row] >= tile end.
#include "common.cuh"
#include "contract.cuh"

namespace fwd80 {
// The shape of a head dim's kernels: NW warps, each owning MT m16 row tiles (MT = 2: every K/V fragment read
// from shared memory feeds two MMAs, halving shared-memory traffic per FLOP against one tile per warp), and
// key tiles of BN.
template <int D>
struct Cfg {
  static constexpr int NW = 4, MT = 2, BN = 64;
  static constexpr int BM = NW * 16 * MT, THREADS = NW * 32;
  // shared memory: the Q tile (BM x D), then two stages of K tiles and two of V tiles (BN x D), 16-bit
  static constexpr int kSmemBytes = (BM * D + 2 * 2 * BN * D) * 2;
};
}  // namespace fwd80

template <int D, bool BF16, bool CAUSAL, bool IV>
__device__ __forceinline__ void attn_fwd(const Fwd80Params args) {
  using C = fwd80::Cfg<D>;
  constexpr int BN = C::BN, MT = C::MT, NT = C::THREADS, WM = 16 * MT, BM = C::BM;
  extern __shared__ __align__(128) unsigned char smem[];
  const u32 sQ = smem_u32(smem);
  const u32 sK = sQ + BM * D * 2;
  const u32 sV = sK + 2 * BN * D * 2;

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int mb = CAUSAL ? (gridDim.x - 1 - blockIdx.x) : blockIdx.x;  // heavy causal blocks first
  const int h = blockIdx.y, b = blockIdx.z, hk = h / args.group;
  const int m0 = mb * BM;

  int n_begin, n_end;
  tile_keys<CAUSAL, IV>(m0, BM, args.Sq, args.Sk, args.off, args.mlo, args.mhi, args.kofs, &n_begin, &n_end);
  if (n_end <= n_begin) return;  // nothing visible: (o, lse) stay as they are
  const int t_begin = n_begin / BN;
  const int ntiles = (n_end + BN - 1) / BN;

  const u16* qg = args.q + b * args.qsb + h * args.qsh + static_cast<i64>(m0) * args.qss;
  const u16* kg = args.k + b * args.ksb + hk * args.ksh;
  const u16* vg = args.v + b * args.vsb + hk * args.vsh;

  load_tile<BM, D, NT>(sQ, qg, args.qss, args.Sq - m0, tid);
  load_tile<BN, D, NT>(sK, kg + t_begin * BN * args.kss, args.kss, args.Sk - t_begin * BN, tid);
  load_tile<BN, D, NT>(sV, vg + t_begin * BN * args.vss, args.vss, args.Sk - t_begin * BN, tid);
  cp_async_commit();

  float acc[MT][D / 8][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int i = 0; i < D / 8; ++i) acc[m][i][0] = acc[m][i][1] = acc[m][i][2] = acc[m][i][3] = 0.f;
  float mrow[MT][2], lrow[MT][2];
#pragma unroll
  for (int m = 0; m < MT; ++m) mrow[m][0] = mrow[m][1] = -BH_INF, lrow[m][0] = lrow[m][1] = 0.f;
  const int row_lo = m0 + w * WM + (lane >> 2);  // rows row_lo + 16*m + 8*r
  // IV: the bounds are re-read (L1 hits) where needed rather than held: registers are at their limit
  const int w_first = min(m0 + w * WM, args.Sq - 1), w_last = min(m0 + w * WM + WM, args.Sq) - 1;

  for (int t = t_begin; t < ntiles; ++t) {
    const int st = (t - t_begin) & 1;
    if (t + 1 < ntiles) {
      const int n1 = (t + 1) * BN;
      load_tile<BN, D, NT>(sK + (st ^ 1) * BN * D * 2, kg + n1 * args.kss, args.kss, args.Sk - n1, tid);
      load_tile<BN, D, NT>(sV + (st ^ 1) * BN * D * 2, vg + n1 * args.vss, args.vss, args.Sk - n1, tid);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const u32 sKt = sK + st * BN * D * 2, sVt = sV + st * BN * D * 2;

    // S = Q K^T for this warp's WM rows x BN keys
    float s[MT][BN / 8][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) s[m][i][0] = s[m][i][1] = s[m][i][2] = s[m][i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      u32 qf[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m)
        ldsm_x4(sQ + tile_off<D>(w * WM + m * 16 + (lane & 15), kk * 2 + (lane >> 4)), qf[m][0], qf[m][1], qf[m][2],
                qf[m][3]);
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        u32 b0, b1, b2, b3;
        ldsm_x4(sKt + tile_off<D>(np * 16 + ((lane >> 4) << 3) + (lane & 7), kk * 2 + ((lane >> 3) & 1)), b0, b1,
                b2, b3);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          mma16816<BF16>(s[m][2 * np], qf[m], b0, b1);
          mma16816<BF16>(s[m][2 * np + 1], qf[m], b2, b3);
        }
      }
    }

    const int n0 = t * BN;
    const bool need_mask = (n0 + BN > args.Sk) ||
                           (CAUSAL && static_cast<i64>(n0 + BN - 1) > static_cast<i64>(m0 + w * WM) + args.off) ||
                           (IV && !(local_key(args.mlo[w_last], args.kofs, args.Sk) <= n0 &&
                                    local_key(args.mhi[w_first], args.kofs, args.Sk) >= n0 + BN));
    // scores are used as exp2(s * mul - max * mul); a non-positive scale is applied up front instead
    float mul = args.sl2;
    if (!(args.sl2 > 0.f)) {
      mul = 1.f;
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < BN / 8; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[m][i][e] *= args.sl2;
    }
    if (need_mask) {
      // hidden when (col - row) > off, col = n0 + i*8 + (lane&3)*2 + (e&1), row = row_lo + m*16 + (e>>1)*8
      const int cbase = n0 + (lane & 3) * 2;
      const i64 dlim = args.off - static_cast<i64>(cbase) + row_lo;  // hidden when i*8+(e&1)-m*16-(e>>1)*8 > dlim
      const int dl = static_cast<int>(max(static_cast<i64>(-4 * BN), min(static_cast<i64>(4 * BN), dlim)));
      const int klim = args.Sk - cbase;  // key out of range when i*8 + (e&1) >= klim
      int rlo[MT][2], rhi[MT][2];     // IV: this thread's rows see i*8 + (e&1) in [rlo, rhi)
      if (IV) {
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int row = min(row_lo + m * 16 + r * 8, args.Sq - 1);
            rlo[m][r] = local_key(args.mlo[row], args.kofs, args.Sk) - cbase;
            rhi[m][r] = local_key(args.mhi[row], args.kofs, args.Sk) - cbase;
          }
      }
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < BN / 8; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = i * 8 + (e & 1);
            const bool hid = (c >= klim) || (CAUSAL && c - m * 16 - (e >> 1) * 8 > dl) ||
                             (IV && (c < rlo[m][e >> 1] || c >= rhi[m][e >> 1]));
            if (hid) s[m][i][e] = -BH_INF;
          }
    }

    // online softmax (base 2)
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      float mx[2] = {-BH_INF, -BH_INF};
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
        mx[0] = fmaxf(mx[0], fmaxf(s[m][i][0], s[m][i][1]));
        mx[1] = fmaxf(mx[1], fmaxf(s[m][i][2], s[m][i][3]));
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        mx[r] = fmaxf(mrow[m][r], mx[r] * mul);  // running max, in scaled base-2 units
      }
      float mu[2], alpha[2], ls[2] = {0.f, 0.f};
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mu[r] = (mx[r] == -BH_INF) ? 0.f : mx[r];
        alpha[r] = fast_exp2(mrow[m][r] - mu[r]);
        mrow[m][r] = mx[r];
      }
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = fast_exp2(fmaf(s[m][i][e], mul, -mu[e >> 1]));
          s[m][i][e] = p;
          ls[e >> 1] += p;
        }
      }
      lrow[m][0] = lrow[m][0] * alpha[0] + ls[0];
      lrow[m][1] = lrow[m][1] * alpha[1] + ls[1];
      // the running max rarely moves once it has settled: skip the rescale when no row's did
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
          acc[m][i][0] *= alpha[0];
          acc[m][i][1] *= alpha[0];
          acc[m][i][2] *= alpha[1];
          acc[m][i][3] *= alpha[1];
        }
      }
    }

    // O += P V
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      u32 pa[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        pa[m][0] = pack2<BF16>(s[m][2 * kk][0], s[m][2 * kk][1]);
        pa[m][1] = pack2<BF16>(s[m][2 * kk][2], s[m][2 * kk][3]);
        pa[m][2] = pack2<BF16>(s[m][2 * kk + 1][0], s[m][2 * kk + 1][1]);
        pa[m][3] = pack2<BF16>(s[m][2 * kk + 1][2], s[m][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        u32 b0, b1, b2, b3;
        ldsm_x4_t(sVt + tile_off<D>(kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7), dp * 2 + (lane >> 4)), b0, b1,
                  b2, b3);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          mma16816<BF16>(acc[m][2 * dp], pa[m], b0, b1);
          mma16816<BF16>(acc[m][2 * dp + 1], pa[m], b2, b3);
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  // epilogue: GAO merge into the running (o, lse)
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      lrow[m][r] += __shfl_xor_sync(0xffffffffu, lrow[m][r], 1);
      lrow[m][r] += __shfl_xor_sync(0xffffffffu, lrow[m][r], 2);
    }
  }
  float lold[MT][2];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_lo + m * 16 + r * 8;
      lold[m][r] = (row < args.Sq) ? args.lse[b * args.lsb + h * args.lsh + row * args.lss] : -BH_INF;
    }
  __syncwarp();
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_lo + m * 16 + r * 8;
      // nothing visible only when the row sum is exactly 0: a NaN sum (the row saw a NaN or Inf) is merged
      // and makes lb, ln and the row's o NaN
      if (row < args.Sq && lrow[m][r] != 0.f) {
        const float lb = (mrow[m][r] + __log2f(lrow[m][r])) * BH_LN2;
        const float lo = lold[m][r];
        const bool fresh = lo == -BH_INF;  // nothing merged yet (a NaN lse is merged: the row stays NaN)
        const float ln = fresh ? lb : fmaxf(lo, lb) + log1pf(__expf(-fabsf(lo - lb)));
        const float wo = fresh ? 0.f : __expf(lo - ln);
        const float wb = __expf(lb - ln) / lrow[m][r];
        float* op = args.o + b * args.osb + h * args.osh + row * args.oss + (lane & 3) * 2;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
          float2 val = make_float2(acc[m][i][2 * r] * wb, acc[m][i][2 * r + 1] * wb);
          if (!fresh) {
            const float2 old = *reinterpret_cast<const float2*>(op + i * 8);
            val.x += old.x * wo;
            val.y += old.y * wo;
          }
          *reinterpret_cast<float2*>(op + i * 8) = val;
        }
        if ((lane & 3) == 0) args.lse[b * args.lsb + h * args.lsh + row * args.lss] = ln;
      }
    }
  }
}

#define BH_FWD80_NAME(DT, MASK, D) attn_fwd_##DT##_d##D##_##MASK
#define BH_FWD80_KERNEL(DT, MASK, D)                                             \
  extern "C" __global__ void __launch_bounds__(fwd80::Cfg<D>::THREADS)           \
      BH_FWD80_NAME(DT, MASK, D)(const __grid_constant__ Fwd80Params args) {     \
    attn_fwd<D, BH_IS_BF16(DT), BH_IS_CAUSAL(MASK), BH_IS_INTERVAL(MASK)>(args); \
  }
#define BH_FWD80_ROW(DT, MASK, D)                                                                      \
  {BH_STR(BH_FWD80_NAME(DT, MASK, D)), BH_DTYPE_##DT, D, BH_MASK_##MASK, fwd80::Cfg<D>::BM,          \
   fwd80::Cfg<D>::BN, fwd80::Cfg<D>::THREADS, fwd80::Cfg<D>::kSmemBytes},
#define BH_FWD80_KERNELS(D) BH_EACH_DTYPE_AND_MASK(BH_FWD80_KERNEL, D)
#define BH_FWD80_ROWS(D) BH_EACH_DTYPE_AND_MASK(BH_FWD80_ROW, D)

// The instances, listed once: each head dim X(D) in bf16 and f16 with the full, causal and interval masks,
// named attn_fwd_<dtype>_d<D>_<mask>; the kernel table attn_fwd_kernels lists them with their geometry.
#define BH_FWD80_SHAPES(X) X(128) X(64)
BH_INSTANCES(BH_FWD80_SHAPES, BH_FWD80_KERNELS)
BH_KERNEL_TABLE(attn_fwd, BH_TABLE_ROWS(BH_FWD80_SHAPES, BH_FWD80_ROWS))
