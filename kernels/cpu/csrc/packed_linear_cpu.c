/* Projections over packed GGUF weights on the CPU: y[M, N] = x[M, K] @ dequant(w)[N, K]^T.
 *
 * The weights stay in llama.cpp's block formats (ggml-common.h): each row is K / B blocks of B
 * values (B = 32, or 256 for the K-quants), each block its bytes of scales and packed integers.
 * A thread takes a strip of weight rows, dequantizes the strip into a small float buffer
 * (6 or 24 rows of K floats, in L1 or L2, never a copy of the matrix) and multiplies it with
 * every row of x, MR rows of x against NR weight rows at a time. Activations stay float32, so the
 * result is the dequantized matrix's product up to float summation order (llama.cpp instead
 * quantizes the activations to 8 bits: faster at many rows, not the same numbers).
 *
 * Dequantization follows llama.cpp's reference (dequantize_row_*) value for value: the float
 * of each weight is d * q (+ m), computed in float32 as there.
 *
 * Layouts: x [M, K] with row stride ldx (floats), w [N, row_bytes] contiguous, y [M, N] with
 * row stride ldy; float32 x and y.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "float_tile.h"
#include "ggml_blocks.h"
#include "row_source.h"

typedef float v16a __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16), aligned(1)));
typedef int8_t i8x16 __attribute__((vector_size(16), aligned(1)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

/* Bytes to floats through 32-bit integers: GCC scalarizes a direct byte -> float
 * __builtin_convertvector (one conversion per value), while byte -> int32 -> float is two
 * vector instructions (vpmovzxbd / vpmovsxbd, vcvtdq2ps) on AVX-512. */
static inline v16 u8_to_f(u8x16 v) {
    return __builtin_convertvector(__builtin_convertvector(v, i32x16), v16a);
}
/* Signed bytes the same way, through their unsigned offset (s + 128): GCC 12 scalarizes the
 * sign-extending conversion. Exact: every value is a small integer. */
static inline v16 i8_to_f(i8x16 v) { return u8_to_f((u8x16)v ^ 0x80) - 128.0f; }

static inline void store16(float *y, v16 v) { memcpy(y, &v, 64); }

#if defined(__AVX2__) && !defined(__AVX512F__) && !defined(TIDEGATE_PORTABLE)
#include <immintrin.h>
/* Without AVX-512, GCC scalarizes the 16-wide conversions above (byte by byte through the
 * stack: a Q4_1 row dequantized at 1.5 G values/s on a Zen 3). The formats of the default
 * models in 256-bit registers instead, with the same float operations (fused where the
 * -ffp-contract=fast build fuses them). */
#define DEQUANT_AVX2 1

/* 16 bytes (column j in byte j) as floats into y[0..16). */
static inline void u8x16_to_f(const __m128i q, float *y, __m256 d, __m256 m, int fma) {
    const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
    const __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)));
    _mm256_storeu_ps(y, fma ? _mm256_fmadd_ps(a, d, m) : _mm256_mul_ps(_mm256_add_ps(a, m), d));
    _mm256_storeu_ps(y + 8, fma ? _mm256_fmadd_ps(b, d, m) : _mm256_mul_ps(_mm256_add_ps(b, m), d));
}

/* A Q4_0 (one 0: (q - 8) * d) or Q4_1 (one 1: q * d + m) row into y[k]; one instance each. */
static inline __attribute__((always_inline)) void q4_row_avx2(const uint8_t *src, int64_t k,
                                                              float *y, const int one) {
    const __m128i lo = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < k / 32; ++b, src += one ? 20 : 18, y += 32) {
        const __m256 d = _mm256_set1_ps(rdh(src));
        const __m256 m = _mm256_set1_ps(one ? rdh(src + 2) : -8.0f);
        const __m128i q = _mm_loadu_si128((const __m128i *)(src + (one ? 4 : 2)));
        u8x16_to_f(_mm_and_si128(q, lo), y, d, m, one);
        u8x16_to_f(_mm_and_si128(_mm_srli_epi16(q, 4), lo), y + 16, d, m, one);
    }
}

