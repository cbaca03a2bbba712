/* exp(x) for -87 <= x <= 87 by range reduction and a degree-6 polynomial (relative error
 * ~2e-7), written so the compiler vectorizes the loop it sits in (libm's expf is one call per
 * value). Callers clamp x into range (paged_decode_cpu.c: softmax, x <= 0; elementwise_cpu.c:
 * SiLU). */
#ifndef TIDEGATE_EXP_POLY_H
#define TIDEGATE_EXP_POLY_H

#include <stdint.h>

static inline float exp_poly(float x) {
    const float log2e = 1.44269504088896341f;
    float n = __builtin_roundf(x * log2e);
    float r = x - n * 0.693145751953125f; /* ln2 split in two for an exact reduction */
    r = r - n * 1.428606765330187e-06f;
    float p = 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

#endif
