/* Decode attention over the slot cache: one query token per row, against that row's cache up
 * to lens[row] positions, read in place (no gathered copy of the keys and values).
 *
 * Why its own code: torch ran it as five small ops a layer, each waking the thread team (1-2 ms
 * a layer under load). A first version here, one query head at a time with a horizontal sum
 * per key and an expf per score, still took 0.8 ms a SmolLM2 step at 128 positions: a fifth of
 * a 4-row fp32 step. This one, per (row, kv head), scores 4 keys per horizontal sum for every
 * query head of the group, takes the softmax with a vectorised exp, and sums the values 8
 * dimensions at a time with the accumulators in registers.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qgemm.h"

/* Element i of a cache row: a float, or the fp16 bits of one (kv_half.c). */
static inline float cached(const void *row, int64_t i, int half) {
    return half ? half_value(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* The plain C version (no AVX2, or d not a multiple of 8): the reference the tests compare. */
static void head_c(const float *query, const void *keys, const void *values, int half, int64_t len,
                   int64_t d, int64_t group, float scale, float *scores, float *dst) {
    for (int64_t g = 0; g < group; g++) {
        const float *qg = query + g * d;
        float *sc = scores + g * len, *out = dst + g * d;
        float top = -INFINITY;
        for (int64_t t = 0; t < len; t++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < d; j++) acc += qg[j] * cached(keys, t * d + j, half);
            sc[t] = scale * acc;
            top = sc[t] > top ? sc[t] : top;
        }
        float total = 0.0f;
        for (int64_t t = 0; t < len; t++) total += sc[t] = expf(sc[t] - top);
        const float norm = 1.0f / total;
        memset(out, 0, sizeof(float) * (size_t)d);
        for (int64_t t = 0; t < len; t++)
            for (int64_t j = 0; j < d; j++)
                out[j] += sc[t] * norm * cached(values, t * d + j, half);
    }
}

/* Rows of one chunk taken together per kv head (below); the bf16 blocks read their chunk's keys
 * and values packed once (pack_chunks), and take more rows a block (the tiles, 32 queries a
 * pass, want them). */
#define CHUNK_ROWS 32
#define BF16_CHUNK_ROWS 128

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_AVX2_CODE 1

/* Softmax of sc[0, len) in place. */
__attribute__((target("avx2,fma"))) static void softmax_avx2(float *sc, int64_t len) {
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(sc + t));
    float top = -INFINITY;
    for (int i = 0; i < 8; i++) top = fmaxf(top, ((float *)&top8)[i]);
    for (; t < len; t++) top = fmaxf(top, sc[t]);
    const __m256 vtop = _mm256_set1_ps(top);
    __m256 total8 = _mm256_setzero_ps();
    for (t = 0; t + 8 <= len; t += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sc + t), vtop));
        _mm256_storeu_ps(sc + t, e);
        total8 = _mm256_add_ps(total8, e);
    }
    float total = hsum(total8);
    for (; t < len; t++) total += sc[t] = expf(sc[t] - top);
    const __m256 norm = _mm256_set1_ps(1.0f / total);
    for (t = 0; t + 8 <= len; t += 8)
        _mm256_storeu_ps(sc + t, _mm256_mul_ps(_mm256_loadu_ps(sc + t), norm));
    for (; t < len; t++) sc[t] *= 1.0f / total;
}

/* softmax_avx2 16 lanes wide, its tail masked (not expf): the fp16 decode head's (it was the
 * bf16 blocks' too, a quarter of their time on a Zen 5 at ~1,000 positions, until they took
 * qgemm.h's bf16_exponentials). */
__attribute__((target("avx512f"))) static void softmax_avx512(float *sc, int64_t len) {
    const int64_t whole = len & ~(int64_t)15;
    const __mmask16 tail = (__mmask16)((1u << (len - whole)) - 1);
    __m512 top16 = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < whole; t += 16) top16 = _mm512_max_ps(top16, _mm512_loadu_ps(sc + t));
    top16 = _mm512_mask_max_ps(top16, tail, top16, _mm512_maskz_loadu_ps(tail, sc + whole));
    const __m512 vtop = _mm512_set1_ps(_mm512_reduce_max_ps(top16));
    __m512 total16 = _mm512_setzero_ps();
    for (int64_t t = 0; t < whole; t += 16) {
        const __m512 e = exp_nonpositive512(_mm512_sub_ps(_mm512_loadu_ps(sc + t), vtop));
        _mm512_storeu_ps(sc + t, e);
        total16 = _mm512_add_ps(total16, e);
    }
    const __m512 e =
        exp_nonpositive512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sc + whole), vtop));
    _mm512_mask_storeu_ps(sc + whole, tail, e);
    total16 = _mm512_mask_add_ps(total16, tail, total16, e);
    const __m512 norm = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total16));
    for (int64_t t = 0; t < whole; t += 16)
        _mm512_storeu_ps(sc + t, _mm512_mul_ps(_mm512_loadu_ps(sc + t), norm));
    _mm512_mask_storeu_ps(sc + whole, tail,
                          _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, sc + whole), norm));
}

