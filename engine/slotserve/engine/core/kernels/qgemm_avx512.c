/* The fp32 panel product in AVX-512 (F, with BW/VL/DQ required alongside by the dispatch), for
 * CPUs that have it: 16 floats a register and 32 registers, so four input rows against the
 * panel's four weight rows keep 16 accumulators, and each weight vector loaded serves four
 * rows. Compiled without -m flags: only this function's target attribute allows the
 * instructions, and products.c calls it only when cpuid reports them (slotserve_kernel_isa() ==
 * ISA_AVX512), so the library still loads and runs on an AVX2-only or a plain x86-64 CPU.
 *
 * Where it pays: with many rows (prefill chunks, wide decode steps) a panel product is bound
 * by the multiply-adds, and a 512-bit FMA does twice the work of a 256-bit one on cores with a
 * full-width unit (Zen 5, most Intel server cores; Zen 4 splits it in two halves). With one
 * row it is bound by the memory, like the AVX2 code.
 */
#include <stdint.h>

#include "qgemm.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

/* R rows of x (R <= 4, a constant where inlined) against the 4 panel rows of w; k % 16 == 0.
 * `next` (or NULL): a panel further on, prefetched into L2 meanwhile (see products.c). */
AVX512 static inline void rows_by_panel(const float *x, int64_t k, const float *w, float *y,
                                        int64_t n, const float *next, const int rows) {
    const float *w0 = w, *w1 = w + k, *w2 = w + 2 * k, *w3 = w + 3 * k;
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 16) {
        if (next != NULL) {
            /* The next panel's 4 * 16 floats for these 16 columns: four lines. */
            for (int line = 0; line < 64; line += 16)
                _mm_prefetch((const char *)(next + 4 * j + line), _MM_HINT_T1);
        }
        const __m512 v0 = _mm512_loadu_ps(w0 + j), v1 = _mm512_loadu_ps(w1 + j);
        const __m512 v2 = _mm512_loadu_ps(w2 + j), v3 = _mm512_loadu_ps(w3 + j);
        for (int r = 0; r < rows; r++) {
            const __m512 xr = _mm512_loadu_ps(x + r * k + j);
            acc[r][0] = _mm512_fmadd_ps(xr, v0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xr, v1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(xr, v2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(xr, v3, acc[r][3]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) y[r * n + c] = _mm512_reduce_add_ps(acc[r][c]);
}

AVX512 void dot_panel_avx512(const float *x, int64_t m, int64_t k, const float *w, float *y,
                             int64_t n, const float *next) {
    int64_t i = 0;
    for (; i + 4 <= m; i += 4)
        rows_by_panel(x + i * k, k, w, y + i * n, n, i == 0 ? next : NULL, 4);
    const float *prefetch = i == 0 ? next : NULL;
    switch (m - i) {
    case 3:
        rows_by_panel(x + i * k, k, w, y + i * n, n, prefetch, 3);
        break;
    case 2:
        rows_by_panel(x + i * k, k, w, y + i * n, n, prefetch, 2);
        break;
    case 1:
        rows_by_panel(x + i * k, k, w, y + i * n, n, prefetch, 1);
        break;
    default:
        break;
    }
}
#else
void dot_panel_avx512(const float *x, int64_t m, int64_t k, const float *w, float *y, int64_t n,
                      const float *next) {
    (void)x, (void)m, (void)k, (void)w, (void)y, (void)n, (void)next; /* never dispatched */
}
#endif
