/* 8-bit-activation projections over repacked weights: 8 rows in the lanes of a vector (lanes8).
 *
 * Q4_0, Q4_1 and Q8_0 matrices may be repacked once, at load, so that the 8 rows of a group
 * sit side by side: per group of 8 rows and per block of 32 columns,
 *     d[8]    the rows' half-float scales (16 bytes),
 *     m[8]    Q4_1 only: the rows' half-float minimums (16 bytes),
 *     qs      Q4: 4 x 32 bytes, vector j holding each row's qs[4j..4j+3] in its 32-bit lane r
 *             (low nibbles: columns 4j..4j+3, high nibbles: 16+4j..16+4j+3);
 *             Q8_0: 8 x 32 bytes, vector j holding each row's qs[4j..4j+3] (columns 4j..4j+3),
 * the same bytes as the 8 rows' blocks (160, 144 and 272 per group and block). One vector of
 * codes then multiplies 4 columns of x broadcast to every lane (vpmaddubsw, or vpdpbusd with
 * VNNI): the 8 rows' sums build up lane by lane, with no horizontal sums and no gathers. At
 * one row of x this takes half the instructions of the rows layout (q8_linear_cpu.c's
 * group_rows) on AVX2 and on AVX-512 AMD parts alike. The arithmetic is q8_linear_cpu.c's, bit
 * for bit: integer sums of
 * c * q with Q8_0's codes c = q + 128, then the same float steps in the same order.
 * Q8_0 on AVX2 multiplies the signed codes with the sign trick (vpmaddubsw takes one unsigned
 * operand), then adds 128 times the block's sum of q: a code of -128 would overflow it, so a
 * matrix holding one is not repacked (GGML's own quantizer writes -127..127).
 * Whether the loader repacks is q8_linear_cpu.c's to say (tidegate_q8_lanes8_preferred): it
 * knows which path its rows layout takes on this CPU.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_blocks.h"
#include "q8_record.h"

#define L8 8

static inline int lanes8_type(int t) { return t == T_Q4_0 || t == T_Q4_1 || t == T_Q8_0; }

/* Bytes of one block of one row, and where its codes start. */
static inline int64_t l8_block(int t) { return t == T_Q4_0 ? 18 : t == T_Q4_1 ? 20 : 34; }
static inline int64_t l8_codes(int t) { return t == T_Q4_1 ? 4 : 2; }

/* w [n, k] of type t (rows layout) into out (lanes8, the same bytes). Returns 0; -1 for a type
 * other than Q4_0/Q4_1/Q8_0, n not whole groups of 8, k not whole blocks, or a Q8_0 code -128
 * (out is then partly written and not to be used). */
int tidegate_q8_repack_lanes8(int t, const uint8_t *w, int64_t n, int64_t k, uint8_t *out) {
    if (!lanes8_type(t) || n % L8 || k % 32 || k <= 0) return -1;
    const int64_t bb = l8_block(t), blocks = k / 32, rb = blocks * bb, qb = bb - l8_codes(t);
    const int64_t head = t == T_Q4_1 ? 32 : 16;
    for (int64_t g = 0; g < n / L8; ++g)
        for (int64_t b = 0; b < blocks; ++b) {
            uint8_t *o = out + (g * blocks + b) * L8 * bb;
            for (int r = 0; r < L8; ++r) {
                const uint8_t *p = w + (g * L8 + r) * rb + b * bb, *qs = p + l8_codes(t);
                memcpy(o + 2 * r, p, 2);
                if (t == T_Q4_1) memcpy(o + 16 + 2 * r, p + 2, 2);
                for (int64_t j = 0; j < qb / 4; ++j)
                    memcpy(o + head + 32 * j + 4 * r, qs + 4 * j, 4);
                if (t == T_Q8_0)
                    for (int e = 0; e < 32; ++e)
                        if (qs[e] == 0x80) return -1;
            }
        }
    return 0;
}

/* Rows ids[0..n) of a lanes8 matrix w [*, k] back into the rows layout, out [n, row bytes]
 * (embedding lookups in a tied matrix). Returns 0, or -1 for a type without lanes8. */
int tidegate_q8_lanes8_rows(int t, const uint8_t *w, int64_t k, const int64_t *ids, int64_t n,
                            uint8_t *out) {
    if (!lanes8_type(t) || k % 32 || k <= 0) return -1;
    const int64_t bb = l8_block(t), blocks = k / 32, qb = bb - l8_codes(t);
    const int64_t head = t == T_Q4_1 ? 32 : 16;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t g = ids[i] / L8, r = ids[i] % L8;
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t *o = w + (g * blocks + b) * L8 * bb;
            uint8_t *p = out + i * blocks * bb + b * bb;
            memcpy(p, o + 2 * r, 2);
            if (t == T_Q4_1) memcpy(p + 2, o + 16 + 2 * r, 2);
            for (int64_t j = 0; j < qb / 4; ++j)
                memcpy(p + l8_codes(t) + 4 * j, o + head + 32 * j + 4 * r, 4);
        }
    }
    return 0;
}

