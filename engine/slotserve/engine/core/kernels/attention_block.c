/* Prefill attention in fp32, a block of one chunk's rows at a time (attention.c's attend_rows
 * calls it for every span of up to CHUNK_ROWS rows and one kv head).
 *
 * Rows of one chunk share their slot's keys and values, so the keys up to the block's last
 * position are transposed once into [d][positions] (d rows of key vectors), then every four
 * queries (row, head pairs) score 16 keys per step with one broadcast of a query value per
 * multiply-add and no horizontal sums, and sum the values with each value vector loaded once for
 * the four. Row by row (attention.c's head_avx2), a 1,000-token chunk re-read its keys and values
 * for every row and summed 4 keys per horizontal add. Two widths: AVX-512 (16 keys a vector, d a
 * multiple of 16) and AVX2 (two vectors of 8 keys, d a multiple of 8).
 */
#include <stdint.h>

#include "qgemm.h"

#define BLOCK_QUADS ATTENTION_QUADS

/* The transposed keys ([d][stride]) and four queries' scores ([4][stride]), stride the block's
 * last length rounded up to 16. */
size_t attention_block_work(int64_t d, int64_t longest) {
    return (size_t)((d + BLOCK_QUADS) * ((longest + 15) & ~(int64_t)15));
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define BLOCK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define BLOCK_AVX2 __attribute__((target("avx2,fma")))

/* Scores of four queries (qs) against keys [0, upto), from kt [d][stride]; scaled. upto and
 * stride are multiples of 16. */
BLOCK_AVX512 static void quad_scores_avx512(const float *const qs[BLOCK_QUADS], const float *kt,
                                            int64_t stride, int64_t d, int64_t upto, float scale,
                                            float *scores) {
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t t = 0; t < upto; t += 16) {
        __m512 acc[BLOCK_QUADS];
        for (int i = 0; i < BLOCK_QUADS; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t j = 0; j < d; j++) {
            const __m512 keys = _mm512_loadu_ps(kt + j * stride + t);
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
        __m256 lo[BLOCK_QUADS], hi[BLOCK_QUADS];
        for (int i = 0; i < BLOCK_QUADS; i++) lo[i] = hi[i] = _mm256_setzero_ps();
        for (int64_t j = 0; j < d; j++) {
            const __m256 k0 = _mm256_loadu_ps(kt + j * stride + t);
            const __m256 k1 = _mm256_loadu_ps(kt + j * stride + t + 8);
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

void attention_block_f32(int avx512, const float *q, const float *keys, const float *values,
                         const int64_t *lens, int64_t r0, int64_t count, int64_t h,
                         int64_t kv_heads, int64_t group, int64_t d, float scale, float *out,
                         float *work, void (*softmax)(float *scores, int64_t len)) {
    const int64_t last = lens[r0 + count - 1];
    const int64_t stride = (last + 15) & ~(int64_t)15;
    float *kt = work, *scores = work + d * stride;
    for (int64_t t = 0; t < stride; t++)
        for (int64_t j = 0; j < d; j++) kt[j * stride + t] = t < last ? keys[t * d + j] : 0.0f;
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
void attention_block_f32(int avx512, const float *q, const float *keys, const float *values,
                         const int64_t *lens, int64_t r0, int64_t count, int64_t h,
                         int64_t kv_heads, int64_t group, int64_t d, float scale, float *out,
                         float *work, void (*softmax)(float *scores, int64_t len)) {
    (void)avx512, (void)q, (void)keys, (void)values, (void)lens, (void)r0, (void)count, (void)h;
    (void)kv_heads, (void)group, (void)d, (void)scale, (void)out, (void)work; /* never taken */
    (void)softmax;
}
#endif