/* Q4_0, Q4_1 and Q8_0 rows into y[k]; -1 for other types. */
static int dequant_row_avx2(int t, const uint8_t *src, int64_t k, float *y) {
    switch (t) {
    case T_Q4_0:
        q4_row_avx2(src, k, y, 0);
        return 0;
    case T_Q4_1:
        q4_row_avx2(src, k, y, 1);
        return 0;
    case T_Q8_0:
        for (int64_t b = 0; b < k / 32; ++b, src += 34, y += 32) {
            const __m256 d = _mm256_set1_ps(rdh(src));
            for (int j = 0; j < 32; j += 8) {
                const __m128i q = _mm_loadl_epi64((const __m128i *)(src + 2 + j));
                _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
            }
        }
        return 0;
    default:
        return -1;
    }
}
#endif



/* One row of K values of type t from its packed bytes into y[K]. Returns 0, or -1 for an
 * unknown type. */
static int dequant_row(int t, const uint8_t *src, int64_t k, float *y) {
#if defined(DEQUANT_AVX2)
    if (t == T_Q4_0 || t == T_Q4_1 || t == T_Q8_0) return dequant_row_avx2(t, src, k, y);
#endif
    switch (t) {
    case T_F32:
        memcpy(y, src, (size_t)k * 4);
        return 0;
    case T_F16:
        for (int64_t i = 0; i < k; ++i) y[i] = rdh(src + 2 * i);
        return 0;
    case T_BF16:
        for (int64_t i = 0; i < k; ++i) {
            uint32_t bits = (uint32_t)rd16(src + 2 * i) << 16;
            memcpy(y + i, &bits, 4);
        }
        return 0;
    case T_Q4_0:
        for (int64_t b = 0; b < k / 32; ++b, src += 18, y += 32) {
            const float d = rdh(src);
            const u8x16 q = *(const u8x16 *)(src + 2);
            const v16 lo = u8_to_f(q & 0xF) - 8.0f, hi = u8_to_f(q >> 4) - 8.0f;
            store16(y, lo * d);
            store16(y + 16, hi * d);
        }
        return 0;
    case T_Q4_1:
        for (int64_t b = 0; b < k / 32; ++b, src += 20, y += 32) {
            const float d = rdh(src), m = rdh(src + 2);
            const u8x16 q = *(const u8x16 *)(src + 4);
            store16(y, u8_to_f(q & 0xF) * d + m);
            store16(y + 16, u8_to_f(q >> 4) * d + m);
        }
        return 0;
    case T_Q5_0:
    case T_Q5_1: {
        const int has_m = t == T_Q5_1, size = has_m ? 24 : 22;
        for (int64_t b = 0; b < k / 32; ++b, src += size, y += 32) {
            const float d = rdh(src), m = has_m ? rdh(src + 2) : 0.0f;
            const uint8_t *qh8 = src + (has_m ? 4 : 2);
            const uint32_t qh = (uint32_t)qh8[0] | (uint32_t)qh8[1] << 8 |
                                (uint32_t)qh8[2] << 16 | (uint32_t)qh8[3] << 24;
            const u8x16 q = *(const u8x16 *)(qh8 + 4);
            u8x16 h0, h1;
            for (int j = 0; j < 16; ++j) {
                h0[j] = (uint8_t)(((qh >> j) & 1) << 4);
                h1[j] = (uint8_t)(((qh >> (j + 16)) & 1) << 4);
            }
            v16 lo = u8_to_f((q & 0xF) | h0), hi = u8_to_f((q >> 4) | h1);
            if (has_m) {
                store16(y, lo * d + m);
                store16(y + 16, hi * d + m);
            } else {
                store16(y, (lo - 16.0f) * d);
                store16(y + 16, (hi - 16.0f) * d);
            }
        }
        return 0;
    }
    case T_Q8_0:
        for (int64_t b = 0; b < k / 32; ++b, src += 34, y += 32) {
            const float d = rdh(src);
            store16(y, i8_to_f(*(const i8x16 *)(src + 2)) * d);
            store16(y + 16, i8_to_f(*(const i8x16 *)(src + 18)) * d);
        }
        return 0;
    case T_Q4_K:
    case T_Q5_K: {
        const int five = t == T_Q5_K, size = five ? 176 : 144;
        for (int64_t b = 0; b < k / 256; ++b, src += size) {
            const float d = rdh(src), dmin = rdh(src + 2);
            const uint8_t *sc = src + 4;
            const uint8_t *qh = src + 16;           /* Q5_K only: 32 bytes of high bits */
            const uint8_t *qs = src + (five ? 48 : 16);
            for (int j = 0; j < 8; j += 2, qs += 32) {
                float dl[2], ml[2];
                for (int s = 0; s < 2; ++s) { /* get_scale_min_k4 */
                    const int js = j + s;
                    uint8_t scv, mv;
                    if (js < 4) {
                        scv = sc[js] & 63;
                        mv = sc[js + 4] & 63;
                    } else {
                        scv = (sc[js + 4] & 0xF) | ((sc[js - 4] >> 6) << 4);
                        mv = (sc[js + 4] >> 4) | ((sc[js] >> 6) << 4);
                    }
                    dl[s] = d * scv;
                    ml[s] = dmin * mv;
                }
                for (int half = 0; half < 2; ++half) {
                    const u8x16 q0 = *(const u8x16 *)(qs + 16 * half);
                    u8x16 lo = q0 & 0xF, hi = q0 >> 4;
                    if (five) {
                        const u8x16 h = *(const u8x16 *)(qh + 16 * half);
                        const uint8_t u1 = (uint8_t)(1 << j), u2 = (uint8_t)(2 << j);
                        lo |= (u8x16)((h & u1) != 0) & 16;
                        hi |= (u8x16)((h & u2) != 0) & 16;
                    }
                    store16(y + 16 * half, u8_to_f(lo) * dl[0] - ml[0]);
                    store16(y + 32 + 16 * half, u8_to_f(hi) * dl[1] - ml[1]);
                }
                y += 64;
            }
        }
        return 0;
    }
    case T_Q6_K:
        for (int64_t b = 0; b < k / 256; ++b, src += 210) {
            const uint8_t *ql = src, *qh = src + 128;
            const int8_t *sc = (const int8_t *)(src + 192);
            const float d = rdh(src + 208);
            for (int n = 0; n < 2; ++n, ql += 64, qh += 32, sc += 8, y += 128) {
                for (int half = 0; half < 2; ++half) { /* l = 16 * half .. + 16 */
                    const int l = 16 * half;
                    const u8x16 a = *(const u8x16 *)(ql + l), c = *(const u8x16 *)(ql + l + 32);
                    const u8x16 h = *(const u8x16 *)(qh + l);
                    const v16 q1 = u8_to_f((a & 0xF) | ((h & 3) << 4)) - 32.0f;
                    const v16 q2 = u8_to_f((c & 0xF) | (((h >> 2) & 3) << 4)) - 32.0f;
                    const v16 q3 = u8_to_f((a >> 4) | (((h >> 4) & 3) << 4)) - 32.0f;
                    const v16 q4 = u8_to_f((c >> 4) | (((h >> 6) & 3) << 4)) - 32.0f;
                    store16(y + l, q1 * (d * sc[half + 0]));
                    store16(y + l + 32, q2 * (d * sc[half + 2]));
                    store16(y + l + 64, q3 * (d * sc[half + 4]));
                    store16(y + l + 96, q4 * (d * sc[half + 6]));
                }
            }
        }
        return 0;
    default:
        return -1;
    }
}

