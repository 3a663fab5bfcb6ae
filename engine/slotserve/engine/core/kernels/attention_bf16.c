/* Prefill attention in bf16 with VDPBF16PS (AVX512_BF16), for steps whose products run in bf16
 * (the step model's bf16_attention): a block of up to BLOCK_ROWS rows of one chunk and one kv
 * head, as attention.c's fp32 blocks, with the keys, values, queries and probabilities rounded
 * to bf16 (nearest even) and every sum in fp32.
 *
 * Why: with ~1,000-token prompts attention is about a sixth of a prefill step's multiply-adds
 * and, in fp32 at ~70% of the FMA peak, a quarter of its time on a 2-core Zen 4; VDPBF16PS does
 * twice the multiply-adds per instruction. What vLLM's CPU backend and FlashAttention do on
 * bf16 models: its quality is measured with the rest of the bf16 path (bench/quant_quality.py
 * --engine bfloat16).
 *
 * Layouts (in the caller's work buffer): keys packed for scoring, 16 keys a vector, each lane
 * holding a key's two values of one dimension pair: kp[t / 16][d / 2][16][2]; values packed for
 * the weighted sum, 16 dimensions a vector, each lane holding two positions' values of one
 * dimension: vp[t / 2][d / 16][16][2]. A query's dimension pair, or a probability pair, is
 * broadcast to all lanes, so neither sum needs a horizontal add.
 */
#include <stdint.h>
#include <string.h>

#include "gemm.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define ATTENTION_BF16_TARGET                                                                      \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,avx2")))

static inline int32_t pair_at(const uint16_t *pairs, int64_t index) {
    int32_t pair;
    memcpy(&pair, pairs + 2 * index, sizeof pair);
    return pair;
}

size_t attention_bf16_work(int64_t d, int64_t longest) {
    const size_t stride = (size_t)((longest + 31) & ~(int64_t)31);
    /* qb: QUADS * d bf16; pb: QUADS * stride bf16; scores: QUADS * stride floats (in floats,
     * rounded up for alignment). */
    return (size_t)(ATTENTION_QUADS * d) / 2 + (size_t)ATTENTION_QUADS * stride / 2 +
           (size_t)ATTENTION_QUADS * stride + 16;
}

/* 16 cached values from element `at` on as floats: fp32 as they are, fp16 widened (exactly). */
ATTENTION_BF16_TARGET static inline __m512 cached16(const void *cache, int half, int64_t at) {
    if (half)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + at)));
    return _mm512_loadu_ps((const float *)cache + at);
}

/* Keys [0, last) into kp and values into vp, zeros up to stride (a multiple of 32), from the
 * cache rows as they are (fp32, or fp16 when `half`); d a multiple of 32 (attention_amx.c's
 * tiles read these layouts as they are). */
ATTENTION_BF16_TARGET void attention_bf16_pack(const void *keys, const void *values, int half,
                                               int64_t last, int64_t stride, int64_t d,
                                               uint16_t *kp, uint16_t *vp, uint16_t *rows) {
    const int64_t pairs = d / 2, groups = d / 16;
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t t = 0; t < stride; t++)
        for (int64_t j = 0; j < d; j += 32) {
            const __m512 lo = t < last ? cached16(keys, half, t * d + j) : zero;
            const __m512 hi = t < last ? cached16(keys, half, t * d + j + 16) : zero;
            _mm512_storeu_si512(rows + t * d + j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    /* kp[g][p] = the pair p of keys 16g .. 16g + 15: a gather of 16 pairs a row apart. */
    const __m512i apart =
        _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                           _mm512_set1_epi32((int)pairs));
    for (int64_t g = 0; g < stride / 16; g++)
        for (int64_t p = 0; p < pairs; p++) {
            const int32_t *base = (const int32_t *)rows + g * 16 * pairs + p;
            _mm512_storeu_si512(kp + (g * pairs + p) * 32,
                                _mm512_i32gather_epi32(apart, (const void *)base, 4));
        }
    /* vp[tp][jg]: positions 2tp and 2tp + 1 of dimensions 16jg .. 16jg + 15, interleaved. */
    const __m512i interleave =
        _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t tp = 0; tp < stride / 2; tp++) {
        const int64_t t = 2 * tp;
        for (int64_t jg = 0; jg < groups; jg++) {
            const __m512 a = t < last ? cached16(values, half, t * d + 16 * jg) : zero;
            const __m512 b = t + 1 < last ? cached16(values, half, (t + 1) * d + 16 * jg) : zero;
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a); /* a low, b high */
            _mm512_storeu_si512(vp + (tp * groups + jg) * 32,
                                _mm512_permutexvar_epi16(interleave, both));
        }
    }
}

