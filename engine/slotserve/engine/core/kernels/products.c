/* Matrix products for CPU decoding: y[M,N] = x[M,K] . W[N,K]^T with W in fp32, int8 or int4.
 *
 * Why a kernel of our own: on AVX2 machines without AVX-512, torch's weight-only int8/int4
 * kernels ran slower than fp32, and MKL's fp32 products with a few rows read the weights at
 * under half the machine's bandwidth. Decode is a few rows against every weight of the model,
 * so the time is the time to stream the weights: fewer bytes per weight (int8, int4) and one
 * pass over them at full bandwidth are what count.
 *
 * How: the output channels are cut into panels of PANEL rows; each thread takes whole panels
 * (OpenMP, the runtime torch already loaded). A quantized panel is dequantized once into a small
 * fp32 buffer that stays in L1/L2, then every input row is multiplied against it (four, three,
 * two or one rows at a time, each (row, panel row) pair with its own accumulator): the weights
 * are read from memory once per call whatever M is. Both quantized formats keep their scales
 * per group of 32 weights along the input. int8: one scale a group (w = scale * q, q in
 * -127..127: llama.cpp's Q8_0). int4: a scale and a minimum (w = scale * q + min, q in 0..15:
 * Q4_1), byte j of a group holding weight j in its low nibble and weight j + 16 in its high
 * nibble, so one 16-byte load unpacks into two runs of 16 weights.
 *
 * Every product has an AVX2/FMA version and a plain C one, and the fp32 panel product an
 * AVX-512 one (qgemm_avx512.c); the widest the CPU has is chosen at run time from cpuid (never
 * one it lacks), and can be lowered for tests (slotserve_kernel_set_isa).
 */
#include "gemm.h"

/* ---- plain C ------------------------------------------------------------------------------ */

static void dot_panel_c(const float *x, int64_t m, int64_t k, const float *w, int64_t rows,
                        float *y, int64_t n) {
    for (int64_t i = 0; i < m; i++) {
        for (int64_t r = 0; r < rows; r++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < k; j++) acc += x[i * k + j] * w[r * k + j];
            y[i * n + r] = acc;
        }
    }
}

static void unpack_q8_c(const int8_t *q, const float *scale, int64_t k, int64_t rows, float *out) {
    for (int64_t j = 0; j < rows * k; j++) out[j] = scale[j / GROUP] * (float)q[j];
}

static void unpack_q4_c(const uint8_t *q, const float *scale, const float *minimum, int64_t k,
                        int64_t rows, float *out) {
    const int64_t groups = k / GROUP;
    for (int64_t g = 0; g < rows * groups; g++) {
        const uint8_t *bytes = q + g * (GROUP / 2);
        float *dst = out + g * GROUP;
        for (int j = 0; j < GROUP / 2; j++) {
            dst[j] = scale[g] * (float)(bytes[j] & 0x0F) + minimum[g];
            dst[j + GROUP / 2] = scale[g] * (float)(bytes[j] >> 4) + minimum[g];
        }
    }
}

/* Channels [n0, n0 + rows) of packed bf16 weights (kernels.h) widened to fp32 rows of k: the
 * reference the VDPBF16PS products are tested against. */
static void unpack_bf16_c(const uint16_t *packed, int64_t n0, int64_t rows, int64_t k, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t c = n0 + r;
        const uint16_t *block = packed + (c / 16) * 16 * k + 2 * (c % 16);
        for (int64_t j = 0; j < k; j++) {
            const uint32_t bits = (uint32_t)block[(j / 2) * 32 + (j % 2)] << 16;
            memcpy(out + r * k + j, &bits, sizeof(float));
        }
    }
}

