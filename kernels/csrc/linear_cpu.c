/* Few-row projections on the CPU: y[M, N] = x[M, K] @ w[N, K]^T for small M (decode steps).
 *
 * With a handful of rows, a projection is a stream over the weight matrix: every weight is
 * used M times. BLAS libraries treat it as a general matrix product and reach about a third of
 * this machine's read bandwidth at M = 1 (11.5 of 33 GB/s measured, GEMV included) and less at
 * M = 2..16, where they repack operands on every call. This kernel reads each weight row from
 * memory exactly once, in order (the hardware prefetcher follows four sequential streams), and
 * reuses it from L1 for every row of x.
 *
 * Tiling: 6 weight rows x up to 4 rows of x, 24 accumulators of 16 floats each, so every load
 * of a weight vector feeds up to 4 FMAs and every load of an x vector 6 (the fastest of the
 * 4x4, 4x6, 6x4, 8x3 and 2x8 tiles measured here at 1, 8, 32 and 64 rows). Threads split the
 * weight rows (OpenMP, the runtime torch already loaded, same soname).
 *
 * Layouts: x [M, K] with row stride ldx, w [N, K] contiguous, y [M, N] with row stride ldy;
 * float32. Summation order differs from BLAS: results agree to float32 rounding.
 */
#include <omp.h>
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

void tidegate_skinny_linear_f32(const float *x, const float *w, float *y, int64_t m_dim,
                                int64_t n_dim, int64_t k_dim, int64_t ldx, int64_t ldy,
                                int num_threads) {
    const int64_t tiles = (n_dim + NR - 1) / NR;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t n0 = t * NR;
        const int nr = (int)(n_dim - n0 < NR ? n_dim - n0 : NR);
        const float *wt = w + n0 * k_dim;
        int64_t m = 0;
        for (; m + MR <= m_dim; m += MR) tile(wt, k_dim, nr, x + m * ldx, ldx, y + m * ldy + n0, ldy, MR);
        switch (m_dim - m) {
        case 3: tile(wt, k_dim, nr, x + m * ldx, ldx, y + m * ldy + n0, ldy, 3); break;
        case 2: tile(wt, k_dim, nr, x + m * ldx, ldx, y + m * ldy + n0, ldy, 2); break;
        case 1: tile(wt, k_dim, nr, x + m * ldx, ldx, y + m * ldy + n0, ldy, 1); break;
        default: break;
        }
    }
}