/* Bytes of one row of k values of type t; 0 if the type is unknown or k is not whole blocks. */
int64_t tidegate_packed_row_bytes(int t, int64_t k) {
    switch (t) {
    case T_F32: return 4 * k;
    case T_F16: case T_BF16: return 2 * k;
    case T_Q4_0: return k % 32 ? 0 : k / 32 * 18;
    case T_Q4_1: return k % 32 ? 0 : k / 32 * 20;
    case T_Q5_0: return k % 32 ? 0 : k / 32 * 22;
    case T_Q5_1: return k % 32 ? 0 : k / 32 * 24;
    case T_Q8_0: return k % 32 ? 0 : k / 32 * 34;
    case T_Q4_K: return k % 256 ? 0 : k / 256 * 144;
    case T_Q5_K: return k % 256 ? 0 : k / 256 * 176;
    case T_Q6_K: return k % 256 ? 0 : k / 256 * 210;
    default: return 0;
    }
}

/* Rows ids[0..n) of a packed [*, k] matrix, dequantized into y[n, k] (embedding lookups).
 * Returns 0, or -1 for an unknown type. */
int tidegate_dequant_rows(int t, const uint8_t *w, int64_t k, const int64_t *ids, int64_t n,
                          float *y) {
    const int64_t rb = tidegate_packed_row_bytes(t, k);
    if (rb == 0) return -1;
    for (int64_t i = 0; i < n; ++i)
        if (dequant_row(t, w + ids[i] * rb, k, y + i * k) != 0) return -1;
    return 0;
}

