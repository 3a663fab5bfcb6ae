/* The kernel library's interface: every function it exports (the ones Python calls through
 * ctypes, declared in signatures.py), the weight kinds, the instruction-set levels and the ABI.
 * This header is the one source of the ABI number and the group size: the C code uses the
 * macros below, and library.py reads them from this file (tests/engine/
 * test_engine_kernel_header.py checks signatures.py and the built library's symbols against
 * these prototypes). Helpers shared between the C files live in qgemm.h, hidden from the
 * library's exports. */
#ifndef SLOTSERVE_KERNELS_H
#define SLOTSERVE_KERNELS_H
#include <stddef.h>
#include <stdint.h>

/* Raised whenever a prototype below changes: a library of another ABI is never loaded. */
#define SLOTSERVE_KERNEL_ABI 18
/* Quantized weights per scale (and minimum) along K, both quantized formats. */
#define SLOTSERVE_KERNEL_GROUP 32

/* Weight formats (native_decode.py's KINDS, slotserve_dequantize's `kind`). */
/* BF16: packed (slotserve_gemm_bf16); I16: packed int16 (slotserve_gemm_int16). */
enum kind { F32 = 0, Q8 = 1, Q4 = 2, BF16 = 3, I16 = 4 };

/* Instruction sets, narrowest first (kernels/__init__.py's ISAS): what slotserve_kernel_isa()
 * returns (nonzero: the AVX2/FMA code of every kernel runs; ISA_AVX512: the fp32 panel products
 * run 512 bits wide too; ISA_AVX512_BF16: bf16 weights multiply with VDPBF16PS, below it they
 * are widened to fp32 first). */
enum { ISA_C = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_BF16 = 3 };

/* A caller's workspace (one per runner, owned by Python): buffers are carved from it front to
 * back and given back in reverse, so a step allocates nothing. When it is too small (the first
 * call of a larger shape), a buffer comes from malloc instead, `needed` records the size the
 * whole call wanted, and the caller grows the workspace for the next call. */
struct scratch {
    char *base;
    size_t size, used, needed;
};

/* llama_step.c: a model's shapes and weight pointers (native_decode.py's StepModel). */
struct step_model;

/* A product the caller computes for the step when it has at least step_model.wide_rows rows:
 * y[m,n] = x[m,k] . W^T in bf16 for product `which` (q/k/v, o, gate/up, down) of layer `layer`,
 * bias left to the step; x and y are bf16 bits, m a multiple of 16 whose rows past the step's
 * are zeros (the step rounds its rows and widens the result with AVX-512, where torch's
 * conversions took a tenth of a prefill on an AMX Xeon). The engine passes one that runs bf16
 * GEMMs through torch's oneDNN (AMX or AVX512_BF16) for prefill chunks. Returns 0, or nonzero
 * when it failed. */
typedef int (*slotserve_wide_product)(int64_t layer, int64_t which, const uint16_t *x, int64_t m,
                                      int64_t k, uint16_t *y, int64_t n);

/* ---- the library itself (dispatch.c) ---- */
int slotserve_kernel_abi(void);        /* SLOTSERVE_KERNEL_ABI */
int slotserve_kernel_group_size(void); /* SLOTSERVE_KERNEL_GROUP */
int slotserve_kernel_isa(void);
int slotserve_kernel_supported_isa(void);
/* Use `level` (ISA_C, ISA_AVX2, ISA_AVX512) or the widest below it this CPU has; returns it. */
int slotserve_kernel_set_isa(int level);
/* attention_amx.c: whether bf16 products of 16 rows or more (gemm_amx.c) and bf16 prefill
 * attention run on AMX tiles (the CPU has AMX-BF16, the kernel granted the tiles' state, the
 * ISA in use is ISA_AVX512_BF16 and no test turned them off); set_amx turns them on or off and
 * returns what runs. */
int slotserve_kernel_amx(void);
int slotserve_kernel_set_amx(int enabled);
/* int16.c: what int16 products run: 2 VPDPWSSD (the CPU has AVX512_VNNI and the ISA in use is
 * ISA_AVX512 or wider), 1 VPMADDWD (ISA_AVX2 in use), 0 the plain C version; all three give the
 * same results to the bit. */
int slotserve_kernel_int16(void);
/* llama_step.c: whether the native step fuses its layers (the norms writing the products' bf16
 * rows, one MLP call, o and down added into the residual stream) where its products are bf16;
 * on by default, turned off by tests to compare with the products one by one. Returns it. */
int slotserve_kernel_set_fused_layers(int enabled);
/* llama_step.c: layers the native step has run fused so far (process-wide; tests read it). */
uint64_t slotserve_kernel_fused_layers_run(void);
/* Buffers taken from malloc because a workspace was missing or short (process-wide). */
uint64_t slotserve_kernel_fallback_allocations(void);
/* Prefetch distance in bytes (negative: the default). */
void slotserve_kernel_set_prefetch(int64_t bytes);

/* ---- quantize (quantize.c), dequantize (products.c): k a multiple of the group ---- */
void slotserve_quantize_q8(const float *w, int64_t n, int64_t k, int8_t *q, float *scale,
                           int threads);
