/* What the kernels over GGUF blocks share: the GGML type ids and the half floats their scales
 * are stored in (packed_linear_cpu.c: float activations; q8_linear_cpu.c: 8-bit ones). */
#ifndef TIDEGATE_GGML_BLOCKS_H
#define TIDEGATE_GGML_BLOCKS_H

#include <stdint.h>
#include <string.h>

/* ggml_type ids (ggml.h), as GGUF files store them. */
enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30,
};

#if defined(__F16C__)
#include <immintrin.h>
static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (mant << 13); /* inf / nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal half: normalise */
        exp = 113;
        while (!(mant & 0x400)) { mant <<= 1; --exp; }
        bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline float rdh(const uint8_t *p) { return f16_to_f32(rd16(p)); }

/* Bytes of one row of k values of type t; 0 if the type is unknown or k is not whole blocks
 * (packed_linear_cpu.c). */
int64_t tidegate_packed_row_bytes(int t, int64_t k);

#endif
