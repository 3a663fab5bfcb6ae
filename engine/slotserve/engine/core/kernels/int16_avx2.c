/* Products on int16 weights with AVX2's VPMADDWD (pairs of int16 products added into int32
 * lanes) and VPADDD, for CPUs with AVX2 and no bf16 units (AMD Zen 2 and 3, Intel before Ice
 * Lake): the same integers and fp32 operations as int16_vnni.c and the plain C version
 * (int16.c), so its results are theirs to the bit.
 *
 * Why: a VPMADDWD does 16 multiply-adds, an FMA 8. With the VPADDD that each one needs, a
 * register-only loop on a 2-core Zen 3 (family 25 model 1) ran 2.5-3.3 G VPMADDWD a second a
 * core against 3.9-5.4 G FMAs: 1.2-1.45x the fp32 multiply-adds. Decode steps gain more: their
 * weights stream from memory, and int16 weights are half fp32's bytes.
 *
 * Work: tasks of I16_TASK_BLOCKS blocks as int16_vnni.c's. A prefill's rows go six at a time
 * (i16_six_rows: 12 int32 sums, both halves of a block's weights, a broadcast pair: the 16
 * registers) over I16_CHUNK_GROUPS groups whose weights stay in L1; up to I16_AVX2_FEW_STEP rows
 * (a decode step) go two at a time over every group with their fp32 sums in registers
 * (i16_few_avx2), the weights streaming once. */
#include <stdint.h>

#include "int16.h"

#if defined(__x86_64__)
#define I16_AVX2 __attribute__((target("avx2,fma")))
#define I16_AVX2_ROWS 6
#define I16_AVX2_FEW 2      /* rows a decode tile takes over every group */
#define I16_AVX2_FEW_STEP 3 /* the most rows that go through those tiles */

/* i16_row_c's results 64 columns at a time (the C version takes a short last group). */
I16_AVX2 void i16_row_avx2(const float *x, int64_t k, int16_t *q, float *scale) {
    const __m256 bound = _mm256_set1_ps(I16_ROW_MAX);
    const __m256 low = _mm256_set1_ps(-I16_ROW_MAX);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t g = 0, j0 = 0; j0 < k; g++, j0 += I16_GROUP) {
        const int64_t j1 = j0 + I16_GROUP < k ? j0 + I16_GROUP : k;
        if (j1 - j0 != I16_GROUP) {
            i16_row_c(x + j0, j1 - j0, q + j0, scale + g);
            continue;
        }
        __m256 v[8], top = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (int i = 0; i < 8; i++) {
            v[i] = _mm256_loadu_ps(x + j0 + 8 * i);
            top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
        }
        __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        t = _mm_max_ps(t, _mm_movehl_ps(t, t));
        t = _mm_max_ss(t, _mm_movehdup_ps(t));
        const float most = _mm256_movemask_ps(nan) ? NAN : _mm_cvtss_f32(t);
        const float inv = most > 0.0f && most <= FLT_MAX ? I16_ROW_MAX / most : 0.0f;
        scale[g] = most / I16_ROW_MAX;
        const __m256 by = _mm256_set1_ps(inv);
        for (int i = 0; i < 8; i += 2) {
            __m256i pair[2];
            for (int h = 0; h < 2; h++) {
                __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i + h], by),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                r = _mm256_and_ps(r, _mm256_cmp_ps(r, r, _CMP_ORD_Q));
                r = _mm256_min_ps(_mm256_max_ps(r, low), bound);
                pair[h] = _mm256_cvtps_epi32(r);
            }
            const __m256i packed =
                _mm256_permute4x64_epi64(_mm256_packs_epi32(pair[0], pair[1]), 0xD8);
            _mm256_storeu_si256((__m256i *)(q + j0 + 8 * i), packed);
        }
    }
}

_Static_assert(16 * I16_TASK_BLOCKS * sizeof(float) == 192, "i16_six_rows' row stride");

/* The fp32 accumulators a first group adds its sums to (fma(sum, scale, +0), the C version's). */
static const float i16_zeros[I16_AVX2_ROWS * 16 * I16_TASK_BLOCKS]
    __attribute__((aligned(32))) = {0};

