/* Products on bf16 weights with the AVX512_BF16 dot-product instruction (VDPBF16PS), for CPUs
 * that have it (Zen 4 and later, Intel Cooper Lake, Sapphire Rapids and later).
 *
 * Why: a decode step streams every weight of the model and, from a few rows up, multiplies
 * each by every row; a prefill chunk multiplies every weight by hundreds of rows. fp32 weights
 * cost 4 bytes and one multiply-add each. bf16 weights halve the bytes, and one VDPBF16PS does
 * 32 multiply-adds (pairs of bf16 products, exact in fp32, added into 16 fp32 accumulators)
 * where an fp32 FMA does 16. The rows of x are rounded to bf16 (nearest even) once per product;
 * accumulation stays fp32, and so does the output (no bf16 rounding of y, unlike a bf16 GEMM).
 *
 * Layout (kernels.h, "packed bf16"): channels in blocks of 16; block b holds, for each pair of
 * input columns (2p, 2p + 1), the 16 channels' two weights side by side: one 64-byte line per
 * pair, exactly what one VDPBF16PS takes against a row's pair broadcast to every lane. So a tile
 * of R rows by B blocks keeps R x B accumulators of 16 channels each, loads B weight lines and
 * broadcasts R pairs per step, and stores its outputs whole: no horizontal sums (the plain
 * [N, K] layout needs one per row and channel, which held an earlier version of this kernel to
 * ~300 GFLOPS on a 2-core Zen 4 where oneDNN's bf16 GEMM reached ~360).
 *
 * Work: a task is TASK_BLOCKS blocks of channels (their weights stay in L2 while every row
 * passes over them); rows go ROW_SPAN at a time (their bf16 copy stays in L2), in tiles of
 * TILE_ROWS. Compiled without -m flags: the target attribute allows the instructions in these
 * functions only, and products.c calls them only when cpuid reports AVX512_BF16.
 */
#include <stdint.h>

#include "gemm.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

#define TASK_BLOCKS 3 /* 48 channels: 3 x 8 accumulators + 3 weights + 1 row pair of 32 zmm */
#define TILE_ROWS 8
#define ROW_SPAN 256 /* rows whose bf16 copy (288 KB at k = 576) stays in L2 across tasks */
/* The fused MLP's tile: 6 rows by 2 blocks of gate and 2 of up, 24 accumulators. */
#define MLP_ROWS 6
#define MLP_PAIRS 2

/* count floats (a multiple of 32) to bf16, rounded to nearest even (torch's .to(bfloat16)). */
BF16_TARGET static void round_to_bf16(const float *x, int64_t count, uint16_t *out) {
    int64_t j = 0;
    for (; j + 32 <= count; j += 32) {
        const __m512bh pair =
            _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + j + 16), _mm512_loadu_ps(x + j));
        _mm512_storeu_si512(out + j, (__m512i)pair);
    }
    for (; j < count; j++)
        out[j] = (uint16_t)_mm_extract_epi16((__m128i)_mm_cvtneps_pbh(_mm_set1_ps(x[j])), 0);
}

/* R rows of xb (bf16, k columns) against B blocks of packed weights from block `w` on; the
 * outputs of channels [0, 16 B) go to y (row stride n), or are added to what it holds when
 * `add` (y + product, as a separate pass would add them), the last block's masked by `last`.
 * `next` (or NULL): weights further on, prefetched into L2 one line per block per step. */
BF16_TARGET static inline __attribute__((always_inline)) void
tile(const uint16_t *xb, int64_t k, const uint16_t *w, float *y, int64_t n, __mmask16 last,
     const uint16_t *next, int add, const int rows, const int blocks) {
    const int64_t block_elems = 16 * k; /* bf16 values in one block of 16 channels */
    __m512 acc[TILE_ROWS][TASK_BLOCKS];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < blocks; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k / 2; p++) {
        __m512bh wv[TASK_BLOCKS];
        for (int b = 0; b < blocks; b++) {
            wv[b] = (__m512bh)_mm512_loadu_si512(w + b * block_elems + 32 * p);
            if (next != NULL)
                _mm_prefetch((const char *)(next + b * block_elems + 32 * p), _MM_HINT_T1);
        }
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, xb + r * k + 2 * p, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int b = 0; b < blocks; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
        }
    }
    if (add)
        for (int r = 0; r < rows; r++) {
            for (int b = 0; b + 1 < blocks; b++)
                acc[r][b] = _mm512_add_ps(_mm512_loadu_ps(y + r * n + 16 * b), acc[r][b]);
            acc[r][blocks - 1] = _mm512_add_ps(
                _mm512_maskz_loadu_ps(last, y + r * n + 16 * (blocks - 1)), acc[r][blocks - 1]);
        }
    for (int r = 0; r < rows; r++) {
        for (int b = 0; b + 1 < blocks; b++) _mm512_storeu_ps(y + r * n + 16 * b, acc[r][b]);
        _mm512_mask_storeu_ps(y + r * n + 16 * (blocks - 1), last, acc[r][blocks - 1]);
    }
}