/* f rounded to the nearest bf16 (gemm.h's bf16_bits), as a float. */
static float round_bf16(float f) {
    const uint32_t bits = (uint32_t)bf16_bits(f) << 16;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* ---- AVX2 + FMA --------------------------------------------------------------------------- */

#if HAVE_AVX2_CODE

/* A full panel (PANEL rows of w) against every row of x; k is a multiple of 8. `next` (or NULL)
 * is a panel further on (see ahead_bytes): its lines are prefetched while this one computes, so
 * that with several rows, where the products take as long as the weights take to arrive, the
 * two overlap. */
__attribute__((target("avx2,fma"))) static void dot_panel_avx2(const float *x, int64_t m, int64_t k,
                                                               const float *w, float *y, int64_t n,
                                                               const float *next) {
    const float *w0 = w, *w1 = w + k, *w2 = w + 2 * k, *w3 = w + 3 * k;
    int64_t i = 0;
    /* Four rows, two panel rows at a time (8 accumulators): every weight loaded from memory is
     * used by all four rows in the same pass, so the multiplies are spread evenly over the
     * stream. Taken at 4 and 8 rows (the steps where memory, not the multiplies, sets the
     * pace); more rows go three at a time below. */
    for (; m - i == 4 || m - i == 8; i += 4) {
        const float *xs[4] = {x + i * k, x + (i + 1) * k, x + (i + 2) * k, x + (i + 3) * k};
        __m256 pairs[4];
        for (int half = 0; half < 2; half++) {
            const float *wa = w + 2 * half * k, *wb = wa + k;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t j = 0; j < k; j += 8) {
                if (next != NULL && i == 0) {
                    _mm_prefetch((const char *)(next + 4 * j + 32 * half), _MM_HINT_T1);
                    _mm_prefetch((const char *)(next + 4 * j + 32 * half + 16), _MM_HINT_T1);
                }
                const __m256 va = _mm256_loadu_ps(wa + j), vb = _mm256_loadu_ps(wb + j);
                __m256 v = _mm256_loadu_ps(xs[0] + j);
                a0 = _mm256_fmadd_ps(v, va, a0), b0 = _mm256_fmadd_ps(v, vb, b0);
                v = _mm256_loadu_ps(xs[1] + j);
                a1 = _mm256_fmadd_ps(v, va, a1), b1 = _mm256_fmadd_ps(v, vb, b1);
                v = _mm256_loadu_ps(xs[2] + j);
                a2 = _mm256_fmadd_ps(v, va, a2), b2 = _mm256_fmadd_ps(v, vb, b2);
                v = _mm256_loadu_ps(xs[3] + j);
                a3 = _mm256_fmadd_ps(v, va, a3), b3 = _mm256_fmadd_ps(v, vb, b3);
            }
            if (half == 0) {
                pairs[0] = _mm256_hadd_ps(a0, b0), pairs[1] = _mm256_hadd_ps(a1, b1);
                pairs[2] = _mm256_hadd_ps(a2, b2), pairs[3] = _mm256_hadd_ps(a3, b3);
            } else {
                const __m256 q[4] = {_mm256_hadd_ps(a0, b0), _mm256_hadd_ps(a1, b1),
                                     _mm256_hadd_ps(a2, b2), _mm256_hadd_ps(a3, b3)};
                for (int r = 0; r < 4; r++) {
                    const __m256 all = _mm256_hadd_ps(pairs[r], q[r]);
                    _mm_storeu_ps(y + (i + r) * n, _mm_add_ps(_mm256_castps256_ps128(all),
                                                              _mm256_extractf128_ps(all, 1)));
                }
            }
        }
    }
    /* Three rows at a time: 12 accumulators (all 16 registers with the three x vectors and one
     * weight vector), 7 loads per 12 multiply-adds, where two rows do 6 per 8. */
    for (; i + 3 <= m; i += 3) {
        const float *xa = x + i * k, *xb = xa + k, *xc = xb + k;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;
        for (int64_t j = 0; j < k; j += 8) {
            /* The next panel into L2 during the first rows, then, with rows enough to hide it,
             * into L1 during the second: by then this panel is in L1, and the next one's first
             * rows find theirs there (fp32 products of a SmolLM2 step at 32 rows: 41 vs 45 ms;
             * at 8 rows the same in the four-row loop cost 7%). */
            if (next != NULL && i == 0) {
                _mm_prefetch((const char *)(next + 4 * j), _MM_HINT_T1);
                _mm_prefetch((const char *)(next + 4 * j + 16), _MM_HINT_T1);
            } else if (next != NULL && i == 3 && m >= 12) {
                _mm_prefetch((const char *)(next + 4 * j), _MM_HINT_T0);
                _mm_prefetch((const char *)(next + 4 * j + 16), _MM_HINT_T0);
            }
            const __m256 va = _mm256_loadu_ps(xa + j), vb = _mm256_loadu_ps(xb + j);
            const __m256 vc = _mm256_loadu_ps(xc + j);
            __m256 v = _mm256_loadu_ps(w0 + j);
            a0 = _mm256_fmadd_ps(va, v, a0), b0 = _mm256_fmadd_ps(vb, v, b0);
            c0 = _mm256_fmadd_ps(vc, v, c0);
            v = _mm256_loadu_ps(w1 + j);
            a1 = _mm256_fmadd_ps(va, v, a1), b1 = _mm256_fmadd_ps(vb, v, b1);
            c1 = _mm256_fmadd_ps(vc, v, c1);
            v = _mm256_loadu_ps(w2 + j);
            a2 = _mm256_fmadd_ps(va, v, a2), b2 = _mm256_fmadd_ps(vb, v, b2);
            c2 = _mm256_fmadd_ps(vc, v, c2);
            v = _mm256_loadu_ps(w3 + j);
            a3 = _mm256_fmadd_ps(va, v, a3), b3 = _mm256_fmadd_ps(vb, v, b3);
            c3 = _mm256_fmadd_ps(vc, v, c3);
        }
        /* A row's four sums are four adjacent outputs: one store. */
        _mm_storeu_ps(y + i * n, hsum4(a0, a1, a2, a3));
        _mm_storeu_ps(y + (i + 1) * n, hsum4(b0, b1, b2, b3));
        _mm_storeu_ps(y + (i + 2) * n, hsum4(c0, c1, c2, c3));
    }
    for (; i + 2 <= m; i += 2) {
        const float *xa = x + i * k, *xb = xa + k;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int64_t j = 0; j < k; j += 8) {
            /* PANEL * k floats ahead in k / 8 steps: 32 floats (two lines) a step. */
            if (next != NULL && i == 0) {
                _mm_prefetch((const char *)(next + 4 * j), _MM_HINT_T1);
                _mm_prefetch((const char *)(next + 4 * j + 16), _MM_HINT_T1);
            }
            __m256 va = _mm256_loadu_ps(xa + j), vb = _mm256_loadu_ps(xb + j);
            __m256 v0 = _mm256_loadu_ps(w0 + j), v1 = _mm256_loadu_ps(w1 + j);
            __m256 v2 = _mm256_loadu_ps(w2 + j), v3 = _mm256_loadu_ps(w3 + j);
            a0 = _mm256_fmadd_ps(va, v0, a0);
            a1 = _mm256_fmadd_ps(va, v1, a1);
            a2 = _mm256_fmadd_ps(va, v2, a2);
            a3 = _mm256_fmadd_ps(va, v3, a3);
            b0 = _mm256_fmadd_ps(vb, v0, b0);
            b1 = _mm256_fmadd_ps(vb, v1, b1);
            b2 = _mm256_fmadd_ps(vb, v2, b2);
            b3 = _mm256_fmadd_ps(vb, v3, b3);
        }
        _mm_storeu_ps(y + i * n, hsum4(a0, a1, a2, a3));
        _mm_storeu_ps(y + (i + 1) * n, hsum4(b0, b1, b2, b3));
    }
    if (i < m) {
        /* One row left (always, at batch 1): two accumulators per panel row keep the FMA
         * latency hidden while the weights stream in. */
        const float *xa = x + i * k;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;
        int64_t j = 0;
        for (; j + 16 <= k; j += 16) {
            if (next != NULL) {
                for (int line = 0; line < 64; line += 16)
                    _mm_prefetch((const char *)(next + 4 * j + line), _MM_HINT_T1);
            }
            __m256 va = _mm256_loadu_ps(xa + j), vc = _mm256_loadu_ps(xa + j + 8);
            a0 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w0 + j), a0);
            a1 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w1 + j), a1);
            a2 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w2 + j), a2);
            a3 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w3 + j), a3);
            c0 = _mm256_fmadd_ps(vc, _mm256_loadu_ps(w0 + j + 8), c0);
            c1 = _mm256_fmadd_ps(vc, _mm256_loadu_ps(w1 + j + 8), c1);
            c2 = _mm256_fmadd_ps(vc, _mm256_loadu_ps(w2 + j + 8), c2);
            c3 = _mm256_fmadd_ps(vc, _mm256_loadu_ps(w3 + j + 8), c3);
        }
        for (; j < k; j += 8) {
            __m256 va = _mm256_loadu_ps(xa + j);
            a0 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w0 + j), a0);
            a1 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w1 + j), a1);
            a2 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w2 + j), a2);
            a3 = _mm256_fmadd_ps(va, _mm256_loadu_ps(w3 + j), a3);
        }
        float *ya = y + i * n;
        ya[0] = hsum(_mm256_add_ps(a0, c0)), ya[1] = hsum(_mm256_add_ps(a1, c1));
        ya[2] = hsum(_mm256_add_ps(a2, c2)), ya[3] = hsum(_mm256_add_ps(a3, c3));
    }
}

