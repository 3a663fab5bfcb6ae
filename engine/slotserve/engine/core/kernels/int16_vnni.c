/* Products on int16 weights with AVX512_VNNI's int16 dot products (VPDPWSSD), for CPUs that
 * have VNNI but no bf16 units (Intel Cascade Lake and Ice Lake, or a newer Xeon whose hypervisor
 * hides AVX512_BF16 and AMX). The numbers and the layout: int16.c.
 *
 * Why: there a prefill chunk's fp32 products run at the FMA units' rate, 16 multiply-adds an
 * instruction, and bf16 would be emulated. One VPDPWSSD does 32 (pairs of int16 products, exact,
 * added into 16 int32 lanes) at the same rate as an FMA (2 a cycle, measured on a 2-core Xeon of
 * family 6 model 207: 5.3 G instructions a second each).
 *
 * Work: a task is I16_TASK_BLOCKS blocks of channels (their weights stay in L2 while the rows
 * pass); rows go I16_ROW_SPAN at a time, in tiles of I16_TILE_ROWS rows that walk all of k with
 * both their int32 group sums and their fp32 sums in registers, as the bf16 kernel's tiles do.
 * An earlier version took 8 rows a tile, group by group, with the fp32 sums in a per-thread
 * buffer: a fifth of its time went to that buffer and to the sums' spills between groups (perf
 * annotate on a Zen 5), and it ran at 0.78-0.89x the bf16 kernel's rate where this one runs at
 * 0.88-1.05x (SmolLM2's prefill shapes at 1,024 rows; VPDPWSSD's own rate is 1.1x VDPBF16PS's
 * there). */
#include <stdint.h>

#include "int16.h"

#define I16_TILE_ROWS 4

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

/* R rows of xq (int16, k columns; their group scales xs, `groups` a row) against B blocks of
 * packed int16 weights from `w` on, over all of k: each group's exact int32 sums, scaled by the
 * rows' group scales and added into fp32 accumulators that stay in registers for the whole row
 * (12 int32 sums + 12 fp32 sums + 3 weights + a broadcast pair: 28 of the 32 zmm), then times
 * the channels' scales ws into y (row stride n), the last block masked by `last`. `next` (or
 * NULL): weights further on, prefetched into L2. */
VNNI_TARGET static inline __attribute__((always_inline)) void
i16_tile(const int16_t *xq, const float *xs, int64_t k, int64_t groups, const int16_t *w,
         const float *ws, float *y, int64_t n, __mmask16 last, const int16_t *next, const int rows,
         const int blocks) {
    const int64_t block_elems = 16 * k;
    __m512 acc[I16_TILE_ROWS][I16_TASK_BLOCKS];
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 3
        for (int b = 0; b < blocks; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const int64_t p0 = g * (I16_GROUP / 2);
        const int64_t p1 = p0 + I16_GROUP / 2 < k / 2 ? p0 + I16_GROUP / 2 : k / 2;
        __m512i sum[I16_TILE_ROWS][I16_TASK_BLOCKS];
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++)
#pragma GCC unroll 3
            for (int b = 0; b < blocks; b++) sum[r][b] = _mm512_setzero_si512();
        for (int64_t p = p0; p < p1; p++) {
            __m512i wv[I16_TASK_BLOCKS];
#pragma GCC unroll 3
            for (int b = 0; b < blocks; b++) {
                wv[b] = _mm512_loadu_si512(w + b * block_elems + 32 * p);
                if (next != NULL)
                    _mm_prefetch((const char *)(next + b * block_elems + 32 * p), _MM_HINT_T1);
            }
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++) {
                int32_t pair;
                memcpy(&pair, xq + r * k + 2 * p, sizeof pair);
                const __m512i xv = _mm512_set1_epi32(pair);
#pragma GCC unroll 3
                for (int b = 0; b < blocks; b++) sum[r][b] = dpwssd(sum[r][b], xv, wv[b]);
            }
        }
        /* acc = fma(sum, scale, acc), from acc = 0: the C version's fmaf chain, zero signs too */
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++) {
            const __m512 scale = _mm512_set1_ps(xs[r * groups + g]);
#pragma GCC unroll 3
            for (int b = 0; b < blocks; b++)
                acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][b]), scale, acc[r][b]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 3
        for (int b = 0; b < blocks; b++) {
            const __mmask16 mask = b + 1 == blocks ? last : (__mmask16)0xFFFF;
            const __m512 channel = _mm512_loadu_ps(ws + 16 * b);
            _mm512_mask_storeu_ps(y + r * n + 16 * b, mask, _mm512_mul_ps(acc[r][b], channel));
        }
}

#define I16_TILE_CASE(R, B)                                                                        \
    case (R) * 4 + (B):                                                                            \
        i16_tile(xq, xs, k, groups, w, ws, y, n, last, next, R, B);                                \
        break;
#define I16_TILE_ROW(R) I16_TILE_CASE(R, 1) I16_TILE_CASE(R, 2) I16_TILE_CASE(R, 3)

VNNI_TARGET static void i16_tile_any(const int16_t *xq, const float *xs, int64_t k, int64_t groups,
                                     const int16_t *w, const float *ws, float *y, int64_t n,
                                     __mmask16 last, const int16_t *next, int rows, int blocks) {
    switch (rows * 4 + blocks) {
        I16_TILE_ROW(1)
        I16_TILE_ROW(2)
        I16_TILE_ROW(3)
        I16_TILE_ROW(4)
    default:
        break;
    }
}

int i16_rows_vnni(const int16_t *xq, const float *xs, int64_t m, int64_t k, const int16_t *w,
                  const float *ws, int64_t n, float *y, int threads, struct scratch *s) {
    (void)s; /* the sums live in registers: no buffer */
    const int64_t groups = (k + I16_GROUP - 1) / I16_GROUP;
    const int64_t blocks = (n + 15) / 16;
    const int64_t tasks = (blocks + I16_TASK_BLOCKS - 1) / I16_TASK_BLOCKS;
    const int64_t block_elems = 16 * k;
    /* A task this many further on is prefetched while its first rows run. */
    const int64_t ahead =
        (channels_ahead(BF16, k) + 16 * I16_TASK_BLOCKS - 1) / (16 * I16_TASK_BLOCKS);
    const int tail = (int)(n % 16);
    const __mmask16 tail_mask = tail == 0 ? (__mmask16)0xFFFF : (__mmask16)((1u << tail) - 1);
#pragma omp parallel num_threads(threads)
    for (int64_t span = 0; span < m; span += I16_ROW_SPAN) {
        const int64_t span_end = m - span < I16_ROW_SPAN ? m : span + I16_ROW_SPAN;
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t first = t * I16_TASK_BLOCKS;
            const int count =
                (int)(blocks - first < I16_TASK_BLOCKS ? blocks - first : I16_TASK_BLOCKS);
            const __mmask16 last = first + count == blocks ? tail_mask : (__mmask16)0xFFFF;
            const int16_t *next = ahead > 0 && span == 0 && t + ahead < tasks
                                      ? w + (t + ahead) * I16_TASK_BLOCKS * block_elems
                                      : NULL;
            for (int64_t i = span; i < span_end; i += I16_TILE_ROWS) {
                const int rows = (int)(span_end - i < I16_TILE_ROWS ? span_end - i : I16_TILE_ROWS);
                i16_tile_any(xq + i * k, xs + i * groups, k, groups, w + first * block_elems,
                             ws + 16 * first, y + i * n + 16 * first, n, last,
                             i == span ? next : NULL, rows, count);
            }
        }
    }
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