#if defined(Q8_LANES) || defined(Q8_AVX2)
/* Rows of x per pass over a group's blocks: the decoded codes stay in registers for them
 * (AVX-512 builds have 32 vector registers, AVX2 16). */
#if defined(Q8_LANES)
#define L8_ROWS 8
#else
#define L8_ROWS 4
#endif

static inline __m256i bcast4x8(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* mr rows of x against one group (8 weight rows from g), every block: y[i * ldy + r] (+ add).
 * sx: each row's per-block sums of q (Q8_0 on AVX2 only). */
static inline __attribute__((always_inline)) void lanes8_group(
    int t, const uint8_t *g, int64_t blocks, const struct q8row *x, const int32_t *sx, int mr,
    float *y, const float *add, int64_t ldy) {
    __m256 accd[L8_ROWS], accm[L8_ROWS];
    for (int i = 0; i < mr; ++i) accd[i] = accm[i] = _mm256_setzero_ps();
    (void)sx; /* AVX2's Q8_0 only */
    const int64_t gb = L8 * l8_block(t);
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *p = g + b * gb, *qs = p + (t == T_Q4_1 ? 32 : 16);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        const __m256 m = t == T_Q4_1
            ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))
            : _mm256_mul_ps(d, _mm256_set1_ps(t == T_Q4_0 ? -8.0f : -128.0f));
        __m256i s[L8_ROWS];
        if (t == T_Q8_0) {
#if defined(Q8_LANES) /* VNNI: the unsigned codes q + 128 straight against x */
            __m256i c[8];
            for (int j = 0; j < 8; ++j)
                c[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qs + 32 * j)),
                                        _mm256_set1_epi8((char)0x80));
            for (int i = 0; i < mr; ++i) {
                const int8_t *xb = x[i].q + 32 * b;
                s[i] = _mm256_setzero_si256();
                for (int j = 0; j < 8; ++j)
                    s[i] = _mm256_dpbusd_epi32(s[i], c[j], bcast4x8(xb + 4 * j));
            }
#else /* |x| times q with x's sign: pairs within 16 bits; then + 128 * sum(q) */
            for (int i = 0; i < mr; ++i) {
                const int8_t *xb = x[i].q + 32 * b;
                s[i] = _mm256_set1_epi32(128 * sx[i * blocks + b]);
                for (int j = 0; j < 8; ++j) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
                    const __m256i xv = bcast4x8(xb + 4 * j);
                    s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(_mm256_maddubs_epi16(
                        _mm256_abs_epi8(xv), _mm256_sign_epi8(v, xv)), _mm256_set1_epi16(1)));
                }
            }
#endif
        } else {
            __m256i lo[4], hi[4];
            for (int j = 0; j < 4; ++j) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
                lo[j] = _mm256_and_si256(v, low);
                hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            for (int i = 0; i < mr; ++i) {
                const int8_t *xb = x[i].q + 32 * b;
#if defined(Q8_LANES)
                s[i] = _mm256_setzero_si256();
                for (int j = 0; j < 4; ++j) {
                    s[i] = _mm256_dpbusd_epi32(s[i], lo[j], bcast4x8(xb + 4 * j));
                    s[i] = _mm256_dpbusd_epi32(s[i], hi[j], bcast4x8(xb + 16 + 4 * j));
                }
#else /* codes up to 15: the 8 pairs of products add up within 16 bits (8 * 3810) */
                __m256i h = _mm256_setzero_si256();
                for (int j = 0; j < 4; ++j) {
                    h = _mm256_add_epi16(h, _mm256_maddubs_epi16(lo[j], bcast4x8(xb + 4 * j)));
                    h = _mm256_add_epi16(h, _mm256_maddubs_epi16(hi[j], bcast4x8(xb + 16 + 4 * j)));
                }
                s[i] = _mm256_madd_epi16(h, _mm256_set1_epi16(1));
#endif
            }
        }
        for (int i = 0; i < mr; ++i) {
            accd[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]),
                                      _mm256_mul_ps(d, _mm256_set1_ps(x[i].dx[b])), accd[i]);
            accm[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(x[i].xs32[b]), accm[i]);
        }
    }
    for (int i = 0; i < mr; ++i) {
        float v[L8];
        _mm256_storeu_ps(v, _mm256_add_ps(accd[i], accm[i]));
        for (int r = 0; r < L8; ++r) y[i * ldy + r] = add == NULL ? v[r] : v[r] + add[i * ldy + r];
    }
}
#if defined(Q8_LANES)
/* AVX-512: two neighbouring groups at once, 16 weight rows in a 512-bit vector (group g in the
 * low half, g + 1 in the high one), the same sums lane by lane: for many rows of x, where the
 * 256-bit groups did a prompt chunk's projections at 0.9 of the rows layout's 512-bit lanes. */
