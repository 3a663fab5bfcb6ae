/* The library itself: its ABI and group size (kernels.h), the instruction set in use (cpuid,
 * lowered by tests), the callers' workspaces and the prefetch distance. */
#include "gemm.h"

int slotserve_kernel_abi(void) { return SLOTSERVE_KERNEL_ABI; }

int slotserve_kernel_group_size(void) { return GROUP; }

/* The widest instruction set this CPU runs (cpuid), and the one in use (tests lower it). */
static int supported_isa(void) {
#if HAVE_AVX2_CODE
    __builtin_cpu_init();
    /* F16C (the fp16 KV cache's conversions) comes with every AVX2 CPU; checked all the same. */
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ||
        !__builtin_cpu_supports("f16c"))
        return ISA_C;
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return __builtin_cpu_supports("avx512bf16") ? ISA_AVX512_BF16 : ISA_AVX512;
#endif
    return ISA_AVX2;
#else
    return ISA_C;
#endif
}

static int isa_in_use = -1;

int slotserve_kernel_isa(void) {
    if (isa_in_use < 0) isa_in_use = supported_isa();
    return isa_in_use;
}

int slotserve_kernel_supported_isa(void) { return supported_isa(); }

int slotserve_kernel_set_isa(int level) {
    const int top = supported_isa();
    isa_in_use = level < ISA_C ? ISA_C : (level > top ? top : level);
    return isa_in_use;
}

/* ---- the workspace ------------------------------------------------------------------------ */

/* Buffers that came from malloc because a workspace was missing or short (tests read it: a
 * steady-state step must add none). */
static uint64_t fallback_allocations = 0;

uint64_t slotserve_kernel_fallback_allocations(void) {
    return __atomic_load_n(&fallback_allocations, __ATOMIC_RELAXED);
}

void *scratch_take(struct scratch *s, size_t bytes, void **owned) {
    bytes = (bytes + 63) & ~(size_t)63;
    *owned = NULL;
    if (s != NULL && s->base != NULL && s->used + bytes <= s->size) {
        void *at = s->base + s->used;
        s->used += bytes;
        return at;
    }
    if (s != NULL) {
        /* Counted on, so that `needed` becomes what the whole call wanted. */
        s->used += bytes;
        if (s->used > s->needed) s->needed = s->used;
    }
    __atomic_add_fetch(&fallback_allocations, 1, __ATOMIC_RELAXED);
    *owned = aligned_alloc(64, bytes);
    return *owned;
}

size_t scratch_mark(const struct scratch *s) { return s == NULL ? 0 : s->used; }

void scratch_release(struct scratch *s, size_t mark) {
    if (s != NULL) s->used = mark;
}

/* How far ahead of the weights being multiplied their successors are prefetched, in bytes.
 * Measured on a SmolLM2 step's products, 2 threads: fp32 at 4 rows 15.2 ms with none, 8.1 at
 * 4-8 KB, 8.6 at 16 KB (1 row: 8.1 -> 7.0); int4 and int8 gained 10-25% in one process and
 * nothing measurable in another. Far enough to cover the memory's latency at full bandwidth.
 *
 * The prefetches go to L2 (T1), not L1 (T0): on a 2-core EPYC, fp32 products of a whole
 * SmolLM2 step at 4 / 8 / 32 rows took 16.8 / 22.6 / 58.0 ms against 24.5 / 34.4 / 69.7 with
 * T0 (1 row: 17.8 vs 18.5), interleaved in one process; int8 and int4 did not move. With T0 a
 * panel's worth of prefetches holds the few L1 miss buffers that the loads of the panel being
 * multiplied also need, so the memory waits while the rows are multiplied; with T1 the stream
 * keeps coming and a step with 4 rows costs what a step with 1 does. */
int64_t ahead_bytes = 8192;

void slotserve_kernel_set_prefetch(int64_t bytes) { ahead_bytes = bytes < 0 ? 8192 : bytes; }
