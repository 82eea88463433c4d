// What every kernel source tells the host, in one format (burst_hpc/backends/cuda/contract.py reads this
// file as text and each source's kernel table from its compiled module): the dtype and mask codes, how a
// source's list of shapes becomes its kernels, the row of a kernel table, and each family kernel's arguments.
#pragma once

// the integer types of kernel arguments (and of the kernels)
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// ---- codes: the dtype and mask columns of a kernel table, and attn_delta's kind arguments
#define BH_DTYPE_bf16 0
#define BH_DTYPE_f16 1
#define BH_DTYPE_f32 2
#define BH_MASK_full 0
#define BH_MASK_causal 1
#define BH_MASK_interval 2
#define BH_ANY -1  // a column a kernel does not fix (attn_delta: dtype, head dim, mask)

// the template flags of a dtype token (bf16 | f16) and a mask token (full | causal | interval)
#define BH_IS_BF16(DT) (BH_DTYPE_##DT == BH_DTYPE_bf16)
#define BH_IS_CAUSAL(MASK) (BH_MASK_##MASK == BH_MASK_causal)
#define BH_IS_INTERVAL(MASK) (BH_MASK_##MASK == BH_MASK_interval)

// A source lists its instances once, as shapes: `#define <FAMILY>_SHAPES(X) X(D, ...) X(D, ...)`, head dim
// first. Every shape is instantiated in both 16-bit dtypes with each of the three masks: K(dtype, mask, shape).
#define BH_ALL_DTYPES_AND_MASKS(K, ...)                                                   \
  K(bf16, full, __VA_ARGS__) K(bf16, causal, __VA_ARGS__) K(bf16, interval, __VA_ARGS__) \
  K(f16, full, __VA_ARGS__) K(f16, causal, __VA_ARGS__) K(f16, interval, __VA_ARGS__)
// (two names: a macro does not expand inside its own expansion, and a selected shape expands its variants)
#define BH_APPLY_SHAPE(F, ...) F(__VA_ARGS__)
#define BH_APPLY_VARIANT(F, ...) F(__VA_ARGS__)

// What one compile builds (burst_hpc/backends/cuda/compile.py chooses): by default every instance and the
// whole table; with BH_TABLE_ONLY defined the kernel table alone (no instance: the host reads every
// kernel's geometry from it); with `#define BH_SELECT_DTYPE bf16`, `#define BH_SELECT_MASK causal` and
// `#define BH_SELECT_SHAPE 128, 2` (a shape of the source's list) before the source, one instance and its
// table row. A source writes its kernels as BH_INSTANCES(<FAMILY>_SHAPES, <per shape>) and
// its rows as BH_TABLE_ROWS(<FAMILY>_SHAPES, <per shape>), each per-shape macro expanding
// BH_EACH_DTYPE_AND_MASK(K, shape).
#if defined(BH_SELECT_SHAPE)
#define BH_EACH_DTYPE_AND_MASK(K, ...) BH_APPLY_VARIANT(K, BH_SELECT_DTYPE, BH_SELECT_MASK, __VA_ARGS__)
#define BH_INSTANCES(SHAPES, K) BH_APPLY_SHAPE(K, BH_SELECT_SHAPE)
#define BH_TABLE_ROWS(SHAPES, K) BH_APPLY_SHAPE(K, BH_SELECT_SHAPE)
#else
#define BH_EACH_DTYPE_AND_MASK(K, ...) BH_ALL_DTYPES_AND_MASKS(K, __VA_ARGS__)
#if defined(BH_TABLE_ONLY)
#define BH_INSTANCES(SHAPES, K)
#else
#define BH_INSTANCES(SHAPES, K) SHAPES(K)
#endif
#define BH_TABLE_ROWS(SHAPES, K) SHAPES(K)
#endif

#define BH_STR(x) BH_STR_(x)
#define BH_STR_(x) #x

// One row of a source's kernel table: a kernel's name, what it runs (dtype and mask codes, head dim) and its
// geometry: query rows per tile, keys per tile (forward) or per CTA (backward), threads per CTA, dynamic
// shared memory bytes. A source <s>.cu exports the table <s>_kernels and its length <s>_kernel_count.
#define BH_NAME_BYTES 48
struct KernelRow {
  char name[BH_NAME_BYTES];
  int dtype, head_dim, mask, query_rows, keys, threads, smem_bytes;
};
#define BH_KERNEL_TABLE(SOURCE, ...)                                     \
  extern "C" __constant__ KernelRow SOURCE##_kernels[] = {__VA_ARGS__}; \
  extern "C" __constant__ int SOURCE##_kernel_count = sizeof(SOURCE##_kernels) / sizeof(KernelRow);