/* One group of six rows: their sums over `pairs` (> 0) column pairs in 12 int32 accumulators
 * (with both halves of the block's weights and a broadcast pair: the 16 registers), then each
 * scaled by its row's group scale (scale, rows `scale_stride` bytes apart) and added to `prior`
 * into `out` (fp32, rows 16 * I16_TASK_BLOCKS floats apart; `out` may be `prior`). As one asm
 * loop: GCC 12 spilled half the accumulators of the same loop in intrinsics (the tile at two
 * thirds of its rate), and the sums passing through memory to the fp32 step cost another ~10%. */
I16_AVX2 static inline __attribute__((always_inline)) void
i16_six_rows(const int16_t *x, int64_t stride_bytes, const int16_t *w, const int16_t *next,
             int64_t pairs, const float *scale, int64_t scale_stride, const float *prior,
             float *out) {
    const char *a = (const char *)x, *b = (const char *)x + 3 * stride_bytes;
    const char *wp = (const char *)w;
    /* Weights further on, prefetched into L2 a line a pair (the first row tile streams them). */
    const char *pf = next != NULL ? (const char *)next : (const char *)w;
    const char *sa = (const char *)scale, *sb = (const char *)scale + 3 * scale_stride;
    /* clang-format off */
    __asm__ volatile(
        "vpxor %%xmm0, %%xmm0, %%xmm0\n\t"
        "vpxor %%xmm1, %%xmm1, %%xmm1\n\t"
        "vpxor %%xmm2, %%xmm2, %%xmm2\n\t"
        "vpxor %%xmm3, %%xmm3, %%xmm3\n\t"
        "vpxor %%xmm4, %%xmm4, %%xmm4\n\t"
        "vpxor %%xmm5, %%xmm5, %%xmm5\n\t"
        "vpxor %%xmm6, %%xmm6, %%xmm6\n\t"
        "vpxor %%xmm7, %%xmm7, %%xmm7\n\t"
        "vpxor %%xmm8, %%xmm8, %%xmm8\n\t"
        "vpxor %%xmm9, %%xmm9, %%xmm9\n\t"
        "vpxor %%xmm10, %%xmm10, %%xmm10\n\t"
        "vpxor %%xmm11, %%xmm11, %%xmm11\n\t"
        "1:\n\t"
        "vmovdqu (%[w]), %%ymm12\n\t"
        "vmovdqu 32(%[w]), %%ymm13\n\t"
        "prefetcht1 (%[pf])\n\t"
#define I16_ROW(ADDR, S0, S1)                                                                      \
        "vpbroadcastd " ADDR ", %%ymm14\n\t"                                                       \
        "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t"                                                   \
        "vpaddd %%ymm15, %%" S0 ", %%" S0 "\n\t"                                                   \
        "vpmaddwd %%ymm13, %%ymm14, %%ymm15\n\t"                                                   \
        "vpaddd %%ymm15, %%" S1 ", %%" S1 "\n\t"
        I16_ROW("(%[a])", "ymm0", "ymm1")
        I16_ROW("(%[a],%[s],1)", "ymm2", "ymm3")
        I16_ROW("(%[a],%[s],2)", "ymm4", "ymm5")
        I16_ROW("(%[b])", "ymm6", "ymm7")
        I16_ROW("(%[b],%[s],1)", "ymm8", "ymm9")
        I16_ROW("(%[b],%[s],2)", "ymm10", "ymm11")
#undef I16_ROW
        "add $64, %[w]\n\t"
        "add $64, %[pf]\n\t"
        "add $4, %[a]\n\t"
        "add $4, %[b]\n\t"
        "dec %[n]\n\t"
        "jnz 1b\n\t"
/* Row r's sums at byte AT = r * 192 of prior and out (16 * I16_TASK_BLOCKS floats a row). */
#define I16_OUT(SCALE, S0, S1, AT)                                                                 \
        "vbroadcastss " SCALE ", %%ymm14\n\t"                                                      \
        "vcvtdq2ps %%" S0 ", %%" S0 "\n\t"                                                         \
        "vfmadd213ps " AT "(%[prior]), %%ymm14, %%" S0 "\n\t"                                      \
        "vmovaps %%" S0 ", " AT "(%[out])\n\t"                                                     \
        "vcvtdq2ps %%" S1 ", %%" S1 "\n\t"                                                         \
        "vfmadd213ps " AT "+32(%[prior]), %%ymm14, %%" S1 "\n\t"                                   \
        "vmovaps %%" S1 ", " AT "+32(%[out])\n\t"
        I16_OUT("(%[sa])", "ymm0", "ymm1", "0")
        I16_OUT("(%[sa],%[ss],1)", "ymm2", "ymm3", "192")
        I16_OUT("(%[sa],%[ss],2)", "ymm4", "ymm5", "384")
        I16_OUT("(%[sb])", "ymm6", "ymm7", "576")
        I16_OUT("(%[sb],%[ss],1)", "ymm8", "ymm9", "768")
        I16_OUT("(%[sb],%[ss],2)", "ymm10", "ymm11", "960")
#undef I16_OUT
        : [w] "+r"(wp), [pf] "+r"(pf), [a] "+r"(a), [b] "+r"(b), [n] "+r"(pairs)
        : [s] "r"(stride_bytes), [sa] "r"(sa), [sb] "r"(sb), [ss] "r"(scale_stride),
          [prior] "r"(prior), [out] "r"(out)
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
          "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "cc", "memory");
    /* clang-format on */
}

/* Rows [0, rows) of xq (stride k) against one block's column pairs [p0, p1): each row's int32
 * sums for the block's two halves into sum[r], zeroed first. `next` (or NULL): weights further
 * on, prefetched into L2 a line a pair. */
I16_AVX2 static inline __attribute__((always_inline)) void
i16_sums_avx2(const int16_t *xq, int64_t k, const int16_t *w, const int16_t *next, int64_t p0,
              int64_t p1, const int rows, __m256i sum[][2]) {
    for (int r = 0; r < rows; r++) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
    for (int64_t p = p0; p < p1; p++) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + 32 * p));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 32 * p + 16));
        if (next != NULL) _mm_prefetch((const char *)(next + 32 * p), _MM_HINT_T1);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, xq + r * k + 2 * p, sizeof pair);
            const __m256i xv = _mm256_set1_epi32(pair);
            sum[r][0] = _mm256_add_epi32(sum[r][0], _mm256_madd_epi16(xv, w0));
            sum[r][1] = _mm256_add_epi32(sum[r][1], _mm256_madd_epi16(xv, w1));
        }
    }
}

