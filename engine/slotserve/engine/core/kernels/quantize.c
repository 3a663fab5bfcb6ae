/* Quantizing fp32 weights into the int8 and int4 formats of products.c (at load). */
#include "gemm.h"

/* ---- quantizing (at load) ----------------------------------------------------------------- */
/* Rounding is to nearest, ties to even (as torch.round), in both versions, so the two give the
 * same bytes. A group's quantized values pass through int32[32] before packing: simple, and
 * load time is spent in the rounding, not there. */

static void round_q8_c(const float *src, int32_t *out, float *scale) {
    float amax = 0.0f;
    for (int j = 0; j < GROUP; j++) amax = fmaxf(amax, fabsf(src[j]));
    const float d = amax > 0.0f ? amax / 127.0f : 1.0f;
    *scale = d;
    for (int j = 0; j < GROUP; j++)
        out[j] = (int32_t)fminf(fmaxf(nearbyintf(src[j] / d), -127.0f), 127.0f);
}

static void round_q4_c(const float *src, int32_t *out, float *scale, float *minimum) {
    float lo = src[0], hi = src[0];
    for (int j = 1; j < GROUP; j++) lo = fminf(lo, src[j]), hi = fmaxf(hi, src[j]);
    const float d = hi > lo ? (hi - lo) / 15.0f : 1.0f;
    *scale = d, *minimum = lo;
    for (int j = 0; j < GROUP; j++)
        out[j] = (int32_t)fminf(fmaxf(nearbyintf((src[j] - lo) / d), 0.0f), 15.0f);
}

#if HAVE_AVX2_CODE
__attribute__((target("avx2,fma"))) static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

__attribute__((target("avx2,fma"))) static inline float hmin(__m256 v) {
    __m128 s = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_min_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_min_ss(s, _mm_movehdup_ps(s)));
}

#define ROUND_EVEN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

__attribute__((target("avx2,fma"))) static void round_q8_avx2(const float *src, int32_t *out,
                                                              float *scale) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(src + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    const float amax = hmax(m);
    const float d = amax > 0.0f ? amax / 127.0f : 1.0f;
    *scale = d;
    const __m256 vd = _mm256_set1_ps(d), top = _mm256_set1_ps(127.0f),
                 bottom = _mm256_set1_ps(-127.0f);
    for (int i = 0; i < 4; i++) {
        __m256 r = _mm256_round_ps(_mm256_div_ps(v[i], vd), ROUND_EVEN);
        r = _mm256_min_ps(_mm256_max_ps(r, bottom), top);
        _mm256_storeu_si256((__m256i *)(out + 8 * i), _mm256_cvtps_epi32(r));
    }
}

__attribute__((target("avx2,fma"))) static void round_q4_avx2(const float *src, int32_t *out,
                                                              float *scale, float *minimum) {
    __m256 v[4];
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(src + 8 * i);
    const float lo = hmin(_mm256_min_ps(_mm256_min_ps(v[0], v[1]), _mm256_min_ps(v[2], v[3])));
    const float hi = hmax(_mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3])));
    const float d = hi > lo ? (hi - lo) / 15.0f : 1.0f;
    *scale = d, *minimum = lo;
    const __m256 vd = _mm256_set1_ps(d), vlo = _mm256_set1_ps(lo);
    const __m256 top = _mm256_set1_ps(15.0f), zero = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_sub_ps(v[i], vlo), vd), ROUND_EVEN);
        r = _mm256_min_ps(_mm256_max_ps(r, zero), top);
        _mm256_storeu_si256((__m256i *)(out + 8 * i), _mm256_cvtps_epi32(r));
    }
}
#else
static void round_q8_avx2(const float *src, int32_t *out, float *scale) {
    round_q8_c(src, out, scale);
}
static void round_q4_avx2(const float *src, int32_t *out, float *scale, float *minimum) {
    round_q4_c(src, out, scale, minimum);
}
#endif

/* w [N,K] fp32 -> q [N,K] int8 and scale [N,K/32]: symmetric, scale = max|w| / 127. */
void slotserve_quantize_q8(const float *w, int64_t n, int64_t k, int8_t *q, float *scale,
                           int threads) {
    const int avx2 = slotserve_kernel_isa();
    const int64_t groups = n * (k / GROUP);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; g++) {
        int32_t values[GROUP];
        if (avx2)
            round_q8_avx2(w + g * GROUP, values, scale + g);
        else
            round_q8_c(w + g * GROUP, values, scale + g);
        for (int j = 0; j < GROUP; j++) q[g * GROUP + j] = (int8_t)values[j];
    }
}

/* w [N,K] fp32 -> q [N,K/2] packed nibbles, scale and minimum [N,K/32]. */
void slotserve_quantize_q4(const float *w, int64_t n, int64_t k, uint8_t *q, float *scale,
                           float *minimum, int threads) {
    const int avx2 = slotserve_kernel_isa();
    const int64_t groups = n * (k / GROUP);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; g++) {
        int32_t values[GROUP];
        if (avx2)
            round_q4_avx2(w + g * GROUP, values, scale + g, minimum + g);
        else
            round_q4_c(w + g * GROUP, values, scale + g, minimum + g);
        for (int j = 0; j < GROUP / 2; j++)
            q[g * (GROUP / 2) + j] = (uint8_t)(values[j] | (values[j + GROUP / 2] << 4));
    }
}
