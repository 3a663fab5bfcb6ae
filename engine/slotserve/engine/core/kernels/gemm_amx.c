/* bf16 products on AMX tiles (TDPBF16PS) with fp32 results: y[m, n] = x[m, k] . W^T for the
 * packed bf16 weights of bf16_avx512.c, where the CPU has AMX-BF16 and a product has at least
 * AMX_GEMM_ROWS rows (prefill chunks, wide decode steps).
 *
 * Why not oneDNN through torch, which ran these products on the tiles before: torch's bf16 GEMM
 * writes bf16, so every product's result lost its low bits before the step added it to the
 * residual stream, and the bf16 path's greedy agreement with fp32 fell to 97.4% on an AMX Xeon
 * (issue 24's bar is 99%; the packed kernels' fp32 results read 99.2% on the same machine).
 * The tiles sum in fp32 and store fp32, and the products stay in C (no call back into Python).
 *
 * The packed layout is the tiles' B operand as it is: a block of 16 channels is [k / 2][16][2],
 * so its k-pairs kk / 2 .. kk / 2 + 15 are 16 rows of 64 bytes, one after the other. Each pass
 * takes two blocks (32 channels) against 32 rows: four sums (tiles 0-3), two row tiles (4, 5),
 * two weight tiles (6, 7): every tile loaded feeds two products. A thread keeps its two blocks'
 * weights (32 x k bf16: 36 KB for SmolLM2's 576) in L1 while it goes down the rows. */
#include <stdint.h>
#include <string.h>

#include "gemm.h"

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>

#define GEMM_AMX_TARGET                                                                            \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,"   \
                          "avx2")))

/* Rows [row, row + 32) of xb (bf16, k columns, padded with zero rows) against blocks b and b + 1
 * (`two`: b + 1 exists) into `out` (32 rows, stride `ld` floats). */
GEMM_AMX_TARGET static inline __attribute__((always_inline)) void
gemm_pass(const uint16_t *xb, int64_t row, int64_t k, const uint16_t *w0, const uint16_t *w1,
          int two, float *out, int64_t ld) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t *a = xb + row * k;
    for (int64_t kk = 0; kk < k; kk += 32) {
        _tile_loadd(4, a + kk, k * 2);
        _tile_loadd(5, a + 16 * k + kk, k * 2);
        _tile_loadd(6, w0 + kk * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (two) {
            _tile_loadd(7, w1 + kk * 16, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, out, ld * 4);
    _tile_stored(2, out + 16 * ld, ld * 4);
    if (two) {
        _tile_stored(1, out + 16, ld * 4);
        _tile_stored(3, out + 16 * ld + 16, ld * 4);
    }
}

GEMM_AMX_TARGET static void gemm_amx_blocks(const uint16_t *xb, int64_t m, int64_t rows, int64_t k,
                                            const uint16_t *w, int64_t n, float *y, int threads) {
    const int64_t blocks = n / 16, pairs = (blocks + 1) / 2, block = 16 * k;
#pragma omp parallel num_threads(threads)
    {
        float tail[32 * 32];
        amx_tiles_configure();
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t b = 2 * p;
            const int two = b + 1 < blocks;
            const uint16_t *w0 = w + b * block, *w1 = w0 + block;
            for (int64_t row = 0; row < rows; row += 32) {
                if (row + 32 <= m) {
                    gemm_pass(xb, row, k, w0, w1, two, y + row * n + 16 * b, n);
                    continue;
                }
                /* The last rows: through a buffer, only the step's own rows written. */
                gemm_pass(xb, row, k, w0, w1, two, tail, 32);
                for (int64_t i = row; i < m; i++)
                    memcpy(y + i * n + 16 * b, tail + (i - row) * 32,
                           sizeof(float) * (size_t)(two ? 32 : 16));
            }
        }
        _tile_release();
    }
}

int gemm_bf16_amx(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, float *y,
                  int threads, struct scratch *s) {
    const int64_t rows = (m + 31) & ~(int64_t)31;
    const size_t mark = scratch_mark(s);
    void *owned;
    uint16_t *xb = scratch_take(s, sizeof(uint16_t) * (size_t)(rows * k), &owned);
    if (xb == NULL) return -1;
    bf16_round(x, m * k, xb, threads);
    memset(xb + m * k, 0, sizeof(uint16_t) * (size_t)((rows - m) * k));
    gemm_amx_blocks(xb, m, rows, k, w, n, y, threads);
    free(owned);
    scratch_release(s, mark);
    return 0;
}
#else
int gemm_bf16_amx(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, float *y,
                  int threads, struct scratch *s) {
    (void)x, (void)m, (void)k, (void)w, (void)n, (void)y, (void)threads, (void)s;
    return -1; /* never dispatched: slotserve_kernel_amx() is 0 here */
}
#endif