__attribute__((target("avx2,fma"))) static void unpack_q8_avx2(const int8_t *q, const float *scale,
                                                               int64_t k, float *out) {
    const int64_t groups = PANEL * (k / GROUP);
    for (int64_t g = 0; g < groups; g++) {
        const __m256 d = _mm256_set1_ps(scale[g]);
        for (int j = 0; j < GROUP; j += 8) {
            __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + g * GROUP + j));
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
            _mm256_storeu_ps(out + g * GROUP + j, _mm256_mul_ps(v, d));
        }
    }
}

__attribute__((target("avx2,fma"))) static inline void store_q4_8(__m128i nibbles, __m256 d,
                                                                  __m256 mn, float *dst) {
    __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nibbles));
    _mm256_storeu_ps(dst, _mm256_fmadd_ps(q, d, mn));
}

__attribute__((target("avx2,fma"))) static void
unpack_q4_avx2(const uint8_t *q, const float *scale, const float *minimum, int64_t k, float *out) {
    const __m128i low = _mm_set1_epi8(0x0F);
    const int64_t groups = PANEL * (k / GROUP);
    for (int64_t g = 0; g < groups; g++) {
        __m128i bytes = _mm_loadu_si128((const __m128i *)(q + g * (GROUP / 2)));
        __m128i lo = _mm_and_si128(bytes, low);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
        __m256 d = _mm256_set1_ps(scale[g]), mn = _mm256_set1_ps(minimum[g]);
        float *dst = out + g * GROUP;
        store_q4_8(lo, d, mn, dst);
        store_q4_8(_mm_srli_si128(lo, 8), d, mn, dst + 8);
        store_q4_8(hi, d, mn, dst + 16);
        store_q4_8(_mm_srli_si128(hi, 8), d, mn, dst + 24);
    }
}

