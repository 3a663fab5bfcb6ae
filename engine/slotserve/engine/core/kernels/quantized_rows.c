/* The one-row products against quantized weights (batch-1 decode). */
#include "gemm.h"

/* ---- one row (batch-1 decode): dequantize into registers, no panel buffer ------------------ */
/* With one row there is nothing to amortise a panel over: per 8 weights a panel costs a convert,
 * a scale, a store, a load and an FMA; here a convert and an FMA, the group's scale applied once
 * to its partial sum, and (int4) its minimum through the group's sum of x. */

#if HAVE_AVX2_CODE
__attribute__((target("avx2,fma"))) static float row_q8_avx2(const float *x, const int8_t *q,
                                                             const float *scale, int64_t k) {
    __m256 total = _mm256_setzero_ps();
    for (int64_t g = 0; g < k / GROUP; g++) {
        const int8_t *qg = q + g * GROUP;
        const float *xg = x + g * GROUP;
        __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
        for (int j = 0; j < GROUP; j += 16) {
            __m256 w0 = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qg + j))));
            __m256 w1 = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qg + j + 8))));
            acc = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xg + j), acc);
            acc2 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + j + 8), acc2);
        }
        total = _mm256_fmadd_ps(_mm256_add_ps(acc, acc2), _mm256_set1_ps(scale[g]), total);
    }
    return hsum(total);
}

/* int4 against the row held as int16 (xq, one factor xs = max(max|x| / 32767, FLT_MIN) per
 * group: |x - xs * xq| <= xs / 2, a relative 1.5e-5 of the group's largest |x|): a group's 32 nibbles widen to 16-bit lanes and
 * two multiply-adds of 16-bit pairs take all 32 products (exact in 32 bits), where converting
 * each nibble to a float took four widenings and four conversions. Two groups at a time, each
 * with its own accumulator, so that no chain of dependent multiply-adds sets the pace. */
__attribute__((target("avx2,fma"))) static inline __m256 group_q4(const int16_t *xq,
                                                                  const uint8_t *q) {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)q));
    const __m256i lo = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F)); /* weights 0..15 */
    const __m256i hi = _mm256_srli_epi16(bytes, 4);                      /* weights 16..31 */
    return _mm256_cvtepi32_ps(
        _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xq)),
                         _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 16)))));
}

__attribute__((target("avx2,fma"))) static float row_q4_avx2(const int16_t *xq, const float *xs,
                                                             const float *xsum, const uint8_t *q,
                                                             const float *scale,
                                                             const float *minimum, int64_t k) {
    const int64_t groups = k / GROUP;
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
        even = _mm256_fmadd_ps(group_q4(xq + g * GROUP, q + g * (GROUP / 2)),
                               _mm256_set1_ps(scale[g] * xs[g]), even);
        odd = _mm256_fmadd_ps(group_q4(xq + (g + 1) * GROUP, q + (g + 1) * (GROUP / 2)),
                              _mm256_set1_ps(scale[g + 1] * xs[g + 1]), odd);
    }
    if (g < groups)
        even = _mm256_fmadd_ps(group_q4(xq + g * GROUP, q + g * (GROUP / 2)),
                               _mm256_set1_ps(scale[g] * xs[g]), even);
    /* The minimums' part: sum over groups of minimum * (sum of the group's x), 8 at a time. */
    __m256 offsets = _mm256_setzero_ps();
    for (g = 0; g + 8 <= groups; g += 8)
        offsets = _mm256_fmadd_ps(_mm256_loadu_ps(minimum + g), _mm256_loadu_ps(xsum + g), offsets);
    float offset = 0.0f;
    for (; g < groups; g++) offset += minimum[g] * xsum[g];
    return hsum(_mm256_add_ps(_mm256_add_ps(even, odd), offsets)) + offset;
}
#endif

#if HAVE_AVX2_CODE
/* One row against quantized weights (k a multiple of 32), channels in dynamic chunks. */
int gemv_quantized(const float *x, int64_t k, struct weights w, int64_t n, float *y, int threads,
                   struct scratch *s) {
    const int64_t groups = k / GROUP;
    float *xsum = NULL, *xs = NULL;
    int16_t *xq = NULL;
    void *owned = NULL;
    const size_t mark = scratch_mark(s);
    if (w.kind == Q4) {
        /* One buffer: the row as int16 [k], its steps and sums [groups] each. */
        const size_t xq_bytes = ((sizeof(int16_t) * (size_t)k + 63) & ~(size_t)63);
        char *buffer = scratch_take(s, xq_bytes + 2 * sizeof(float) * (size_t)groups, &owned);
        if (buffer == NULL) {
            scratch_release(s, mark);
            return -1;
        }
        xq = (int16_t *)buffer;
        xs = (float *)(buffer + xq_bytes);
        xsum = xs + groups;
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + g * GROUP;
            float total = 0.0f, amax = 0.0f;
            for (int j = 0; j < GROUP; j++) total += xg[j], amax = fmaxf(amax, fabsf(xg[j]));
            /* NaN or infinity in the row reaches the output through this sum. */
            xsum[g] = total;
            /* At least FLT_MIN: a group of values below ~4e-34 would otherwise get a step whose
             * inverse overflows, and its zeros would become NaN, clamped to -32767. */
            xs[g] = fmaxf(amax / 32767.0f, FLT_MIN);
            const float inverse = 1.0f / xs[g];
            for (int j = 0; j < GROUP; j++)
                xq[g * GROUP + j] =
                    (int16_t)lrintf(fminf(fmaxf(xg[j] * inverse, -32767.0f), 32767.0f));
        }
    }
    const int64_t ahead = channels_ahead(w.kind, k);
    /* Guided chunks (see the panel loop below): with dynamic chunks of 32 channels, two threads
     * were no faster than one on 576-wide int4 weights (22.8 vs 21.6 Gw/s; guided: 44.2). */
#pragma omp parallel for schedule(guided, 32) num_threads(threads)
    for (int64_t c = 0; c < n; c++) {
        if (ahead > 0 && c + ahead < n) prefetch_channels(w, c + ahead, 1, k);
        if (w.kind == Q8)
            y[c] = row_q8_avx2(x, (const int8_t *)w.data + c * k, w.scale + c * groups, k);
        else
            y[c] = row_q4_avx2(xq, xs, xsum, (const uint8_t *)w.data + c * (k / 2),
                               w.scale + c * groups, w.minimum + c * groups, k);
    }
    free(owned);
    scratch_release(s, mark);
    return 0;
}
#endif
