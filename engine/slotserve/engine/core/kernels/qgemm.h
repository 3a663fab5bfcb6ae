/* What the C files share beyond the library's interface (kernels.h): the weight format and
 * the product over it, the workspace's allocator, the AVX-512 panel product and a few inline
 * SIMD helpers. Hidden: none of these is exported from the library. */
#ifndef SLOTSERVE_QGEMM_H
#define SLOTSERVE_QGEMM_H
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

#pragma GCC visibility push(hidden)

struct weights {
    enum kind kind;
    const void *data;     /* float[N,K], int8[N,K], uint8[N,K/2] or packed (BF16, I16) */
    const float *scale;   /* Q8, Q4: [N, K/32]; I16: [ceil(N/16) * 16] */
    const float *minimum; /* Q4: [N, K/32] */
};

/* `bytes` (rounded up to 64) from `s` (which may be NULL), else from aligned_alloc; *owned is
 * what to free() afterwards (NULL when it came from the workspace). NULL: out of memory. */
void *scratch_take(struct scratch *s, size_t bytes, void **owned);
size_t scratch_mark(const struct scratch *s);
void scratch_release(struct scratch *s, size_t mark);

/* y[m,n] = x[m,k] . W[n,k]^T; returns 0, or -1 when a buffer could not be allocated. */
int slotserve_gemm_weights(const float *x, int64_t m, int64_t k, struct weights w, int64_t n,
                           float *y, int threads, struct scratch *s);

/* qgemm_avx512.c: the panel product of products.c's dot_panel_avx2, 512 bits wide; k % 16 == 0. */
void dot_panel_avx512(const float *x, int64_t m, int64_t k, const float *w, float *y, int64_t n,
                      const float *next);

/* attention.c: slotserve_attend, with prefill blocks in bf16 when `bf16` (and the CPU has
 * AVX512_BF16): what a bf16 step of llama_step.c calls. k and v: float, or fp16 bits when
 * `kv_half`. */
int attend_rows(const float *q, const void *k, const void *v, int kv_half, int64_t rows,
                const int64_t *slots, int64_t kv_heads, int64_t group, int64_t d, int64_t max_len,
                const int64_t *lens, float scale, float *out, int threads, struct scratch *s,
                int bf16);

/* llama_step.c: act[m, inter] = silu(gate) * up of each row of wide [m, 2 * inter] (its gate's
 * inter values, then its up's), `vector` 2: 16 lanes (inter % 16 == 0), 1: 8 lanes (inter % 8
 * == 0), 0: plain C. The step's unfused MLP, and slotserve_mlp_bf16's where the tiles do not
 * run. */
void silu_mul_rows(const float *wide, int64_t m, int64_t inter, float *act, int threads,
                   int vector);

/* kv_half.c: the fp16 KV cache. half_bits: fp16 bits of f, nearest even, saturating at +-65504
 * (NaN stays NaN); half_value: the float an fp16 holds. kv_store: n floats into the cache at
 * element `at` (fp16 when `half`, else as they are); kv_widen: n fp16 values to floats.
 * decode_head_half512 (AVX-512, d % 16 == 0): attention.c's decode head over fp16 keys and
 * values, scores[group * len] its work. */
uint16_t half_bits(float f);
float half_value(uint16_t h);
void kv_store(void *cache, int64_t at, const float *src, int64_t n, int half);
void kv_widen(const uint16_t *src, int64_t n, float *dst);
void decode_head_half512(const float *query, const uint16_t *keys, const uint16_t *values,
                         int64_t len, int64_t d, int64_t group, float scale, float *scores,
                         float *dst, void (*softmax)(float *, int64_t));

/* attention_block.c: one block of a chunk's rows for one kv head, 512 bits wide when `avx512`
 * (d % 16 == 0), else AVX2 (d % 8 == 0), over the chunk's keys and values packed once
 * (attention_block_pack: keys [stride / 16][d][16], each 16 positions' d values as d vectors;
 * values [position][d] as floats; stride a multiple of 16, keys zero past `last`); `work` holds
 * attention_block_work(d, the block's last length) floats. `softmax` normalises scores[0, len)
 * in place. */
size_t attention_block_work(int64_t d, int64_t longest);
void attention_block_pack(const void *keys, const void *values, int half, int64_t last,
                          int64_t stride, int64_t d, float *kt, float *vf);
