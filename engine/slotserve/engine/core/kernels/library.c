/* The kernel library as one translation unit, the file the compiler is given (library.py).
 *
 * Every source includes <immintrin.h> (~40,000 lines of intrinsics' declarations): compiled file
 * by file, parsing it nine times took half of the build (8.4 s of one core on a Xeon); as one
 * unit it is parsed once (3.8 s), for each engine's first start on a machine and for every test
 * that compiles the library. The sources keep their own names for file-local macros and statics,
 * so they can be read, formatted and linted alone; `make lint` compiles this file as built. */
#include "dispatch.c"
#include "products.c"
#include "wide_avx2.c"
#include "quantized_rows.c"
#include "quantize.c"
#include "qgemm_avx512.c"
#include "bf16_avx512.c"
#include "quantized_bf16.c"
#include "int16_vnni.c"
#include "int16_avx2.c"
#include "int16.c"
#include "attention_block.c"
#include "attention_bf16.c"
#include "attention_amx.c"
#include "gemm_amx.c"
#include "kv_half.c"
#include "attention.c"
#include "llama_step.c"
