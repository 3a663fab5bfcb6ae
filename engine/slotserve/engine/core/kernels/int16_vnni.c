/* Products on int16 weights with AVX512_VNNI's int16 dot products (VPDPWSSD), for CPUs that
 * have VNNI but no bf16 units (Intel Cascade Lake and Ice Lake, or a newer Xeon whose hypervisor
 * hides AVX512_BF16 and AMX). The numbers and the layout: int16.c.
 *
 * Why: there a prefill chunk's fp32 products run at the FMA units' rate, 16 multiply-adds an
 * instruction, and bf16 would be emulated. One VPDPWSSD does 32 (pairs of int16 products, exact,
 * added into 16 int32 lanes) at the same rate as an FMA (2 a cycle, measured on a 2-core Xeon of
 * family 6 model 207: 5.3 G instructions a second each).
 *
 * Work: a task is I16_TASK_BLOCKS blocks of channels; rows go I16_ROW_SPAN at a time, and the
 * task walks them group by group, in tiles of I16_TILE_ROWS rows whose 24 int32 sums stay in
 * registers for the group, so the group's weights (6 KB) stay in L1 while every row passes; the
 * fp32 accumulators of the span live in a per-thread buffer. */
#include <stdint.h>

#include "int16.h"

#define I16_TILE_ROWS 8

#if defined(__x86_64__)
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))

/* acc + the pairs of int16 products of a and b, as _mm512_dpwssd_epi32: through GCC 12 that
 * intrinsic left the accumulator untied, and the tile's loop copied 2-3 registers per VPDPWSSD
 * (the tile ran at a third of the instruction's rate); as one asm statement it stays in place. */
VNNI_TARGET static inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

VNNI_TARGET void i16_row_vnni(const float *x, int64_t k, int16_t *q, float *scale) {
    const __m512 bound = _mm512_set1_ps(I16_ROW_MAX);
    for (int64_t g = 0, j0 = 0; j0 < k; g++, j0 += I16_GROUP) {
        const int64_t j1 = j0 + I16_GROUP < k ? j0 + I16_GROUP : k;
        if (j1 - j0 != I16_GROUP) {
            i16_row_c(x + j0, j1 - j0, q + j0, scale + g);
            continue;
        }
        __m512 v[4], top = _mm512_setzero_ps();
        __mmask16 nan = 0;
        for (int i = 0; i < 4; i++) {
            v[i] = _mm512_loadu_ps(x + j0 + 16 * i);
            top = _mm512_max_ps(top, _mm512_abs_ps(v[i]));
            nan |= _mm512_cmp_ps_mask(v[i], v[i], _CMP_UNORD_Q);
        }
        const float most = nan ? NAN : _mm512_reduce_max_ps(top);
        const float inv = most > 0.0f && most <= FLT_MAX ? I16_ROW_MAX / most : 0.0f;
        scale[g] = most / I16_ROW_MAX;
        const __m512 by = _mm512_set1_ps(inv);
        for (int i = 0; i < 4; i++) {
            __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v[i], by),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            /* NaN lanes (a group with a NaN or inf, whose scale is NaN or inf too) become 0 as in
             * the C version, before the clamp (VMAXPS would turn them into the bound). */
            r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(r, r, _CMP_ORD_Q), r);
            r = _mm512_min_ps(_mm512_max_ps(r, _mm512_sub_ps(_mm512_setzero_ps(), bound)), bound);
            _mm256_storeu_si256((__m256i *)(q + j0 + 16 * i),
                                _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(r)));
        }
    }
}

/* Groups [g0, g1) of R rows of xq (int16, k columns; their group scales xs, `groups` a row)
 * against B blocks of packed int16 weights from `w` on: each group's exact int32 sums, scaled by
 * the rows' group scales and added into acc (fp32, row stride 16 * I16_TASK_BLOCKS; the first
 * group starts it). After the last group the sums times the channels' scales ws go to y (row
 * stride n), the last block's masked by `last`: no pass of their own over the accumulators (one
 * took 6% of a prefill). `next` (or NULL): weights further on, prefetched into L2. */