/* Vectors of 16 keys scored at once against the eight queries (ATTENTION_QUADS): 24
 * accumulators, so the chains of VDPBF16PS (latency ~6 cycles, two a cycle on Zen 5) overlap;
 * one vector at a time left the scores latency-bound. Eight queries a pass rather than four:
 * each pass reads the chunk's packed keys and values from L2 once (~256 KB at 1,000
 * positions), and with four that traffic held a 1,024-row chunk's block to ~290 GFLOPS on two
 * Zen 4 cores (4.1 ms a layer; eight: 3.55 ms, twelve no better). */
#define SCORE_VECTORS 3
/* Vectors of 16 dimensions summed at once for the eight queries: 16 accumulators. */
#define VALUE_VECTORS 2

/* The eight queries' scores (unscaled: bf16_exponentials scales them) against `width` vectors
 * of keys from vector g on. */
ATTENTION_BF16_TARGET static inline __attribute__((always_inline)) void
score_vectors(const uint16_t *kp, const uint16_t *qb, int64_t d, int64_t g, float *scores,
              int64_t stride, const int width) {
    const int64_t pairs = d / 2;
    __m512 acc[ATTENTION_QUADS][SCORE_VECTORS];
    for (int i = 0; i < ATTENTION_QUADS; i++)
        for (int c = 0; c < width; c++) acc[i][c] = _mm512_setzero_ps();
    const uint16_t *kg = kp + g * pairs * 32;
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh kv[SCORE_VECTORS];
        for (int c = 0; c < width; c++)
            kv[c] = (__m512bh)_mm512_loadu_si512(kg + (c * pairs + p) * 32);
        for (int i = 0; i < ATTENTION_QUADS; i++) {
            const __m512bh qv = (__m512bh)_mm512_set1_epi32(pair_at(qb + i * d, p));
            for (int c = 0; c < width; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], qv, kv[c]);
        }
    }
    for (int i = 0; i < ATTENTION_QUADS; i++)
        for (int c = 0; c < width; c++)
            _mm512_storeu_ps(scores + i * stride + 16 * (g + c), acc[i][c]);
}

/* The eight queries' outputs for `width` vectors of 16 dimensions from vector j0 on: the
 * exponentials pb (row stride `stride`) over positions [0, even) times the packed values, each
 * query's sums times its norm (1 / the sum of its exponentials). A
 * width known when compiled keeps the 4 x width accumulators in registers (a width read at run
 * time put them on the stack, with a branch per multiply-add). */
ATTENTION_BF16_TARGET static inline __attribute__((always_inline)) void
sum_values(const uint16_t *vp, const uint16_t *pb, int64_t stride, int64_t groups, int64_t j0,
           int64_t even, float *const *outs, const float *norm, const int width) {
    __m512 acc[ATTENTION_QUADS][VALUE_VECTORS];
    for (int i = 0; i < ATTENTION_QUADS; i++)
        for (int c = 0; c < width; c++) acc[i][c] = _mm512_setzero_ps();
    for (int64_t tp = 0; tp < even / 2; tp++) {
        __m512bh vv[VALUE_VECTORS];
        for (int c = 0; c < width; c++)
            vv[c] = (__m512bh)_mm512_loadu_si512(vp + ((tp * groups + j0 + c) * 32));
        for (int i = 0; i < ATTENTION_QUADS; i++) {
            const __m512bh pv = (__m512bh)_mm512_set1_epi32(pair_at(pb + i * stride, tp));
            for (int c = 0; c < width; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], pv, vv[c]);
        }
    }
    for (int i = 0; i < ATTENTION_QUADS; i++) {
        const __m512 by = _mm512_set1_ps(norm[i]);
        for (int c = 0; c < width; c++)
            _mm512_storeu_ps(outs[i] + 16 * (j0 + c), _mm512_mul_ps(acc[i][c], by));
    }
}