void attention_block_f32(int avx512, const float *q, const float *kt, const float *values,
                         const int64_t *lens, int64_t r0, int64_t count, int64_t h,
                         int64_t kv_heads, int64_t group, int64_t d, float scale, float *out,
                         float *work, void (*softmax)(float *scores, int64_t len));

/* attention_bf16.c: one block of a chunk's rows for one kv head in bf16 (attention_block.c's
 * block in VDPBF16PS), over the chunk's keys and values packed once (attention_bf16_pack, stride
 * the chunk's last length rounded up to 32); `work` holds attention_bf16_work(d, the block's
 * last length) floats, 64-byte aligned. The probabilities are rounded unnormalised and each
 * output scaled after its sums, as on the tiles (bf16_exponentials). */
#define ATTENTION_QUADS 8 /* queries a pass */
size_t attention_bf16_work(int64_t d, int64_t longest);
/* Keys [0, last) packed for scoring (kp) and values for the weighted sum (vp), zeros up to
 * `stride` (a multiple of 32), through `rows` (d * stride bf16 of room); keys and values are
 * cache rows of floats, or of fp16 bits when `half`. */
void attention_bf16_pack(const void *keys, const void *values, int half, int64_t last,
                         int64_t stride, int64_t d, uint16_t *kp, uint16_t *vp, uint16_t *rows);
void attention_block_bf16(const float *q, const uint16_t *kp, const uint16_t *vp,
                          const int64_t *lens, int64_t r0, int64_t count, int64_t h,
                          int64_t kv_heads, int64_t group, int64_t d, float scale, float *out,
                          float *work);

/* bf16_avx512.c: `count` floats rounded to bf16 (nearest even) and bf16 widened to floats, on
 * `threads` threads, VCVTNE2PS2BF16 / shifts where the ISA in use is ISA_AVX512_BF16. */
void bf16_round(const float *x, int64_t count, uint16_t *out, int threads);
void bf16_widen(const uint16_t *in, int64_t count, float *out, int threads);

/* wide_avx2.c: the wide fp32 product with AVX2/FMA on weights packed WIDE_CHANNELS channels a
 * block as [k][WIDE_CHANNELS] (64-byte aligned). wide_pack16 packs `count` (<= WIDE_CHANNELS)
 * channel rows of k floats, zeros for the rest; wide_rows multiplies rows [0, m) of x against
 * `blocks` packed blocks, the first at channel n0 of y's n (the last block's channels past n
 * are not stored). */
#define WIDE_CHANNELS 16
#define WIDE_TILE_ROWS 6
void wide_pack16(const float *const rows[WIDE_CHANNELS], int count, int64_t k, float *out);
void wide_rows(const float *x, int64_t m, int64_t k, const float *packed, int64_t blocks,
               int64_t n0, int64_t n, float *y);

/* gemm_amx.c: gemm_bf16_avx512's product on AMX tiles, fp32 results; k % 32 == 0, n % 16 == 0,
 * where slotserve_kernel_amx() says the tiles run. */
#define AMX_GEMM_ROWS 16
int gemm_bf16_amx(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, float *y,
                  int threads, struct scratch *s);
/* gemm_amx.c: a decoder's MLP on AMX tiles, y[m, hidden] = down(silu(gate(x)) * up(x)), with
 * gate_up the packed gate and up weights stacked (2 * inter channels) and down's packed weights
 * (hidden channels of inter); hidden and inter multiples of 32. The same sums and roundings as
 * the products one after the other with silu_mul16 between (bit for bit), without writing the
 * gate/up results out: each pass's silu(gate) * up goes to the down product's rows as bf16. */
int mlp_bf16_amx(const float *x, int64_t m, int64_t hidden, const uint16_t *gate_up,
                 const uint16_t *down, int64_t inter, float *y, int threads, struct scratch *s);
/* bf16_avx512.c, for a step that rounds its rows to bf16 itself (llama_step.c; AVX512_BF16
 * only): the product on rows already in bf16 (xb [m, k]), adding to what y holds when `add`
 * (y + product, bit for bit what a separate pass adds); and the MLP down(silu(gate) * up) with
 * silu(gate) * up rounded to bf16 in the gate/up product's registers (never written as fp32),
 * bit for bit the products with silu_mul_rows between. gate_up: gate's inter channels, then
 * up's, packed bf16; it returns 0, or -1 when its buffer could not be allocated. */