// ---- kernel arguments: one struct per family kernel, passed by value (`const __grid_constant__ <Params> args`,
// in parameter space), and on by value to the kernel's device function (its fields then load once at entry,
// as scalar arguments did; read through a reference, ptxas allocated registers differently). The host builds
// each as a NumPy record from this text (contract.params_dtype), so a field is written here and set by name in
// Python. The grammar it reads: one declaration per `;` of `int`, `float`, `i64`, a pointer (`const`, `*`
// allowed) or a struct defined above, several names to a declaration; a struct may derive from one above.
// Strides are in elements.

// The block pair every attention kernel runs (the block contract's shapes, scale, q_start - k_start, mask).
struct PairParams {
  const int *mlo, *mhi;   // interval masks: each query row's visible global keys [mlo, mhi) (else null)
  i64 kofs;               // interval masks: the global position of local key 0
  i64 off;                // q_start - k_start: causal masks hide key j from query i when j > i + off
  int Sq, Sk;             // query rows, keys
  int B, Hq, Hkv, group;  // batch, query heads, kv heads, query heads per kv head
  float scale, sl2;       // softmax scale, and scale * log2(e) (the softmax runs in base 2)
};

// sm80 forward (attn_fwd.cu): q, k, v (B, S, H, D) 16-bit; the running o (B, S, H, D) and lse (B, H, S)
struct Fwd80Params : PairParams {
  const u16 *q, *k, *v;
  float *o, *lse;
  i64 qsb, qss, qsh, ksb, kss, ksh, vsb, vss, vsh, osb, oss, osh, lsb, lsh, lss;
};

// sm80 backward (attn_bwd.cu): dout, its gradient input (strides gsb, ...); lse, delta (B, H, S); the float32
// accumulators dq, dk, dv; atomic_kv: several CTAs add into one dk, dv row; order_g: head slots per chunk of
// the causal tile order
struct Bwd80Params : PairParams {
  const u16 *q, *k, *v, *dout;
  const float *lse, *delta;
  float *dq, *dk, *dv;
  i64 qsb, qss, qsh, ksb, kss, ksh, vsb, vss, vsh, gsb, gss, gsh, lsb, lsh, lss, dsb, dsh, dss;
  i64 qgsb, qgss, qgsh, kgsb, kgss, kgsh, vgsb, vgss, vgsh;
  int hpb, atomic_kv, order_g;  // query heads per CTA; the two above
};

// sm90 forward (attn_fwd_sm90.cu, where the fields are described at its instances)
struct Fwd90Params : PairParams {
  const unsigned char* tmaps;  // the q, k, v tensor maps, 128 bytes each, in global memory
  float *o, *lse;              // the running (o, lse)
  u16* out;                    // null, or the final output in the kernel's dtype
  const int* order;
  int *next_tile, *locks;
  i64 osb, oss, osh, lsb, lsh, lss, tsb, tss, tsh;  // o, lse, out
  int hchunk, nsplit, cross_tile, first;
  int nq;  // query tiles of the schedule: ceil(Sq / BM), or under interval masks the order's (first, end) pairs
  int pack_log2;  // interval masks: a tile's rows are BM >> pack_log2 positions x (1 << pack_log2) query heads
};

// The sm90 backward's dk_out, dv_out, the block contract's (the last pair of these keys; the host passes them
// only when one CTA holds the whole GQA group of its keys and the pair is the first too): scale * dK and dV go
// there in the kernel's 16-bit type, straight from the registers, instead of being added into the float32 dk,
// dv. Null dk: the float32 reductions. Rows 16-byte aligned; dk and dv share strides.
struct KvOut {
  u16 *dk, *dv;
  i64 sb, ss, sh;
};

// sm90 backward (attn_bwd_sm90.cu, where the fields are described at its instances)
struct Bwd90Params : PairParams {
  const unsigned char* tmaps;  // the q, k, v, do (16-bit) and dq, dk, dv (float32) tensor maps
  const float* rows;
  const int *ranges, *order, *tiles;
  KvOut kv;
  int Sq_pad, hpb, nkb;
};