#else /* no x86: the dispatch never picks these */
static void dot_panel_avx2(const float *x, int64_t m, int64_t k, const float *w, float *y,
                           int64_t n, const float *next) {
    dot_panel_c(x, m, k, w, PANEL, y, n);
}
static void unpack_q8_avx2(const int8_t *q, const float *scale, int64_t k, float *out) {
    unpack_q8_c(q, scale, k, PANEL, out);
}
static void unpack_q4_avx2(const uint8_t *q, const float *scale, const float *minimum, int64_t k,
                           float *out) {
    unpack_q4_c(q, scale, minimum, k, PANEL, out);
}
#endif

/* ---- drivers ------------------------------------------------------------------------------ */

/* The PANEL rows of weights of channel n0 onwards as fp32: the weights themselves (F32), or
 * unpacked into `buffer` (PANEL * k floats). */
static const float *panel_weights(struct weights w, int64_t n0, int64_t rows, int64_t k, int avx2,
                                  float *buffer) {
    if (w.kind == F32) return (const float *)w.data + n0 * k;
    if (w.kind == BF16) {
        unpack_bf16_c((const uint16_t *)w.data, n0, rows, k, buffer);
        return buffer;
    }
    const int64_t groups = k / GROUP;
    if (w.kind == Q8) {
        const int8_t *q = (const int8_t *)w.data + n0 * k;
        if (avx2 && rows == PANEL)
            unpack_q8_avx2(q, w.scale + n0 * groups, k, buffer);
        else
            unpack_q8_c(q, w.scale + n0 * groups, k, rows, buffer);
        return buffer;
    }
    const uint8_t *q = (const uint8_t *)w.data + n0 * (k / 2);
    if (avx2 && rows == PANEL)
        unpack_q4_avx2(q, w.scale + n0 * groups, w.minimum + n0 * groups, k, buffer);
    else
        unpack_q4_c(q, w.scale + n0 * groups, w.minimum + n0 * groups, k, rows, buffer);
    return buffer;
}

void dequantize_channels(struct weights w, int64_t n0, int64_t rows, int64_t k, float *out) {
    const int avx2 = slotserve_kernel_isa() && k % 8 == 0;
    for (int64_t r = 0; r < rows; r += PANEL) {
        const int64_t count = rows - r < PANEL ? rows - r : PANEL;
        const float *from = panel_weights(w, n0 + r, count, k, avx2, out + r * k);
        if (from != out + r * k) memcpy(out + r * k, from, sizeof(float) * (size_t)(count * k));
    }
}

