/* The float micro-kernel both projection kernels share: NR weight rows against MR rows of x,
 * NR x MR accumulators of 16 floats (linear_cpu.c: the weights as they are; packed_linear_cpu.c:
 * a strip of packed rows dequantized into cache). */
#ifndef TIDEGATE_FLOAT_TILE_H
#define TIDEGATE_FLOAT_TILE_H

#include <stdint.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* A tile's NR x MR accumulators stay in registers: 6 x 4 of AVX-512's 32; with 16 registers
 * of half the width (AVX2), where a v16 takes two, 3 x 2 (12 registers, the rows of x 4 more,
 * the weights read from memory by the FMAs). Each output's sum is the same whichever tile
 * computes it (16 partial sums over k, then hsum), so both give the same bits. */
#if !defined(TIDEGATE_FLOAT_TILE_NR) && defined(__AVX512F__)
#define NR 6 /* weight rows per tile */
#define MR 4 /* rows of x per tile */
#elif !defined(TIDEGATE_FLOAT_TILE_NR)
#define NR 3
#define MR 2
#else
#define NR TIDEGATE_FLOAT_TILE_NR
#define MR TIDEGATE_FLOAT_TILE_MR
#endif

static inline float hsum(v16 v) {
    float s = 0.0f;
    for (int i = 0; i < 16; ++i) s += v[i];
    return s;
}

#if defined(__AVX512F__)
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
#else
/* The same sums in 256-bit halves: GCC spills a 64-byte vector type to the stack on every
 * operation where the CPU has no 512-bit registers (a float GEMV ran at a twentieth of the
 * FMA rate). lo holds lanes 0-7 of the 16 partial sums, hi lanes 8-15. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));

static inline __attribute__((always_inline)) void tile(const float *w, int64_t k_dim, int nr,
                                                       const float *x, int64_t ldx, float *y,
                                                       int64_t ldy, const int mr) {
    v8 lo[NR][MR], hi[NR][MR];
    for (int i = 0; i < NR; ++i)
        for (int m = 0; m < MR; ++m) lo[i][m] = hi[i][m] = (v8){0};
    const int64_t kv = k_dim & ~(int64_t)15;
    for (int64_t k = 0; k < kv; k += 16) {
        v8 xl[MR], xh[MR];
        for (int m = 0; m < mr; ++m) {
            xl[m] = *(const v8 *)(x + m * ldx + k);
            xh[m] = *(const v8 *)(x + m * ldx + k + 8);
        }
        for (int i = 0; i < NR; ++i) {
            if (i >= nr) break;
            const v8 wl = *(const v8 *)(w + i * k_dim + k), wh = *(const v8 *)(w + i * k_dim + k + 8);
            for (int m = 0; m < mr; ++m) {
                lo[i][m] += wl * xl[m];
                hi[i][m] += wh * xh[m];
            }
        }
    }
    for (int i = 0; i < nr; ++i) {
        for (int m = 0; m < mr; ++m) {
            v16 v;
            for (int j = 0; j < 8; ++j) {
                v[j] = lo[i][m][j];
                v[j + 8] = hi[i][m][j];
            }
            float s = hsum(v);
            for (int64_t k = kv; k < k_dim; ++k) s += w[i * k_dim + k] * x[m * ldx + k];
            y[m * ldy + i] = s;
        }
    }
}
#endif

/* Weight rows w[0..nr) against every row of x [m_dim]: MR rows at a time, then the rest. */
static inline void tile_rows(const float *w, int64_t k_dim, int nr, const float *x, int64_t ldx,
                             float *y, int64_t ldy, int64_t m_dim) {
    int64_t m = 0;
    for (; m + MR <= m_dim; m += MR) tile(w, k_dim, nr, x + m * ldx, ldx, y + m * ldy, ldy, MR);
    switch (m_dim - m) {
#if MR > 3
    case 3: tile(w, k_dim, nr, x + m * ldx, ldx, y + m * ldy, ldy, 3); break;
#endif
#if MR > 2
    case 2: tile(w, k_dim, nr, x + m * ldx, ldx, y + m * ldy, ldy, 2); break;
#endif
    case 1: tile(w, k_dim, nr, x + m * ldx, ldx, y + m * ldy, ldy, 1); break;
    default: break;
    }
}

#endif