/* Every instantiation the loops below call: rows 1..TILE_ROWS by blocks 1..TASK_BLOCKS. */
#define TILE_CASE(R, B)                                                                            \
    case (R) * 4 + (B):                                                                            \
        tile(xb, k, w, y, n, last, next, add, R, B);                                               \
        break;
#define TILE_ROW(R) TILE_CASE(R, 1) TILE_CASE(R, 2) TILE_CASE(R, 3)

BF16_TARGET static void tile_any(const uint16_t *xb, int64_t k, const uint16_t *w, float *y,
                                 int64_t n, __mmask16 last, const uint16_t *next, int add, int rows,
                                 int blocks) {
    switch (rows * 4 + blocks) {
        TILE_ROW(1)
        TILE_ROW(2)
        TILE_ROW(3)
        TILE_ROW(4)
        TILE_ROW(5)
        TILE_ROW(6)
        TILE_ROW(7)
        TILE_ROW(8)
    default:
        break;
    }
}

void gemm_bf16_rows(const uint16_t *xb, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                    float *y, int add, int threads) {
    const int64_t blocks = (n + 15) / 16;
    const int64_t tasks = (blocks + TASK_BLOCKS - 1) / TASK_BLOCKS;
    const int64_t block_elems = 16 * k;
    /* A task this many further on is prefetched while the first tile of rows runs (decode:
     * its weights come from memory once, so their fetch overlaps this task's products). */
    const int64_t ahead = (channels_ahead(BF16, k) + 16 * TASK_BLOCKS - 1) / (16 * TASK_BLOCKS);
    const int tail = (int)(n % 16);
    const __mmask16 tail_mask = tail == 0 ? (__mmask16)0xFFFF : (__mmask16)((1u << tail) - 1);
#pragma omp parallel num_threads(threads)
    for (int64_t span = 0; span < m; span += ROW_SPAN) {
        const int64_t span_end = m - span < ROW_SPAN ? m : span + ROW_SPAN;
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t first = t * TASK_BLOCKS;
            const int count = (int)(blocks - first < TASK_BLOCKS ? blocks - first : TASK_BLOCKS);
            const __mmask16 last = first + count == blocks ? tail_mask : (__mmask16)0xFFFF;
            const uint16_t *weights = w + first * block_elems;
            const uint16_t *next = ahead > 0 && span == 0 && t + ahead < tasks
                                       ? w + (t + ahead) * TASK_BLOCKS * block_elems
                                       : NULL;
            for (int64_t i = span; i < span_end; i += TILE_ROWS) {
                const int rows = (int)(span_end - i < TILE_ROWS ? span_end - i : TILE_ROWS);
                tile_any(xb + i * k, k, weights, y + i * n + 16 * first, n, last,
                         i == span ? next : NULL, add, rows, count);
            }
        }
    }
}

BF16_TARGET void bf16_task_rows(const uint16_t *xb, int64_t m, int64_t k, const uint16_t *w,
                                float *y, int64_t n, int blocks, int tail) {
    const __mmask16 last = tail == 0 ? (__mmask16)0xFFFF : (__mmask16)((1u << tail) - 1);
    for (int64_t i = 0; i < m; i += TILE_ROWS) {
        const int rows = (int)(m - i < TILE_ROWS ? m - i : TILE_ROWS);
        tile_any(xb + i * k, k, w, y + i * n, n, last, NULL, 0, rows, blocks);
    }
}

