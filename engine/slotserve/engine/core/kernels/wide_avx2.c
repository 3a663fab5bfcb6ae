/* The wide fp32 product with AVX2/FMA (prefill chunks on CPUs without bf16 units): y = x . W^T
 * for many rows, with the weights repacked so that each multiply-add takes one input value
 * broadcast and eight output channels, as BLIS and oneDNN lay out their fp32 GEMMs.
 *
 * Why: products.c's panels take the dot product of a row and a channel along k, 3 rows x 4
 * channels a pass: 7 vector loads per 12 multiply-adds, both operands from memory. With a
 * 1,024-row chunk neither the rows nor the panel stay in the 32 KB L1 beside the other, so
 * every load came from L2 and the products ran at ~68% of the FMA peak on a Zen 3 (134 of 196
 * GFLOPS on two cores). Here 16 channels are packed as [k][16] (one 64-byte line a step of k)
 * and a tile of 6 rows keeps 6 x 16 sums in 12 registers: per step of k, two weight loads (one
 * line) and six broadcasts feed 12 multiply-adds, and no horizontal sums close the tile. Each
 * output is summed in the order of k, one multiply-add at a time, as the plain C reference sums
 * it.
 *
 * products.c drives it: each task packs a group of 16-channel blocks into a buffer that stays
 * in L2 (wide_pack16) and runs its row tiles over the group (wide_rows). Where the rows are split
 * in parts for the threads, each part's task packs its group again (~1 / (2 x its rows) of its
 * multiply-adds' time: 0.2% at 256 rows).
 */
#include <stdint.h>
#include <string.h>

#include "qgemm.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define WIDE_AVX2 __attribute__((target("avx2,fma")))

/* Transposes the 8 x 8 block of floats at rows[0..8) + j into out[0..8)[0..8), out's rows
 * `stride` floats apart. */
WIDE_AVX2 static inline void wide_transpose8(const float *const rows[8], int64_t j, float *out,
                                             int64_t stride) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(rows[i] + j);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(out + i * stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(out + (i + 4) * stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}

WIDE_AVX2 void wide_pack16(const float *const rows[WIDE_CHANNELS], int count, int64_t k,
                           float *out) {
    if (count == WIDE_CHANNELS && k % 8 == 0) {
        for (int64_t j = 0; j < k; j += 8) {
            wide_transpose8(rows, j, out + j * WIDE_CHANNELS, WIDE_CHANNELS);
            wide_transpose8(rows + 8, j, out + j * WIDE_CHANNELS + 8, WIDE_CHANNELS);
        }
        return;
    }
    for (int64_t j = 0; j < k; j++)
        for (int c = 0; c < WIDE_CHANNELS; c++)
            out[j * WIDE_CHANNELS + c] = c < count ? rows[c][j] : 0.0f;
}

/* R rows of x (R <= WIDE_TILE_ROWS, a constant where inlined) against one packed block: the
 * R x 16 sums into y's rows (n apart), `width` of the 16 channels stored. */
WIDE_AVX2 static inline __attribute__((always_inline)) void wide_tile(const float *x, int64_t k,
                                                                      const float *b, float *y,
                                                                      int64_t n, int width,
                                                                      const int rows) {
    __m256 lo[WIDE_TILE_ROWS], hi[WIDE_TILE_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < k; j++) {
        const __m256 b0 = _mm256_load_ps(b + j * WIDE_CHANNELS);
        const __m256 b1 = _mm256_load_ps(b + j * WIDE_CHANNELS + 8);
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const __m256 a = _mm256_broadcast_ss(x + r * k + j);
            lo[r] = _mm256_fmadd_ps(a, b0, lo[r]);
            hi[r] = _mm256_fmadd_ps(a, b1, hi[r]);
        }
    }
    if (width == WIDE_CHANNELS) {
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            _mm256_storeu_ps(y + r * n, lo[r]);
            _mm256_storeu_ps(y + r * n + 8, hi[r]);
        }
        return;
    }
    float sums[WIDE_CHANNELS];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(sums, lo[r]);
        _mm256_storeu_ps(sums + 8, hi[r]);
        memcpy(y + r * n, sums, sizeof(float) * (size_t)width);
    }
}

/* wide_tile with its row count a constant in each case, so that its sums stay in registers. */
WIDE_AVX2 static void wide_block(const float *x, int64_t k, const float *b, float *y, int64_t n,
                                 int width, int64_t rows) {
    switch (rows) {
    case 1:
        wide_tile(x, k, b, y, n, width, 1);
        break;
    case 2:
        wide_tile(x, k, b, y, n, width, 2);
        break;
    case 3:
        wide_tile(x, k, b, y, n, width, 3);
        break;
    case 4:
        wide_tile(x, k, b, y, n, width, 4);
        break;
    case 5:
        wide_tile(x, k, b, y, n, width, 5);
        break;
    default:
        wide_tile(x, k, b, y, n, width, WIDE_TILE_ROWS);
        break;
    }
}

WIDE_AVX2 void wide_rows(const float *x, int64_t m, int64_t k, const float *packed, int64_t blocks,
                         int64_t n0, int64_t n, float *y) {
    for (int64_t i = 0; i < m; i += WIDE_TILE_ROWS) {
        const int64_t rows = m - i < WIDE_TILE_ROWS ? m - i : WIDE_TILE_ROWS;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t c = n0 + b * WIDE_CHANNELS;
            const int width = n - c < WIDE_CHANNELS ? (int)(n - c) : WIDE_CHANNELS;
            wide_block(x + i * k, k, packed + b * k * WIDE_CHANNELS, y + i * n + c, n, width, rows);
        }
    }
}
#else /* no x86: products.c never calls these */
void wide_pack16(const float *const rows[WIDE_CHANNELS], int count, int64_t k, float *out) {
    (void)rows, (void)count, (void)k, (void)out;
}
void wide_rows(const float *x, int64_t m, int64_t k, const float *packed, int64_t blocks,
               int64_t n0, int64_t n, float *y) {
    (void)x, (void)m, (void)k, (void)packed, (void)blocks, (void)n0, (void)n, (void)y;
}
#endif
