/* Prefill attention in fp32, a block of one chunk's rows at a time (attention.c's attend_rows
 * calls it for every span of up to CHUNK_ROWS rows and one kv head).
 *
 * Rows of one chunk share their slot's keys and values, so attend_rows packs them once a chunk
 * (attention_block_pack): the keys 16 positions a tile, each tile's d values of its 16 keys as
 * d vectors of 16 ([stride / 16][d][16]: a tile is one run of memory), the values widened to
 * floats where the cache is fp16. Then every BLOCK_QUADS queries (row, head pairs) score 16 keys
 * per step with one broadcast of a query value per multiply-add and no horizontal sums, and sum
 * the values with each value vector loaded once for all of them. Row by row (attention.c's
 * head_avx2), a 1,000-token chunk re-read its keys and values for every row and summed 4 keys
 * per horizontal add. The keys were first transposed to [d][positions] for every span: at
 * ~1,024 positions a row of that layout is 4 KB, so the d lines a step of the scores read all
 * fell in one set of the 8-way L1, and the transposes and fp16 widening were redone for each of
 * a chunk's 32 spans. Two widths: AVX-512 (16 keys a vector, d a multiple of 16) and AVX2 (two
 * vectors of 8 keys, d a multiple of 8).
 */
#include <stdint.h>
#include <string.h>

#include "qgemm.h"

/* Queries a pass: 6 x 2 score accumulators of 8 keys, with the two key vectors and the
 * broadcast, fill 15 of AVX2's 16 registers (8 spilled: 68 against 93 GFLOPS on a 1,024-row
 * chunk of SmolLM2's heads, Zen 3); AVX-512's 6 x 4 value accumulators fit its 32 too. */
#define BLOCK_QUADS 6
#define KEY_TILE 16

/* The scores' rows: the block's last length rounded up to 16, and 16 more, so that the rows do
 * not start 4 KB apart (one L1 set) at ~1,024 positions. */
static int64_t scores_stride(int64_t last) { return ((last + 15) & ~(int64_t)15) + 16; }

/* Each thread's scores: BLOCK_QUADS rows. */
size_t attention_block_work(int64_t d, int64_t longest) {
    (void)d;
    return (size_t)(BLOCK_QUADS * scores_stride(longest));
}

void attention_block_pack(const void *keys, const void *values, int half, int64_t last,
                          int64_t stride, int64_t d, float *kt, float *vf) {
    /* The keys as floats first (in vf, which the values overwrite after). */
    if (half)
        kv_widen(keys, last * d, vf);
    else
        memcpy(vf, keys, sizeof(float) * (size_t)(last * d));
    for (int64_t g = 0; g < stride / KEY_TILE; g++) {
        float *tile = kt + g * d * KEY_TILE;
        for (int64_t i = 0; i < KEY_TILE; i++) {
            const int64_t t = g * KEY_TILE + i;
            const float *key = vf + t * d;
            for (int64_t j = 0; j < d; j++) tile[j * KEY_TILE + i] = t < last ? key[j] : 0.0f;
        }
    }
    if (half)
        kv_widen(values, last * d, vf);
    else
        memcpy(vf, values, sizeof(float) * (size_t)(last * d));
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define BLOCK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define BLOCK_AVX2 __attribute__((target("avx2,fma")))

/* Scores of BLOCK_QUADS queries (qs) against keys [0, upto), from the packed tiles kt; scaled,
 * into scores' rows `stride` apart. upto is a multiple of 16. */
BLOCK_AVX512 static void quad_scores_avx512(const float *const qs[BLOCK_QUADS], const float *kt,
                                            int64_t stride, int64_t d, int64_t upto, float scale,
                                            float *scores) {
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t t = 0; t < upto; t += 16) {
        const float *tile = kt + t * d; /* tile t / 16 of d * 16 floats */
        __m512 acc[BLOCK_QUADS];
        for (int i = 0; i < BLOCK_QUADS; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t j = 0; j < d; j++) {
            const __m512 keys = _mm512_loadu_ps(tile + j * KEY_TILE);
            for (int i = 0; i < BLOCK_QUADS; i++)
                acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(qs[i][j]), keys, acc[i]);
        }
        for (int i = 0; i < BLOCK_QUADS; i++)
            _mm512_storeu_ps(scores + i * stride + t, _mm512_mul_ps(acc[i], vscale));
    }
}

/* outs[i][0, d) = sum over t < upto of p_i[t] * values[t]; p_i is 0 past its query's length. */
BLOCK_AVX512 static void quad_values_avx512(const float *scores, int64_t stride,
                                            const float *values, int64_t d, int64_t upto,
                                            float *const outs[BLOCK_QUADS]) {
    for (int64_t j = 0; j < d; j += 64) {
        const int64_t width = d - j < 64 ? d - j : 64; /* a multiple of 16 */
        __m512 acc[BLOCK_QUADS][4];
        for (int i = 0; i < BLOCK_QUADS; i++)
            for (int c = 0; c < 4; c++) acc[i][c] = _mm512_setzero_ps();
        for (int64_t t = 0; t < upto; t++) {
            const float *row = values + t * d + j;
            for (int c = 0; c < width / 16; c++) {
                const __m512 v = _mm512_loadu_ps(row + 16 * c);
                for (int i = 0; i < BLOCK_QUADS; i++)
                    acc[i][c] =
                        _mm512_fmadd_ps(_mm512_set1_ps(scores[i * stride + t]), v, acc[i][c]);
            }
        }
        for (int i = 0; i < BLOCK_QUADS; i++)
            for (int c = 0; c < width / 16; c++) _mm512_storeu_ps(outs[i] + j + 16 * c, acc[i][c]);
    }
}