/* 8 elements of a cache row from element i on: floats, or fp16 bits widened (F16C). */
__attribute__((target("avx2,fma,f16c"))) static inline __attribute__((always_inline)) __m256
load8(const void *row, int64_t i, const int half) {
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    return _mm256_loadu_ps((const float *)row + i);
}

/* d a multiple of 8; keys and values floats, or fp16 when `half` (a constant in each caller). */
__attribute__((target("avx2,fma,f16c"))) static inline __attribute__((always_inline)) void
head_avx2_of(const float *query, const void *keys, const void *values, int64_t len, int64_t d,
             int64_t group, float scale, float *scores, float *dst, const int half) {
    const __m128 vscale = _mm_set1_ps(scale);
    int64_t t = 0;
    for (; t + 4 <= len; t += 4) {
        const int64_t k0 = t * d, k1 = k0 + d, k2 = k1 + d, k3 = k2 + d;
        int64_t g = 0;
        /* Two query heads at a time: each key vector loaded once serves both (8 accumulators,
         * 6 loads per 8 multiply-adds; one head alone does 5 per 4). */
        for (; g + 2 <= group; g += 2) {
            const float *qa = query + g * d, *qb = qa + d;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t j = 0; j < d; j += 8) {
                const __m256 va = _mm256_loadu_ps(qa + j), vb = _mm256_loadu_ps(qb + j);
                __m256 kv = load8(keys, k0 + j, half);
                a0 = _mm256_fmadd_ps(va, kv, a0), b0 = _mm256_fmadd_ps(vb, kv, b0);
                kv = load8(keys, k1 + j, half);
                a1 = _mm256_fmadd_ps(va, kv, a1), b1 = _mm256_fmadd_ps(vb, kv, b1);
                kv = load8(keys, k2 + j, half);
                a2 = _mm256_fmadd_ps(va, kv, a2), b2 = _mm256_fmadd_ps(vb, kv, b2);
                kv = load8(keys, k3 + j, half);
                a3 = _mm256_fmadd_ps(va, kv, a3), b3 = _mm256_fmadd_ps(vb, kv, b3);
            }
            _mm_storeu_ps(scores + g * len + t, _mm_mul_ps(hsum4(a0, a1, a2, a3), vscale));
            _mm_storeu_ps(scores + (g + 1) * len + t, _mm_mul_ps(hsum4(b0, b1, b2, b3), vscale));
        }
        for (; g < group; g++) {
            const float *qg = query + g * d;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t j = 0; j < d; j += 8) {
                const __m256 qv = _mm256_loadu_ps(qg + j);
                a0 = _mm256_fmadd_ps(qv, load8(keys, k0 + j, half), a0);
                a1 = _mm256_fmadd_ps(qv, load8(keys, k1 + j, half), a1);
                a2 = _mm256_fmadd_ps(qv, load8(keys, k2 + j, half), a2);
                a3 = _mm256_fmadd_ps(qv, load8(keys, k3 + j, half), a3);
            }
            _mm_storeu_ps(scores + g * len + t, _mm_mul_ps(hsum4(a0, a1, a2, a3), vscale));
        }
    }
    for (; t < len; t++) {
        for (int64_t g = 0; g < group; g++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t j = 0; j < d; j += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(query + g * d + j),
                                      load8(keys, t * d + j, half), acc);
            scores[g * len + t] = scale * hsum(acc);
        }
    }
    for (int64_t g = 0; g < group; g++) softmax_avx2(scores + g * len, len);
    /* Values: up to 64 dimensions at a time in registers (8 accumulators), every position
     * once per block: one broadcast of its weight serves 8 loads and multiply-adds (a block of 8
     * dimensions at a time paid a broadcast per multiply-add). */
    for (int64_t g = 0; g < group; g++) {
        const float *p = scores + g * len;
        float *out = dst + g * d;
        int64_t j = 0;
        for (; j + 64 <= d; j += 64) {
            __m256 acc[8];
            for (int b = 0; b < 8; b++) acc[b] = _mm256_setzero_ps();
            for (int64_t s = 0; s < len; s++) {
                const __m256 weight = _mm256_set1_ps(p[s]);
                const int64_t row = s * d + j;
                for (int b = 0; b < 8; b++)
                    acc[b] = _mm256_fmadd_ps(weight, load8(values, row + 8 * b, half), acc[b]);
            }
            for (int b = 0; b < 8; b++) _mm256_storeu_ps(out + j + 8 * b, acc[b]);
        }
        for (; j < d; j += 8) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0;
            int64_t s = 0;
            for (; s + 2 <= len; s += 2) {
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[s]), load8(values, s * d + j, half), a0);
                a1 = _mm256_fmadd_ps(_mm256_set1_ps(p[s + 1]), load8(values, (s + 1) * d + j, half),
                                     a1);
            }
            for (; s < len; s++)
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[s]), load8(values, s * d + j, half), a0);
            _mm256_storeu_ps(out + j, _mm256_add_ps(a0, a1));
        }
    }
}