/* Eight results: total times the channels' scales, stored where `mask` holds channels. */
I16_AVX2 static inline void i16_out(float *y, __m256 total, const float *ws, __m256i mask) {
    _mm256_maskstore_ps(y, mask, _mm256_mul_ps(total, _mm256_loadu_ps(ws)));
}

/* Where a block's stream prefetches: `ahead_bytes` (dispatch.c) further on. */
static inline const int16_t *i16_ahead(const int16_t *block) {
    return (const int16_t *)((const char *)block + ahead_bytes);
}

/* Groups [g0, g1) of `rows` rows (<= I16_AVX2_ROWS) against one block: six rows in
 * i16_six_rows, fewer here with intrinsics (their sums fit the registers). The fp32 sums go to acc
 * (rows 16 * I16_TASK_BLOCKS floats apart) until the last group, which writes y (stride n) times
 * the channels' scales, masked past the block's channels; `next`: weights to prefetch or NULL. */
I16_AVX2 static inline __attribute__((always_inline)) void
i16_tile_avx2(const int16_t *xq, const float *xs, int64_t k, int64_t groups, int64_t g0, int64_t g1,
              const int16_t *w, float *acc, const float *ws, float *y, int64_t n, __m256i mask0,
              __m256i mask1, const int16_t *next, const int rows) {
    for (int64_t g = g0; g < g1; g++) {
        const int64_t p0 = g * (I16_GROUP / 2);
        const int64_t p1 = p0 + I16_GROUP / 2 < k / 2 ? p0 + I16_GROUP / 2 : k / 2;
        if (rows == I16_AVX2_ROWS) {
            i16_six_rows(xq + 2 * p0, 2 * k, w + 32 * p0, next != NULL ? next + 32 * p0 : NULL,
                         p1 - p0, xs + g, (int64_t)sizeof(float) * groups, g == 0 ? i16_zeros : acc,
                         acc);
            if (g + 1 < groups) continue;
            for (int r = 0; r < rows; r++)
                for (int h = 0; h < 2; h++)
                    i16_out(y + r * n + 8 * h,
                            _mm256_load_ps(acc + r * 16 * I16_TASK_BLOCKS + 8 * h), ws + 8 * h,
                            h ? mask1 : mask0);
            continue;
        }
        __m256i sum[I16_AVX2_ROWS][2];
        i16_sums_avx2(xq, k, w, next, p0, p1, rows, sum);
        for (int r = 0; r < rows; r++) {
            const __m256 scale = _mm256_set1_ps(xs[r * groups + g]);
            for (int h = 0; h < 2; h++) {
                float *at = acc + r * 16 * I16_TASK_BLOCKS + 8 * h;
                const __m256 prior = g == 0 ? _mm256_setzero_ps() : _mm256_load_ps(at);
                const __m256 total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][h]), scale, prior);
                if (g + 1 < groups) {
                    _mm256_store_ps(at, total);
                    continue;
                }
                i16_out(y + r * n + 8 * h, total, ws + 8 * h, h ? mask1 : mask0);
            }
        }
    }
}

