/* What the parts of the matrix products share (dispatch.c, products.c, quantized_rows.c,
 * quantize.c): the panel and group sizes, the prefetch distance and helpers, and the one-row
 * product. Hidden from the library's exports, as qgemm.h. */
#ifndef SLOTSERVE_GEMM_H
#define SLOTSERVE_GEMM_H
#include <omp.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qgemm.h"

#if defined(__x86_64__) || defined(__i386__)
#define HAVE_AVX2_CODE 1
#include <immintrin.h>
#else
#define HAVE_AVX2_CODE 0
#endif

#define PANEL 4
#define GROUP SLOTSERVE_KERNEL_GROUP

#pragma GCC visibility push(hidden)

/* dispatch.c: how far ahead of the weights being multiplied their successors are prefetched,
 * in bytes (slotserve_kernel_set_prefetch). */
extern int64_t ahead_bytes;

#if HAVE_AVX2_CODE
/* quantized_rows.c: one row against quantized weights (k a multiple of 32). */
int gemv_quantized(const float *x, int64_t k, struct weights w, int64_t n, float *y, int threads,
                   struct scratch *s);
#endif

/* products.c: channels [n0, n0 + rows) of quantized (or bf16) weights as fp32 rows of k. */
void dequantize_channels(struct weights w, int64_t n0, int64_t rows, int64_t k, float *out);

/* bf16_avx512.c: y = x . W^T on packed bf16 weights (kernels.h) with VDPBF16PS (k even;
 * AVX512_BF16 only). */
int gemm_bf16_avx512(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, float *y,
                     int threads, struct scratch *s);

#pragma GCC visibility pop

/* Bytes of one output channel's weights (and scales, minimums). */
static inline int64_t channel_bytes(enum kind kind, int64_t k) {
    if (kind == F32) return 4 * k;
    if (kind == BF16 || kind == I16) return 2 * k;
    if (kind == Q8) return k + 4 * (k / GROUP);
    return k / 2 + 8 * (k / GROUP);
}

/* f as bf16 bits, rounded to nearest even (torch's .to(bfloat16), VCVTNEPS2BF16); a NaN stays
 * a NaN. The scalar rounding of the bf16 reference products and of bf16 attention's operands. */
static inline uint16_t bf16_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7f800000u) == 0x7f800000u)
        return (uint16_t)((bits >> 16) | ((bits & 0xffffu) ? 0x40u : 0u));
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* bf16 bits as the float they stand for (exact). */
static inline float bf16_value(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline void prefetch_span(const void *start, int64_t bytes);

/* The weights (and scales, minimums) of channels [c, c + count). */
static inline void prefetch_channels(struct weights w, int64_t c, int64_t count, int64_t k) {
    const int64_t groups = k / GROUP;
    if (w.kind == F32 || w.kind == BF16 || w.kind == I16) {
        prefetch_span((const char *)w.data + c * channel_bytes(w.kind, k),
                      channel_bytes(w.kind, k) * count);
        return;
    }
    if (w.kind == Q8)
        prefetch_span((const int8_t *)w.data + c * k, k * count);
    else
        prefetch_span((const uint8_t *)w.data + c * (k / 2), k / 2 * count);
    prefetch_span(w.scale + c * groups, 4 * groups * count);
    if (w.kind == Q4) prefetch_span(w.minimum + c * groups, 4 * groups * count);
}

static inline int64_t channels_ahead(enum kind kind, int64_t k) {
    const int64_t c = ahead_bytes / channel_bytes(kind, k);
    return ahead_bytes == 0 ? 0 : (c > 1 ? c : 1);
}

static inline void prefetch_span(const void *start, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch((const char *)start + at, 0, 2);
}

#endif