__attribute__((target("avx2,fma,f16c"))) static void
head_avx2(const float *query, const void *keys, const void *values, int half, int64_t len,
          int64_t d, int64_t group, float scale, float *scores, float *dst) {
    if (half)
        head_avx2_of(query, keys, values, len, d, group, scale, scores, dst, 1);
    else
        head_avx2_of(query, keys, values, len, d, group, scale, scores, dst, 0);
}
#else
#define HAVE_AVX2_CODE 0
static void softmax_avx2(float *sc, int64_t len) { (void)sc, (void)len; }
static void softmax_avx512(float *sc, int64_t len) { (void)sc, (void)len; }
static void head_avx2(const float *query, const void *keys, const void *values, int half,
                      int64_t len, int64_t d, int64_t group, float scale, float *scores,
                      float *dst) {
    head_c(query, keys, values, half, len, d, group, scale, scores, dst);
}
#endif

/* Rows taken together: a block of up to CHUNK_ROWS rows of one chunk (count > 1), or one row. */
struct span {
    int64_t first, count;
    int64_t chunk; /* which chunk's packed keys a span of several rows reads; -1 for one row */
};

/* Rows r and r + 1 are neighbours in one chunk: the same slot, the next position. */
static int same_chunk(const int64_t *slots, const int64_t *lens, int64_t r) {
    return slots != NULL && slots[r] == slots[r + 1] && lens[r + 1] == lens[r] + 1;
}

/* Where a chunk's keys and values, packed for its blocks, are (per kv head): bf16 (uint16_t) for
 * the bf16 blocks, floats for the fp32 ones. */
struct kv_pack {
    void *kp, *vp;
};

/* Every chunk's keys and values, per kv head, packed once for all the chunk's spans, for the
 * bf16 blocks (attention_bf16_pack) or, with `fp32`, the fp32 ones (attention_block_pack): a
 * 1,000-row chunk in spans of 128 rows packed positions [0, 128), [0, 256), ... again for each
 * span, ~4.5x its length, with an fp16 cache widened first. Returns the packs ([chunk *
 * kv_heads + head]) in one buffer (*owned to free), or NULL when out of memory. */
static struct kv_pack *pack_chunks(const void *k, const void *v, int kv_half, int fp32,
                                   const struct span *spans, int64_t num_spans, int64_t chunks,
                                   const int64_t *slots, const int64_t *lens, int64_t kv_heads,
                                   int64_t d, int64_t max_len, int team, struct scratch *s,
                                   void **owned) {
    const size_t element = kv_half ? sizeof(uint16_t) : sizeof(float);
    /* A packed key or value: bf16, or fp32 (twice the room, counted in uint16_t). */
    const int64_t unit = fp32 ? 2 : 1;
    int64_t *last = NULL, *slot = NULL, total = 0, widest = 0;
    size_t bytes =
        sizeof(struct kv_pack) * (size_t)(chunks * kv_heads) + 2 * sizeof(int64_t) * (size_t)chunks;
    char *base = NULL;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) {
            /* The bf16 packing's rows: a thread's chunk rounded to bf16 before the gather. */
            const int64_t rows = fp32 ? 0 : team * d * widest;
            bytes += sizeof(uint16_t) * (size_t)(2 * unit * d * total * kv_heads + rows);
            base = scratch_take(s, bytes + 64, owned); /* 64: room to align the data */
            if (base == NULL) return NULL;
            last = (int64_t *)(base + sizeof(struct kv_pack) * (size_t)(chunks * kv_heads));
            slot = last + chunks;
        }
        for (int64_t i = 0; i < num_spans; i++) {
            if (spans[i].chunk < 0) continue;
            const int64_t end = lens[spans[i].first + spans[i].count - 1];
            const int64_t stride = (end + 31) & ~(int64_t)31;
            if (pass == 0) {
                /* A chunk's spans come in order: its last span's end is its stride. */
                if (i + 1 == num_spans || spans[i + 1].chunk != spans[i].chunk) total += stride;
                widest = stride > widest ? stride : widest;
            } else {
                last[spans[i].chunk] = end;
                slot[spans[i].chunk] = slots[spans[i].first];
            }
        }
    }
    struct kv_pack *packs = (struct kv_pack *)base;
    uint16_t *data = (uint16_t *)(((uintptr_t)(slot + chunks) + 63) & ~(uintptr_t)63);
    for (int64_t c = 0; c < chunks; c++)
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t stride = (last[c] + 31) & ~(int64_t)31;
            packs[c * kv_heads + h] = (struct kv_pack){data, data + unit * d * stride};
            data += 2 * unit * d * stride;
        }
    uint16_t *rows = data;
