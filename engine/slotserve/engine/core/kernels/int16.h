/* What the int16 products share (int16.c: the reference and the dispatch; int16_vnni.c:
 * VPDPWSSD; int16_avx2.c: VPMADDWD): the numbers' bounds, the work's sizes and the row quantizer.
 * Hidden from the library's exports, as gemm.h. */
#ifndef SLOTSERVE_INT16_H
#define SLOTSERVE_INT16_H
#include "gemm.h"

#define I16_GROUP 64        /* columns a row scale covers, and an exact int32 sum */
#define I16_ROW_MAX 4095.0f /* rows' integers; weights' are within +-8191 */
#define I16_TASK_BLOCKS 3   /* blocks of 16 channels a task takes */
#define I16_ROW_SPAN 256    /* rows a task's pass takes (AVX2: their fp32 accumulators) */
#define I16_CHUNK_GROUPS 4  /* AVX2: groups a tile takes in one call (256 columns) */

#pragma GCC visibility push(hidden)

/* int16_vnni.c: whether the CPU has AVX512_VNNI; rows as int16 (i16_row_c's results) and the
 * products with VPDPWSSD (0, or -1 when a buffer could not be allocated). */
int i16_vnni_cpu(void);
void i16_row_vnni(const float *x, int64_t k, int16_t *q, float *scale);
int i16_rows_vnni(const int16_t *xq, const float *xs, int64_t m, int64_t k, const int16_t *w,
                  const float *ws, int64_t n, float *y, int threads, struct scratch *s);

/* int16_avx2.c: the same with AVX2's VPMADDWD. */
void i16_row_avx2(const float *x, int64_t k, int16_t *q, float *scale);
int i16_rows_avx2(const int16_t *xq, const float *xs, int64_t m, int64_t k, const int16_t *w,
                  const float *ws, int64_t n, float *y, int threads, struct scratch *s);

#pragma GCC visibility pop

/* Row `x` (k floats) as int16 in groups of I16_GROUP: q[j] = nearest(x[j] * inv) of its group,
 * scale[g] = max |x| / I16_ROW_MAX (inf or NaN with the row's: they reach the product). */
static inline void i16_row_c(const float *x, int64_t k, int16_t *q, float *scale) {
    for (int64_t g = 0, j0 = 0; j0 < k; g++, j0 += I16_GROUP) {
        const int64_t j1 = j0 + I16_GROUP < k ? j0 + I16_GROUP : k;
        float top = 0.0f;
        int nan = 0;
        for (int64_t j = j0; j < j1; j++) {
            top = fmaxf(top, fabsf(x[j]));
            nan |= isnan(x[j]);
        }
        if (nan) top = NAN;
        const float inv = top > 0.0f && top <= FLT_MAX ? I16_ROW_MAX / top : 0.0f;
        scale[g] = top / I16_ROW_MAX;
        for (int64_t j = j0; j < j1; j++) {
            float v = nearbyintf(x[j] * inv);
            v = v > I16_ROW_MAX ? I16_ROW_MAX : (v < -I16_ROW_MAX ? -I16_ROW_MAX : v);
            q[j] = (int16_t)(v == v ? v : 0.0f);
        }
    }
}

#endif
