/* Products on packed int16 weights (slotserve_gemm_int16): the plain C reference, the dispatch
 * to VPDPWSSD (int16_vnni.c) or VPMADDWD (int16_avx2.c), and which of them runs.
 *
 * Numbers: each weight channel is scaled to integers within +-8191 (kernels.pack_int16: its
 * largest magnitude on the bound, one fp32 scale a channel), each row of x to integers within
 * +-I16_ROW_MAX in groups of I16_GROUP columns (one scale a group: a group's outliers do not
 * coarsen the rest of the row). A group's sum of 64 products is at most 64 * 4095 * 8191 <
 * 2^31, so its int32 sum is exact; it is then scaled into an fp32 accumulator by one FMA, and
 * the channel's scale multiplies the result. Teacher-forced on SmolLM2's shipped text (bench/
 * quant_quality.py --engine int16, fp16 KV cache) the engine agrees with fp32 on 99.87% of greedy
 * tokens, perplexity +0.00%.
 *
 * Layout (kernels.h, "packed int16"): packed bf16's, int16 values: channels in blocks of 16,
 * each block holding for every column pair the 16 channels' two weights side by side (one
 * 64-byte line, what one VPDPWSSD takes against a row's pair broadcast to every lane, or two
 * VPMADDWD), the scales [blocks * 16] (zeros past n). Every version computes the same integers
 * and the same fp32 operations in the same order: their results agree bit for bit, and the
 * plain C one here is the tests' reference. */
#include <stdint.h>

#include "int16.h"

/* What runs: 2 VPDPWSSD (AVX512_VNNI, the ISA in use AVX-512 or wider), 1 VPMADDWD (AVX2 or
 * wider in use), 0 plain C (tests lower the ISA to run it). */
int slotserve_kernel_int16(void) {
    if (slotserve_kernel_isa() >= ISA_AVX512 && i16_vnni_cpu()) return 2;
    return slotserve_kernel_isa() >= ISA_AVX2 ? 1 : 0;
}

/* The reference: the SIMD version's integers and fp32 operations, one output at a time. */
static void i16_rows_c(const int16_t *xq, const float *xs, int64_t m, int64_t k, const int16_t *w,
                       const float *ws, int64_t n, float *y, int threads) {
    const int64_t groups = (k + I16_GROUP - 1) / I16_GROUP;
#pragma omp parallel for num_threads(threads) collapse(2)
    for (int64_t i = 0; i < m; i++)
        for (int64_t c = 0; c < n; c++) {
            const int16_t *block = w + (c / 16) * 16 * k;
            float acc = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const int64_t j1 = (g + 1) * I16_GROUP < k ? (g + 1) * I16_GROUP : k;
                int32_t sum = 0;
                for (int64_t j = g * I16_GROUP; j < j1; j++)
                    sum += (int32_t)xq[i * k + j] * block[(j / 2) * 32 + (c % 16) * 2 + j % 2];
                acc = fmaf((float)sum, xs[i * groups + g], acc);
            }
            y[i * n + c] = acc * ws[c];
        }
}

int gemm_int16(const float *x, int64_t m, int64_t k, struct weights w, int64_t n, float *y,
               int threads, struct scratch *s) {
    if (w.kind != I16 || k % 2 != 0) return -1;
    if (m == 0 || n == 0) return 0;
    const int64_t groups = (k + I16_GROUP - 1) / I16_GROUP;
    const size_t mark = scratch_mark(s);
    void *owned[2] = {NULL};
    int16_t *xq = scratch_take(s, sizeof(int16_t) * (size_t)(m * k), &owned[0]);
    float *xs = scratch_take(s, sizeof(float) * (size_t)(m * groups), &owned[1]);
    int status = -1;
    if (xq != NULL && xs != NULL) {
        const int code = slotserve_kernel_int16();
#pragma omp parallel for num_threads(threads) if (m >= 64)
        for (int64_t i = 0; i < m; i++) {
            if (code == 2)
                i16_row_vnni(x + i * k, k, xq + i * k, xs + i * groups);
            else if (code == 1)
                i16_row_avx2(x + i * k, k, xq + i * k, xs + i * groups);
            else
                i16_row_c(x + i * k, k, xq + i * k, xs + i * groups);
        }
        const int16_t *data = (const int16_t *)w.data;
        if (code == 2)
            status = i16_rows_vnni(xq, xs, m, k, data, w.scale, n, y, threads, s);
        else if (code == 1)
            status = i16_rows_avx2(xq, xs, m, k, data, w.scale, n, y, threads, s);
        else
            i16_rows_c(xq, xs, m, k, data, w.scale, n, y, threads), status = 0;
    }
    free(owned[0]), free(owned[1]);
    scratch_release(s, mark);
    return status;
}

int slotserve_gemm_int16(const float *x, int64_t m, int64_t k, const int16_t *w, const float *scale,
                         int64_t n, float *y, int threads, struct scratch *s) {
    const struct weights weights = {I16, w, scale, NULL};
    return gemm_int16(x, m, k, weights, n, y, threads, s);
}