#pragma omp parallel for num_threads(team) schedule(dynamic, 1)
    for (int64_t task = 0; task < chunks * kv_heads; task++) {
        const int64_t c = task / kv_heads, h = task % kv_heads;
        const int64_t at = (slot[c] * kv_heads + h) * max_len * d;
        const void *keys = (const char *)k + element * (size_t)at;
        const void *values = (const char *)v + element * (size_t)at;
        const int64_t stride = (last[c] + 31) & ~(int64_t)31;
        if (fp32) {
            attention_block_pack(keys, values, kv_half, last[c], stride, d, packs[task].kp,
                                 packs[task].vp);
            continue;
        }
        uint16_t *mine = rows + (int64_t)omp_get_thread_num() * d * widest;
        attention_bf16_pack(keys, values, kv_half, last[c], stride, d, packs[task].kp,
                            packs[task].vp, mine);
    }
    return packs;
}

int slotserve_attend(const float *q, const void *k, const void *v, int kv_half, int64_t rows,
                     const int64_t *slots, int64_t kv_heads, int64_t group, int64_t d,
                     int64_t max_len, const int64_t *lens, float scale, float *out, int threads,
                     struct scratch *s) {
    return attend_rows(q, k, v, kv_half, rows, slots, kv_heads, group, d, max_len, lens, scale, out,
                       threads, s, 0);
}

int slotserve_attend_bf16(const float *q, const void *k, const void *v, int kv_half, int64_t rows,
                          const int64_t *slots, int64_t kv_heads, int64_t group, int64_t d,
                          int64_t max_len, const int64_t *lens, float scale, float *out,
                          int threads, struct scratch *s) {
    return attend_rows(q, k, v, kv_half, rows, slots, kv_heads, group, d, max_len, lens, scale, out,
                       threads, s, 1);
}

int attend_rows(const float *q, const void *k, const void *v, int kv_half, int64_t rows,
                const int64_t *slots, int64_t kv_heads, int64_t group, int64_t d, int64_t max_len,
                const int64_t *lens, float scale, float *out, int threads, struct scratch *s,
                int bf16) {
    const int avx2 = HAVE_AVX2_CODE && slotserve_kernel_isa() && d % 8 == 0;
    /* Chunks' rows go in blocks (attention_block.c) wherever AVX2 runs; 512 bits wide with
     * AVX-512 and d a multiple of 16. */
    const int avx512 = avx2 && slotserve_kernel_isa() >= ISA_AVX512 && d % 16 == 0;
    bf16 = bf16 && avx512 && d % 32 == 0 && slotserve_kernel_isa() >= ISA_AVX512_BF16;
    const int amx = bf16 && slotserve_kernel_amx();
    const size_t element = kv_half ? sizeof(uint16_t) : sizeof(float);
    int64_t longest = 1, work = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t len = lens[r] < max_len ? lens[r] : max_len;
        longest = len > longest ? len : longest;
        work += len > 0 ? len : 0;
    }
    work *= kv_heads * group * d;
    /* Below ~128K multiply-adds a second thread costs more to wake than it saves (with the
     * engine's spinning OpenMP workers; the first version's 1M kept a 4-row step at 128
     * positions on one thread). */
    const int team = work < (1 << 17) ? 1 : threads;
    /* Each thread's scores for one (row, kv head): group * longest floats; for blocks, what
     * attention_block_work (or the bf16 blocks' work) says. */
    size_t floats = (size_t)(group * longest);
    if (avx2) {
        const size_t block = amx    ? attention_amx_work(d, longest)
                             : bf16 ? attention_bf16_work(d, longest)
                                    : attention_block_work(d, longest);
        floats = block > floats ? block : floats;
    }
    const size_t per_thread = (sizeof(float) * floats + 63) & ~(size_t)63;
    const size_t mark = scratch_mark(s);
    void *owned[3] = {NULL};
    char *all_scores = scratch_take(s, per_thread * (size_t)team, &owned[0]);
    struct span *spans = scratch_take(s, sizeof(struct span) * (size_t)rows, &owned[1]);
    int status = -1;
    if (all_scores == NULL || spans == NULL) goto done;
    int64_t num_spans = 0, chunks = 0;
    for (int64_t r = 0; r < rows;) {
        int64_t count = 1;
        while (avx2 && count < (bf16 ? BF16_CHUNK_ROWS : CHUNK_ROWS) && r + count < rows &&
               lens[r + count] <= max_len && same_chunk(slots, lens, r + count - 1))
            count++;
        /* A span that goes on where the last one stopped shares its chunk's packed keys. */
        const int more = num_spans > 0 && spans[num_spans - 1].count > 1 && count > 1 &&
                         same_chunk(slots, lens, r - 1);
        if (count > 1 && !more) chunks++;
        spans[num_spans++] = (struct span){r, count, count > 1 ? chunks - 1 : -1};
        r += count;
    }
    /* Each chunk's keys and values packed once per kv head, for all its spans. */
    struct kv_pack *packs = NULL;
    if (chunks > 0) {
        packs = pack_chunks(k, v, kv_half, !bf16, spans, num_spans, chunks, slots, lens, kv_heads,
                            d, max_len, team, s, &owned[2]);
        if (packs == NULL) goto done;
    }