ATTENTION_BF16_TARGET void attention_block_bf16(const float *q, const uint16_t *kp,
                                                const uint16_t *vp, const int64_t *lens, int64_t r0,
                                                int64_t count, int64_t h, int64_t kv_heads,
                                                int64_t group, int64_t d, float scale, float *out,
                                                float *work) {
    const int64_t last = lens[r0 + count - 1];
    const int64_t stride = (last + 31) & ~(int64_t)31, groups = d / 16;
    uint16_t *qb = (uint16_t *)work;
    uint16_t *pb = qb + ATTENTION_QUADS * d;
    float *scores = (float *)(((uintptr_t)(pb + ATTENTION_QUADS * stride) + 63) & ~(uintptr_t)63);
    const int64_t queries = count * group;
    for (int64_t first = 0; first < queries; first += ATTENTION_QUADS) {
        float *outs[ATTENTION_QUADS];
        int64_t len[ATTENTION_QUADS], upto = 0;
        for (int i = 0; i < ATTENTION_QUADS; i++) {
            /* Past the last query, repeat it (its results are written twice, identically). */
            const int64_t index = first + i < queries ? first + i : queries - 1;
            const int64_t r = r0 + index / group, g = index % group;
            const float *qi = q + ((r * kv_heads + h) * group + g) * d;
            for (int64_t j = 0; j < d; j++) qb[i * d + j] = bf16_bits(qi[j]);
            outs[i] = out + ((r * kv_heads + h) * group + g) * d;
            len[i] = lens[r];
            upto = len[i] > upto ? len[i] : upto;
        }
        const int64_t padded = (upto + 15) & ~(int64_t)15;
        /* Scores: eight queries against 16 keys a vector, SCORE_VECTORS vectors at a time. */
        const int64_t vectors = padded / 16;
        int64_t g = 0;
        for (; g + SCORE_VECTORS <= vectors; g += SCORE_VECTORS)
            score_vectors(kp, qb, d, g, scores, stride, SCORE_VECTORS);
        switch (vectors - g) {
        case 2:
            score_vectors(kp, qb, d, g, scores, stride, 2);
            break;
        case 1:
            score_vectors(kp, qb, d, g, scores, stride, 1);
            break;
        default:
            break;
        }
        /* Exponentials rounded to bf16 unnormalised, each output scaled once after its sums
         * (attention_amx.c's order: two passes over a row of scores instead of three). */
        const int64_t even = (upto + 1) & ~(int64_t)1;
        float norm[ATTENTION_QUADS];
        for (int i = 0; i < ATTENTION_QUADS; i++)
            norm[i] =
                bf16_exponentials(scores + i * stride, len[i], padded, scale, pb + i * stride);
        /* Values: 16 dimensions a vector, two positions a multiply-add; 32 dimensions (two
         * vectors) of the eight queries in registers at once. */
        for (int64_t j0 = 0; j0 < groups; j0 += VALUE_VECTORS) {
            if (groups - j0 >= 2)
                sum_values(vp, pb, stride, groups, j0, even, outs, norm, 2);
            else
                sum_values(vp, pb, stride, groups, j0, even, outs, norm, 1);
        }
    }
}
#else
void attention_bf16_pack(const void *keys, const void *values, int half, int64_t last,
                         int64_t stride, int64_t d, uint16_t *kp, uint16_t *vp, uint16_t *rows) {
    (void)keys, (void)values, (void)half, (void)last, (void)stride, (void)d, (void)kp, (void)vp;
    (void)rows;
}
size_t attention_bf16_work(int64_t d, int64_t longest) {
    (void)d, (void)longest;
    return 0;
}
void attention_block_bf16(const float *q, const uint16_t *kp, const uint16_t *vp,
                          const int64_t *lens, int64_t r0, int64_t count, int64_t h,
                          int64_t kv_heads, int64_t group, int64_t d, float scale, float *out,
                          float *work) {
    (void)q, (void)kp, (void)vp, (void)lens, (void)r0, (void)count, (void)h;
    (void)kv_heads, (void)group, (void)d, (void)scale, (void)out, (void)work;
}
#endif