void gemm_bf16_rows(const uint16_t *xb, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                    float *y, int add, int threads);
int mlp_bf16_rows(const uint16_t *xb, int64_t m, int64_t hidden, const uint16_t *gate_up,
                  const uint16_t *down, int64_t inter, float *y, int add, int threads,
                  struct scratch *s);
/* bf16_avx512.c: every row of xb (bf16 [m, k]) against `blocks` (1 to 3) packed bf16 blocks of
 * one task, on the calling thread, into y's channels [0, 16 blocks) of n; `tail`: the last
 * block's channels (n % 16) when it ends the weights short of a full block, else 0. */
void bf16_task_rows(const uint16_t *xb, int64_t m, int64_t k, const uint16_t *w, float *y,
                    int64_t n, int blocks, int tail);
/* quantized_bf16.c: y = x . W^T for int8 or int4 weights with x rounded to bf16 and the weights
 * widened to bf16 a task at a time (VDPBF16PS where the ISA in use is ISA_AVX512_BF16, else the
 * plain C reference); k % 32 == 0. Returns 0, or -1 (a buffer, or weights not quantized). */
int gemm_quantized_bf16(const float *x, int64_t m, int64_t k, struct weights w, int64_t n, float *y,
                        int threads, struct scratch *s);
/* int16.c: y = x . W^T on packed int16 weights (kind I16,
 * scale: the channels' scales), k even. Returns 0, or -1 (a buffer, or weights not I16). */
int gemm_int16(const float *x, int64_t m, int64_t k, struct weights w, int64_t n, float *y,
               int threads, struct scratch *s);
/* gemm_amx.c, for a step that lays its rows out as the tiles read them (llama_step.c): row i of
 * k floats, times weight (k floats, or NULL) and scale as an RMS norm scales it, into A tiles xt
 * (bf16, [rows / 16][k / 32][16][32], rows m rounded up to 32; NULL row: zeros), and the two
 * products above on such rows, adding to what y holds when `add` (a residual stream: no
 * separate pass adds the product to it). */
void amx_row_to_tiles(const float *row, const float *weight, float scale, int64_t i, int64_t k,
                      uint16_t *xt);
void gemm_amx_tiles(const uint16_t *xt, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                    float *y, int add, int threads);
int mlp_amx_tiles(const uint16_t *xt, int64_t m, int64_t hidden, const uint16_t *gate_up,
                  const uint16_t *down, int64_t inter, float *y, int add, int threads,
                  struct scratch *s);

/* attention_amx.c: the tiles' configuration both AMX files use (each thread loads it before its
 * first tile instruction and releases the tiles after its last). */
void amx_tiles_configure(void);
/* attention_amx.c: attention_bf16.c's block on AMX tiles (TDPBF16PS), where
 * slotserve_kernel_amx() says they run, its softmax fused with the scaling and the rounding;
 * `work` holds attention_amx_work(d, longest) floats. */
size_t attention_amx_work(int64_t d, int64_t longest);
void attention_block_amx(const float *q, const uint16_t *kp, const uint16_t *vp,
                         const int64_t *lens, int64_t r0, int64_t count, int64_t h,
                         int64_t kv_heads, int64_t group, int64_t d, float scale, float *out,
                         float *work);

#pragma GCC visibility pop

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

/* The sum of a vector's 8 lanes. */
__attribute__((target("avx2,fma"))) static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The four horizontal sums of a, b, c, e as one vector. */
__attribute__((target("avx2,fma"))) static inline __m128 hsum4(__m256 a, __m256 b, __m256 c,
                                                               __m256 e) {
    const __m256 ab = _mm256_hadd_ps(a, b), ce = _mm256_hadd_ps(c, e);
    const __m256 abce = _mm256_hadd_ps(ab, ce);
    return _mm_add_ps(_mm256_castps256_ps128(abce), _mm256_extractf128_ps(abce, 1));
}

/* e^x for x <= 0 (scores minus their maximum): 2^n * p(r), r = x - n ln 2 in [-ln2/2, ln2/2],
 * p of degree 6, the Taylor terms r^k / k! (relative error ~2e-7); below EXP_FLOOR the result is
 * 0, as expf's underflow. The constants are named once for both widths below, which give the
 * same results lane by lane. */
#define EXP_FLOOR (-87.0f)
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f /* ln 2 split in two (Cody-Waite): n * EXP_LN2_HI is exact */
#define EXP_LN2_LO (-2.12194440e-4f)

__attribute__((target("avx2,fma"))) static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 low = _mm256_set1_ps(EXP_FLOOR);
    const __m256 underflow = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
    x = _mm256_max_ps(x, low);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i bits =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

