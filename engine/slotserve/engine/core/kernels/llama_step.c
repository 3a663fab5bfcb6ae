/* A whole decode step of a Llama-style decoder in one call: every layer, for a few rows.
 *
 * Why: at batch 1 the products of a step stream the weights in about 36 ms (fp32) or 12 ms
 * (int4) on the machines we target, while the same step through the transformers modules took
 * 60 ms or 33 ms: some 15-25 ms went to the ~15 torch ops per layer around the products (each a
 * dispatch, an allocation, a wake-up of the thread team). Here the small ops (RMSNorm, rotary
 * embedding, the cache write, SiLU * up, the residual adds) run inline on the calling thread:
 * a few thousand floats each. Only the products and, with enough work, attention use the team.
 *
 * The layer is transformers' LlamaDecoderLayer: h = x + o(attn(rope(qkv(norm1(x)))));
 * x' = h + down(silu(gate(norm2(h))) * up(norm2(h))). q/k/v and gate/up are fused products
 * (q, k, v and gate, up stacked along the output channels). The rotary cos/sin per row come from
 * the model's own rotary module, so every rope scaling transformers knows is honoured.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qgemm.h"

enum { QKV, O, GATE_UP, DOWN, PRODUCTS };

/* From this many rows (prefill chunks) the per-row work between the products (norms, rotary
 * embedding and cache writes, SiLU * up, residual adds) is spread over the thread team; below
 * it stays on the calling thread, where a decode step's few rows cost less than a wake-up. */
#define SPREAD_ROWS 64
/* From this many rows a bf16 step's int8/int4 products widen their weights to bf16 per task
 * (quantized_bf16.c); below it the fp32 panels keep them (at one row the int4 product's int16
 * pairs stream the weights in half the time). SmolLM2's 120 int4 products of a step, weights
 * from memory, 2-core Zen 4: fp32 panels / widened to bf16 5.4 / 12.2 ms at 1 row, 16.2 / 15.6
 * at 8, 19.8 / 17.2 at 12, 25.3 / 19.3 at 16, 55.4 / 35.5 at 32. */
#define QUANTIZED_BF16_ROWS 12

struct step_layer {
    int64_t kind[PRODUCTS]; /* enum kind */
    const void *data[PRODUCTS];
    const float *scale[PRODUCTS];
    const float *minimum[PRODUCTS];
    const float *bias[PRODUCTS];      /* NULL: none */
    const float *input_norm;          /* [hidden] */
    const float *post_attention_norm; /* [hidden] */
    void *k_cache;                    /* [slots, kv_heads, max_len, head_dim]: float, or */
    void *v_cache;                    /* fp16 bits when step_model.kv_half */
};

struct step_model {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, max_len;
    float eps, scale;
    const float *final_norm;
    const struct step_layer *layers;
    /* NULL, or the caller's product for steps of wide_rows rows and more (kernels.h). */
    slotserve_wide_product wide;
    int64_t wide_rows;
    /* Nonzero: prefill blocks of attention in bf16 (a step whose products are bf16). */
    int64_t bf16_attention;
    /* Nonzero: the caches hold fp16 (kv_half.c). */
    int64_t kv_half;
    /* Nonzero: products of QUANTIZED_BF16_ROWS rows or more on int8/int4 weights take their rows
     * in bf16 (quantized_bf16.c): a quantized model's prefill steps where the CPU has
     * AVX512_BF16. */
    int64_t bf16_quantized;
};

static void rms_norm_c(const float *x, const float *weight, int64_t n, float eps, float *out) {
    float total = 0.0f;
    for (int64_t j = 0; j < n; j++) total += x[j] * x[j];
    const float inv = 1.0f / sqrtf(total / (float)n + eps);
    for (int64_t j = 0; j < n; j++) out[j] = weight[j] * (x[j] * inv);
}

/* out = silu(gate) * up = gate * sigmoid(gate) * up. */
static void silu_mul_c(const float *gate, const float *up, int64_t n, float *out) {
    for (int64_t j = 0; j < n; j++) out[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
}

#if defined(__x86_64__) || defined(__i386__)
/* The AVX2 versions (n a multiple of 8): at 4 rows, the scalar SiLU's expf alone took ~1 ms of a
 * SmolLM2 step (184K calls). */
__attribute__((target("avx2,fma"))) static float inverse_rms_avx2(const float *x, int64_t n,
                                                                  float eps) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    return 1.0f / sqrtf(hsum(acc) / (float)n + eps);
}