/* Wide products (prefill chunks, WIDE_ROWS rows and more). With AVX2 alone the weights are
 * repacked for broadcast products (gemm_wide_packed, below). With AVX-512 the panels are taken
 * GROUP_PANELS at a time, and every block of PANEL_ROWS rows of x passes over the whole group,
 * whose weights (64 channels: 147 KB at k = 576 in fp32) stay in L2 meanwhile; the row block
 * stays in L1.
 * Panel by panel, as below, every panel read all of x again: past L2 (2,048 rows of 576 floats
 * are 4.7 MB) that was a pass over L3 per panel, and SmolLM2's products of a layer cost 1.05x
 * aten's at 256 rows, 1.97x at 1,024 and 3.1x at 2,048 on an Intel Xeon. */
#define WIDE_ROWS 64
#define GROUP_PANELS 16
#define PANEL_ROWS 12 /* the 4-row AVX-512 register blocks divide it */

/* Each thread's buffer for unpacked quantized panels, `bytes` each (none for fp32 weights):
 * 0, or -1 when out of memory (the workspace is then released to `mark`). */
static int panel_buffers(struct scratch *s, enum kind kind, size_t bytes, int threads, size_t mark,
                         char **buffers, void **owned) {
    *buffers = NULL, *owned = NULL;
    if (kind == F32) return 0;
    *buffers = scratch_take(s, bytes * (size_t)threads, owned);
    if (*buffers != NULL) return 0;
    scratch_release(s, mark);
    return -1;
}

/* The AVX2 wide product (wide_avx2.c): a task packs a group of 16-channel blocks (at most
 * WIDE_GROUP_BYTES of them, so that they stay in L2 while every row tile of the task passes over
 * them) and multiplies its rows against it. With few groups (a 576-channel product is 36
 * blocks, 6 groups at k = 576) the rows are split too, so that two threads get even shares.
 * SmolLM2's products of a layer at 1,024 rows on two Zen 3 cores: 126 -> 143 GFLOPS (in
 * process, interleaved; 196 is the FMA peak); under ~48 rows the panels below are faster (the
 * packing costs more than the tiles save), so the switch stays at WIDE_ROWS. */
#define WIDE_GROUP_BYTES (256 * 1024)

static int gemm_wide_packed(const float *x, int64_t m, int64_t k, struct weights w, int64_t n,
                            float *y, int threads, struct scratch *s) {
    const int64_t blocks = (n + WIDE_CHANNELS - 1) / WIDE_CHANNELS;
    const int64_t block_floats = k * WIDE_CHANNELS;
    int64_t per_group = WIDE_GROUP_BYTES / (int64_t)(sizeof(float) * (size_t)block_floats);
    per_group = per_group < 1 ? 1 : (per_group > blocks ? blocks : per_group);
    const int64_t groups = (blocks + per_group - 1) / per_group;
    int64_t parts = 1;
    while (groups * parts < 4 * threads && m / (2 * parts) >= 4 * WIDE_TILE_ROWS) parts *= 2;
    int64_t part_rows = (m + parts - 1) / parts;
    part_rows = (part_rows + WIDE_TILE_ROWS - 1) / WIDE_TILE_ROWS * WIDE_TILE_ROWS;
    /* Each thread: the packed group, and for quantized (or bf16) weights the block's channels
     * unpacked first (WIDE_CHANNELS rows of k floats). */
    const size_t unpacked = w.kind == F32 ? 0 : (size_t)block_floats;
    const size_t per_thread = sizeof(float) * ((size_t)(per_group * block_floats) + unpacked);
    const size_t mark = scratch_mark(s);
    void *owned;
    char *buffers = scratch_take(s, per_thread * (size_t)threads, &owned);
    if (buffers == NULL) return -1;
#pragma omp parallel num_threads(threads)
    {
        float *packed = (float *)(buffers + per_thread * (size_t)omp_get_thread_num());
        float *rows_buffer = packed + per_group * block_floats;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < groups * parts; task++) {
            const int64_t g = task / parts, first = task % parts * part_rows;
            if (first >= m) continue;
            const int64_t b0 = g * per_group;
            const int64_t count = blocks - b0 < per_group ? blocks - b0 : per_group;
            for (int64_t b = 0; b < count; b++) {
                const int64_t c0 = (b0 + b) * WIDE_CHANNELS;
                const int channels = n - c0 < WIDE_CHANNELS ? (int)(n - c0) : WIDE_CHANNELS;
                const float *rows[WIDE_CHANNELS] = {NULL};
                for (int p = 0; p * PANEL < channels; p++) {
                    const int64_t panel_rows =
                        channels - p * PANEL < PANEL ? channels - p * PANEL : PANEL;
                    const float *panel =
                        panel_weights(w, c0 + p * PANEL, panel_rows, k, 1,
                                      w.kind == F32 ? NULL : rows_buffer + p * PANEL * k);
                    for (int r = 0; r < panel_rows; r++) rows[p * PANEL + r] = panel + r * k;
                }
                wide_pack16(rows, channels, k, packed + b * block_floats);
            }
            const int64_t count_rows = m - first < part_rows ? m - first : part_rows;
            wide_rows(x + first * k, count_rows, k, packed, count, b0 * WIDE_CHANNELS, n,
                      y + first * n);
        }
    }
    free(owned);
    scratch_release(s, mark);
    return 0;
}

