/* Few-row projections on the CPU: y[M, N] = x[M, K] @ w[N, K]^T for small M (decode steps).
 *
 * With a handful of rows, a projection is a stream over the weight matrix: every weight is
 * used M times. BLAS libraries treat it as a general matrix product and reach about a third of
 * this machine's read bandwidth at M = 1 (11.5 of 33 GB/s measured, GEMV included) and less at
 * M = 2..16, where they repack operands on every call. This kernel reads each weight row from
 * memory exactly once, in order (the hardware prefetcher follows four sequential streams), and
 * reuses it from L1 for every row of x.
 *
 * Tiling (float_tile.h): with AVX-512, 6 weight rows x up to 4 rows of x, 24 accumulators of
 * 16 floats each, so every load of a weight vector feeds up to 4 FMAs and every load of an x
 * vector 6 (the fastest of the 4x4, 4x6, 6x4, 8x3 and 2x8 tiles measured at 1, 8, 32 and 64
 * rows); with AVX2's 16 registers, 3 x 2 (the fastest of 2x2, 2x3, 3x2 and 4x2 on a Zen 3).
 * Threads split the weight rows (OpenMP, the runtime torch already loaded, same soname).
 *
 * Layouts: x [M, K] with row stride ldx, w [N, K] contiguous, y [M, N] with row stride ldy;
 * float32. Summation order differs from BLAS: results agree to float32 rounding.
 */
#include <omp.h>
#include <stdint.h>

#include "float_tile.h"

void tidegate_skinny_linear_f32(const float *x, const float *w, float *y, int64_t m_dim,
                                int64_t n_dim, int64_t k_dim, int64_t ldx, int64_t ldy,
                                int num_threads) {
    const int64_t tiles = (n_dim + NR - 1) / NR;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t n0 = t * NR;
        const int nr = (int)(n_dim - n0 < NR ? n_dim - n0 : NR);
        tile_rows(w + n0 * k_dim, k_dim, nr, x, ldx, y + n0, ldy, m_dim);
    }
}