__attribute__((target("avx2,fma"))) static void rms_norm_avx2(const float *x, const float *weight,
                                                              int64_t n, float eps, float *out) {
    const __m256 inv = _mm256_set1_ps(inverse_rms_avx2(x, n, eps));
    for (int64_t j = 0; j < n; j += 8)
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_loadu_ps(weight + j),
                                                _mm256_mul_ps(_mm256_loadu_ps(x + j), inv)));
}

/* sigmoid(g) from e = exp(-|g|) <= 1: 1 / (1 + e) for g >= 0, e / (1 + e) below. */
__attribute__((target("avx2,fma"))) static void silu_mul_avx2(const float *gate, const float *up,
                                                              int64_t n, float *out) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    for (int64_t j = 0; j < n; j += 8) {
        const __m256 g = _mm256_loadu_ps(gate + j);
        const __m256 e = exp_nonpositive(_mm256_or_ps(g, sign)); /* -|g| */
        const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
        const __m256 sigmoid =
            _mm256_div_ps(_mm256_blendv_ps(one, e, negative), _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + j,
                         _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + j)));
    }
}

/* silu_mul_avx2 16 lanes wide (the same operations lane by lane, so the same results), n a
 * multiple of 16: a twentieth of a 1,000-token prefill on a Zen 5 in 8 lanes. */
__attribute__((target("avx512f,avx512dq"))) static void
silu_mul_avx512(const float *gate, const float *up, int64_t n, float *out) {
    for (int64_t j = 0; j < n; j += 16)
        _mm512_storeu_ps(out + j, silu_mul16(_mm512_loadu_ps(gate + j), _mm512_loadu_ps(up + j)));
}
#define HAVE_AVX2_CODE 1
#else
#define HAVE_AVX2_CODE 0
static void silu_mul_avx512(const float *gate, const float *up, int64_t n, float *out) {
    silu_mul_c(gate, up, n, out);
}
static void rms_norm_avx2(const float *x, const float *weight, int64_t n, float eps, float *out) {
    rms_norm_c(x, weight, n, eps, out);
}
static float inverse_rms_avx2(const float *x, int64_t n, float eps) {
    (void)x, (void)n, (void)eps;
    return 0.0f; /* never taken: the fused layers need AVX512_BF16 */
}
static void silu_mul_avx2(const float *gate, const float *up, int64_t n, float *out) {
    silu_mul_c(gate, up, n, out);
}
#endif

void silu_mul_rows(const float *wide, int64_t m, int64_t inter, float *act, int threads,
                   int vector) {
#pragma omp parallel for num_threads(threads) if (m >= SPREAD_ROWS)
    for (int64_t i = 0; i < m; i++) {
        const float *gate = wide + i * 2 * inter, *up = gate + inter;
        if (vector == 2)
            silu_mul_avx512(gate, up, inter, act + i * inter);
        else if (vector == 1)
            silu_mul_avx2(gate, up, inter, act + i * inter);
        else
            silu_mul_c(gate, up, inter, act + i * inter);
    }
}

static void rms_norm(const float *x, const float *weight, int64_t n, float eps, float *out,
                     int avx2) {
    if (avx2)
        rms_norm_avx2(x, weight, n, eps, out);
    else
        rms_norm_c(x, weight, n, eps, out);
}

/* transformers' rotate_half convention: pairs are (j, j + d/2). */
static void rope_c(float *head, const float *cos, const float *sin, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t j = 0; j < half; j++) {
        const float a = head[j], b = head[j + half];
        head[j] = a * cos[j] - b * sin[j];
        head[j + half] = b * cos[j + half] + a * sin[j + half];
    }
}

#if HAVE_AVX2_CODE
/* rope_c 16 pairs at a time (d a multiple of 32), each product and sum rounded as rope_c's (no
 * fused multiply-add): the same results. Compiled for no particular CPU, rope_c ran 4 lanes. */