static int gemm_wide(const float *x, int64_t m, int64_t k, struct weights w, int64_t n, float *y,
                     int threads, struct scratch *s, int avx512) {
    if (!avx512) return gemm_wide_packed(x, m, k, w, n, y, threads, s);
    const int64_t panels = (n + PANEL - 1) / PANEL;
    const int64_t num_groups = (panels + GROUP_PANELS - 1) / GROUP_PANELS;
    const size_t group_bytes = sizeof(float) * PANEL * GROUP_PANELS * (size_t)k;
    const size_t mark = scratch_mark(s);
    void *owned;
    char *buffers;
    if (panel_buffers(s, w.kind, group_bytes, threads, mark, &buffers, &owned)) return -1;
#pragma omp parallel num_threads(threads)
    {
        float *buffer = NULL;
        if (buffers != NULL)
            buffer = (float *)(buffers + group_bytes * (size_t)omp_get_thread_num());
        const float *weights[GROUP_PANELS];
#pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < num_groups; g++) {
            const int64_t first = g * GROUP_PANELS;
            const int64_t count = panels - first < GROUP_PANELS ? panels - first : GROUP_PANELS;
            for (int64_t p = 0; p < count; p++) {
                const int64_t n0 = (first + p) * PANEL;
                const int64_t rows = n - n0 < PANEL ? n - n0 : PANEL;
                weights[p] = panel_weights(w, n0, rows, k, 1,
                                           buffer == NULL ? NULL : buffer + p * PANEL * k);
            }
            for (int64_t i = 0; i < m; i += PANEL_ROWS) {
                const int64_t block = m - i < PANEL_ROWS ? m - i : PANEL_ROWS;
                for (int64_t p = 0; p < count; p++) {
                    const int64_t n0 = (first + p) * PANEL;
                    const int64_t rows = n - n0 < PANEL ? n - n0 : PANEL;
                    float *out = y + i * n + n0;
                    if (rows < PANEL)
                        dot_panel_c(x + i * k, block, k, weights[p], rows, out, n);
                    else if (avx512)
                        dot_panel_avx512(x + i * k, block, k, weights[p], out, n, NULL);
                    else
                        dot_panel_avx2(x + i * k, block, k, weights[p], out, n, NULL);
                }
            }
        }
    }
    free(owned);
    scratch_release(s, mark);
    return 0;
}

static int gemm_panels(const float *x, int64_t m, int64_t k, struct weights w, int64_t n, float *y,
                       int threads, struct scratch *s);

/* bf16 weights: AMX tiles from AMX_GEMM_ROWS rows where the CPU has them, VDPBF16PS where it
 * has AVX512_BF16; elsewhere (and as the tests' reference) x is rounded to bf16 and the weights
 * widened to fp32, the same products summed in another order. */