/* exp_nonpositive 16 lanes wide: the same operations lane by lane, so the same results. */
__attribute__((target("avx512f"))) static inline __m512 exp_nonpositive512(__m512 x) {
    const __m512 low = _mm512_set1_ps(EXP_FLOOR);
    const __mmask16 underflow = _mm512_cmp_ps_mask(x, low, _CMP_LT_OQ);
    x = _mm512_max_ps(x, low);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i bits =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~underflow, p, _mm512_castsi512_ps(bits));
}

/* silu(g) * u over 16 lanes: g * sigmoid(g) * u, sigmoid from e = exp(-|g|) <= 1 (1 / (1 + e)
 * for g >= 0, e / (1 + e) below). llama_step.c's SiLU and gemm_amx.c's fused MLP. */
__attribute__((target("avx512f,avx512dq"))) static inline __m512 silu_mul16(__m512 g, __m512 u) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 e = exp_nonpositive512(_mm512_or_ps(g, _mm512_set1_ps(-0.0f))); /* -|g| */
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sigmoid =
        _mm512_div_ps(_mm512_mask_blend_ps(negative, one, e), _mm512_add_ps(one, e));
    return _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), u);
}

/* The exponentials of bf16 attention (attention_bf16.c's VDPBF16PS blocks and attention_amx.c's
 * tiles). */
#define EXP_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

/* 2^x for x <= 0 with VSCALEFPS: 2^n * p(f), n = round(x), f = x - n in [-1/2, 1/2], p the
 * Taylor terms of e^(f ln 2) to degree 5 (relative error < 3e-6, under a thousandth of the
 * bf16 rounding that follows), 0 below 2^-126 (no denormals). Six operations fewer a vector
 * than exp_nonpositive512: the exponent goes in through the scaling instruction. */
EXP_BF16_TARGET static inline __m512 exp2_nonpositive(__m512 x) {
    const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3333558146428443e-3f);                 /* ln2^5 / 120 */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f)); /* ln2^4 / 24 */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f)); /* ln2^3 / 6 */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f)); /* ln2^2 / 2 */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f)); /* ln2 */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(normal, p, n);
}

/* A query's scores [0, len) times `scale`, exponentiated less their maximum and rounded to bf16
 * (nearest even) into pb, zeros over [len, span); returns 1 / the sum of the exponentials (fp32,
 * before rounding), by which the query's output is scaled once the values are summed (as
 * FlashAttention does): two passes over the row where normalising each probability before
 * rounding it took a third, and the softmax was the largest part of the race once the tiles ran.
 * The exponentials are taken base 2, the scale folded into one multiply-add with log2(e). */
EXP_BF16_TARGET static inline float bf16_exponentials(const float *scores, int64_t len,
                                                      int64_t span, float scale, uint16_t *pb) {
    __m512 top16 = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < len; t += 16) {
        const int64_t left = len - t;
        const __mmask16 keep = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        top16 = _mm512_mask_max_ps(top16, keep, top16, _mm512_maskz_loadu_ps(keep, scores + t));
    }
    /* scale > 0 (1 / sqrt(d)), so the largest scaled score is the largest score scaled. */
    const float base2 = scale * EXP_LOG2E;
    const __m512 vscale = _mm512_set1_ps(base2);
    const __m512 vtop = _mm512_set1_ps(_mm512_reduce_max_ps(top16) * base2);
    __m512 total16 = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) { /* whole vectors: no masks */
        const __m512 e =
            exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(scores + t), vscale, vtop));
        total16 = _mm512_add_ps(total16, e);
        _mm256_storeu_si256((__m256i *)(pb + t), (__m256i)_mm512_cvtneps_pbh(e));
    }
    for (; t < span; t += 16) {
        const int64_t left = len - t;
        const __mmask16 keep = left >= 16  ? (__mmask16)0xFFFF
                               : left <= 0 ? (__mmask16)0
                                           : (__mmask16)((1u << left) - 1);
        const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(keep, scores + t), vscale, vtop);
        const __m512 e = _mm512_maskz_mov_ps(keep, exp2_nonpositive(x));
        total16 = _mm512_add_ps(total16, e);
        _mm256_storeu_si256((__m256i *)(pb + t), (__m256i)_mm512_cvtneps_pbh(e));
    }
    return 1.0f / _mm512_reduce_add_ps(total16);
}
#endif
#endif