__attribute__((target("avx512f"))) static void rope_avx512(float *head, const float *cos,
                                                           const float *sin, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t j = 0; j < half; j += 16) {
        const __m512 a = _mm512_loadu_ps(head + j), b = _mm512_loadu_ps(head + j + half);
        _mm512_storeu_ps(head + j, _mm512_sub_ps(_mm512_mul_ps(a, _mm512_loadu_ps(cos + j)),
                                                 _mm512_mul_ps(b, _mm512_loadu_ps(sin + j))));
        _mm512_storeu_ps(head + j + half,
                         _mm512_add_ps(_mm512_mul_ps(b, _mm512_loadu_ps(cos + j + half)),
                                       _mm512_mul_ps(a, _mm512_loadu_ps(sin + j + half))));
    }
}
#else
static void rope_avx512(float *head, const float *cos, const float *sin, int64_t d) {
    rope_c(head, cos, sin, d);
}
#endif

static void rope(float *head, const float *cos, const float *sin, int64_t d, int wide) {
    if (wide)
        rope_avx512(head, cos, sin, d);
    else
        rope_c(head, cos, sin, d);
}

/* The caller's bf16 product (kernels.h's slotserve_wide_product): the rows rounded to bf16,
 * padded with zero rows to a multiple of 16 (oneDNN builds a kernel per shape), the result
 * widened into y. */
static int wide_product(const struct step_model *model, int64_t l, int which, const float *x,
                        int64_t m, int64_t k, int64_t n, float *y, int threads, struct scratch *s) {
    const int64_t rows = (m + 15) & ~(int64_t)15;
    const size_t mark = scratch_mark(s);
    void *owned[2] = {NULL};
    uint16_t *xb = scratch_take(s, sizeof(uint16_t) * (size_t)(rows * k), &owned[0]);
    uint16_t *yb = scratch_take(s, sizeof(uint16_t) * (size_t)(rows * n), &owned[1]);
    int status = -1;
    if (xb != NULL && yb != NULL) {
        bf16_round(x, m * k, xb, threads);
        memset(xb + m * k, 0, sizeof(uint16_t) * (size_t)((rows - m) * k));
        if (model->wide(l, which, xb, rows, k, yb, n) == 0) {
            bf16_widen(yb, m * n, y, threads);
            status = 0;
        }
    }
    free(owned[0]), free(owned[1]);
    scratch_release(s, mark);
    return status;
}

static void add_bias(const float *bias, float *y, int64_t m, int64_t n) {
    if (bias != NULL)
        for (int64_t i = 0; i < m; i++)
            for (int64_t c = 0; c < n; c++) y[i * n + c] += bias[c];
}

static int product(const struct step_model *model, int64_t l, int which, const float *x, int64_t m,
                   int64_t k, int64_t n, float *y, int threads, struct scratch *s) {
    const struct step_layer *layer = &model->layers[l];
    if (model->wide != NULL && m >= model->wide_rows) {
        if (wide_product(model, l, which, x, m, k, n, y, threads, s) != 0) return -1;
    } else {
        struct weights w = {(enum kind)layer->kind[which], layer->data[which], layer->scale[which],
                            layer->minimum[which]};
        const int quantized = w.kind == Q8 || w.kind == Q4;
        if (model->bf16_quantized && quantized && m >= QUANTIZED_BF16_ROWS && k % 32 == 0) {
            if (gemm_quantized_bf16(x, m, k, w, n, y, threads, s) != 0) return -1;
        } else if (slotserve_gemm_weights(x, m, k, w, n, y, threads, s) != 0) {
            return -1;
        }
    }
    add_bias(layer->bias[which], y, m, n);
    return 0;
}

/* Whether the whole layer runs on the AMX tiles with its rows laid out as the tiles read them
 * (gemm_amx.c): bf16 weights, no bias but q/k/v's, shapes the tiles take, rows enough for them,
 * and no caller's product in their place. Then the norms write bf16 tiles, not fp32 rows, the
 * MLP is one fused call (silu(gate) * up goes to the down product as bf16 tiles), and the o and
 * down products add themselves to the residual stream: four passes over [m, hidden] or wider a
 * layer fewer. */
static int layer_on_tiles(const struct step_model *model, const struct step_layer *layer,
                          int64_t m) {
    for (int which = 0; which < PRODUCTS; which++)
        if (layer->kind[which] != BF16 || (which != QKV && layer->bias[which] != NULL)) return 0;
    const int64_t nq = model->heads * model->head_dim;
    const int64_t nqkv = nq + 2 * model->kv_heads * model->head_dim;
    return !(model->wide != NULL && m >= model->wide_rows) && m >= AMX_GEMM_ROWS &&
           model->hidden % 32 == 0 && model->intermediate % 32 == 0 && nq % 32 == 0 &&
           nqkv % 16 == 0 && slotserve_kernel_amx();
}