/* R rows of xb against PAIRS blocks of gate weights from `gate` on and the same blocks of up
 * weights from `up` on (block stride 16 k each); silu(gate) * up of each row's 16 PAIRS channels
 * is rounded to bf16 into `act` (row stride inter): the gate/up results never leave the
 * registers. `next` (or NULL): gate weights further on, prefetched with their up weights. */
BF16_TARGET static inline __attribute__((always_inline)) void
tile_mlp(const uint16_t *xb, int64_t k, const uint16_t *gate, const uint16_t *up, uint16_t *act,
         int64_t inter, const uint16_t *next, int64_t up_offset, const int rows, const int pairs) {
    const int64_t block_elems = 16 * k;
    __m512 acc_gate[MLP_ROWS][MLP_PAIRS], acc_up[MLP_ROWS][MLP_PAIRS];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < pairs; b++)
            acc_gate[r][b] = _mm512_setzero_ps(), acc_up[r][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k / 2; p++) {
        __m512bh gv[MLP_PAIRS], uv[MLP_PAIRS];
        for (int b = 0; b < pairs; b++) {
            gv[b] = (__m512bh)_mm512_loadu_si512(gate + b * block_elems + 32 * p);
            uv[b] = (__m512bh)_mm512_loadu_si512(up + b * block_elems + 32 * p);
            if (next != NULL) {
                _mm_prefetch((const char *)(next + b * block_elems + 32 * p), _MM_HINT_T1);
                _mm_prefetch((const char *)(next + up_offset + b * block_elems + 32 * p),
                             _MM_HINT_T1);
            }
        }
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, xb + r * k + 2 * p, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int b = 0; b < pairs; b++) {
                acc_gate[r][b] = _mm512_dpbf16_ps(acc_gate[r][b], xv, gv[b]);
                acc_up[r][b] = _mm512_dpbf16_ps(acc_up[r][b], xv, uv[b]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < pairs; b++)
            _mm256_storeu_si256(
                (__m256i *)(act + r * inter + 16 * b),
                (__m256i)_mm512_cvtneps_pbh(silu_mul16(acc_gate[r][b], acc_up[r][b])));
}

#define MLP_CASE(R, G)                                                                             \
    case (R) * 4 + (G):                                                                            \
        tile_mlp(xb, k, gate, up, act, inter, next, up_offset, R, G);                              \
        break;
#define MLP_ROW(R) MLP_CASE(R, 1) MLP_CASE(R, 2)

BF16_TARGET static void tile_mlp_any(const uint16_t *xb, int64_t k, const uint16_t *gate,
                                     const uint16_t *up, uint16_t *act, int64_t inter,
                                     const uint16_t *next, int64_t up_offset, int rows, int pairs) {
    switch (rows * 4 + pairs) {
        MLP_ROW(1)
        MLP_ROW(2)
        MLP_ROW(3)
        MLP_ROW(4)
        MLP_ROW(5)
        MLP_ROW(6)
    default:
        break;
    }
}

int mlp_bf16_rows(const uint16_t *xb, int64_t m, int64_t hidden, const uint16_t *gate_up,
                  const uint16_t *down, int64_t inter, float *y, int add, int threads,
                  struct scratch *s) {
    const size_t mark = scratch_mark(s);
    void *owned;
    uint16_t *act = scratch_take(s, sizeof(uint16_t) * (size_t)(m * inter), &owned);
    if (act == NULL) return -1;
    const int pairs = inter % (16 * MLP_PAIRS) == 0 ? MLP_PAIRS : 1;
    const int64_t block_elems = 16 * hidden, up_offset = (inter / 16) * block_elems;
    const int64_t tasks = inter / (16 * pairs);
    const int64_t ahead = (channels_ahead(BF16, hidden) + 32 * pairs - 1) / (32 * pairs);
#pragma omp parallel num_threads(threads)
    for (int64_t span = 0; span < m; span += ROW_SPAN) {
        const int64_t span_end = m - span < ROW_SPAN ? m : span + ROW_SPAN;
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t t = 0; t < tasks; t++) {
            const uint16_t *gate = gate_up + t * pairs * block_elems;
            const uint16_t *next = ahead > 0 && span == 0 && t + ahead < tasks
                                       ? gate_up + (t + ahead) * pairs * block_elems
                                       : NULL;
            for (int64_t i = span; i < span_end; i += MLP_ROWS) {
                const int rows = (int)(span_end - i < MLP_ROWS ? span_end - i : MLP_ROWS);
                tile_mlp_any(xb + i * hidden, hidden, gate, gate + up_offset,
                             act + i * inter + t * pairs * 16, inter, i == span ? next : NULL,
                             up_offset, rows, pairs);
            }
        }
    }
    gemm_bf16_rows(act, m, inter, down, hidden, y, add, threads);
    free(owned);
    scratch_release(s, mark);
    return 0;
}