static int gemm_bf16(const float *x, int64_t m, int64_t k, struct weights w, int64_t n, float *y,
                     int threads, struct scratch *s) {
    if (m >= AMX_GEMM_ROWS && k % 32 == 0 && n % 16 == 0 && slotserve_kernel_amx())
        return gemm_bf16_amx(x, m, k, (const uint16_t *)w.data, n, y, threads, s);
    if (slotserve_kernel_isa() >= ISA_AVX512_BF16)
        return gemm_bf16_avx512(x, m, k, (const uint16_t *)w.data, n, y, threads, s);
    const size_t mark = scratch_mark(s);
    void *owned;
    float *rounded = scratch_take(s, sizeof(float) * (size_t)(m * k), &owned);
    if (rounded == NULL) return -1;
    for (int64_t j = 0; j < m * k; j++) rounded[j] = round_bf16(x[j]);
    const int status = gemm_panels(rounded, m, k, w, n, y, threads, s);
    free(owned);
    scratch_release(s, mark);
    return status;
}

int slotserve_gemm_weights(const float *x, int64_t m, int64_t k, struct weights w, int64_t n,
                           float *y, int threads, struct scratch *s) {
    if (w.kind == BF16) return gemm_bf16(x, m, k, w, n, y, threads, s);
    if (w.kind == I16) return gemm_int16(x, m, k, w, n, y, threads, s);
    return gemm_panels(x, m, k, w, n, y, threads, s);
}

static int gemm_panels(const float *x, int64_t m, int64_t k, struct weights w, int64_t n, float *y,
                       int threads, struct scratch *s) {
    const int avx2 = slotserve_kernel_isa() && k % 8 == 0;
    /* 512-bit panels from 2 rows up: one row is bound by the memory either way. */
    const int avx512 = slotserve_kernel_isa() >= ISA_AVX512 && k % 16 == 0 && m >= 2;
    const int64_t panels = (n + PANEL - 1) / PANEL;
    const int64_t panels_ahead = (channels_ahead(w.kind, k) + PANEL - 1) / PANEL;
#if HAVE_AVX2_CODE
    if (avx2 && m == 1 && (w.kind == Q8 || w.kind == Q4))
        return gemv_quantized(x, k, w, n, y, threads, s);
#endif
    if (avx2 && m >= WIDE_ROWS) return gemm_wide(x, m, k, w, n, y, threads, s, avx512);
    /* A quantized panel is unpacked into a buffer of each thread's own: PANEL * k floats (a
     * multiple of 64 bytes, as k % 32 == 0). */
    const size_t panel_bytes = sizeof(float) * PANEL * (size_t)k;
    const size_t mark = scratch_mark(s);
    void *owned;
    char *buffers;
    if (panel_buffers(s, w.kind, panel_bytes, threads, mark, &buffers, &owned)) return -1;
#pragma omp parallel num_threads(threads)
    {
        float *buffer = NULL;
        if (buffers != NULL)
            buffer = (float *)(buffers + panel_bytes * (size_t)omp_get_thread_num());
        /* Guided chunks: large ones first (few grabs of the shared counter), then smaller, so
         * that a thread the OS has descheduled (another process on the core) leaves the tail to
         * the others instead of holding the whole call at the barrier. Dynamic chunks of 8
         * panels did that too, at a cost: a SmolLM2 int4 step at 4 rows took 10.9 ms (guided:
         * 9.4), fp32 at one row 8.2 (7.2-7.9). */
#pragma omp for schedule(guided, 8)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t n0 = p * PANEL;
            const int64_t rows = n - n0 < PANEL ? n - n0 : PANEL;
            /* A panel some way ahead (see ahead_bytes): its bytes arrive while this one is
             * unpacked and multiplied. fp32 panels are prefetched inside dot_panel_avx2. */
            if (w.kind != F32 && panels_ahead > 0 && p + panels_ahead + 1 < panels)
                prefetch_channels(w, n0 + panels_ahead * PANEL, PANEL, k);
            const float *panel = panel_weights(w, n0, rows, k, avx2, buffer);
            if (avx2 && rows == PANEL) {
                /* The next panel of this thread's chunk (fp32: the weights themselves). */
                const float *next = NULL;
                if (w.kind == F32 && panels_ahead > 0 && p + panels_ahead + 1 < panels)
                    next = (const float *)w.data + (n0 + panels_ahead * PANEL) * k;
                if (avx512)
                    dot_panel_avx512(x, m, k, panel, y + n0, n, next);
                else
                    dot_panel_avx2(x, m, k, panel, y + n0, n, next);
            } else {
                dot_panel_c(x, m, k, panel, rows, y + n0, n);
            }
        }
    }
    free(owned);
    scratch_release(s, mark);
    return 0;
}