/* Rows [0, rows) (rows <= I16_AVX2_FEW) against one block over every group: a decode step's
 * product, whose weights stream from memory once. The fp32 accumulators stay in registers beside
 * the int32 sums, so nothing but the weights goes through memory per group. */
I16_AVX2 static inline __attribute__((always_inline)) void
i16_few_avx2(const int16_t *xq, const float *xs, int64_t k, int64_t groups, const int16_t *w,
             const float *ws, float *y, int64_t n, __m256i mask0, __m256i mask1,
             const int16_t *next, const int rows) {
    __m256 total[I16_AVX2_FEW][2];
    for (int r = 0; r < rows; r++) total[r][0] = total[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const int64_t p0 = g * (I16_GROUP / 2);
        const int64_t p1 = p0 + I16_GROUP / 2 < k / 2 ? p0 + I16_GROUP / 2 : k / 2;
        __m256i sum[I16_AVX2_FEW][2];
        i16_sums_avx2(xq, k, w, next, p0, p1, rows, sum);
        for (int r = 0; r < rows; r++) {
            const __m256 scale = _mm256_set1_ps(xs[r * groups + g]);
            for (int h = 0; h < 2; h++)
                total[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][h]), scale, total[r][h]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < 2; h++)
            i16_out(y + r * n + 8 * h, total[r][h], ws + 8 * h, h ? mask1 : mask0);
}

I16_AVX2 static void i16_tile_avx2_any(const int16_t *xq, const float *xs, int64_t k,
                                       int64_t groups, int64_t g0, int64_t g1, const int16_t *w,
                                       float *acc, const float *ws, float *y, int64_t n,
                                       __m256i mask0, __m256i mask1, const int16_t *next,
                                       int rows) {
#define I16_AVX2_CASE(R)                                                                           \
    case R:                                                                                        \
        i16_tile_avx2(xq, xs, k, groups, g0, g1, w, acc, ws, y, n, mask0, mask1, next, R);         \
        break;
    switch (rows) {
        I16_AVX2_CASE(1)
        I16_AVX2_CASE(2)
        I16_AVX2_CASE(3)
        I16_AVX2_CASE(4)
        I16_AVX2_CASE(5)
        I16_AVX2_CASE(6)
    default:
        break;
    }
#undef I16_AVX2_CASE
}

