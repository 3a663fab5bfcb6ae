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
 * two weight tiles (6, 7): every tile loaded feeds two products. The rows are rounded to bf16
 * in tile order (a tile's 16 x 32 values 1 KB in one piece); each thread takes a chunk of its
 * passes whose weights fit its L2 and runs every 32-row block over the chunk before the next
 * (thread_share), the k direction alternating from pass to pass. On an AMX Xeon of 2 vCPUs
 * (2026-12-06) that took SmolLM2's four products at 1,024 rows from 4.5 to 3.2 ms a layer; the
 * same loop with every operand in L1 does 1.8: the row and weight tiles (36 KB each at k =
 * 576) do not both fit its 48 KB L1, and keeping partial sums in memory to split k cost more
 * than it saved (tried).
 *
 * A bf16 step's layer (llama_step.c's layer_on_tiles) hands its rows over in tile order
 * (gemm_amx_tiles) and has the MLP fused (mlp_amx_tiles) and o and down added to the residual
 * stream (`add`). */
#include <stdint.h>
#include <string.h>

#include "gemm.h"
#include <omp.h>

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>

#define GEMM_AMX_TARGET                                                                            \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,"   \
                          "avx2")))

/* Where row i, column c of rows of k columns sits in A tiles xt[r / 16][k / 32][16][32] (each
 * tile's 16 x 32 values 1 KB in one piece, so a tile load reads 16 consecutive lines). */
static inline uint16_t *tile_at(uint16_t *xt, int64_t i, int64_t c, int64_t k) {
    return xt + ((i / 16) * (k / 32) + c / 32) * 512 + (i % 16) * 32 + c % 32;
}

/* Row i of x (k floats), times `weight` (k floats; NULL: none) and `scale` as rms_norm scales a
 * row (weight * (x * scale)), rounded to bf16 into its place in the A tiles xt; NULL row:
 * zeros. */
GEMM_AMX_TARGET void amx_row_to_tiles(const float *row, const float *weight, float scale, int64_t i,
                                      int64_t k, uint16_t *xt) {
    const int64_t steps = k / 32;
    uint16_t *at = tile_at(xt, i, 0, k);
    const __m512 by = _mm512_set1_ps(scale);
    for (int64_t s = 0; s < steps; s++) {
        __m512i bits = _mm512_setzero_si512();
        if (row != NULL) {
            __m512 lo = _mm512_loadu_ps(row + 32 * s), hi = _mm512_loadu_ps(row + 32 * s + 16);
            if (weight != NULL) {
                lo = _mm512_mul_ps(_mm512_loadu_ps(weight + 32 * s), _mm512_mul_ps(lo, by));
                hi = _mm512_mul_ps(_mm512_loadu_ps(weight + 32 * s + 16), _mm512_mul_ps(hi, by));
            }
            bits = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        }
        _mm512_storeu_si512(at + s * 512, bits);
    }
}

/* x's rows [0, m) into A tiles, rows [m, rows) zeros. */
GEMM_AMX_TARGET static void rows_to_tiles(const float *x, int64_t m, int64_t rows, int64_t k,
                                          uint16_t *xt, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 64)
    for (int64_t i = 0; i < rows; i++)
        amx_row_to_tiles(i < m ? x + i * k : NULL, NULL, 1, i, k, xt);
}

/* Row tiles a0 and a1 (tiled layout, `steps` tiles each) against blocks w0 and w1 (`two`: w1
 * exists) into `out` (32 rows, stride `ld` floats), added to what `out` holds when `add`. The
 * k steps go down when `down`: a pass that starts where the last one ended finds those rows'
 * tiles still in L1 (alternating cut a 1,024-row gate/up product by a tenth). */
