/* Where a projection's weight rows come from, for the float (packed_linear_cpu.c) and the
 * 8-bit-activation (q8_linear_cpu.c) kernels alike: a GGML type's packed rows, or an integer
 * matrix with group scales and zero points (int_weight.py's layout). */
#ifndef TIDEGATE_ROW_SOURCE_H
#define TIDEGATE_ROW_SOURCE_H

#include <stdint.h>

struct row_source {
    int ggml_type;        /* >= 0: GGML rows; -1: integers of `bits` bits (the float kernel
                           * has one more: e4m3 rows) */
    const uint8_t *w;     /* row r starts at w + r * row_bytes */
    int64_t row_bytes;
    int bits;             /* integers: 4 or 8 */
    int64_t group;        /* integers: columns per group */
    const float *scales;  /* integers: [N, K / group] */
    const uint8_t *zeros; /* integers: [N, K / group] */
    int half;             /* 8-bit activations: steps of 16 columns (Q6_K, 16-column groups),
                           * else 32 */
};

#endif