/* Weight rows dequantized per strip (multiples of NR). A strip is dequantized into a buffer
 * and multiplied with every row of x. Few rows of x: one micro-tile's rows at a time, so the
 * buffer stays in L1 (measured here, one row of a Q4_1 49152 x 576 matrix on one thread: 2.7 ms
 * against 4.6 with strips of 24); many rows: 24, so each
 * row of x is read once per 24 weight rows. Either way every row of y is computed with the
 * same arithmetic in the same order (dequant_row, then tile()), so a row's result does not
 * depend on how many rows its step had. */
#define SR_FEW NR
#define SR_MANY 24
#define FEW_ROWS 4

/* One row of an integer matrix: (q - zero) * scale per group. 4 bits: each run of 32 columns
 * is 16 bytes, low nibbles columns 0-15, high nibbles 16-31 (as Q4_0). */
static void int_row(const struct row_source *src, int64_t r, int64_t k, float *y) {
    const uint8_t *q = src->w + r * src->row_bytes;
    const int64_t groups = k / src->group;
    const float *sc = src->scales + r * groups;
    const uint8_t *zp = src->zeros + r * groups;
    for (int64_t g = 0; g < groups; ++g) {
        const float s = sc[g], z = (float)zp[g];
        const int64_t c0 = g * src->group, c1 = c0 + src->group;
        if (src->bits == 8) {
            int64_t c = c0;
            for (; c + 16 <= c1; c += 16)
                store16(y + c, (u8_to_f(*(const u8x16 *)(q + c)) - z) * s);
            for (; c < c1; ++c) y[c] = ((float)q[c] - z) * s;
        } else if (src->group % 32 == 0) { /* a group is whole runs of 32 */
            for (int64_t c = c0; c < c1; c += 32) {
                const u8x16 b = *(const u8x16 *)(q + c / 2);
                store16(y + c, (u8_to_f(b & 0xF) - z) * s);
                store16(y + c + 16, (u8_to_f(b >> 4) - z) * s);
            }
        } else { /* groups of 16: a group is one half (the low or high nibbles) of a run */
            const u8x16 b = *(const u8x16 *)(q + (c0 - c0 % 32) / 2);
            store16(y + c0, (u8_to_f(c0 % 32 ? b >> 4 : b & 0xF) - z) * s);
        }
    }
}

/* ggml_type of an FP8 (e4m3) matrix (fp8_weight.py): one byte a value, `scales` [N] per row. */
#define SRC_FP8 (-2)
static void fp8_row(const struct row_source *src, int64_t r, int64_t k, float *y);

static inline void source_row(const struct row_source *src, int64_t r, int64_t k, float *y) {
    if (src->ggml_type >= 0)
        dequant_row(src->ggml_type, src->w + r * src->row_bytes, k, y);
    else if (src->ggml_type == SRC_FP8)
        fp8_row(src, r, k, y);
    else
        int_row(src, r, k, y);
}

/* y[M, N] = x[M, K] @ rows(src)[N, K]^T (+ add): strips of weight rows dequantized into a
 * buffer, each multiplied with every row of x. Returns 0, or -2 when scratch memory cannot be
 * had. */
static int strip_linear(const struct row_source *src, const float *x, float *y, const float *add,
                        int64_t m_dim, int64_t n_dim, int64_t k_dim, int64_t ldx, int64_t ldy,
                        int num_threads) {
    const int64_t sr = m_dim <= FEW_ROWS ? SR_FEW : SR_MANY;
    const int64_t strips = (n_dim + sr - 1) / sr;
    int failed = 0;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > strips) num_threads = (int)strips;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *buf = aligned_alloc(64, (size_t)((sr * k_dim * 4 + 63) / 64 * 64));
        if (buf == NULL) {
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t s = 0; s < strips; ++s) {
                const int64_t n0 = s * sr;
                const int rows = (int)(n_dim - n0 < sr ? n_dim - n0 : sr);
                for (int r = 0; r < rows; ++r) source_row(src, n0 + r, k_dim, buf + r * k_dim);
                for (int r = 0; r < rows; r += NR) {
                    const int nr = rows - r < NR ? rows - r : NR;
                    tile_rows(buf + r * k_dim, k_dim, nr, x, ldx, y + n0 + r, ldy, m_dim);
                }
                if (add != NULL)
                    for (int64_t mm = 0; mm < m_dim; ++mm)
                        for (int r = 0; r < rows; ++r) y[mm * ldy + n0 + r] += add[mm * ldy + n0 + r];
            }
            free(buf);
        }
    }
    return failed ? -2 : 0;
}

