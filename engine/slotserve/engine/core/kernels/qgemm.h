/* What llama_step.c uses of qgemm.c: the weight formats and the product over them. */
#ifndef SLOTSERVE_QGEMM_H
#define SLOTSERVE_QGEMM_H
#include <stdint.h>

enum kind { F32, Q8, Q4 };

struct weights {
    enum kind kind;
    const void *data;    /* float[N,K], int8[N,K] or uint8[N,K/2] */
    const float *scale;  /* Q8, Q4: [N, K/32] */
    const float *minimum;/* Q4: [N, K/32] */
};

/* y[m,n] = x[m,k] . W[n,k]^T; returns 0, or -1 when a buffer could not be allocated. */
int slotserve_gemm_weights(const float *x, int64_t m, int64_t k, struct weights w, int64_t n,
                           float *y, int threads);

/* Softmax attention of one query token per row over cache row slots[r] (r itself when slots is
 * NULL), positions [0, lens[r]); q and out [rows, kv_heads, group, d]; caches [slots, kv_heads,
 * max_len, d]. Returns 0, or -1 when a buffer could not be allocated. */
int slotserve_attend(const float *q, const float *k, const float *v, int64_t rows,
                     const int64_t *slots, int64_t kv_heads, int64_t group, int64_t d,
                     int64_t max_len, const int64_t *lens, float scale, float *out, int threads);

int slotserve_kernel_isa(void);

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

/* The sum of a vector's 8 lanes. */
__attribute__((target("avx2,fma"))) static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif
#endif