GEMM_AMX_TARGET static inline __attribute__((always_inline)) void
gemm_pass(const uint16_t *a0, const uint16_t *a1, int64_t steps, const uint16_t *w0,
          const uint16_t *w1, int two, float *out, int64_t ld, int down, int add) {
    if (add) {
        _tile_loadd(0, out, ld * 4);
        _tile_loadd(2, out + 16 * ld, ld * 4);
        if (two) {
            _tile_loadd(1, out + 16, ld * 4);
            _tile_loadd(3, out + 16 * ld + 16, ld * 4);
        }
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t i = 0; i < steps; i++) {
        const int64_t s = down ? steps - 1 - i : i;
        _tile_loadd(4, a0 + 512 * s, 64);
        _tile_loadd(5, a1 + 512 * s, 64);
        _tile_loadd(6, w0 + 512 * s, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (two) {
            _tile_loadd(7, w1 + 512 * s, 64);
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

#define CHUNK_BYTES 600000

/* The calling thread's share [from, to) of a product's `passes`, taken `chunk` at a time: the
 * passes (two blocks of 16 channels each, 64 k bytes of weights) whose weights it keeps in its
 * L2 while every row tile goes over them. */
struct share {
    int64_t from, to, chunk;
};
static inline struct share thread_share(int64_t passes, int64_t k) {
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t chunk = CHUNK_BYTES / (64 * k) > 0 ? CHUNK_BYTES / (64 * k) : 1;
    return (struct share){passes * me / team, passes * (me + 1) / team, chunk};
}

/* y[m, n] = xt . w^T (plus what y holds when `add`), xt in A tiles (m rounded up to 32 rows).
 * Each thread takes its share of the passes (pairs of 16-channel blocks) in chunks whose weights
 * stay in its L2 while every row tile goes over them. */
GEMM_AMX_TARGET void gemm_amx_tiles(const uint16_t *xt, int64_t m, int64_t k, const uint16_t *w,
                                    int64_t n, float *y, int add, int threads) {
    const int64_t rows = (m + 31) & ~(int64_t)31;
    const int64_t blocks = n / 16, pairs = (blocks + 1) / 2, block = 16 * k, steps = k / 32;
#pragma omp parallel num_threads(threads)
    {
        float tail[32 * 32];
        amx_tiles_configure();
        const struct share mine = thread_share(pairs, k);
        for (int64_t c = mine.from; c < mine.to; c += mine.chunk) {
            const int64_t p_end = c + mine.chunk < mine.to ? c + mine.chunk : mine.to;
            for (int64_t row = 0; row < rows; row += 32) {
                const uint16_t *a0 = xt + (row / 16) * steps * 512, *a1 = a0 + steps * 512;
                for (int64_t p = c; p < p_end; p++) {
                    const int64_t b = 2 * p;
                    const int two = b + 1 < blocks, down = (int)(p & 1);
                    const size_t width = sizeof(float) * (size_t)(two ? 32 : 16);
                    const uint16_t *w0 = w + b * block, *w1 = w0 + block;
                    if (row + 32 <= m) {
                        gemm_pass(a0, a1, steps, w0, w1, two, y + row * n + 16 * b, n, down, add);
                        continue;
                    }
                    /* The last rows: through a buffer, only the step's own rows read and
                     * written. */
                    if (add) {
                        memset(tail, 0, sizeof tail);
                        for (int64_t i = row; i < m; i++)
                            memcpy(tail + (i - row) * 32, y + i * n + 16 * b, width);
                    }
                    gemm_pass(a0, a1, steps, w0, w1, two, tail, 32, down, add);
                    for (int64_t i = row; i < m; i++)
                        memcpy(y + i * n + 16 * b, tail + (i - row) * 32, width);
                }
            }
        }
        _tile_release();
    }
}

/* One pass of the MLP's gate/up product, 32 rows x 16 channels of each (gate block j, up block
 * j), through `buf` (32 x 32 floats: the gate's 16 then the up's 16 of each row): silu(gate) *
 * up rounded to bf16 into the down product's A tiles (act, rows of inter columns) as channel
 * j's 16 columns. Padded rows come out 0 (their x is). */
GEMM_AMX_TARGET static inline __attribute__((always_inline)) void
mlp_pass(const uint16_t *a0, const uint16_t *a1, int64_t steps, const uint16_t *gate,
         const uint16_t *up, int64_t row, int64_t j, uint16_t *act, int64_t inter, float *buf) {
    gemm_pass(a0, a1, steps, gate, up, 1, buf, 32, (int)(j & 1), 0);
    for (int r = 0; r < 32; r++) {
        const int64_t i = row + r;
        uint16_t *at = tile_at(act, i, 16 * j, inter);
        const __m512 v =
            silu_mul16(_mm512_load_ps(buf + 32 * r), _mm512_load_ps(buf + 32 * r + 16));
        _mm256_storeu_si256((__m256i *)at, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

GEMM_AMX_TARGET int mlp_amx_tiles(const uint16_t *xt, int64_t m, int64_t hidden,
                                  const uint16_t *gate_up, const uint16_t *down, int64_t inter,
                                  float *y, int add, int threads, struct scratch *s) {
    const int64_t rows = (m + 31) & ~(int64_t)31;
    const size_t mark = scratch_mark(s);
    void *owned;
    uint16_t *act = scratch_take(s, sizeof(uint16_t) * (size_t)(rows * inter), &owned);
    if (act == NULL) return -1;
    const int64_t blocks = inter / 16, block = 16 * hidden, steps = hidden / 32;
#pragma omp parallel num_threads(threads)
    {
        float buf[32 * 32] __attribute__((aligned(64)));
        amx_tiles_configure();
        const struct share mine = thread_share(blocks, hidden);
        for (int64_t c = mine.from; c < mine.to; c += mine.chunk) {
            const int64_t end = c + mine.chunk < mine.to ? c + mine.chunk : mine.to;
            for (int64_t row = 0; row < rows; row += 32) {
                const uint16_t *a0 = xt + (row / 16) * steps * 512, *a1 = a0 + steps * 512;
                for (int64_t j = c; j < end; j++)
                    mlp_pass(a0, a1, steps, gate_up + j * block, gate_up + (blocks + j) * block,
                             row, j, act, inter, buf);
            }
        }
        _tile_release();
    }
    gemm_amx_tiles(act, m, inter, down, hidden, y, add, threads);
    free(owned);
    scratch_release(s, mark);
    return 0;
}

/* x's rows as A tiles, taken from s (*owned to free); NULL when out of memory. */
static uint16_t *tiles_of(const float *x, int64_t m, int64_t k, int threads, struct scratch *s,
                          void **owned) {
    const int64_t rows = (m + 31) & ~(int64_t)31;
    uint16_t *xt = scratch_take(s, sizeof(uint16_t) * (size_t)(rows * k), owned);
    if (xt != NULL) rows_to_tiles(x, m, rows, k, xt, threads);
    return xt;
}

int mlp_bf16_amx(const float *x, int64_t m, int64_t hidden, const uint16_t *gate_up,
                 const uint16_t *down, int64_t inter, float *y, int threads, struct scratch *s) {
    const size_t mark = scratch_mark(s);
    void *owned;
    uint16_t *xt = tiles_of(x, m, hidden, threads, s, &owned);
    const int status =
        xt == NULL ? -1 : mlp_amx_tiles(xt, m, hidden, gate_up, down, inter, y, 0, threads, s);
    free(owned);
    scratch_release(s, mark);
    return status;
}

int gemm_bf16_amx(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, float *y,
                  int threads, struct scratch *s) {
    const size_t mark = scratch_mark(s);
    void *owned;
    uint16_t *xt = tiles_of(x, m, k, threads, s, &owned);
    if (xt != NULL) gemm_amx_tiles(xt, m, k, w, n, y, 0, threads);
    free(owned);
    scratch_release(s, mark);
    return xt == NULL ? -1 : 0;
}
#else
int gemm_bf16_amx(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, float *y,
                  int threads, struct scratch *s) {
    (void)x, (void)m, (void)k, (void)w, (void)n, (void)y, (void)threads, (void)s;
    return -1; /* never dispatched: slotserve_kernel_amx() is 0 here */
}
int mlp_bf16_amx(const float *x, int64_t m, int64_t hidden, const uint16_t *gate_up,
                 const uint16_t *down, int64_t inter, float *y, int threads, struct scratch *s) {
    (void)x, (void)m, (void)hidden, (void)gate_up, (void)down, (void)inter, (void)y;
    (void)threads, (void)s;
    return -1;
}
void amx_row_to_tiles(const float *row, const float *weight, float scale, int64_t i, int64_t k,
                      uint16_t *xt) {
    (void)row, (void)weight, (void)scale, (void)i, (void)k, (void)xt;
}
void gemm_amx_tiles(const uint16_t *xt, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                    float *y, int add, int threads) {
    (void)xt, (void)m, (void)k, (void)w, (void)n, (void)y, (void)add, (void)threads;
}
int mlp_amx_tiles(const uint16_t *xt, int64_t m, int64_t hidden, const uint16_t *gate_up,
                  const uint16_t *down, int64_t inter, float *y, int add, int threads,
                  struct scratch *s) {
    (void)xt, (void)m, (void)hidden, (void)gate_up, (void)down, (void)inter, (void)y, (void)add;
    (void)threads, (void)s;
    return -1;
}
#endif