void slotserve_quantize_q4(const float *w, int64_t n, int64_t k, uint8_t *q, float *scale,
                           float *minimum, int threads);
void slotserve_dequantize(int kind, const void *data, const float *scale, const float *minimum,
                          int64_t n, int64_t k, float *out, int threads);

/* ---- products y[m,n] = x[m,k] . W[n,k]^T (products.c): 0, or -1 when out of memory ---- */
int slotserve_gemm_f32(const float *x, int64_t m, int64_t k, const float *w, int64_t n, float *y,
                       int threads, struct scratch *s);
int slotserve_gemm_q8(const float *x, int64_t m, int64_t k, const int8_t *w, const float *scale,
                      int64_t n, float *y, int threads, struct scratch *s);
/* Packed bf16 weights (k even): channels in blocks of 16 (the last padded with zeros), block b
 * holding for each column pair p the 16 channels' weights (2p, 2p + 1) side by side, i.e.
 * bf16[ceil(N/16), K/2, 16, 2]. The rows of x are rounded to bf16 and the products accumulated
 * in fp32, on every instruction set (bf16_avx512.c where the CPU has AVX512_BF16). */
int slotserve_gemm_bf16(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                        float *y, int threads, struct scratch *s);
int slotserve_gemm_q4(const float *x, int64_t m, int64_t k, const uint8_t *w, const float *scale,
                      const float *minimum, int64_t n, float *y, int threads, struct scratch *s);
/* int8 (kind Q8) or int4 (Q4) weights, k a multiple of 32, with the rows of x rounded to bf16
 * and the weights widened to bf16 (quantized_bf16.c): what a quantized model's prefill chunks
 * and wide decode steps take where the CPU has AVX512_BF16 (llama_step.c's bf16_quantized).
 * Returns 0, or -1 when a buffer could not be allocated or the kind or k is not one it takes. */
int slotserve_gemm_quantized_bf16(int kind, const float *x, int64_t m, int64_t k, const void *data,
                                  const float *scale, const float *minimum, int64_t n, float *y,
                                  int threads, struct scratch *s);
/* Packed int16 weights (k even): packed bf16's layout holding integers within +-8191, each
 * channel's scale in scale[ceil(N/16) * 16] (zeros past N): weight = integer * scale. The rows of
 * x are scaled to integers within +-4095 per group of 64 columns, each group's int32 sums exact,
 * then scaled and summed in fp32 (int16.c; slotserve_kernel_int16() says which code runs). Returns
 * 0, or -1 when a buffer could not be allocated or k is odd. */
int slotserve_gemm_int16(const float *x, int64_t m, int64_t k, const int16_t *w, const float *scale,
                         int64_t n, float *y, int threads, struct scratch *s);
/* A decoder's MLP on packed bf16 weights: y[m, hidden] = down(silu(gate(x)) * up(x)), gate_up
 * the gate's and the up's inter channels stacked, down hidden channels of inter. One fused pass
 * on the AMX tiles where they run (gemm_amx.c), or on VDPBF16PS where the kernels run
 * AVX512_BF16 (bf16_avx512.c): what a bf16 step of llama_step.c takes; else the two products
 * with SiLU between. */
int slotserve_mlp_bf16(const float *x, int64_t m, int64_t hidden, const uint16_t *gate_up,
                       const uint16_t *down, int64_t inter, float *y, int threads,
                       struct scratch *s);

/* ---- attention (attention.c) ---- */
/* Softmax attention of one query token per row over cache row slots[r] (r itself when slots is
 * NULL), positions [0, lens[r]); q and out [rows, kv_heads, group, d]; caches [slots, kv_heads,
 * max_len, d] of floats, or of fp16 (IEEE half bits, read widened to fp32) when kv_half is
 * nonzero. Returns 0, or -1 when a buffer could not be allocated. */
int slotserve_attend(const float *q, const void *k, const void *v, int kv_half, int64_t rows,
                     const int64_t *slots, int64_t kv_heads, int64_t group, int64_t d,
                     int64_t max_len, const int64_t *lens, float scale, float *out, int threads,
                     struct scratch *s);
/* slotserve_attend with the blocks of a prefill chunk's rows in bf16 (queries, keys, values and
 * probabilities rounded to bf16, sums in fp32) where the CPU has AVX512_BF16; fp32 elsewhere. */
int slotserve_attend_bf16(const float *q, const void *k, const void *v, int kv_half, int64_t rows,
                          const int64_t *slots, int64_t kv_heads, int64_t group, int64_t d,
                          int64_t max_len, const int64_t *lens, float scale, float *out,
                          int threads, struct scratch *s);
/* slotserve_attend with row r reading cache row r. */
int slotserve_decode_attention(const float *q, const void *k, const void *v, int kv_half,
                               int64_t rows, int64_t kv_heads, int64_t group, int64_t d,
                               int64_t max_len, const int64_t *lens, float scale, float *out,
                               int threads, struct scratch *s);

/* ---- a whole decode step (llama_step.c) ---- */
int slotserve_llama_step(const struct step_model *model, int64_t m, float *x, const float *cos,
                         const float *sin, const int64_t *slots, const int64_t *positions,
                         int threads, struct scratch *s);
#endif