/* Rows [0, m) of x RMS-normed straight into the A tiles xt (no fp32 copy of the normed rows),
 * the rows up to the next 32 zeros. */
static void norm_to_tiles(const float *x, const float *weight, int64_t m, int64_t hidden, float eps,
                          uint16_t *xt, int threads) {
    const int64_t rows = (m + 31) & ~(int64_t)31;
#pragma omp parallel for num_threads(threads) if (m >= SPREAD_ROWS)
    for (int64_t i = 0; i < rows; i++) {
        if (i >= m) {
            amx_row_to_tiles(NULL, NULL, 1, i, hidden, xt);
            continue;
        }
        const float *row = x + i * hidden;
        amx_row_to_tiles(row, weight, inverse_rms_avx2(row, hidden, eps), i, hidden, xt);
    }
}

/* Whether the step's layers are fused (layer_on_tiles, layer_on_rows); tests turn it off to
 * compare with the products one by one. */
static int fused_layers = 1;
static uint64_t fused_layers_run = 0;

int slotserve_kernel_set_fused_layers(int enabled) {
    fused_layers = enabled != 0;
    return fused_layers;
}

uint64_t slotserve_kernel_fused_layers_run(void) {
    return __atomic_load_n(&fused_layers_run, __ATOMIC_RELAXED);
}

/* Whether the layer runs its products on rows it rounds to bf16 itself (bf16_avx512.c's
 * gemm_bf16_rows, mlp_bf16_rows) where the kernels run VDPBF16PS and the tiles do not take it:
 * the norms write bf16 rows (no fp32 normed rows to round again), the MLP is one call (the
 * gate/up results never leave the registers: at 1,024 rows they were 12 MB written and read
 * back a layer), and o and down add themselves to the residual stream. Bit for bit the unfused
 * layer: the same roundings and sums. The caller checks the kernels run AVX512_BF16. */
static int layer_on_rows(const struct step_model *model, const struct step_layer *layer) {
    for (int which = 0; which < PRODUCTS; which++)
        if (layer->kind[which] != BF16 || (which != QKV && layer->bias[which] != NULL)) return 0;
    return model->wide == NULL && model->hidden % 16 == 0 && model->intermediate % 16 == 0;
}

/* Rows [0, m) of x RMS-normed and rounded to bf16 into xb: rms_norm_avx2's arithmetic, so the
 * same bits as the fp32 normed row rounded afterwards. hidden a multiple of 16. */
#if HAVE_AVX2_CODE
__attribute__((target("avx512f,avx512bf16,avx2,fma"))) static void
norm_row_to_bf16(const float *x, const float *weight, int64_t hidden, float eps, uint16_t *out) {
    const __m512 inv = _mm512_set1_ps(inverse_rms_avx2(x, hidden, eps));
    for (int64_t j = 0; j < hidden; j += 16) {
        const __m512 v =
            _mm512_mul_ps(_mm512_loadu_ps(weight + j), _mm512_mul_ps(_mm512_loadu_ps(x + j), inv));
        _mm256_storeu_si256((__m256i *)(out + j), (__m256i)_mm512_cvtneps_pbh(v));
    }
}
#else
static void norm_row_to_bf16(const float *x, const float *weight, int64_t hidden, float eps,
                             uint16_t *out) {
    (void)x, (void)weight, (void)hidden, (void)eps, (void)out; /* never taken, as above */
}
#endif

static void norm_to_bf16(const float *x, const float *weight, int64_t m, int64_t hidden, float eps,
                         uint16_t *xb, int threads) {
#pragma omp parallel for num_threads(threads) if (m >= SPREAD_ROWS)
    for (int64_t i = 0; i < m; i++)
        norm_row_to_bf16(x + i * hidden, weight, hidden, eps, xb + i * hidden);
}