int slotserve_gemm_f32(const float *x, int64_t m, int64_t k, const float *w, int64_t n, float *y,
                       int threads, struct scratch *s) {
    struct weights weights = {F32, w, NULL, NULL};
    return slotserve_gemm_weights(x, m, k, weights, n, y, threads, s);
}

int slotserve_gemm_bf16(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                        float *y, int threads, struct scratch *s) {
    struct weights weights = {BF16, w, NULL, NULL};
    return slotserve_gemm_weights(x, m, k, weights, n, y, threads, s);
}

int slotserve_mlp_bf16(const float *x, int64_t m, int64_t hidden, const uint16_t *gate_up,
                       const uint16_t *down, int64_t inter, float *y, int threads,
                       struct scratch *s) {
    if (m >= AMX_GEMM_ROWS && hidden % 32 == 0 && inter % 32 == 0 && slotserve_kernel_amx())
        return mlp_bf16_amx(x, m, hidden, gate_up, down, inter, y, threads, s);
    const size_t mark = scratch_mark(s);
    void *owned;
    if (slotserve_kernel_isa() >= ISA_AVX512_BF16 && inter % 16 == 0) {
        uint16_t *xb = scratch_take(s, sizeof(uint16_t) * (size_t)(m * hidden), &owned);
        int status = -1;
        if (xb != NULL) {
            bf16_round(x, m * hidden, xb, threads);
            status = mlp_bf16_rows(xb, m, hidden, gate_up, down, inter, y, 0, threads, s);
        }
        free(owned);
        scratch_release(s, mark);
        return status;
    }
    float *wide = scratch_take(s, sizeof(float) * (size_t)(m * 3 * inter), &owned);
    int status = -1;
    if (wide != NULL &&
        slotserve_gemm_bf16(x, m, hidden, gate_up, 2 * inter, wide, threads, s) == 0) {
        float *act = wide + m * 2 * inter;
        const int isa = slotserve_kernel_isa();
        silu_mul_rows(wide, m, inter, act, threads,
                      !isa || inter % 8                      ? 0
                      : isa >= ISA_AVX512 && inter % 16 == 0 ? 2
                                                             : 1);
        status = slotserve_gemm_bf16(act, m, inter, down, hidden, y, threads, s);
    }
    free(owned);
    scratch_release(s, mark);
    return status;
}

int slotserve_gemm_q8(const float *x, int64_t m, int64_t k, const int8_t *w, const float *scale,
                      int64_t n, float *y, int threads, struct scratch *s) {
    struct weights weights = {Q8, w, scale, NULL};
    return slotserve_gemm_weights(x, m, k, weights, n, y, threads, s);
}

/* Whole weights back to fp32 (out: [N,K]), for products with many rows (prefill), where a
 * tuned fp32 GEMM beats streaming panels: the weights are then read once and the work is
 * compute-bound. */
void slotserve_dequantize(int kind, const void *data, const float *scale, const float *minimum,
                          int64_t n, int64_t k, float *out, int threads) {
    const int avx2 = slotserve_kernel_isa() && k % 8 == 0;
    const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t n0 = p * PANEL;
        const int64_t rows = n - n0 < PANEL ? n - n0 : PANEL;
        float *dst = out + n0 * k;
        if (kind == Q8) {
            const int8_t *q = (const int8_t *)data + n0 * k;
            const float *sc = scale + n0 * (k / GROUP);
            if (avx2 && rows == PANEL)
                unpack_q8_avx2(q, sc, k, dst);
            else
                unpack_q8_c(q, sc, k, rows, dst);
        } else {
            const int64_t groups = k / GROUP;
            const uint8_t *q = (const uint8_t *)data + n0 * (k / 2);
            const float *sc = scale + n0 * groups, *mn = minimum + n0 * groups;
            if (avx2 && rows == PANEL)
                unpack_q4_avx2(q, sc, mn, k, dst);
            else
                unpack_q4_c(q, sc, mn, k, rows, dst);
        }
    }
}

/* k must be a multiple of 32 (both quantized formats). */
int slotserve_gemm_q4(const float *x, int64_t m, int64_t k, const uint8_t *w, const float *scale,
                      const float *minimum, int64_t n, float *y, int threads, struct scratch *s) {
    struct weights weights = {Q4, w, scale, minimum};
    return slotserve_gemm_weights(x, m, k, weights, n, y, threads, s);
}