VNNI_TARGET static inline __attribute__((always_inline)) void
i16_tile(const int16_t *xq, const float *xs, int64_t k, int64_t groups, int64_t g0, int64_t g1,
         const int16_t *w, float *acc, const float *ws, float *y, int64_t n, __mmask16 last,
         const int16_t *next, const int rows, const int blocks) {
    const int64_t block_elems = 16 * k;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t p0 = g * (I16_GROUP / 2);
        const int64_t p1 = p0 + I16_GROUP / 2 < k / 2 ? p0 + I16_GROUP / 2 : k / 2;
        __m512i sum[I16_TILE_ROWS][I16_TASK_BLOCKS];
        for (int r = 0; r < rows; r++)
            for (int b = 0; b < blocks; b++) sum[r][b] = _mm512_setzero_si512();
        for (int64_t p = p0; p < p1; p++) {
            __m512i wv[I16_TASK_BLOCKS];
            for (int b = 0; b < blocks; b++) {
                wv[b] = _mm512_loadu_si512(w + b * block_elems + 32 * p);
                if (next != NULL)
                    _mm_prefetch((const char *)(next + b * block_elems + 32 * p), _MM_HINT_T1);
            }
            for (int r = 0; r < rows; r++) {
                int32_t pair;
                memcpy(&pair, xq + r * k + 2 * p, sizeof pair);
                const __m512i xv = _mm512_set1_epi32(pair);
                for (int b = 0; b < blocks; b++) sum[r][b] = dpwssd(sum[r][b], xv, wv[b]);
            }
        }
        for (int r = 0; r < rows; r++) {
            const __m512 scale = _mm512_set1_ps(xs[r * groups + g]);
            for (int b = 0; b < blocks; b++) {
                float *at = acc + r * 16 * I16_TASK_BLOCKS + 16 * b;
                /* fma(sum, scale, 0) in the first group: the C version's first fmaf, zero signs
                 * too */
                const __m512 prior = g == 0 ? _mm512_setzero_ps() : _mm512_load_ps(at);
                const __m512 total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][b]), scale, prior);
                if (g + 1 < groups) {
                    _mm512_store_ps(at, total);
                    continue;
                }
                const __mmask16 mask = b + 1 == blocks ? last : (__mmask16)0xFFFF;
                const __m512 channel = _mm512_loadu_ps(ws + 16 * b);
                _mm512_mask_storeu_ps(y + r * n + 16 * b, mask, _mm512_mul_ps(total, channel));
            }
        }
    }
}

#define I16_TILE_CASE(R, B)                                                                        \
    case (R) * 4 + (B):                                                                            \
        i16_tile(xq, xs, k, groups, g0, g1, w, acc, ws, y, n, last, next, R, B);                   \
        break;
#define I16_TILE_ROW(R) I16_TILE_CASE(R, 1) I16_TILE_CASE(R, 2) I16_TILE_CASE(R, 3)

VNNI_TARGET static void i16_tile_any(const int16_t *xq, const float *xs, int64_t k, int64_t groups,
                                     int64_t g0, int64_t g1, const int16_t *w, float *acc,
                                     const float *ws, float *y, int64_t n, __mmask16 last,
                                     const int16_t *next, int rows, int blocks) {
    switch (rows * 4 + blocks) {
        I16_TILE_ROW(1)
        I16_TILE_ROW(2)
        I16_TILE_ROW(3)
        I16_TILE_ROW(4)
        I16_TILE_ROW(5)
        I16_TILE_ROW(6)
        I16_TILE_ROW(7)
        I16_TILE_ROW(8)
    default:
        break;
    }
}

/* A task: rows [0, m) (m <= I16_ROW_SPAN) against `blocks` blocks from w on, into y (stride n).
 * The rows pass over I16_CHUNK_GROUPS groups at a time, whose weights (up to 24 KB for three
 * blocks) stay in L1 meanwhile; a tile takes them all in one call, where one call a group cost
 * ~20% of the tile's rate in calls and set-up. */
