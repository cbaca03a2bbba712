/* The float micro-kernel both projection kernels share: NR weight rows against MR rows of x,
 * NR x MR accumulators of 16 floats (linear_cpu.c: the weights as they are; packed_linear_cpu.c:
 * a strip of packed rows dequantized into cache). */
#ifndef TIDEGATE_FLOAT_TILE_H
#define TIDEGATE_FLOAT_TILE_H

#include <stdint.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));

#define NR 6 /* weight rows per tile */
#define MR 4 /* rows of x per tile (6 x 4 = 24 accumulators: most of the 32 vector registers) */

static inline float hsum(v16 v) {
    float s = 0.0f;
    for (int i = 0; i < 16; ++i) s += v[i];
    return s;
}

/* One tile: weight rows w[0..nr) against x rows x[0..mr); y[m * ldy + i] = dot(x[m], w[i]). */
static inline __attribute__((always_inline)) void tile(const float *w, int64_t k_dim, int nr,
                                                       const float *x, int64_t ldx, float *y,
                                                       int64_t ldy, const int mr) {
    v16 acc[NR][MR];
    for (int i = 0; i < NR; ++i)
        for (int m = 0; m < MR; ++m) acc[i][m] = (v16){0};
    const int64_t kv = k_dim & ~(int64_t)15;
    for (int64_t k = 0; k < kv; k += 16) {
        v16 xv[MR];
        for (int m = 0; m < mr; ++m) xv[m] = *(const v16 *)(x + m * ldx + k);
        for (int i = 0; i < NR; ++i) {
            if (i >= nr) break;
            const v16 wv = *(const v16 *)(w + i * k_dim + k);
            for (int m = 0; m < mr; ++m) acc[i][m] += wv * xv[m];
        }
    }
    for (int i = 0; i < nr; ++i) {
        for (int m = 0; m < mr; ++m) {
            float s = hsum(acc[i][m]);
            for (int64_t k = kv; k < k_dim; ++k) s += w[i * k_dim + k] * x[m * ldx + k];
            y[m * ldy + i] = s;
        }
    }
}

/* Weight rows w[0..nr) against every row of x [m_dim]: MR rows at a time, then the rest. */
static inline void tile_rows(const float *w, int64_t k_dim, int nr, const float *x, int64_t ldx,
                             float *y, int64_t ldy, int64_t m_dim) {
    int64_t m = 0;
    for (; m + MR <= m_dim; m += MR) tile(w, k_dim, nr, x + m * ldx, ldx, y + m * ldy, ldy, MR);
    switch (m_dim - m) {
    case 3: tile(w, k_dim, nr, x + m * ldx, ldx, y + m * ldy, ldy, 3); break;
    case 2: tile(w, k_dim, nr, x + m * ldx, ldx, y + m * ldy, ldy, 2); break;
    case 1: tile(w, k_dim, nr, x + m * ldx, ldx, y + m * ldy, ldy, 1); break;
    default: break;
    }
}

#endif
