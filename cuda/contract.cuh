// What every kernel source tells the host, in one format (burst_hpc/backends/cuda/contract.py reads this
// file as text and each source's kernel table from its compiled module): the dtype and mask codes, how a
// source's list of shapes becomes its kernels, and the row of a kernel table.
#pragma once

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