VNNI_TARGET static void i16_task(const int16_t *xq, const float *xs, int64_t m, int64_t k,
                                 const int16_t *w, const float *ws, float *y, int64_t n,
                                 __mmask16 last, const int16_t *next, int blocks, float *acc) {
    const int64_t groups = (k + I16_GROUP - 1) / I16_GROUP;
    const int64_t chunks = (groups + I16_CHUNK_GROUPS - 1) / I16_CHUNK_GROUPS;
    const int64_t per_chunk = (groups + chunks - 1) / chunks; /* 9 groups: 3 of 3, not 4, 4, 1 */
    const int64_t stride = 16 * I16_TASK_BLOCKS;
    for (int64_t g0 = 0; g0 < groups; g0 += per_chunk) {
        const int64_t g1 = g0 + per_chunk < groups ? g0 + per_chunk : groups;
        for (int64_t i = 0; i < m; i += I16_TILE_ROWS) {
            const int rows = (int)(m - i < I16_TILE_ROWS ? m - i : I16_TILE_ROWS);
            i16_tile_any(xq + i * k, xs + i * groups, k, groups, g0, g1, w, acc + i * stride, ws,
                         y + i * n, n, last, i == 0 ? next : NULL, rows, blocks);
        }
    }
}

int i16_rows_vnni(const int16_t *xq, const float *xs, int64_t m, int64_t k, const int16_t *w,
                  const float *ws, int64_t n, float *y, int threads, struct scratch *s) {
    const int64_t groups = (k + I16_GROUP - 1) / I16_GROUP;
    const int64_t blocks = (n + 15) / 16;
    const int64_t tasks = (blocks + I16_TASK_BLOCKS - 1) / I16_TASK_BLOCKS;
    const int64_t block_elems = 16 * k;
    /* The accumulators of a task's span of rows, one set per thread. */
    const int64_t span_rows = m < I16_ROW_SPAN ? m : I16_ROW_SPAN;
    const size_t per_thread = (size_t)(span_rows * 16 * I16_TASK_BLOCKS);
    const size_t mark = scratch_mark(s);
    void *owned;
    float *accs = scratch_take(s, sizeof(float) * per_thread * (size_t)threads, &owned);
    if (accs == NULL) return -1;
    /* A task this many further on is prefetched while its predecessor's first rows run. */
    const int64_t ahead =
        (channels_ahead(BF16, k) + 16 * I16_TASK_BLOCKS - 1) / (16 * I16_TASK_BLOCKS);
    const int tail = (int)(n % 16);
    const __mmask16 tail_mask = tail == 0 ? (__mmask16)0xFFFF : (__mmask16)((1u << tail) - 1);
#pragma omp parallel num_threads(threads)
    {
        float *acc = accs + per_thread * (size_t)omp_get_thread_num();
        for (int64_t span = 0; span < m; span += I16_ROW_SPAN) {
            const int64_t rows = m - span < I16_ROW_SPAN ? m - span : I16_ROW_SPAN;
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t t = 0; t < tasks; t++) {
                const int64_t first = t * I16_TASK_BLOCKS;
                const int count =
                    (int)(blocks - first < I16_TASK_BLOCKS ? blocks - first : I16_TASK_BLOCKS);
                const __mmask16 last = first + count == blocks ? tail_mask : (__mmask16)0xFFFF;
                const int16_t *next = ahead > 0 && span == 0 && t + ahead < tasks
                                          ? w + (t + ahead) * I16_TASK_BLOCKS * block_elems
                                          : NULL;
                i16_task(xq + span * k, xs + span * groups, rows, k, w + first * block_elems,
                         ws + 16 * first, y + span * n + 16 * first, n, last, next, count, acc);
            }
        }
    }
    free(owned);
    scratch_release(s, mark);
    return 0;
}

int i16_vnni_cpu(void) {
    static int cpu = -1;
    if (cpu < 0) {
        __builtin_cpu_init();
        cpu = __builtin_cpu_supports("avx512vnni") != 0;
    }
    return cpu;
}
#else
int i16_vnni_cpu(void) { return 0; }
void i16_row_vnni(const float *x, int64_t k, int16_t *q, float *scale) {
    i16_row_c(x, k, q, scale);
}
int i16_rows_vnni(const int16_t *xq, const float *xs, int64_t m, int64_t k, const int16_t *w,
                  const float *ws, int64_t n, float *y, int threads, struct scratch *s) {
    (void)xq, (void)xs, (void)m, (void)k, (void)w, (void)ws, (void)n, (void)y;
    (void)threads, (void)s;
    return -1; /* never taken: i16_vnni_cpu() is 0 */
}
#endif
