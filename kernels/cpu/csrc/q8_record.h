/* What the 8-bit-activation kernels share (q8_linear_cpu.c, q8_lanes8_cpu.c): which path this
 * build computes with, and a quantized row's record (the layout q8_linear_cpu.c's header
 * defines: q [K] int8, then float32 d [K/32], xs32 [K/32], xs16 [K/16]). */
#ifndef TIDEGATE_Q8_RECORD_H
#define TIDEGATE_Q8_RECORD_H

#include <stdint.h>

/* Q8_LANES: AVX512-VNNI (with VL and BW); Q8_AVX2: AVX2 without it; neither: portable C.
 * TIDEGATE_NO_AVX512 / TIDEGATE_PORTABLE (compile definitions) force the slower ones. */
#if !defined(TIDEGATE_PORTABLE) && !defined(TIDEGATE_NO_AVX512) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define Q8_LANES 1
#include <immintrin.h>
#elif !defined(TIDEGATE_PORTABLE) && defined(__AVX2__)
#define Q8_AVX2 1
#include <immintrin.h>
#endif

struct q8row {
    const int8_t *q;
    const float *dx, *xs32, *xs16;
};

static inline struct q8row q8_row(const uint8_t *rec, int64_t k) {
    const float *f = (const float *)(rec + k);
    return (struct q8row){(const int8_t *)rec, f, f + k / 32, f + k / 16};
}

/* Bytes of one quantized row of k columns; 0 when k is not whole blocks of 32. */
int64_t tidegate_q8_row_bytes(int64_t k);

#endif