/* x [m, hidden]: the rows' embeddings in, their final-normed hidden states out. Row i is the
 * token at positions[i] of the sequence in cache row slots[i]; its keys and values are written
 * there and it attends to positions [0, positions[i]]. cos, sin: [m, head_dim].
 * Buffers come from the caller's workspace `s` (see qgemm.h): a step allocates nothing once it
 * is large enough. Returns 0, or -1 when a buffer could not be allocated (x then holds no result). */
int slotserve_llama_step(const struct step_model *model, int64_t m, float *x, const float *cos,
                         const float *sin, const int64_t *slots, const int64_t *positions,
                         int threads, struct scratch *s) {
    const int64_t hidden = model->hidden, d = model->head_dim;
    const int64_t nq = model->heads * d, nkv = model->kv_heads * d, inter = model->intermediate;
    const int64_t nqkv = nq + 2 * nkv, group = model->heads / model->kv_heads;
    const size_t widest = (size_t)(nqkv > 2 * inter ? nqkv : 2 * inter);
    const size_t mark = scratch_mark(s);
    void *owned[8] = {NULL};
    float *normed = scratch_take(s, sizeof(float) * (size_t)(m * hidden), &owned[0]);
    float *wide = scratch_take(s, sizeof(float) * (size_t)m * widest, &owned[1]);
    float *query = scratch_take(s, sizeof(float) * (size_t)(m * nq), &owned[2]);
    float *attended = scratch_take(s, sizeof(float) * (size_t)(m * nq), &owned[3]);
    float *narrow =
        scratch_take(s, sizeof(float) * (size_t)(m * (hidden > inter ? hidden : inter)), &owned[4]);
    int64_t *lens = scratch_take(s, sizeof(int64_t) * (size_t)m, &owned[5]);
    /* The tiles' bf16 rows (layer_on_tiles), m rounded up to 32 rows of hidden or nq, where the
     * tiles may run. */
    const int may_tile = m >= AMX_GEMM_ROWS && slotserve_kernel_amx();
    uint16_t *tiles = may_tile
                          ? scratch_take(s,
                                         sizeof(uint16_t) * (size_t)(((m + 31) & ~(int64_t)31) *
                                                                     (hidden > nq ? hidden : nq)),
                                         &owned[6])
                          : NULL;
    /* The bf16 rows of layer_on_rows, m rows of hidden or nq, where it may run. */
    const int may_rows = fused_layers && slotserve_kernel_isa() >= ISA_AVX512_BF16;
    uint16_t *rows_bf16 =
        may_rows ? scratch_take(s, sizeof(uint16_t) * (size_t)(m * (hidden > nq ? hidden : nq)),
                                &owned[7])
                 : NULL;
    int status = -1;
    if (!normed || !wide || !query || !attended || !narrow || !lens || (may_tile && !tiles) ||
        (may_rows && !rows_bf16))
        goto done;
    const int avx2 = HAVE_AVX2_CODE && slotserve_kernel_isa() && hidden % 8 == 0 && inter % 8 == 0;
    const int avx512 = avx2 && slotserve_kernel_isa() >= ISA_AVX512 && inter % 16 == 0;
    const int wide_rope = HAVE_AVX2_CODE && slotserve_kernel_isa() >= ISA_AVX512 && d % 32 == 0;
    for (int64_t i = 0; i < m; i++) lens[i] = positions[i] + 1;

    for (int64_t l = 0; l < model->num_layers; l++) {
        const struct step_layer *layer = &model->layers[l];
        const int on_tiles = may_tile && fused_layers && layer_on_tiles(model, layer, m);
        const int on_rows = may_rows && !on_tiles && layer_on_rows(model, layer);
        if (on_tiles || on_rows) __atomic_add_fetch(&fused_layers_run, 1, __ATOMIC_RELAXED);
        if (on_rows) {
            norm_to_bf16(x, layer->input_norm, m, hidden, model->eps, rows_bf16, threads);
            gemm_bf16_rows(rows_bf16, m, hidden, layer->data[QKV], nqkv, wide, 0, threads);
            add_bias(layer->bias[QKV], wide, m, nqkv);
        } else if (on_tiles) {
            norm_to_tiles(x, layer->input_norm, m, hidden, model->eps, tiles, threads);
            gemm_amx_tiles(tiles, m, hidden, layer->data[QKV], nqkv, wide, 0, threads);
            add_bias(layer->bias[QKV], wide, m, nqkv);
        } else {
#pragma omp parallel for num_threads(threads) if (m >= SPREAD_ROWS)
            for (int64_t i = 0; i < m; i++)
                rms_norm(x + i * hidden, layer->input_norm, hidden, model->eps, normed + i * hidden,
                         avx2);
            if (product(model, l, QKV, normed, m, hidden, nqkv, wide, threads, s)) goto done;
        }
#pragma omp parallel for num_threads(threads) if (m >= SPREAD_ROWS)
        for (int64_t i = 0; i < m; i++) {
            float *row = wide + i * nqkv;
            const float *c = cos + i * d, *s = sin + i * d;
            for (int64_t h = 0; h < model->heads; h++) rope(row + h * d, c, s, d, wide_rope);
            for (int64_t h = 0; h < model->kv_heads; h++) {
                rope(row + nq + h * d, c, s, d, wide_rope);
                const int64_t at =
                    ((slots[i] * model->kv_heads + h) * model->max_len + positions[i]) * d;
                kv_store(layer->k_cache, at, row + nq + h * d, d, (int)model->kv_half);
                kv_store(layer->v_cache, at, row + nq + nkv + h * d, d, (int)model->kv_half);
            }
            /* Query heads are laid out [kv_heads, group, d]: head h uses kv head h / group. */
            memcpy(query + i * nq, row, sizeof(float) * (size_t)nq);
        }
        if (attend_rows(query, layer->k_cache, layer->v_cache, (int)model->kv_half, m, slots,
                        model->kv_heads, group, d, model->max_len, lens, model->scale, attended,
                        threads, s, (int)model->bf16_attention))
            goto done;
        if (on_tiles) {
            const int64_t rows = (m + 31) & ~(int64_t)31;
#pragma omp parallel for num_threads(threads) if (m >= SPREAD_ROWS)
            for (int64_t i = 0; i < rows; i++)
                amx_row_to_tiles(i < m ? attended + i * nq : NULL, NULL, 1, i, nq, tiles);
            gemm_amx_tiles(tiles, m, nq, layer->data[O], hidden, x, 1, threads);
            norm_to_tiles(x, layer->post_attention_norm, m, hidden, model->eps, tiles, threads);
            if (mlp_amx_tiles(tiles, m, hidden, layer->data[GATE_UP], layer->data[DOWN], inter, x,
                              1, threads, s))
                goto done;
            continue;
        }
        if (on_rows) {
            bf16_round(attended, m * nq, rows_bf16, threads);
            gemm_bf16_rows(rows_bf16, m, nq, layer->data[O], hidden, x, 1, threads);
            norm_to_bf16(x, layer->post_attention_norm, m, hidden, model->eps, rows_bf16, threads);
            if (mlp_bf16_rows(rows_bf16, m, hidden, layer->data[GATE_UP], layer->data[DOWN], inter,
                              x, 1, threads, s))
                goto done;
            continue;
        }
        if (product(model, l, O, attended, m, nq, hidden, narrow, threads, s)) goto done;
#pragma omp parallel for num_threads(threads) if (m >= SPREAD_ROWS)
        for (int64_t j = 0; j < m * hidden; j++) x[j] += narrow[j];

#pragma omp parallel for num_threads(threads) if (m >= SPREAD_ROWS)
        for (int64_t i = 0; i < m; i++)
            rms_norm(x + i * hidden, layer->post_attention_norm, hidden, model->eps,
                     normed + i * hidden, avx2);
        if (product(model, l, GATE_UP, normed, m, hidden, 2 * inter, wide, threads, s)) goto done;
        silu_mul_rows(wide, m, inter, narrow, threads, avx512 ? 2 : avx2);
        if (product(model, l, DOWN, narrow, m, inter, hidden, normed, threads, s)) goto done;
#pragma omp parallel for num_threads(threads) if (m >= SPREAD_ROWS)
        for (int64_t j = 0; j < m * hidden; j++) x[j] += normed[j];
    }
    for (int64_t i = 0; i < m; i++) {
        rms_norm(x + i * hidden, model->final_norm, hidden, model->eps, normed + i * hidden, avx2);
    }
    memcpy(x, normed, sizeof(float) * (size_t)(m * hidden));
    status = 0;
done:
    for (int i = 0; i < 8; i++) free(owned[i]);
    scratch_release(s, mark);
    return status;
}
