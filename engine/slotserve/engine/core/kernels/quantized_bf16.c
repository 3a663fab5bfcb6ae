/* Quantized weights (int8, int4: products.c's formats) against rows rounded to bf16: the
 * products of a quantized model's steps of QUANTIZED_BF16_ROWS rows or more (prefill chunks,
 * wide decode steps) on CPUs with AVX512_BF16 (the step's bf16_quantized, llama_step.c).
 *
 * Why: those products ran in fp32 on the unpacked weights (the panels), where VDPBF16PS does
 * twice the multiply-adds an instruction; on a 2-core Zen 4 an int4 model prefilled at ~0.43x
 * the prompt tokens a second of the default (fp32 weights with bf16 copies). Keeping bf16
 * copies of quantized weights would undo what quantizing saves in memory, so each task widens
 * its QUANT_BLOCKS blocks of 16 channels to packed bf16 (kernels.h's layout: the bits
 * kernels.pack_bf16 gives the dequantized weights) once per call, into a buffer of its thread's,
 * and every row of the step then passes over them (bf16_avx512.c's tiles): the widening is
 * about 1 / m of the products' work.
 *
 * The plain C version runs on any CPU and is the reference the tests hold the vector one to:
 * the rows and the dequantized weights rounded to bf16 and multiplied in fp32, each output summed
 * in the order of k (the vector one sums pairs first, so the two differ in the last bits).
 */
#include "gemm.h"

/* Blocks of 16 channels a task widens at once: bf16_avx512.c's tile takes 1 to 3. */
#define QUANT_BLOCKS 3

/* The plain C product: x rounded to bf16 into `rounded` (m * k floats), each 16 channels
 * dequantized into `wide` (16 * k floats a thread) and rounded too. */
static void gemm_quantized_c(const float *x, int64_t m, int64_t k, struct weights w, int64_t n,
                             float *y, int threads, float *rounded, float *wide) {
    for (int64_t j = 0; j < m * k; j++) rounded[j] = bf16_value(bf16_bits(x[j]));
    const int64_t blocks = (n + 15) / 16;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t b = 0; b < blocks; b++) {
        float *mine = wide + (size_t)omp_get_thread_num() * 16 * (size_t)k;
        const int64_t count = n - 16 * b < 16 ? n - 16 * b : 16;
        dequantize_channels(w, 16 * b, count, k, mine);
        for (int64_t j = 0; j < count * k; j++) mine[j] = bf16_value(bf16_bits(mine[j]));
        for (int64_t i = 0; i < m; i++)
            for (int64_t c = 0; c < count; c++) {
                float acc = 0.0f;
                for (int64_t j = 0; j < k; j++) acc += rounded[i * k + j] * mine[c * k + j];
                y[i * n + 16 * b + c] = acc;
            }
    }
}

#if defined(__x86_64__)
#define QBF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

/* The 16 x 16 matrix of 32-bit units in r transposed into out's 16 rows of 64 bytes (row q at
 * out + 16 q): unit pairs, then 64-bit pairs within each 128-bit lane, then the lanes. */
QBF16_TARGET static inline void transpose_units(const __m512i r[16], int32_t *out) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* u[4 i + j]'s lane L: column 4 L + j of rows 4 i .. 4 i + 3. */
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i low_ab = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
        const __m512i high_ab = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
        const __m512i low_cd = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
        const __m512i high_cd = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
        _mm512_storeu_si512(out + 16 * j, _mm512_shuffle_i32x4(low_ab, low_cd, 0x88));
        _mm512_storeu_si512(out + 16 * (4 + j), _mm512_shuffle_i32x4(low_ab, low_cd, 0xDD));
        _mm512_storeu_si512(out + 16 * (8 + j), _mm512_shuffle_i32x4(high_ab, high_cd, 0x88));
        _mm512_storeu_si512(out + 16 * (12 + j), _mm512_shuffle_i32x4(high_ab, high_cd, 0xDD));
    }
}

/* 16 channel rows of k floats (k a multiple of 32) as one packed bf16 block: line p holds each
 * channel's weights 2p and 2p + 1 side by side, channel c in the 32 bits at 4c. Each channel's
 * run of 32 floats rounds to 16 such pairs (VCVTNE2PS2BF16, nearest even); 16 channels' runs
 * are one 16 x 16 matrix of pairs whose transpose is 16 lines of the block (a scatter of each
 * run into its column took ~3.5x as long: at 32 rows the widening was most of the product). */
