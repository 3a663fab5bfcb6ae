/* Prefill attention on AMX tiles (TDPBF16PS), for bf16 steps on CPUs with AMX-BF16: the block of
 * attention_bf16.c (the same packed keys and values, queries and values rounded to bf16, every
 * sum in fp32), 32 queries a pass (two tiles) instead of eight queries a vector; the
 * probabilities are rounded before they are normalised and each output is scaled once after
 * (exponentials below).
 *
 * Why: on an Intel Xeon with AMX the prefill products already run on the tiles through oneDNN,
 * and the VDPBF16PS blocks were left with 44% of a 1,000-token prefill race's time (perf, 2 vCPUs,
 * 2026-12-06) where their multiply-adds are ~14% of the race's; vLLM's CPU backend runs its
 * prefill attention on the tiles too. A tile product multiplies 16 x 32 by 32 x 16 in one
 * instruction, sixteen times VDPBF16PS's work.
 *
 * The packed layouts are the tiles' as they are: kp[t / 16][d / 2][16][2] is, for 16 keys and
 * 16 dimension pairs, a B tile of 16 rows of 64 bytes (the keys' pairs side by side), and
 * vp[t / 2][d / 16][16][2] is, for 16 position pairs and 16 dimensions, a B tile whose rows are
 * d / 16 x 64 bytes apart. Queries (A: 16 rows of 32 dimensions) and probabilities (A: 16 rows
 * of 32 positions) are rows of bf16 in the work buffer; attention.c packs a chunk's keys and
 * values once for all its blocks.
 *
 * Linux lets a process use the tiles' 8 KB of state only once it asked (arch_prctl
 * ARCH_REQ_XCOMP_PERM, as oneDNN does); a CPU or kernel without them keeps the VDPBF16PS blocks. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gemm.h"

#define AMX_ROWS 32 /* queries a pass: two tiles of 16 */

static int amx_usable = -1; /* unknown until first asked */
static int amx_wanted = 1;  /* tests and benchmarks turn it off */

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

#define AMX_TARGET                                                                                 \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,"   \
                          "avx2")))