int gemm_bf16_avx512(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, float *y,
                     int threads, struct scratch *s) {
    const size_t mark = scratch_mark(s);
    void *owned;
    uint16_t *xb = scratch_take(s, sizeof(uint16_t) * (size_t)(m * k), &owned);
    if (xb == NULL) return -1;
    bf16_round(x, m * k, xb, threads);
    gemm_bf16_rows(xb, m, k, w, n, y, 0, threads);
    free(owned);
    scratch_release(s, mark);
    return 0;
}

BF16_TARGET static void widen_from_bf16(const uint16_t *in, int64_t count, float *out) {
    int64_t j = 0;
    for (; j + 16 <= count; j += 16) {
        const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(in + j)));
        _mm512_storeu_ps(out + j, _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
    }
    for (; j < count; j++) out[j] = bf16_value(in[j]);
}
#else
int gemm_bf16_avx512(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, float *y,
                     int threads, struct scratch *s) {
    (void)x, (void)m, (void)k, (void)w, (void)n, (void)y, (void)threads, (void)s;
    return -1; /* never dispatched */
}
void gemm_bf16_rows(const uint16_t *xb, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                    float *y, int add, int threads) {
    (void)xb, (void)m, (void)k, (void)w, (void)n, (void)y, (void)add, (void)threads;
    /* never dispatched */
}
void bf16_task_rows(const uint16_t *xb, int64_t m, int64_t k, const uint16_t *w, float *y,
                    int64_t n, int blocks, int tail) {
    (void)xb, (void)m, (void)k, (void)w, (void)y, (void)n, (void)blocks, (void)tail;
    /* never dispatched */
}
int mlp_bf16_rows(const uint16_t *xb, int64_t m, int64_t hidden, const uint16_t *gate_up,
                  const uint16_t *down, int64_t inter, float *y, int add, int threads,
                  struct scratch *s) {
    (void)xb, (void)m, (void)hidden, (void)gate_up, (void)down, (void)inter, (void)y, (void)add;
    (void)threads, (void)s;
    return -1; /* never dispatched */
}
#endif

/* Spans of this many values a thread: big enough that a thread's wake-up is a small part. */
#define CONVERT_SPAN 16384

/* floats <-> bf16 over `count` values, a span a task: `narrow` rounds floats to bf16 bits (f to
 * h), else h is widened into f. */
static void bf16_convert(float *f, uint16_t *h, int64_t count, int narrow, int threads) {
    const int64_t spans = (count + CONVERT_SPAN - 1) / CONVERT_SPAN;
#if defined(__x86_64__)
    const int vector = slotserve_kernel_isa() >= ISA_AVX512_BF16;
#else
    const int vector = 0;
#endif
#pragma omp parallel for num_threads(threads) if (spans > 1)
    for (int64_t i = 0; i < spans; i++) {
        const int64_t at = i * CONVERT_SPAN;
        const int64_t len = count - at < CONVERT_SPAN ? count - at : CONVERT_SPAN;
#if defined(__x86_64__)
        if (vector) {
            if (narrow)
                round_to_bf16(f + at, len, h + at);
            else
                widen_from_bf16(h + at, len, f + at);
            continue;
        }
#endif
        for (int64_t j = at; j < at + len; j++) {
            if (narrow)
                h[j] = bf16_bits(f[j]);
            else
                f[j] = bf16_value(h[j]);
        }
    }
    (void)vector;
}

void bf16_round(const float *x, int64_t count, uint16_t *out, int threads) {
    bf16_convert((float *)x, out, count, 1, threads); /* x is only read */
}

void bf16_widen(const uint16_t *in, int64_t count, float *out, int threads) {
    bf16_convert(out, (uint16_t *)in, count, 0, threads); /* in is only read */
}