QBF16_TARGET static void pack_block(const float *wide, int64_t k, uint16_t *out) {
    int32_t *lines = (int32_t *)out;
    for (int64_t p = 0; p < k / 2; p += 16) {
        __m512i runs[16];
        for (int64_t c = 0; c < 16; c++) {
            const float *from = wide + c * k + 2 * p;
            runs[c] =
                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(from + 16), _mm512_loadu_ps(from));
        }
        transpose_units(runs, lines + 16 * p);
    }
}

/* xb: the rows already rounded to bf16. `buffers`: per_thread bytes a thread, 64-byte aligned:
 * 16 * k floats to dequantize into, then QUANT_BLOCKS packed blocks. */
QBF16_TARGET static void gemm_quantized_avx512(const uint16_t *xb, int64_t m, int64_t k,
                                               struct weights w, int64_t n, float *y, int threads,
                                               char *buffers, size_t per_thread) {
    const int64_t blocks = (n + 15) / 16;
    const int64_t tasks = (blocks + QUANT_BLOCKS - 1) / QUANT_BLOCKS;
    const size_t wide_bytes = (sizeof(float) * 16 * (size_t)k + 63) & ~(size_t)63;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; t++) {
        char *mine = buffers + per_thread * (size_t)omp_get_thread_num();
        float *wide = (float *)mine;
        uint16_t *packed = (uint16_t *)(mine + wide_bytes);
        const int64_t first = t * QUANT_BLOCKS;
        const int count = (int)(blocks - first < QUANT_BLOCKS ? blocks - first : QUANT_BLOCKS);
        for (int b = 0; b < count; b++) {
            const int64_t c0 = 16 * (first + b);
            const int64_t channels = n - c0 < 16 ? n - c0 : 16;
            dequantize_channels(w, c0, channels, k, wide);
            if (channels < 16)
                memset(wide + channels * k, 0, sizeof(float) * (size_t)((16 - channels) * k));
            pack_block(wide, k, packed + b * 16 * k);
        }
        bf16_task_rows(xb, m, k, packed, y + 16 * first, n, count,
                       first + count == blocks ? (int)(n % 16) : 0);
    }
}
#endif

int gemm_quantized_bf16(const float *x, int64_t m, int64_t k, struct weights w, int64_t n, float *y,
                        int threads, struct scratch *s) {
    if ((w.kind != Q8 && w.kind != Q4) || k % 32 != 0) return -1;
    if (m < 1 || n < 1) return 0; /* nothing to multiply */
    const size_t mark = scratch_mark(s);
    void *owned[2] = {NULL};
    int status = -1;
    const size_t wide_bytes = (sizeof(float) * 16 * (size_t)k + 63) & ~(size_t)63;
#if defined(__x86_64__)
    if (slotserve_kernel_isa() >= ISA_AVX512_BF16) {
        const size_t per_thread = wide_bytes + sizeof(uint16_t) * QUANT_BLOCKS * 16 * (size_t)k;
        uint16_t *xb = scratch_take(s, sizeof(uint16_t) * (size_t)(m * k), &owned[0]);
        char *buffers = scratch_take(s, per_thread * (size_t)threads, &owned[1]);
        if (xb != NULL && buffers != NULL) {
            bf16_round(x, m * k, xb, threads);
            gemm_quantized_avx512(xb, m, k, w, n, y, threads, buffers, per_thread);
            status = 0;
        }
        goto done;
    }
#endif
    float *rounded = scratch_take(s, sizeof(float) * (size_t)(m * k), &owned[0]);
    float *wide = scratch_take(s, wide_bytes * (size_t)threads, &owned[1]);
    if (rounded != NULL && wide != NULL) {
        gemm_quantized_c(x, m, k, w, n, y, threads, rounded, wide);
        status = 0;
    }
#if defined(__x86_64__)
done:
#endif
    free(owned[0]), free(owned[1]);
    scratch_release(s, mark);
    return status;
}

int slotserve_gemm_quantized_bf16(int kind, const float *x, int64_t m, int64_t k, const void *data,
                                  const float *scale, const float *minimum, int64_t n, float *y,
                                  int threads, struct scratch *s) {
    const struct weights w = {(enum kind)kind, data, scale, minimum};
    return gemm_quantized_bf16(x, m, k, w, n, y, threads, s);
}