/* The lanes of a block's two halves that hold channels: all, or the first `tail` (1-15). */
I16_AVX2 static inline void i16_masks(int tail, __m256i *mask0, __m256i *mask1) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    *mask0 = *mask1 = _mm256_set1_epi32(-1);
    if (tail == 0) return;
    *mask0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(tail), lane);
    *mask1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(tail - 8), lane);
}

/* A task: rows [0, m) (m <= I16_ROW_SPAN) against `blocks` blocks from w on, into y (stride n),
 * the last block's channels `tail` (0: all 16). Each block's weights stream from memory once:
 * the first rows to reach them prefetch `ahead_bytes` further on into L2 as they go. */
I16_AVX2 static void i16_task_avx2(const int16_t *xq, const float *xs, int64_t m, int64_t k,
                                   const int16_t *w, const float *ws, float *y, int64_t n, int tail,
                                   int blocks, float *acc) {
    const int64_t groups = (k + I16_GROUP - 1) / I16_GROUP;
    const int64_t block_elems = 16 * k;
    __m256i mask0, mask1;
    if (m <= I16_AVX2_FEW_STEP) {
        for (int b = 0; b < blocks; b++) {
            i16_masks(b + 1 == blocks ? tail : 0, &mask0, &mask1);
            const int16_t *block = w + b * block_elems;
            for (int64_t i = 0; i < m; i += I16_AVX2_FEW) {
                /* The first pair of rows streams the block; the others find it in L1. */
                const int16_t *next = i == 0 ? i16_ahead(block) : NULL;
                if (m - i == 1)
                    i16_few_avx2(xq + i * k, xs + i * groups, k, groups, block, ws + 16 * b,
                                 y + i * n + 16 * b, n, mask0, mask1, next, 1);
                else
                    i16_few_avx2(xq + i * k, xs + i * groups, k, groups, block, ws + 16 * b,
                                 y + i * n + 16 * b, n, mask0, mask1, next, 2);
            }
        }
        return;
    }
    const int64_t chunks = (groups + I16_CHUNK_GROUPS - 1) / I16_CHUNK_GROUPS;
    const int64_t per_chunk = (groups + chunks - 1) / chunks;
    const int64_t stride = 16 * I16_TASK_BLOCKS;
    for (int64_t g0 = 0; g0 < groups; g0 += per_chunk) {
        const int64_t g1 = g0 + per_chunk < groups ? g0 + per_chunk : groups;
        for (int64_t i = 0; i < m; i += I16_AVX2_ROWS) {
            const int rows = (int)(m - i < I16_AVX2_ROWS ? m - i : I16_AVX2_ROWS);
            for (int b = 0; b < blocks; b++) {
                i16_masks(b + 1 == blocks ? tail : 0, &mask0, &mask1);
                const int16_t *block = w + b * block_elems;
                const int16_t *next = i == 0 ? i16_ahead(block) : NULL;
                i16_tile_avx2_any(xq + i * k, xs + i * groups, k, groups, g0, g1, block,
                                  acc + i * stride + 16 * b, ws + 16 * b, y + i * n + 16 * b, n,
                                  mask0, mask1, next, rows);
            }
        }
    }
}

int i16_rows_avx2(const int16_t *xq, const float *xs, int64_t m, int64_t k, const int16_t *w,
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
    const int tail = (int)(n % 16);
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
                i16_task_avx2(xq + span * k, xs + span * groups, rows, k, w + first * block_elems,
                              ws + 16 * first, y + span * n + 16 * first, n,
                              first + count == blocks ? tail : 0, count, acc);
            }
        }
    }
    free(owned);
    scratch_release(s, mark);
    return 0;
}
#else
void i16_row_avx2(const float *x, int64_t k, int16_t *q, float *scale) {
    i16_row_c(x, k, q, scale);
}
int i16_rows_avx2(const int16_t *xq, const float *xs, int64_t m, int64_t k, const int16_t *w,
                  const float *ws, int64_t n, float *y, int threads, struct scratch *s) {
    (void)xq, (void)xs, (void)m, (void)k, (void)w, (void)ws, (void)n, (void)y;
    (void)threads, (void)s;
    return -1; /* never taken: no AVX2 code off x86-64 */
}
#endif