/* quad_scores_avx512 with 16 keys as two 8-key vectors (8 accumulators of the 16 registers). */
BLOCK_AVX2 static void quad_scores_avx2(const float *const qs[BLOCK_QUADS], const float *kt,
                                        int64_t stride, int64_t d, int64_t upto, float scale,
                                        float *scores) {
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t t = 0; t < upto; t += 16) {
        const float *tile = kt + t * d;
        __m256 lo[BLOCK_QUADS], hi[BLOCK_QUADS];
        for (int i = 0; i < BLOCK_QUADS; i++) lo[i] = hi[i] = _mm256_setzero_ps();
        for (int64_t j = 0; j < d; j++) {
            const __m256 k0 = _mm256_loadu_ps(tile + j * KEY_TILE);
            const __m256 k1 = _mm256_loadu_ps(tile + j * KEY_TILE + 8);
            for (int i = 0; i < BLOCK_QUADS; i++) {
                const __m256 query = _mm256_set1_ps(qs[i][j]);
                lo[i] = _mm256_fmadd_ps(query, k0, lo[i]);
                hi[i] = _mm256_fmadd_ps(query, k1, hi[i]);
            }
        }
        for (int i = 0; i < BLOCK_QUADS; i++) {
            _mm256_storeu_ps(scores + i * stride + t, _mm256_mul_ps(lo[i], vscale));
            _mm256_storeu_ps(scores + i * stride + t + 8, _mm256_mul_ps(hi[i], vscale));
        }
    }
}

/* quad_values_avx512, 16 dimensions (two vectors) at a time: 8 accumulators. */
BLOCK_AVX2 static void quad_values_avx2(const float *scores, int64_t stride, const float *values,
                                        int64_t d, int64_t upto, float *const outs[BLOCK_QUADS]) {
    for (int64_t j = 0; j < d; j += 16) {
        const int vectors = d - j < 16 ? 1 : 2; /* d is a multiple of 8 */
        __m256 acc[BLOCK_QUADS][2];
        for (int i = 0; i < BLOCK_QUADS; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        for (int64_t t = 0; t < upto; t++) {
            const float *row = values + t * d + j;
            const __m256 v0 = _mm256_loadu_ps(row);
            const __m256 v1 = vectors == 2 ? _mm256_loadu_ps(row + 8) : v0;
            for (int i = 0; i < BLOCK_QUADS; i++) {
                const __m256 weight = _mm256_set1_ps(scores[i * stride + t]);
                acc[i][0] = _mm256_fmadd_ps(weight, v0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(weight, v1, acc[i][1]);
            }
        }
        for (int i = 0; i < BLOCK_QUADS; i++)
            for (int c = 0; c < vectors; c++) _mm256_storeu_ps(outs[i] + j + 8 * c, acc[i][c]);
    }
}

void attention_block_f32(int avx512, const float *q, const float *kt, const float *values,
                         const int64_t *lens, int64_t r0, int64_t count, int64_t h,
                         int64_t kv_heads, int64_t group, int64_t d, float scale, float *out,
                         float *work, void (*softmax)(float *scores, int64_t len)) {
    const int64_t stride = scores_stride(lens[r0 + count - 1]);
    float *scores = work;
    const int64_t queries = count * group;
    for (int64_t first = 0; first < queries; first += BLOCK_QUADS) {
        const float *qs[BLOCK_QUADS];
        float *outs[BLOCK_QUADS];
        int64_t len[BLOCK_QUADS], upto = 0;
        for (int i = 0; i < BLOCK_QUADS; i++) {
            /* Past the last query, repeat it (its results are written twice, identically). */
            const int64_t index = first + i < queries ? first + i : queries - 1;
            const int64_t r = r0 + index / group, g = index % group;
            qs[i] = q + ((r * kv_heads + h) * group + g) * d;
            outs[i] = out + ((r * kv_heads + h) * group + g) * d;
            len[i] = lens[r];
            upto = len[i] > upto ? len[i] : upto;
        }
        const int64_t padded = (upto + 15) & ~(int64_t)15;
        if (avx512)
            quad_scores_avx512(qs, kt, stride, d, padded, scale, scores);
        else
            quad_scores_avx2(qs, kt, stride, d, padded, scale, scores);
        for (int i = 0; i < BLOCK_QUADS; i++) {
            float *sc = scores + i * stride;
            softmax(sc, len[i]);
            for (int64_t t = len[i]; t < upto; t++) sc[t] = 0.0f;
        }
        if (avx512)
            quad_values_avx512(scores, stride, values, d, upto, outs);
        else
            quad_values_avx2(scores, stride, values, d, upto, outs);
    }
}
#else
void attention_block_f32(int avx512, const float *q, const float *kt, const float *values,
                         const int64_t *lens, int64_t r0, int64_t count, int64_t h,
                         int64_t kv_heads, int64_t group, int64_t d, float scale, float *out,
                         float *work, void (*softmax)(float *scores, int64_t len)) {
    (void)avx512, (void)q, (void)kt, (void)values, (void)lens, (void)r0, (void)count, (void)h;
    (void)kv_heads, (void)group, (void)d, (void)scale, (void)out, (void)work; /* never taken */
    (void)softmax;
}
#endif