/* y[M, N] = x[M, K] @ dequant(w)[N, K]^T; add (if not NULL, [M, N] with row stride ldy) is
 * added to the result. Returns 0, -1 for an unknown type or K not whole blocks, -2 when
 * scratch memory cannot be had. */
int tidegate_packed_linear_f32(int t, const float *x, const uint8_t *w, float *y,
                               const float *add, int64_t m_dim, int64_t n_dim, int64_t k_dim,
                               int64_t ldx, int64_t ldy, int num_threads) {
    const int64_t rb = tidegate_packed_row_bytes(t, k_dim);
    if (rb == 0) return -1;
    const struct row_source src = {t, w, rb, 0, 0, NULL, NULL};
    return strip_linear(&src, x, y, add, m_dim, n_dim, k_dim, ldx, ldy, num_threads);
}

/* The same over an integer matrix (int_weight.py): q [N, K * bits / 8], scales and zeros
 * [N, K / group]. Returns 0, -1 for bits other than 4 and 8 or a group that does not fit
 * the layout, -2 when scratch memory cannot be had. */
int tidegate_int_linear_f32(int bits, int64_t group, const float *x, const uint8_t *q,
                            const float *scales, const uint8_t *zeros, float *y, const float *add,
                            int64_t m_dim, int64_t n_dim, int64_t k_dim, int64_t ldx, int64_t ldy,
                            int num_threads) {
    if ((bits != 4 && bits != 8) || group <= 0 || k_dim % group) return -1;
    if (bits == 4 && (k_dim % 32 || (group % 32 && group != 16))) return -1;
    const struct row_source src = {-1, q, k_dim * bits / 8, bits, group, scales, zeros};
    return strip_linear(&src, x, y, add, m_dim, n_dim, k_dim, ldx, ldy, num_threads);
}

/* FP8 e4m3 (OCP "fn": no infinities, NaN at S.1111.111) as float, exactly: with exponent
 * field e and mantissa m, |v| = (e ? 8 + m : m) << (e ? e - 1 : 0), times 2^-9. The integer
 * is below 2^18 and the power of two is exact, so the float is the e4m3 value itself; going
 * through an integer keeps float32 subnormals (and a DAZ setting) out of the way. */
static inline float fp8_to_f(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const float v = (float)((e ? 8 + m : m) << (e ? e - 1 : 0)) * (1.0f / 512.0f);
    return b & 0x80 ? -v : v;
}

/* One row of an FP8 matrix: 16 values a step as fp8_to_f, times the row's scale. */
static void fp8_row(const struct row_source *src, int64_t r, int64_t k, float *y) {
    const uint8_t *q = src->w + r * src->row_bytes;
    const float s = src->scales[r];
    int64_t c = 0;
    for (; c + 16 <= k; c += 16) {
        const i32x16 b = __builtin_convertvector(*(const u8x16 *)(q + c), i32x16);
        const i32x16 e = (b >> 3) & 15, normal = e != 0; /* normal: -1 or 0 */
        const i32x16 mag = ((normal & 8) | (b & 7)) << (e + normal);
        const i32x16 sign = (b & 0x80) << 24;
        const v16 v = __builtin_convertvector(mag, v16a) * (1.0f / 512.0f);
        store16(y + c, (v16)((i32x16)v ^ sign) * s);
    }
    for (; c < k; ++c) y[c] = fp8_to_f(q[c]) * s;
}

/* The same over an FP8 matrix (fp8_weight.py): q [N, K] e4m3 bytes, scales [N] (weight-only:
 * x stays float32). Returns 0, or -2 when scratch memory cannot be had. */
int tidegate_fp8_linear_f32(const float *x, const uint8_t *q, const float *scales, float *y,
                            const float *add, int64_t m_dim, int64_t n_dim, int64_t k_dim,
                            int64_t ldx, int64_t ldy, int num_threads) {
    const struct row_source src = {.ggml_type = SRC_FP8, .w = q, .row_bytes = k_dim,
                                   .scales = scales};
    return strip_linear(&src, x, y, add, m_dim, n_dim, k_dim, ldx, ldy, num_threads);
}
