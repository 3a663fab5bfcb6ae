/* The KV cache in fp16 (the engine's kv_cache_dtype float16): rows written rounded to fp16,
 * read back widened to fp32 in registers, and a decode row's attention 512 bits wide over it.
 *
 * Why: at 32 decode rows a step's attention streams every row's keys and values from memory
 * (SmolLM2, ~1,000 positions: 1.6 GB a step in fp32, ~48 ms of a ~60 ms step at the ~32 GB/s
 * two cores of a Zen 5 draw), so the bytes a position decide a serving run's decode speed. fp16
 * halves them and keeps 11 significant bits (bf16 keeps 8), as llama.cpp's default f16 cache and
 * vLLM's bf16 cache do. Every sum stays fp32: only the stored keys and values are rounded.
 *
 * Values past fp16's range (|x| > 65504) are stored as +-65504, not inf: an inf key would turn
 * its row's every score into NaN. NaN stays NaN. The plain C conversion is the reference; F16C
 * (every AVX2 CPU has it) and AVX-512 give the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "qgemm.h"

#define HALF_MAX 65504.0f

uint16_t half_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);  /* NaN */
    if (x >= 0x477fe000u) return (uint16_t)(sign | 0x7bffu); /* |f| >= 65504: saturate */
    uint32_t h, rest, halfway;
    if (x >= 0x38800000u) { /* normal in fp16: 2^-14 and up */
        h = (x - 0x38000000u) >> 13;
        rest = x & 0x1fffu, halfway = 0x1000u;
    } else if (x >= 0x33000000u) { /* fp16 subnormal: units of 2^-24 */
        const int shift = 126 - (int)(x >> 23);
        const uint32_t mantissa = (x & 0x7fffffu) | 0x800000u;
        h = mantissa >> shift;
        rest = mantissa & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    } else {
        return sign; /* under 2^-25: rounds to zero */
    }
    if (rest > halfway || (rest == halfway && (h & 1u))) h++; /* nearest, ties to even */
    return (uint16_t)(sign | h);
}

float half_value(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0) {
        const float magnitude = (float)mantissa * 5.9604644775390625e-8f; /* 2^-24, exact */
        return sign ? -magnitude : magnitude;
    }
    if (exponent == 31)
        bits = sign | 0x7f800000u | (mantissa << 13);
    else
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define KV_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KV_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

KV_AVX2 static void store_half_avx2(uint16_t *dst, const float *src, int64_t n) {
    const __m256 high = _mm256_set1_ps(HALF_MAX), low = _mm256_set1_ps(-HALF_MAX);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        /* x last in max and min: a NaN lane passes through both (they return the second). */
        const __m256 x = _mm256_min_ps(high, _mm256_max_ps(low, _mm256_loadu_ps(src + i)));
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    for (; i < n; i++) dst[i] = half_bits(src[i]);
}

KV_AVX2 static void widen_half_avx2(float *dst, const uint16_t *src, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) dst[i] = half_value(src[i]);
}

KV_AVX512 static inline __attribute__((always_inline)) __m512 widen16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* Query heads of one kv head taken together by the 512-bit decode head: each key and value
 * vector is widened once for all of them (up to 16 accumulators in registers). */
#define HEAD_PASS 4

/* How far ahead (bytes) the decode head prefetches the keys and values it streams. 32 rows at
 * ~1,000 positions read ~25 MB of fp16 cache a layer, from memory: without it a step's
 * attention took its compute time plus its memory time (50 ms a SmolLM2 step on an AMX Xeon
 * of 2 vCPUs, ~15 GB/s); 1-2 KB ahead overlaps them (40 ms, ~18 GB/s). */
#define DECODE_AHEAD 2048

/* Scores (times scale) of `heads` queries (d floats apart) against keys [0, len). */
KV_AVX512 static inline __attribute__((always_inline)) void
scores_pass(const float *query, const uint16_t *keys, int64_t len, int64_t d, float scale,
            float *scores, const int heads) {
    const __m128 vscale = _mm_set1_ps(scale);
    int64_t t = 0;
    for (; t + 4 <= len; t += 4) {
        __m512 acc[HEAD_PASS][4];
        for (int g = 0; g < heads; g++)
            for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();
        for (int64_t line = 0; line < 4 * d * 2; line += 64)
            _mm_prefetch((const char *)(keys + t * d) + DECODE_AHEAD + line, _MM_HINT_T0);
        for (int64_t j = 0; j < d; j += 16) {
            __m512 k[4];
            for (int c = 0; c < 4; c++) k[c] = widen16(keys + (t + c) * d + j);
            for (int g = 0; g < heads; g++) {
                const __m512 qv = _mm512_loadu_ps(query + g * d + j);
                for (int c = 0; c < 4; c++) acc[g][c] = _mm512_fmadd_ps(qv, k[c], acc[g][c]);
            }
        }
        for (int g = 0; g < heads; g++) {
            __m256 half[4];
            for (int c = 0; c < 4; c++)
                half[c] = _mm256_add_ps(_mm512_castps512_ps256(acc[g][c]),
                                        _mm512_extractf32x8_ps(acc[g][c], 1));
            _mm_storeu_ps(scores + g * len + t,
                          _mm_mul_ps(hsum4(half[0], half[1], half[2], half[3]), vscale));
        }
    }
    for (; t < len; t++)
        for (int g = 0; g < heads; g++) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t j = 0; j < d; j += 16)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(query + g * d + j), widen16(keys + t * d + j),
                                      acc);
            scores[g * len + t] = scale * _mm512_reduce_add_ps(acc);
        }
}