#pragma omp parallel num_threads(team)
    {
        float *scores = (float *)(all_scores + per_thread * (size_t)omp_get_thread_num());
#pragma omp for schedule(dynamic, 1)
        for (int64_t next = 0; next < num_spans * kv_heads; next++) {
            /* The last spans of a chunk first: they see the most positions, and the shortest
             * tasks last leave the threads least time idle at the end. */
            const int64_t task = num_spans * kv_heads - 1 - next;
            const struct span span = spans[task / kv_heads];
            const int64_t r = span.first, h = task % kv_heads;
            const int64_t slot = slots == NULL ? r : slots[r];
            const int64_t at = (slot * kv_heads + h) * max_len * d;
            const void *keys = (const char *)k + element * (size_t)at;
            const void *values = (const char *)v + element * (size_t)at;
            if (span.count > 1 && bf16) {
                const struct kv_pack *pack = &packs[span.chunk * kv_heads + h];
                if (amx)
                    attention_block_amx(q, pack->kp, pack->vp, lens, r, span.count, h, kv_heads,
                                        group, d, scale, out, scores);
                else
                    attention_block_bf16(q, pack->kp, pack->vp, lens, r, span.count, h, kv_heads,
                                         group, d, scale, out, scores);
                continue;
            }
            if (span.count > 1) {
                const struct kv_pack *pack = &packs[span.chunk * kv_heads + h];
                /* 16 lanes where the blocks run 16 (4% of an fp32-attention prefill in 8) */
                attention_block_f32(avx512, q, pack->kp, pack->vp, lens, r, span.count, h, kv_heads,
                                    group, d, scale, out, scores,
                                    avx512 ? softmax_avx512 : softmax_avx2);
                continue;
            }
            const int64_t len = lens[r] < max_len ? lens[r] : max_len;
            const float *query = q + (r * kv_heads + h) * group * d;
            float *dst = out + (r * kv_heads + h) * group * d;
            if (len <= 0) {
                memset(dst, 0, sizeof(float) * (size_t)(group * d));
                continue;
            }
            if (kv_half && avx512)
                decode_head_half512(query, keys, values, len, d, group, scale, scores, dst,
                                    softmax_avx512);
            else if (avx2)
                head_avx2(query, keys, values, kv_half, len, d, group, scale, scores, dst);
            else
                head_c(query, keys, values, kv_half, len, d, group, scale, scores, dst);
        }
    }
    status = 0;
done:
    for (int i = 0; i < 3; i++) free(owned[i]);
    scratch_release(s, mark);
    return status;
}

int slotserve_decode_attention(const float *q, const void *k, const void *v, int kv_half,
                               int64_t rows, int64_t kv_heads, int64_t group, int64_t d,
                               int64_t max_len, const int64_t *lens, float scale, float *out,
                               int threads, struct scratch *s) {
    return slotserve_attend(q, k, v, kv_half, rows, NULL, kv_heads, group, d, max_len, lens, scale,
                            out, threads, s);
}