static inline __attribute__((always_inline)) void lanes8_pair(
    int t, const uint8_t *g, int64_t blocks, const struct q8row *x, int mr, float *y,
    const float *add, int64_t ldy) {
    __m512 accd[L8_ROWS], accm[L8_ROWS];
    for (int i = 0; i < mr; ++i) accd[i] = accm[i] = _mm512_setzero_ps();
    const int64_t gb = L8 * l8_block(t), next = blocks * gb, head = t == T_Q4_1 ? 32 : 16;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *p = g + b * gb, *q = p + next;
#define PAIR256(off) _mm512_inserti64x4(                                                        \
        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + (off)))),              \
        _mm256_loadu_si256((const __m256i *)(q + (off))), 1)
#define PAIR128(off) _mm256_inserti128_si256(                                                   \
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p + (off)))),                 \
        _mm_loadu_si128((const __m128i *)(q + (off))), 1)
        const __m512 d = _mm512_cvtph_ps(PAIR128(0));
        const __m512 m = t == T_Q4_1
            ? _mm512_cvtph_ps(PAIR128(16))
            : _mm512_mul_ps(d, _mm512_set1_ps(t == T_Q4_0 ? -8.0f : -128.0f));
        __m512i c[8];
        if (t == T_Q8_0) {
            for (int j = 0; j < 8; ++j)
                c[j] = _mm512_xor_si512(PAIR256(head + 32 * j), _mm512_set1_epi8((char)0x80));
        } else {
            for (int j = 0; j < 4; ++j) {
                const __m512i v = PAIR256(head + 32 * j);
                c[j] = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
                c[4 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
            }
        }
#undef PAIR256
#undef PAIR128
        for (int i = 0; i < mr; ++i) {
            const int8_t *xb = x[i].q + 32 * b;
            __m512i s = _mm512_setzero_si512();
            for (int j = 0; j < 8; ++j) { /* Q4: c[j] columns 4j.. below 16, c[4 + j] 16 + 4j.. */
                const int col = t == T_Q8_0 ? 4 * j : j < 4 ? 4 * j : 16 + 4 * (j - 4);
                int32_t v;
                memcpy(&v, xb + col, 4);
                s = _mm512_dpbusd_epi32(s, c[j], _mm512_set1_epi32(v));
            }
            accd[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),
                                      _mm512_mul_ps(d, _mm512_set1_ps(x[i].dx[b])), accd[i]);
            accm[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(x[i].xs32[b]), accm[i]);
        }
    }
    for (int i = 0; i < mr; ++i) {
        float v[2 * L8];
        _mm512_storeu_ps(v, _mm512_add_ps(accd[i], accm[i]));
        for (int r = 0; r < 2 * L8; ++r)
            y[i * ldy + r] = add == NULL ? v[r] : v[r] + add[i * ldy + r];
    }
}
#endif
#define PER_LANES8_TYPE(t, fn, ...)                                                            \
    switch (t) {                                                                               \
    case T_Q4_0: fn(T_Q4_0, __VA_ARGS__); break;                                               \
    case T_Q4_1: fn(T_Q4_1, __VA_ARGS__); break;                                               \
    default: fn(T_Q8_0, __VA_ARGS__); break;                                                   \
    }
#else
#define L8_ROWS 1
/* Portable C: one output at a time, the same integer sums and float steps. */
static void lanes8_group(int t, const uint8_t *g, int64_t blocks, const struct q8row *x,
                         const int32_t *sx, int mr, float *y, const float *add, int64_t ldy) {
    (void)sx;
    const int64_t gb = L8 * l8_block(t), head = t == T_Q4_1 ? 32 : 16;
    for (int i = 0; i < mr; ++i)
        for (int r = 0; r < L8; ++r) {
            float accd = 0.0f, accm = 0.0f;
            for (int64_t b = 0; b < blocks; ++b) {
                const uint8_t *p = g + b * gb, *qs = p + head;
                const int8_t *xb = x[i].q + 32 * b;
                const float d = rdh(p + 2 * r);
                const float m = t == T_Q4_1 ? rdh(p + 16 + 2 * r)
                                            : d * (t == T_Q4_0 ? -8.0f : -128.0f);
                int32_t s = 0;
                for (int col = 0; col < 32; ++col) {
                    int32_t c;
                    if (t == T_Q8_0) {
                        c = (qs[32 * (col / 4) + 4 * r + col % 4] ^ 0x80);
                    } else {
                        const int lo = col < 16, cc = lo ? col : col - 16;
                        const uint8_t byte = qs[32 * (cc / 4) + 4 * r + cc % 4];
                        c = lo ? byte & 0xF : byte >> 4;
                    }
                    s += c * (int32_t)xb[col];
                }
                accd = fmaf((float)s, d * x[i].dx[b], accd);
                accm = fmaf(m, x[i].xs32[b], accm);
            }
            const float v = accd + accm;
            y[i * ldy + r] = add == NULL ? v : v + add[i * ldy + r];
        }
}
#define PER_LANES8_TYPE(t, fn, ...) fn(t, __VA_ARGS__)
#endif