/* outs[g][j, j + 16 * vectors) = sum over s of p_g[s] * values[s]: each value vector widened
 * once for the `heads` heads. */
KV_AVX512 static inline __attribute__((always_inline)) void
values_pass(const float *probs, const uint16_t *values, int64_t len, int64_t d, int64_t j,
            float *dst, const int heads, const int vectors) {
    __m512 acc[HEAD_PASS][4];
    for (int g = 0; g < heads; g++)
        for (int c = 0; c < vectors; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t s = 0; s < len; s++) {
        __m512 v[4];
        for (int64_t line = 0; line < vectors * 32; line += 64)
            _mm_prefetch((const char *)(values + s * d + j) + DECODE_AHEAD + line, _MM_HINT_T0);
        for (int c = 0; c < vectors; c++) v[c] = widen16(values + s * d + j + 16 * c);
        for (int g = 0; g < heads; g++) {
            const __m512 weight = _mm512_set1_ps(probs[g * len + s]);
            for (int c = 0; c < vectors; c++) acc[g][c] = _mm512_fmadd_ps(weight, v[c], acc[g][c]);
        }
    }
    for (int g = 0; g < heads; g++)
        for (int c = 0; c < vectors; c++) _mm512_storeu_ps(dst + g * d + j + 16 * c, acc[g][c]);
}

KV_AVX512 static inline __attribute__((always_inline)) void
head_pass(const float *query, const uint16_t *keys, const uint16_t *values, int64_t len, int64_t d,
          float scale, float *scores, float *dst, void (*softmax)(float *, int64_t),
          const int heads) {
    scores_pass(query, keys, len, d, scale, scores, heads);
    for (int g = 0; g < heads; g++) softmax(scores + g * len, len);
    int64_t j = 0;
    for (; j + 64 <= d; j += 64) values_pass(scores, values, len, d, j, dst, heads, 4);
    for (; j < d; j += 16) values_pass(scores, values, len, d, j, dst, heads, 1);
}

typedef void (*head_pass_fn)(const float *q, const uint16_t *k, const uint16_t *v, int64_t len,
                             int64_t d, float scale, float *sc, float *dst,
                             void (*softmax)(float *, int64_t));

/* head_pass for a count of heads known when compiled (its accumulators stay in registers). */
#define HEAD_PASS_OF(heads)                                                                        \
    KV_AVX512 static void head_pass_##heads(const float *q, const uint16_t *k, const uint16_t *v,  \
                                            int64_t len, int64_t d, float scale, float *sc,        \
                                            float *dst, void (*softmax)(float *, int64_t)) {       \
        head_pass(q, k, v, len, d, scale, sc, dst, softmax, heads);                                \
    }
HEAD_PASS_OF(1)
HEAD_PASS_OF(2)
HEAD_PASS_OF(3)
HEAD_PASS_OF(4)

void decode_head_half512(const float *query, const uint16_t *keys, const uint16_t *values,
                         int64_t len, int64_t d, int64_t group, float scale, float *scores,
                         float *dst, void (*softmax)(float *, int64_t)) {
    /* By the number of heads in the pass, 1 .. HEAD_PASS. */
    static const head_pass_fn passes[HEAD_PASS] = {head_pass_1, head_pass_2, head_pass_3,
                                                   head_pass_4};
    for (int64_t g = 0; g < group; g += HEAD_PASS) {
        const int64_t heads = group - g < HEAD_PASS ? group - g : HEAD_PASS;
        passes[heads - 1](query + g * d, keys, values, len, d, scale, scores + g * len, dst + g * d,
                          softmax);
    }
}
#define HAVE_F16C_CODE 1
#else
#define HAVE_F16C_CODE 0
void decode_head_half512(const float *query, const uint16_t *keys, const uint16_t *values,
                         int64_t len, int64_t d, int64_t group, float scale, float *scores,
                         float *dst, void (*softmax)(float *, int64_t)) {
    (void)query, (void)keys, (void)values, (void)len, (void)d, (void)group, (void)scale;
    (void)scores, (void)dst, (void)softmax; /* never taken: no AVX-512 */
}
#endif

void kv_store(void *cache, int64_t at, const float *src, int64_t n, int half) {
    if (!half) {
        memcpy((float *)cache + at, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + at;
#if HAVE_F16C_CODE
    if (slotserve_kernel_isa()) {
        store_half_avx2(dst, src, n);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) dst[i] = half_bits(src[i]);
}

void kv_widen(const uint16_t *src, int64_t n, float *dst) {
#if HAVE_F16C_CODE
    if (slotserve_kernel_isa()) {
        widen_half_avx2(dst, src, n);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) dst[i] = half_value(src[i]);
}