static int amx_probe(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return 0; /* AMX-BF16, AMX-TILE */
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* All eight tiles 16 rows of 64 bytes (a sum: 16 x 16 floats; an operand: 16 x 32 bf16): here
 * sums in 0-3, queries or probabilities in 4, keys or values in 5; gemm_amx.c's sums in 0-3,
 * rows in 4-5, weights in 6-7. */
AMX_TARGET void amx_tiles_configure(void) {
    struct tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
}

/* Scores of the 32 queries in qb (rows of d bf16: one tile's rows 0-15, the other's 16-31)
 * against `vectors` groups of 16 packed keys, two groups a pass, into scores (rows `stride`
 * floats apart): sums 0 / 1 the first 16 queries against groups g / g + 1, sums 2 / 3 the next
 * 16; each tile loaded feeds two products. */
AMX_TARGET static void tiles_score(const uint16_t *qb, const uint16_t *kp, int64_t d,
                                   int64_t vectors, float *scores, int64_t stride) {
    const int64_t steps = d / 32, group = (d / 2) * 32;
    for (int64_t g = 0; g < vectors; g += 2) {
        const int two = g + 1 < vectors;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps; s++) {
            const uint16_t *keys = kp + g * group + 512 * s;
            _tile_loadd(4, qb + 32 * s, d * 2);
            _tile_loadd(5, qb + 16 * d + 32 * s, d * 2);
            _tile_loadd(6, keys, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if (two) {
                _tile_loadd(7, keys + group, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        float *at = scores + 16 * g;
        _tile_stored(0, at, stride * 4);
        _tile_stored(2, at + 16 * stride, stride * 4);
        if (two) {
            _tile_stored(1, at + 16, stride * 4);
            _tile_stored(3, at + 16 * stride + 16, stride * 4);
        }
    }
}

/* The 32 queries' outputs (rows of d floats in acc): probabilities pb (rows `stride` bf16 apart)
 * over positions [0, span), span a multiple of 32, times the packed values; two groups of 16
 * dimensions a pass (d a multiple of 32), the sums laid out as tiles_score's. */
AMX_TARGET static void tiles_sum(const uint16_t *pb, const uint16_t *vp, int64_t stride, int64_t d,
                                 int64_t span, float *acc) {
    const int64_t groups = d / 16;
    for (int64_t j = 0; j < groups; j += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t t = 0; t < span; t += 32) {
            const uint16_t *values = vp + ((t / 2) * groups + j) * 32;
            _tile_loadd(4, pb + t, stride * 2);
            _tile_loadd(5, pb + 16 * stride + t, stride * 2);
            _tile_loadd(6, values, groups * 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            _tile_loadd(7, values + 32, groups * 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
        float *at = acc + 16 * j;
        _tile_stored(0, at, d * 4);
        _tile_stored(1, at + 16, d * 4);
        _tile_stored(2, at + 16 * d, d * 4);
        _tile_stored(3, at + 16 * d + 16, d * 4);
    }
}

int slotserve_kernel_amx(void) {
    if (amx_usable < 0) amx_usable = amx_probe();
    return amx_usable && amx_wanted && slotserve_kernel_isa() >= ISA_AVX512_BF16;
}

size_t attention_amx_work(int64_t d, int64_t longest) {
    const size_t stride = (size_t)((longest + 31) & ~(int64_t)31);
    /* qb: 32 * d bf16; pb: 32 * stride bf16; scores: 32 * stride floats; acc: 32 * d floats (in
     * floats, with room to align). */
    return (size_t)(AMX_ROWS * d) / 2 + (size_t)AMX_ROWS * stride / 2 + (size_t)AMX_ROWS * stride +
           (size_t)AMX_ROWS * (size_t)d + 32;
}

AMX_TARGET void attention_block_amx(const float *q, const uint16_t *kp, const uint16_t *vp,
                                    const int64_t *lens, int64_t r0, int64_t count, int64_t h,
                                    int64_t kv_heads, int64_t group, int64_t d, float scale,
                                    float *out, float *work) {
    const int64_t last = lens[r0 + count - 1];
    const int64_t stride = (last + 31) & ~(int64_t)31;
    uint16_t *qb = (uint16_t *)work;
    uint16_t *pb = qb + AMX_ROWS * d;
    float *scores = (float *)(((uintptr_t)(pb + AMX_ROWS * stride) + 63) & ~(uintptr_t)63);
    float *acc = scores + AMX_ROWS * stride;
    amx_tiles_configure();
    const int64_t queries = count * group;
    for (int64_t first = 0; first < queries; first += AMX_ROWS) {
        float *outs[AMX_ROWS];
        int64_t len[AMX_ROWS], upto = 0;
        const int64_t real = queries - first < AMX_ROWS ? queries - first : AMX_ROWS;
        for (int64_t i = 0; i < AMX_ROWS; i++) {
            uint16_t *qi_b = qb + i * d;
            if (i >= real) { /* past the last query: zeros, and results not written */
                memset(qi_b, 0, sizeof(uint16_t) * (size_t)d);
                len[i] = 0;
                continue;
            }
            const int64_t index = first + i;
            const int64_t r = r0 + index / group, g = index % group;
            const float *qi = q + ((r * kv_heads + h) * group + g) * d;
            for (int64_t j = 0; j < d; j += 32)
                _mm512_storeu_si512(qi_b + j,
                                    (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qi + j + 16),
                                                                 _mm512_loadu_ps(qi + j)));
            outs[i] = out + ((r * kv_heads + h) * group + g) * d;
            len[i] = lens[r];
            upto = len[i] > upto ? len[i] : upto;
        }
        tiles_score(qb, kp, d, (upto + 15) / 16, scores, stride);
        const int64_t span = (upto + 31) & ~(int64_t)31;
        float norm[AMX_ROWS];
        for (int64_t i = 0; i < AMX_ROWS; i++) {
            if (i < real)
                norm[i] =
                    bf16_exponentials(scores + i * stride, len[i], span, scale, pb + i * stride);
            else
                memset(pb + i * stride, 0, sizeof(uint16_t) * (size_t)span);
        }
        tiles_sum(pb, vp, stride, d, span, acc);
        for (int64_t i = 0; i < real; i++) {
            const __m512 by = _mm512_set1_ps(norm[i]);
            for (int64_t j = 0; j < d; j += 16)
                _mm512_storeu_ps(outs[i] + j, _mm512_mul_ps(_mm512_loadu_ps(acc + i * d + j), by));
        }
    }
    _tile_release();
}
#else
void amx_tiles_configure(void) {}
int slotserve_kernel_amx(void) {
    amx_usable = 0;
    return 0;
}
size_t attention_amx_work(int64_t d, int64_t longest) {
    (void)d, (void)longest;
    return 0;
}
void attention_block_amx(const float *q, const uint16_t *kp, const uint16_t *vp,
                         const int64_t *lens, int64_t r0, int64_t count, int64_t h,
                         int64_t kv_heads, int64_t group, int64_t d, float scale, float *out,
                         float *work) {
    (void)q, (void)kp, (void)vp, (void)lens, (void)r0, (void)count, (void)h;
    (void)kv_heads, (void)group, (void)d, (void)scale, (void)out, (void)work;
}
#endif

int slotserve_kernel_set_amx(int enabled) {
    amx_wanted = enabled != 0;
    return slotserve_kernel_amx();
}