/* Rows of x per thread pass: a chunk's 8-bit rows stay in L1 while the thread's groups (its
 * share of the matrix, in L2) go by. */
#define L8_CHUNK 32
/* Rows of x beyond which AVX-512 takes two groups at a time (lanes8_pair). */
#ifndef L8_PAIR_FROM
#define L8_PAIR_FROM 4
#endif

/* y[M, N] = records xq @ w^T for a lanes8 matrix w (n whole groups of 8), + add; the entry
 * point's contract (tidegate_q8_packed_linear). */
int tidegate_q8_lanes8_linear(int t, const uint8_t *xq, const uint8_t *w, float *y,
                              const float *add, int64_t m_dim, int64_t n_dim, int64_t k_dim,
                              int64_t ldy, int num_threads) {
    if (!lanes8_type(t) || n_dim % L8 || k_dim % 32 || k_dim <= 0) return -1;
    const int64_t blocks = k_dim / 32, xrb = tidegate_q8_row_bytes(k_dim), groups = n_dim / L8;
    const int64_t gb = L8 * l8_block(t);
    int32_t *sx = NULL;
#if defined(Q8_AVX2)
    if (t == T_Q8_0) { /* each row's sum of q per block, for the sign trick */
        sx = malloc((size_t)(m_dim * blocks) * sizeof(int32_t));
        if (sx == NULL) return -2;
        for (int64_t i = 0; i < m_dim; ++i)
            for (int64_t b = 0; b < blocks; ++b) {
                const int8_t *q = (const int8_t *)(xq + i * xrb) + 32 * b;
                int32_t s = 0;
                for (int e = 0; e < 32; ++e) s += q[e];
                sx[i * blocks + b] = s;
            }
    }
#endif
    if (num_threads < 1) num_threads = 1;
    if (num_threads > groups) num_threads = (int)groups;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t nth = omp_get_num_threads(), me = omp_get_thread_num();
        /* whole pairs of groups per thread, for lanes8_pair */
        const int64_t pairs = (groups + 1) / 2, g0 = 2 * (pairs * me / nth);
        const int64_t g1 = me + 1 == nth ? groups : 2 * (pairs * (me + 1) / nth);
        for (int64_t c0 = 0; c0 < m_dim; c0 += L8_CHUNK) {
            const int64_t c1 = c0 + L8_CHUNK < m_dim ? c0 + L8_CHUNK : m_dim;
            for (int64_t g = g0; g < g1;) {
#if defined(Q8_LANES) /* two groups per 512-bit vector for more than a few rows of x */
                const int pair = m_dim > L8_PAIR_FROM && g + 1 < g1;
#else
                const int pair = 0;
#endif
                for (int64_t m0 = c0; m0 < c1; m0 += L8_ROWS) {
                    const int mr = c1 - m0 < L8_ROWS ? (int)(c1 - m0) : L8_ROWS;
                    struct q8row x[L8_ROWS];
                    for (int i = 0; i < mr; ++i) x[i] = q8_row(xq + (m0 + i) * xrb, k_dim);
                    float *yg = y + m0 * ldy + g * L8;
                    const float *ag = add == NULL ? NULL : add + m0 * ldy + g * L8;
#if defined(Q8_LANES)
                    if (pair) {
                        PER_LANES8_TYPE(t, lanes8_pair, w + g * blocks * gb, blocks, x, mr, yg, ag,
                                        ldy);
                        continue;
                    }
#endif
                    PER_LANES8_TYPE(t, lanes8_group, w + g * blocks * gb, blocks, x,
                                    sx == NULL ? NULL : sx + m0 * blocks, mr, yg, ag, ldy);
                }
                g += pair ? 2 : 1;
            }
        }
    }
    free(sx);
    return 0;
}
