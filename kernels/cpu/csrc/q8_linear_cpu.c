/* Projections with 8-bit activations on the CPU: y[M, N] = q8(x)[M, K] @ w[N, K]^T, where w is
 * a quantized matrix (GGUF blocks, or integers with group scales) and every row of x is first
 * rounded to 8-bit blocks, as llama.cpp does: the products are integer dot products
 * (AVX512-VNNI vpdpbusd: 64 byte products per instruction) instead of float FMAs on weights
 * unpacked to floats (packed_linear_cpu.c, the exact mode).
 *
 * Activations (tidegate_quantize_rows_q8): each row independently, in blocks of 32 columns,
 * d = max|x| / 127 (computed as max|x| * (1/127)), q = round-to-nearest-even(x / d) as
 * x * (1 / d), so x ~= d * q with q in -127..127. A quantized row is one record of
 * tidegate_q8_row_bytes(K) = 1.5 K bytes: q [K] int8, then float32 d [K/32], xs32 [K/32] and
 * xs16 [K/16], where xs is d times the sum of q over the 32 (or 16) columns (the zero-point
 * and minimum terms need it). One row's record never depends on the other rows.
 *
 * Weights as unsigned codes: every supported format is, per run of 32 columns (a "step"; 16
 * for Q6_K and 16-column integer groups), w = d_s * c + m_s with c an unsigned integer code
 * and d_s, m_s floats: Q4_1/Q5_1 (c the nibble, m the block minimum), Q4_0/Q5_0 (m = -8 d,
 * -16 d), Q8_0 (c = q + 128, m = -128 d), Q4_K/Q5_K (d_s = d * scale, m_s = -dmin * min),
 * Q6_K (d_s = d * scale, m_s = -32 d_s), integers (d_s = scale, m_s = -zero * scale). So
 *     dot(w, x) over a step = d_s * dx * sum(c * q) + m_s * xs.
 *
 * The arithmetic, the same on every path and for every batch (a row's result does not depend
 * on how many rows its step had, nor on which path or thread computed it): for each output
 * (row m of x, row n of w), over the steps s in column order,
 *     i = sum over the step of c * q           (exact, 32-bit integers)
 *     accd = fma((float)i, d_s * dx, accd)
 *     accm = fma(m_s, xs, accm)
 * and y = (accd + accm) (+ add).
 *
 * Paths, chosen when the shared object is compiled (-march=native on the machine that runs it):
 * * AVX512-VNNI: 16 weight rows per vector, one row per 32-bit lane. For each block of 32
 *   columns the 16 rows' codes are gathered 4 bytes at a time into 8 vectors (lane r holds
 *   row r's codes of 4 columns), so vpdpbusd against the activation's 4 bytes broadcast
 *   adds 4 products per lane and the float steps above run lane by lane, 16 outputs at a time,
 *   no horizontal sums. Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 are gathered straight from their blocks; at
 *   up to DIRECT_ROWS rows of x a block is used from registers, at more it is decoded once
 *   per strip into a buffer. Other formats are decoded per row into codes first.
 *   On AMD (Zen 4's gathers are microcoded: the lanes path ran batch-1 decode at a third of
 *   the float kernel's speed on cold weights), up to DIRECT_ROWS rows of x go row by row
 *   instead: one weight row's block of 32 codes decoded into a 256-bit vector with plain
 *   loads, vpdpbusd against each row of x, the 8 partial sums added (exact), then the same
 *   float steps. At more rows of x a strip's blocks are decoded there row by row too and
 *   gathered into lanes from L1 (rows_to_lanes). TIDEGATE_Q8_ROWS / TIDEGATE_Q8_LANES (compile
 *   definitions) force either.
 *   With AMX (Sapphire Rapids and later), 16 rows of x at a time take a block's integer sums
 *   from one tile instruction (tdpbsud: 16 x 16 outputs of 32 products each; the lanes'
 *   codes are already its second operand's layout), then the same float steps.
 * * AVX2 (Zen 3 and other CPUs without AVX-512): Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 go 8 weight rows
 *   at a time, each row's block decoded with plain loads into a 256-bit vector, multiplied
 *   with a row of x by vpmaddubsw (Q8_0's codes reach 255, so vpmaddwd on 16-bit halves),
 *   the 8 rows' partial sums added into one vector (lane r: row r), and the float steps run
 *   for the 8 outputs at once. Other formats, and portable C: rows decoded into codes, then
 *   one dot product per (row, step).
 * * Repacked (lanes8, q8_lanes8_cpu.c; the loader repacks Q4_0/Q4_1/Q8_0 where
 *   tidegate_q8_lanes8_preferred says so: AVX2, and AVX-512 on AMD): 8 weight rows already
 *   side by side in each vector, so a block's codes multiply x's 4 bytes broadcast
 *   (vpmaddubsw, vpdpbusd with VNNI) with no decoding across rows and no horizontal sums:
 *   half the instructions at batch-1 decode.
 * TIDEGATE_NO_AMX, TIDEGATE_NO_AVX512 or TIDEGATE_PORTABLE (compile definitions) force the
 * slower paths, so the tests check them on a machine that has AMX.
 */
#define _GNU_SOURCE /* syscall(), to ask Linux for the AMX tile state */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_blocks.h"
#include "row_source.h"

#include "q8_record.h"

#if defined(Q8_LANES) && !defined(TIDEGATE_NO_AMX) && defined(__AMX_TILE__) && \
    defined(__AMX_INT8__) && defined(__linux__)
#define Q8_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define STRIP 16      /* weight rows per strip: one per 32-bit lane of an AVX-512 vector */
#define DIRECT_ROWS 4 /* rows of x up to which a block's codes are used straight from registers */

/* fn(TYPE, ...) with the type a constant: one inlined instance per type, so that the switch on
 * the type is taken once per strip and leaves the block loops. */
#define PER_DIRECT_TYPE(t, fn, ...)                                                            \
    switch (t) {                                                                               \
    case T_Q4_0: fn(T_Q4_0, __VA_ARGS__); break;                                               \
    case T_Q4_1: fn(T_Q4_1, __VA_ARGS__); break;                                               \
    case T_Q5_0: fn(T_Q5_0, __VA_ARGS__); break;                                               \
    case T_Q5_1: fn(T_Q5_1, __VA_ARGS__); break;                                               \
    default: fn(T_Q8_0, __VA_ARGS__); break;                                                   \
    }

#if defined(Q8_AMX)
static int amx_ready(void);
#endif

/* Which path this build computes with: 3 AVX512-VNNI with AMX tiles for 16 rows of x and
 * more, 2 AVX512-VNNI, 1 AVX2, 0 portable C. */
int tidegate_q8_path(void) {
#if defined(Q8_AMX)
    return amx_ready() ? 3 : 2;
#elif defined(Q8_LANES)
    return 2;
#elif defined(Q8_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------------------------------- */
/* Activations                                                                              */

/* Bytes of one quantized row of k columns; 0 when k is not whole blocks of 32. */
int64_t tidegate_q8_row_bytes(int64_t k) { return k % 32 || k <= 0 ? 0 : k + k / 2; }

/* One row x[k] into its record (layout above). */
void tidegate_quantize_row_q8(const float *x, int64_t k, uint8_t *rec) {
    int8_t *q = (int8_t *)rec;
    float *dx = (float *)(rec + k), *xs32 = dx + k / 32, *xs16 = dx + k / 16;
    for (int64_t b = 0; b < k / 32; ++b) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(xb[i]));
        /* Through volatiles: with reciprocal and associative math allowed, the compiler
         * otherwise rewrote 1 / (amax * (1/127)) as 127 / amax, which rounds differently and
         * moved some q by one from the reference's. */
        volatile float dv = amax * (1.0f / 127.0f);
        const float d = dv;
        volatile float idv = d > 0.0f ? 1.0f / d : 0.0f;
        const float id = idv;
        int32_t s[2];
        for (int h = 0; h < 2; ++h) { /* halves of 16: one vector each, their sums exact */
            int32_t sum = 0;
            for (int i = 16 * h; i < 16 * h + 16; ++i) {
                const int32_t v = (int32_t)nearbyintf(xb[i] * id);
                q[32 * b + i] = (int8_t)v;
                sum += v;
            }
            s[h] = sum;
        }
        dx[b] = d;
        xs16[2 * b] = d * (float)s[0];
        xs16[2 * b + 1] = d * (float)s[1];
        xs32[b] = d * (float)(s[0] + s[1]);
    }
}

/* Rows x[m, k] (row stride ldx floats) into m records, tidegate_q8_row_bytes(k) apart. */
void tidegate_quantize_rows_q8(const float *x, int64_t ldx, int64_t m, int64_t k, uint8_t *out,
                               int num_threads) {
    const int64_t rb = tidegate_q8_row_bytes(k);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m >= 64)
    for (int64_t r = 0; r < m; ++r) tidegate_quantize_row_q8(x + r * ldx, k, out + r * rb);
}

/* ---------------------------------------------------------------------------------------- */
/* Weights: codes and step scales                                                           */

/* Q4_K / Q5_K's 6-bit scale and minimum of sub-block j (llama.cpp's get_scale_min_k4). */
static inline void scale_min_k4(int j, const uint8_t *sc, uint8_t *scv, uint8_t *mv) {
    if (j < 4) {
        *scv = sc[j] & 63;
        *mv = sc[j + 4] & 63;
    } else {
        *scv = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
        *mv = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

/* Row r as codes c[k] and per-step d[], m[] (k / 32 steps, or k / 16 with src->half). */
static void decode_row(const struct row_source *src, int64_t r, int64_t k, uint8_t *c, float *d,
                       float *m) {
    const uint8_t *p = src->w + r * src->row_bytes;
    switch (src->ggml_type) {
    case T_Q4_0:
    case T_Q4_1:
        for (int64_t b = 0; b < k / 32; ++b, c += 32) {
            const int one = src->ggml_type == T_Q4_1;
            const uint8_t *blk = p + b * (one ? 20 : 18), *qs = blk + (one ? 4 : 2);
            d[b] = rdh(blk);
            m[b] = one ? rdh(blk + 2) : -8.0f * d[b];
            for (int j = 0; j < 16; ++j) {
                c[j] = qs[j] & 0xF;
                c[j + 16] = qs[j] >> 4;
            }
        }
        return;
    case T_Q5_0:
    case T_Q5_1:
        for (int64_t b = 0; b < k / 32; ++b, c += 32) {
            const int one = src->ggml_type == T_Q5_1;
            const uint8_t *blk = p + b * (one ? 24 : 22), *h = blk + (one ? 4 : 2), *qs = h + 4;
            const uint32_t qh = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 |
                                (uint32_t)h[3] << 24;
            d[b] = rdh(blk);
            m[b] = one ? rdh(blk + 2) : -16.0f * d[b];
            for (int j = 0; j < 16; ++j) {
                c[j] = (uint8_t)((qs[j] & 0xF) | ((qh >> j) & 1) << 4);
                c[j + 16] = (uint8_t)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
            }
        }
        return;
    case T_Q8_0:
        for (int64_t b = 0; b < k / 32; ++b, c += 32) {
            const uint8_t *blk = p + 34 * b;
            d[b] = rdh(blk);
            m[b] = -128.0f * d[b];
            for (int j = 0; j < 32; ++j) c[j] = blk[2 + j] ^ 0x80;
        }
        return;
    case T_Q4_K:
    case T_Q5_K:
        for (int64_t sb = 0; sb < k / 256; ++sb) {
            const int five = src->ggml_type == T_Q5_K;
            const uint8_t *blk = p + sb * (five ? 176 : 144);
            const float dd = rdh(blk), dmin = rdh(blk + 2);
            const uint8_t *qh = blk + 16, *qs = blk + (five ? 48 : 16);
            for (int j = 0; j < 8; ++j, c += 32) {
                uint8_t scv, mv;
                scale_min_k4(j, blk + 4, &scv, &mv);
                d[8 * sb + j] = dd * scv;
                m[8 * sb + j] = -(dmin * mv);
                const uint8_t *q = qs + 32 * (j / 2);
                for (int l = 0; l < 32; ++l) {
                    uint8_t v = j % 2 ? q[l] >> 4 : q[l] & 0xF;
                    if (five) v |= ((qh[l] >> j) & 1) << 4;
                    c[l] = v;
                }
            }
        }
        return;
    case T_Q6_K:
        for (int64_t sb = 0; sb < k / 256; ++sb, c += 256) {
            const uint8_t *blk = p + 210 * sb;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const float dd = rdh(blk + 208);
            for (int j = 0; j < 16; ++j) {
                d[16 * sb + j] = dd * (float)sc[j];
                m[16 * sb + j] = -32.0f * d[16 * sb + j];
            }
            for (int n = 0; n < 2; ++n) {
                const uint8_t *ql = blk + 64 * n, *qh = blk + 128 + 32 * n;
                uint8_t *o = c + 128 * n;
                for (int l = 0; l < 32; ++l) {
                    o[l] = (uint8_t)((ql[l] & 0xF) | ((qh[l] & 3) << 4));
                    o[l + 32] = (uint8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
                    o[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                    o[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
                }
            }
        }
        return;
    default: { /* integers with group scales and zero points (int_weight.py's layout) */
        const int64_t groups = k / src->group, step = src->half ? 16 : 32;
        const float *sc = src->scales + r * groups;
        const uint8_t *zp = src->zeros + r * groups;
        if (src->bits == 8) {
            memcpy(c, p, (size_t)k);
        } else {
            for (int64_t c0 = 0; c0 < k; c0 += 32)
                for (int j = 0; j < 16; ++j) {
                    c[c0 + j] = p[c0 / 2 + j] & 0xF;
                    c[c0 + 16 + j] = p[c0 / 2 + j] >> 4;
                }
        }
        for (int64_t s = 0; s < k / step; ++s) {
            const int64_t g = s * step / src->group;
            d[s] = sc[g];
            m[s] = -((float)zp[g] * sc[g]);
        }
        return;
    }
    }
}

#if defined(Q8_LANES) || defined(Q8_AVX2)
/* AVX2 (also the AVX-512 build's path on AMD for a few rows of x), blocks of 32 columns
 * straight from the matrix (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): GROUP
 * weight rows at a time, each row's block of codes decoded with plain loads into a 256-bit
 * vector (column j in byte j), its integer dot product with a row of x as 8 partial sums
 * (exact), and the GROUP rows' partial sums added into one vector, lane r for row r, so the
 * float steps run for GROUP outputs at once, in the order the header defines. */
#define GROUP 8

/* Whether a type's blocks are read straight from the matrix (else: decode_row first). */
static inline int direct_type(int t) {
    return t == T_Q4_0 || t == T_Q4_1 || t == T_Q5_0 || t == T_Q5_1 || t == T_Q8_0;
}

static inline int64_t block_bytes(int t) {
    return t == T_Q4_0 ? 18 : t == T_Q4_1 ? 20 : t == T_Q5_0 ? 22 : t == T_Q5_1 ? 24 : 34;
}

/* One row's block at p: its 32 codes, column j in byte j (Q8_0: q + 128). */
static inline __attribute__((always_inline)) __m256i block_codes(int t, const uint8_t *p) {
    if (t == T_Q8_0)
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 2)),
                                _mm256_set1_epi8((char)0x80));
    const int five = t == T_Q5_0 || t == T_Q5_1, one = t == T_Q4_1 || t == T_Q5_1;
    const uint8_t *qs = p + (one ? 4 : 2) + (five ? 4 : 0);
    /* The 16 bytes in both halves, the upper half shifted right by 4 within 64-bit lanes: a
     * byte's high nibble lands in its low four bits (its neighbour's bits above them go with
     * the mask), so one load, shift and mask give columns 0-15 below and 16-31 above. */
    const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    __m256i c = _mm256_and_si256(_mm256_srlv_epi64(q, _mm256_setr_epi64x(0, 0, 4, 4)),
                                 _mm256_set1_epi8(0x0F));
    if (five) { /* bit j of the 32-bit qh is the fifth bit of column j */
        uint32_t qh;
        memcpy(&qh, p + (one ? 4 : 2), 4);
#if defined(Q8_LANES) /* AVX512-BW: qh is the byte mask */
        return _mm256_or_si256(c, _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(0x10)));
#else
        const __m256i spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32((int)qh),
            _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                             3, 3, 3, 3, 3, 3, 3, 3));
        const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        c = _mm256_or_si256(c, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
#endif
    }
    return c;
}

/* The GROUP rows' d and m of block b (rows[r] points at row r's first block), widened from half
 * floats exactly as decode_row's (m = -8 d, -16 d, -128 d where the format has no minimum). */
static inline __attribute__((always_inline)) void block_scales(int t, const uint8_t *const *rows,
                                                               int64_t b, __m256 *d, __m256 *m) {
    const int64_t bb = block_bytes(t);
    uint32_t w[GROUP];
    for (int r = 0; r < GROUP; ++r) memcpy(&w[r], rows[r] + b * bb, 4);
    /* Inserted lane by lane: eight 4-byte stores read back as one 32-byte load would stall on
     * store forwarding. */
    const __m256i dm = _mm256_setr_epi32((int)w[0], (int)w[1], (int)w[2], (int)w[3], (int)w[4],
                                         (int)w[5], (int)w[6], (int)w[7]);
    const __m256i halves = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(dm, _mm256_set1_epi32(0xFFFF)),
                            _mm256_srli_epi32(dm, 16)),
        _MM_SHUFFLE(3, 1, 2, 0));
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
    if (t == T_Q4_1 || t == T_Q5_1)
        *m = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
    else
        *m = _mm256_mul_ps(*d, _mm256_set1_ps(t == T_Q4_0 ? -8.0f : t == T_Q5_0 ? -16.0f
                                                                                  : -128.0f));
}

/* The sum of v's 8 lanes. */
static inline int32_t hsum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* Lane r: the sum of s[r]'s 8 lanes (integers: exact in any order). */
static inline __attribute__((always_inline)) __m256i lanes_of_sums(const __m256i *s) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                            _mm256_permute2x128_si256(a, b, 0x31));
}

/* Block b's float steps for mr rows of x against a group's codes c[GROUP] and scales d, m. */
static inline __attribute__((always_inline)) void group_block(
    int t, const __m256i *c, __m256 d, __m256 m, const struct q8row *x, int mr, int64_t b,
    __m256 *accd, __m256 *accm) {
    for (int i = 0; i < mr; ++i) {
        const __m256i xq = _mm256_loadu_si256((const __m256i *)(x[i].q + 32 * b));
        __m256i s[GROUP];
#if defined(Q8_LANES) /* VNNI: four byte products into each 32-bit lane, exact for any code */
        for (int r = 0; r < GROUP; ++r) s[r] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), c[r], xq);
#else
        if (t == T_Q8_0) { /* codes up to 255: 16-bit products, as vpmaddubsw would saturate */
            const __m256i xl = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(xq));
            const __m256i xh = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(xq, 1));
            for (int r = 0; r < GROUP; ++r)
                s[r] = _mm256_add_epi32(
                    _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(c[r])), xl),
                    _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(c[r], 1)), xh));
        } else { /* codes up to 31: each pair of byte products fits 16 bits */
            for (int r = 0; r < GROUP; ++r)
                s[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(c[r], xq), _mm256_set1_epi16(1));
        }
#endif
        const __m256 i32 = _mm256_cvtepi32_ps(lanes_of_sums(s));
        accd[i] = _mm256_fmadd_ps(i32, _mm256_mul_ps(d, _mm256_set1_ps(x[i].dx[b])), accd[i]);
        accm[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(x[i].xs32[b]), accm[i]);
    }
}

static inline __attribute__((always_inline)) void group_store(
    const __m256 *accd, const __m256 *accm, int mr, int rows, float *y, const float *add,
    int64_t ldy) {
    for (int i = 0; i < mr; ++i) {
        float v[GROUP];
        _mm256_storeu_ps(v, _mm256_add_ps(accd[i], accm[i]));
        for (int r = 0; r < rows; ++r) y[i * ldy + r] = add == NULL ? v[r] : v[r] + add[i * ldy + r];
    }
}

/* m_dim rows of x against `rows` (up to GROUP) weight rows from base: up to DIRECT_ROWS rows
 * of x straight from the decoded block; more through the group's codes decoded once into buf
 * (k / 32 * GROUP vectors) and scales (2 * k / 32). */
static inline __attribute__((always_inline)) void group_rows(
    int t, const uint8_t *base, int64_t row_bytes, int rows, const uint8_t *xbuf, int64_t xrb,
    int64_t m_dim, float *y, const float *add, int64_t ldy, int64_t k, __m256i *buf,
    __m256 *scales) {
    const uint8_t *row[GROUP];
    const int64_t bb = block_bytes(t), blocks = k / 32;
    for (int r = 0; r < GROUP; ++r) row[r] = base + (r < rows ? r : rows - 1) * row_bytes;
    if (m_dim <= DIRECT_ROWS) {
        struct q8row x[DIRECT_ROWS];
        __m256 accd[DIRECT_ROWS], accm[DIRECT_ROWS];
        for (int i = 0; i < m_dim; ++i) {
            x[i] = q8_row(xbuf + i * xrb, k);
            accd[i] = accm[i] = _mm256_setzero_ps();
        }
        /* The next group's bytes, a few lines per block: its 8 rows are read block by block,
         * across the rows, which the hardware's streaming prefetch does not follow ahead. */
        const uint8_t *next = base + GROUP * row_bytes;
        const int64_t lines = (GROUP * row_bytes + 63) / 64;
        for (int64_t b = 0; b < blocks; ++b) {
            __m256i c[GROUP];
            __m256 d, m;
            for (int64_t l = b * lines / blocks; l < (b + 1) * lines / blocks; ++l)
                _mm_prefetch((const char *)(next + 64 * l), _MM_HINT_T0);
            for (int r = 0; r < GROUP; ++r) c[r] = block_codes(t, row[r] + b * bb);
            block_scales(t, row, b, &d, &m);
            group_block(t, c, d, m, x, (int)m_dim, b, accd, accm);
        }
        group_store(accd, accm, (int)m_dim, rows, y, add, ldy);
        return;
    }
    for (int64_t b = 0; b < blocks; ++b) {
        for (int r = 0; r < GROUP; ++r) buf[GROUP * b + r] = block_codes(t, row[r] + b * bb);
        block_scales(t, row, b, &scales[2 * b], &scales[2 * b + 1]);
    }
    for (int64_t m0 = 0; m0 < m_dim; m0 += DIRECT_ROWS) {
        const int mr = m_dim - m0 < DIRECT_ROWS ? (int)(m_dim - m0) : DIRECT_ROWS;
        struct q8row x[DIRECT_ROWS];
        __m256 accd[DIRECT_ROWS], accm[DIRECT_ROWS];
        for (int i = 0; i < mr; ++i) {
            x[i] = q8_row(xbuf + (m0 + i) * xrb, k);
            accd[i] = accm[i] = _mm256_setzero_ps();
        }
        for (int64_t b = 0; b < blocks; ++b)
            group_block(t, buf + GROUP * b, scales[2 * b], scales[2 * b + 1], x, mr, b, accd, accm);
        group_store(accd, accm, mr, rows, y + m0 * ldy, add == NULL ? NULL : add + m0 * ldy, ldy);
    }
}
#endif

/* ---------------------------------------------------------------------------------------- */
/* AVX512-VNNI: 16 weight rows per vector                                                   */
#if defined(Q8_LANES)

/* One block of 32 columns of a strip's 16 rows: q[u] lane r = row r's codes of columns
 * 4u .. 4u+3; d[h], m[h] the step scales (h = 1 only for steps of 16: columns 16-31). */
struct lanes {
    __m512i q[8];
    __m512 d[2], m[2];
};

static inline __m512i gather4(__m512i idx, const uint8_t *p, __mmask16 k) {
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, idx, p, 1);
}
static inline __m512 half_lo(__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }
static inline __m512 half_hi(__m512i v) {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
}

/* Nibbles of 4 bytes per lane: the low ones are columns 4u.., the high ones 16 + 4u.. */
static inline void nibbles(struct lanes *L, int u, __m512i t) {
    const __m512i lo = _mm512_set1_epi8(0x0F);
    L->q[u] = _mm512_and_si512(t, lo);
    L->q[u + 4] = _mm512_and_si512(_mm512_srli_epi32(t, 4), lo);
}

/* Bits shift .. shift+3 of each lane's 32-bit qh as bit 4 of its 4 bytes (Q5's fifth bits). */
static inline __m512i fifth_bits(__m512i qh, int shift) {
    const int byte = shift / 8, off = shift % 8;
    const __m512i pick = _mm512_add_epi8(
        _mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0x00000000),
        _mm512_set1_epi8((char)byte));
    const __m512i rep = _mm512_shuffle_epi8(qh, pick);
    const __m512i bits = _mm512_set1_epi32((int)((1u << off) | (2u << off) << 8 |
                                                 (4u << off) << 16 | (8u << off) << 24));
    return _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(rep, bits), _mm512_set1_epi8(0x10));
}

/* Block b of the strip starting at base (lane r: row r, idx = r * row_bytes). The d and m
 * computed here equal decode_row's bit for bit (half floats widened, times -8, -16, -128). */
static inline __attribute__((always_inline)) void gather_block(int t, const uint8_t *base,
                                                               __m512i idx, __mmask16 k,
                                                               int64_t b, struct lanes *L) {
    switch (t) {
    case T_Q4_0: {
        const uint8_t *p = base + 18 * b;
        L->d[0] = half_lo(gather4(idx, p, k));
        L->m[0] = _mm512_mul_ps(L->d[0], _mm512_set1_ps(-8.0f));
        for (int u = 0; u < 4; ++u) nibbles(L, u, gather4(idx, p + 2 + 4 * u, k));
        break;
    }
    case T_Q4_1: {
        const uint8_t *p = base + 20 * b;
        const __m512i dm = gather4(idx, p, k);
        L->d[0] = half_lo(dm);
        L->m[0] = half_hi(dm);
        for (int u = 0; u < 4; ++u) nibbles(L, u, gather4(idx, p + 4 + 4 * u, k));
        break;
    }
    case T_Q5_0:
    case T_Q5_1: {
        const int one = t == T_Q5_1;
        const uint8_t *p = base + b * (one ? 24 : 22), *h = p + (one ? 4 : 2);
        const __m512i dm = gather4(idx, p, k), qh = gather4(idx, h, k);
        L->d[0] = half_lo(dm);
        L->m[0] = one ? half_hi(dm) : _mm512_mul_ps(L->d[0], _mm512_set1_ps(-16.0f));
        for (int u = 0; u < 4; ++u) {
            nibbles(L, u, gather4(idx, h + 4 + 4 * u, k));
            L->q[u] = _mm512_or_si512(L->q[u], fifth_bits(qh, 4 * u));
            L->q[u + 4] = _mm512_or_si512(L->q[u + 4], fifth_bits(qh, 16 + 4 * u));
        }
        break;
    }
    default: { /* T_Q8_0: signed bytes, offset by 128 */
        const uint8_t *p = base + 34 * b;
        L->d[0] = half_lo(gather4(idx, p, k));
        L->m[0] = _mm512_mul_ps(L->d[0], _mm512_set1_ps(-128.0f));
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int u = 0; u < 8; ++u) L->q[u] = _mm512_xor_si512(gather4(idx, p + 2 + 4 * u, k), flip);
        break;
    }
    }
}

/* Block b from a strip decoded by decode_row: codes [16][k], d and m [16][steps]. */
static inline void gather_decoded(const uint8_t *codes, const float *d, const float *m,
                                  int64_t k, int half, __mmask16 km, int64_t b, struct lanes *L) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i idx = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)k));
    const int64_t steps = half ? k / 16 : k / 32;
    const __m512i sidx = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)steps));
    for (int u = 0; u < 8; ++u) L->q[u] = gather4(idx, codes + 32 * b + 4 * u, km);
    for (int h = 0; h <= half; ++h) {
        const int64_t s = half ? 2 * b + h : b;
        L->d[h] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), km, sidx, d + s, 4);
        L->m[h] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), km, sidx, m + s, 4);
    }
}

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* One step's float arithmetic for 16 outputs (the header comment's): i its integer sums. */
static inline __attribute__((always_inline)) void float_step(__m512i i, __m512 d, __m512 m,
                                                             float dx, float xs, __m512 *accd,
                                                             __m512 *accm) {
    *accd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(d, _mm512_set1_ps(dx)), *accd);
    *accm = _mm512_fmadd_ps(m, _mm512_set1_ps(xs), *accm);
}

/* The steps of block b for one row of x. */
static inline __attribute__((always_inline)) void lanes_step(const struct lanes *L, int half,
                                                             const struct q8row *x, int64_t b,
                                                             __m512 *accd, __m512 *accm) {
    const int8_t *xq = x->q + 32 * b;
    for (int h = 0; h < 2; h += half ? 1 : 2) {
        const int u0 = half ? 4 * h : 0, u1 = half ? u0 + 4 : 8;
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int u = u0; u < u1; u += 2) { /* two chains: the sums are exact either way */
            s0 = _mm512_dpbusd_epi32(s0, L->q[u], bcast4(xq + 4 * u));
            s1 = _mm512_dpbusd_epi32(s1, L->q[u + 1], bcast4(xq + 4 * u + 4));
        }
        float_step(_mm512_add_epi32(s0, s1), L->d[h], L->m[h], x->dx[b],
                   half ? x->xs16[2 * b + h] : x->xs32[b], accd, accm);
    }
}

static inline void lanes_store(__m512 accd, __m512 accm, float *y, const float *add,
                               __mmask16 km) {
    __m512 v = _mm512_add_ps(accd, accm);
    if (add != NULL) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(km, add));
    _mm512_mask_storeu_ps(y, km, v);
}

/* Up to DIRECT_ROWS rows of x: each block gathered into registers and used for every row. */
static inline __attribute__((always_inline)) void strip_direct(
    int t, const uint8_t *base, __m512i idx, __mmask16 km, const uint8_t *xbuf, int64_t xrb,
    int mr, float *y, const float *add, int64_t ldy, int64_t k) {
    struct q8row x[DIRECT_ROWS];
    __m512 accd[DIRECT_ROWS], accm[DIRECT_ROWS];
    for (int i = 0; i < mr; ++i) {
        x[i] = q8_row(xbuf + i * xrb, k);
        accd[i] = accm[i] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < k / 32; ++b) {
        struct lanes L;
        gather_block(t, base, idx, km, b, &L);
        for (int i = 0; i < mr; ++i) lanes_step(&L, 0, &x[i], b, &accd[i], &accm[i]);
    }
    for (int i = 0; i < mr; ++i)
        lanes_store(accd[i], accm[i], y + i * ldy, add == NULL ? NULL : add + i * ldy, km);
}

/* Whether the weights' blocks are read row by row with plain loads rather than gathered into
 * lanes (vpgatherdd, microcode on AMD): up to DIRECT_ROWS rows of x through group_rows for 4-
 * and 5-bit codes (GROUP weight rows at a time, their sums in one vector: on Zen 4 1.6-1.9x the
 * one-row-at-a-time dot products of strip_rows, the same bits) and strip_rows for Q8_0, more
 * through rows_to_lanes. On AMD, unless a definition forces either. */
static int rows_path(void) {
#if defined(TIDEGATE_Q8_ROWS)
    return 1;
#elif defined(TIDEGATE_Q8_LANES)
    return 0;
#else
    static int amd = -1;
    if (amd < 0) {
        __builtin_cpu_init();
        amd = __builtin_cpu_is("amd") ? 1 : 0;
    }
    return amd;
#endif
}

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Block b of one weight row (row points at its first block): its 32 codes (column j in byte j)
 * and the step's d and m, equal to gather_block's bit for bit. */
static inline __attribute__((always_inline)) __m256i rows_block(int t, const uint8_t *row,
                                                                int64_t b, float *d, float *m) {
    const uint8_t *p = row + b * block_bytes(t);
    *d = half_to_float(p);
    *m = t == T_Q4_1 || t == T_Q5_1 ? half_to_float(p + 2)
                                    : *d * (t == T_Q4_0 ? -8.0f : t == T_Q5_0 ? -16.0f : -128.0f);
    return block_codes(t, p);
}

/* Block b of a strip into lanes without gathering from the matrix: each of its rows decoded
 * with plain loads (rows_block) into tmp, then the lanes gathered from tmp, in L1. The same
 * codes, d and m as gather_block. */
static inline __attribute__((always_inline)) void rows_to_lanes(
    int t, const uint8_t *base, int64_t row_bytes, int rows, __mmask16 km, int64_t b,
    struct lanes *L) {
    uint8_t tmp[STRIP * 32] __attribute__((aligned(64)));
    float d[STRIP] = {0}, m[STRIP] = {0};
    for (int r = 0; r < rows; ++r)
        _mm256_store_si256((__m256i *)(tmp + 32 * r), rows_block(t, base + r * row_bytes, b, d + r, m + r));
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i idx = _mm512_slli_epi32(lane, 5);
    for (int u = 0; u < 8; ++u) L->q[u] = gather4(idx, tmp + 4 * u, km);
    L->d[0] = _mm512_maskz_loadu_ps(km, d);
    L->m[0] = _mm512_maskz_loadu_ps(km, m);
}

/* Up to DIRECT_ROWS rows of x against a strip's `rows` weight rows, one weight row at a time. */
static inline __attribute__((always_inline)) void strip_rows(
    int t, const uint8_t *base, int64_t row_bytes, int rows, const uint8_t *xbuf, int64_t xrb,
    int mr, float *y, const float *add, int64_t ldy, int64_t k) {
    struct q8row x[DIRECT_ROWS];
    for (int i = 0; i < mr; ++i) x[i] = q8_row(xbuf + i * xrb, k);
    for (int r = 0; r < rows; ++r) {
        const uint8_t *row = base + r * row_bytes;
        float accd[DIRECT_ROWS] = {0}, accm[DIRECT_ROWS] = {0};
        for (int64_t b = 0; b < k / 32; ++b) {
            float d, m;
            const __m256i c = rows_block(t, row, b, &d, &m);
            for (int i = 0; i < mr; ++i) {
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(x[i].q + 32 * b));
                const int32_t isum = hsum8(_mm256_dpbusd_epi32(_mm256_setzero_si256(), c, xq));
                accd[i] = fmaf((float)isum, d * x[i].dx[b], accd[i]);
                accm[i] = fmaf(m, x[i].xs32[b], accm[i]);
            }
        }
        for (int i = 0; i < mr; ++i) {
            float v = accd[i] + accm[i];
            if (add != NULL) v += add[i * ldy + r];
            y[i * ldy + r] = v;
        }
    }
}

/* Any number of rows of x against a strip whose blocks are in buf (4 rows of x at a time). */
static void strip_buffered(const struct lanes *buf, int half, __mmask16 km, const uint8_t *xbuf,
                           int64_t xrb, int64_t m_dim, float *y, const float *add, int64_t ldy,
                           int64_t k) {
    for (int64_t m0 = 0; m0 < m_dim; m0 += 4) {
        const int mr = m_dim - m0 < 4 ? (int)(m_dim - m0) : 4;
        struct q8row x[4];
        __m512 accd[4], accm[4];
        for (int i = 0; i < mr; ++i) {
            x[i] = q8_row(xbuf + (m0 + i) * xrb, k);
            accd[i] = accm[i] = _mm512_setzero_ps();
        }
        for (int64_t b = 0; b < k / 32; ++b)
            for (int i = 0; i < mr; ++i) lanes_step(&buf[b], half, &x[i], b, &accd[i], &accm[i]);
        for (int i = 0; i < mr; ++i)
            lanes_store(accd[i], accm[i], y + (m0 + i) * ldy,
                        add == NULL ? NULL : add + (m0 + i) * ldy, km);
    }
}

#if defined(Q8_AMX)
/* Linux lends the AMX tile state to a process that asks (once, for all its threads). */
static int amx_ready(void) {
    static volatile int state = 0; /* 0 not asked yet, 1 granted, -1 refused */
    if (state == 0)
        state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                        18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
    return state > 0;
}

/* Tiles: 0-3 a block's 16 x 16 sums each, 4-5 16 rows of x's block (32 bytes), 6-7 the
 * strip's codes of a block (8 rows of 16 lanes x 4 bytes: struct lanes' q). */
static void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = t == 4 || t == 5 ? 32 : 64;
        cfg.rows[t] = t >= 6 ? 8 : 16;
    }
    _tile_loadconfig(&cfg);
}

/* Block b0 + j's sums for 16 rows of x (xq, stride xrb) into sums[j]: [row of x][lane]. */
#define AMX_BLOCK(j, a, bt)                                                                    \
    do {                                                                                       \
        _tile_loadd(a, xq + 32 * (b0 + j), xrb);                                               \
        _tile_loadd(bt, buf[b0 + j].q, 64);                                                    \
        _tile_zero(j);                                                                         \
        _tile_dpbsud(j, a, bt);                                                                \
        _tile_stored(j, sums[j], 64);                                                          \
    } while (0)

/* Rows m0 .. m0+15 of x against a strip whose blocks are in buf (steps of 32 columns). */
static void strip_amx16(const struct lanes *buf, __mmask16 km, const uint8_t *xbuf, int64_t xrb,
                        int64_t m0, float *y, const float *add, int64_t ldy, int64_t k) {
    int32_t sums[4][16][16] __attribute__((aligned(64)));
    __m512 accd[16], accm[16];
    struct q8row x[16];
    const int64_t blocks = k / 32;
    const uint8_t *xq = xbuf + m0 * xrb;
    for (int i = 0; i < 16; ++i) {
        x[i] = q8_row(xbuf + (m0 + i) * xrb, k);
        accd[i] = accm[i] = _mm512_setzero_ps();
    }
    for (int64_t b0 = 0; b0 < blocks; b0 += 4) {
        const int nb = blocks - b0 < 4 ? (int)(blocks - b0) : 4;
        AMX_BLOCK(0, 4, 6);
        if (nb > 1) AMX_BLOCK(1, 5, 7);
        if (nb > 2) AMX_BLOCK(2, 4, 6);
        if (nb > 3) AMX_BLOCK(3, 5, 7);
        for (int i = 0; i < 16; ++i)
            for (int j = 0; j < nb; ++j) {
                const struct lanes *L = &buf[b0 + j];
                float_step(_mm512_load_si512(sums[j][i]), L->d[0], L->m[0], x[i].dx[b0 + j],
                           x[i].xs32[b0 + j], &accd[i], &accm[i]);
            }
    }
    for (int i = 0; i < 16; ++i)
        lanes_store(accd[i], accm[i], y + (m0 + i) * ldy,
                    add == NULL ? NULL : add + (m0 + i) * ldy, km);
}
#endif

static int q8_linear(const struct row_source *src, const uint8_t *xbuf, float *y, const float *add,
                     int64_t m_dim, int64_t n_dim, int64_t k_dim, int64_t ldy, int num_threads) {
    const int64_t strips = (n_dim + STRIP - 1) / STRIP, xrb = tidegate_q8_row_bytes(k_dim);
#if defined(Q8_AMX)
    /* 16 rows of x at a time through tiles, the rest (and steps of 16) through vpdpbusd */
    const int64_t amx_rows = !src->half && m_dim >= 16 && amx_ready() ? m_dim / 16 * 16 : 0;
#else
    const int64_t amx_rows = 0;
#endif
    const int t = src->ggml_type, direct = direct_type(t), by_rows = rows_path();
    const int64_t steps = src->half ? k_dim / 16 : k_dim / 32;
    int failed = 0;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > strips) num_threads = (int)strips;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        struct lanes *buf = NULL;
        uint8_t *codes = NULL;
        float *dm = NULL;
        if (!direct || m_dim > DIRECT_ROWS)
            buf = aligned_alloc(64, (size_t)(k_dim / 32) * sizeof(struct lanes));
        if (!direct) {
            codes = aligned_alloc(64, (size_t)(STRIP * k_dim));
            dm = aligned_alloc(64, (size_t)(2 * STRIP * steps * 4 + 64) / 64 * 64);
        }
        failed = ((!direct || m_dim > DIRECT_ROWS) && buf == NULL) ||
                 (!direct && (codes == NULL || dm == NULL));
        const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512i idx = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)src->row_bytes));
#if defined(Q8_AMX)
        if (amx_rows) amx_configure();
#endif
#pragma omp for schedule(static)
        for (int64_t s = 0; s < strips; ++s) {
            if (failed) continue;
            const int64_t n0 = s * STRIP;
            const int rows = (int)(n_dim - n0 < STRIP ? n_dim - n0 : STRIP);
            const __mmask16 km = (__mmask16)(rows == STRIP ? 0xFFFF : (1u << rows) - 1);
            const uint8_t *base = src->w + n0 * src->row_bytes;
            const float *a = add == NULL ? NULL : add + n0;
            if (direct && m_dim <= DIRECT_ROWS && by_rows && t == T_Q8_0) {
                /* byte codes: one row's dot product per block beats the group's shared steps
                 * (the Q8_0 LM head 1.1-1.4 ms against 2.5 on Zen 4) */
                strip_rows(T_Q8_0, base, src->row_bytes, rows, xbuf, xrb, (int)m_dim, y + n0, a,
                           ldy, k_dim);
                continue;
            }
            if (direct && m_dim <= DIRECT_ROWS && by_rows) {
                for (int g = 0; g < rows; g += GROUP) {
                    const int gr = rows - g < GROUP ? rows - g : GROUP;
                    PER_DIRECT_TYPE(t, group_rows, base + g * src->row_bytes, src->row_bytes, gr,
                                    xbuf, xrb, m_dim, y + n0 + g, a == NULL ? NULL : a + g, ldy,
                                    k_dim, NULL, NULL);
                }
                continue;
            }
            if (direct && m_dim <= DIRECT_ROWS) {
                PER_DIRECT_TYPE(t, strip_direct, base, idx, km, xbuf, xrb, (int)m_dim, y + n0, a,
                                ldy, k_dim);
                continue;
            }
            if (direct && by_rows) {
                for (int64_t b = 0; b < k_dim / 32; ++b)
                    rows_to_lanes(t, base, src->row_bytes, rows, km, b, &buf[b]);
            } else if (direct) {
                for (int64_t b = 0; b < k_dim / 32; ++b) gather_block(t, base, idx, km, b, &buf[b]);
            } else {
                for (int r = 0; r < rows; ++r)
                    decode_row(src, n0 + r, k_dim, codes + r * k_dim, dm + r * steps,
                               dm + (STRIP + r) * steps);
                for (int64_t b = 0; b < k_dim / 32; ++b)
                    gather_decoded(codes, dm, dm + STRIP * steps, k_dim, src->half, km, b, &buf[b]);
            }
#if defined(Q8_AMX)
            for (int64_t m0 = 0; m0 < amx_rows; m0 += 16)
                strip_amx16(buf, km, xbuf, xrb, m0, y + n0, a, ldy, k_dim);
#endif
            strip_buffered(buf, src->half, km, xbuf + amx_rows * xrb, xrb, m_dim - amx_rows,
                           y + n0 + amx_rows * ldy, a == NULL ? NULL : a + amx_rows * ldy, ldy,
                           k_dim);
        }
#if defined(Q8_AMX)
        if (amx_rows) _tile_release();
#endif
        free(buf);
        free(codes);
        free(dm);
    }
    return failed ? -2 : 0;
}

#else
/* ---------------------------------------------------------------------------------------- */
/* AVX2 and portable C                                                                       */

/* sum(c[i] * q[i]) over n (16 or 32) columns; exact. */
static inline int32_t idot(const uint8_t *c, const int8_t *q, int n) {
#if defined(Q8_AVX2)
    __m256i acc = _mm256_setzero_si256();
    for (int i = 0; i < n; i += 16) { /* 16-bit products: vpmaddubsw would saturate at c > 127 */
        const __m256i cw = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(c + i)));
        const __m256i qw = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + i)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(cw, qw));
    }
    return hsum8(acc);
#else
    int32_t s = 0;
    for (int i = 0; i < n; ++i) s += (int32_t)c[i] * (int32_t)q[i];
    return s;
#endif
}

/* One output: codes c[k] with step scales d, m against one quantized row. */
static float row_dot(const uint8_t *c, const float *d, const float *m, int half,
                     const struct q8row *x, int64_t k) {
    float accd = 0.0f, accm = 0.0f;
    const int step = half ? 16 : 32;
    for (int64_t s = 0; s < k / step; ++s) {
        const int64_t b = half ? s / 2 : s;
        const int32_t i = idot(c + s * step, x->q + s * step, step);
        accd = fmaf((float)i, d[s] * x->dx[b], accd);
        accm = fmaf(m[s], half ? x->xs16[s] : x->xs32[s], accm);
    }
    return accd + accm;
}


static int q8_linear(const struct row_source *src, const uint8_t *xbuf, float *y, const float *add,
                     int64_t m_dim, int64_t n_dim, int64_t k_dim, int64_t ldy, int num_threads) {
    const int64_t strips = (n_dim + STRIP - 1) / STRIP, xrb = tidegate_q8_row_bytes(k_dim);
    const int64_t steps = src->half ? k_dim / 16 : k_dim / 32;
    int failed = 0;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > strips) num_threads = (int)strips;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        uint8_t *codes = malloc((size_t)(STRIP * k_dim));
        float *dm = malloc((size_t)(2 * STRIP * steps) * sizeof(float));
        failed = codes == NULL || dm == NULL;
#if defined(Q8_AVX2)
        const int t = src->ggml_type, direct = direct_type(t);
        __m256i *buf = NULL;
        __m256 *scales = NULL;
        if (direct && m_dim > DIRECT_ROWS) {
            buf = aligned_alloc(32, (size_t)(k_dim / 32 * GROUP) * sizeof(__m256i));
            scales = aligned_alloc(32, (size_t)(k_dim / 32 * 2) * sizeof(__m256));
            failed |= buf == NULL || scales == NULL;
        }
#endif
#pragma omp for schedule(static)
        for (int64_t s = 0; s < strips; ++s) {
            if (failed) continue;
            const int64_t n0 = s * STRIP;
            const int rows = (int)(n_dim - n0 < STRIP ? n_dim - n0 : STRIP);
#if defined(Q8_AVX2)
            if (direct) {
                for (int g = 0; g < rows; g += GROUP) {
                    const int gr = rows - g < GROUP ? rows - g : GROUP;
                    const uint8_t *base = src->w + (n0 + g) * src->row_bytes;
                    const float *a = add == NULL ? NULL : add + n0 + g;
                    PER_DIRECT_TYPE(t, group_rows, base, src->row_bytes, gr, xbuf, xrb, m_dim,
                                    y + n0 + g, a, ldy, k_dim, buf, scales);
                }
                continue;
            }
#endif
            for (int r = 0; r < rows; ++r)
                decode_row(src, n0 + r, k_dim, codes + r * k_dim, dm + r * steps,
                           dm + (STRIP + r) * steps);
            for (int64_t mm = 0; mm < m_dim; ++mm) {
                const struct q8row x = q8_row(xbuf + mm * xrb, k_dim);
                for (int r = 0; r < rows; ++r) {
                    float v = row_dot(codes + r * k_dim, dm + r * steps, dm + (STRIP + r) * steps,
                                      src->half, &x, k_dim);
                    if (add != NULL) v += add[mm * ldy + n0 + r];
                    y[mm * ldy + n0 + r] = v;
                }
            }
        }
#if defined(Q8_AVX2)
        free(buf);
        free(scales);
#endif
        free(codes);
        free(dm);
    }
    return failed ? -2 : 0;
}
#endif

/* ---------------------------------------------------------------------------------------- */
/* The lanes8 layout (q8_lanes8_cpu.c)                                                      */

/* Whether the kernels here prefer lanes8 for a matrix of type t (the loader then repacks it):
 * on AVX2, and with AVX512-VNNI where the rows are read with plain loads (AMD, whose gathers are
 * microcoded). Not with AMX tiles, which take 16 rows of x at a time from the rows layout, nor
 * where Intel's gathers serve the lanes path (not measured against lanes8). */
int tidegate_q8_lanes8_preferred(int t) {
    if (t != T_Q4_0 && t != T_Q4_1 && t != T_Q8_0) return 0;
#if defined(Q8_AMX)
    if (amx_ready()) return 0;
#endif
#if defined(Q8_LANES)
    return rows_path();
#elif defined(Q8_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------------------------------- */
/* Entry points                                                                             */

/* y[M, N] (row stride ldy) = records xq (M rows of tidegate_quantize_rows_q8) @ w[N, K]^T of
 * GGML type t (+ add, [M, N] with row stride ldy). Returns 0; -1 for a type without 8-bit
 * products (F32, F16, BF16: the float kernel serves them) or K not whole blocks; -2 when
 * scratch memory cannot be had. */
int tidegate_q8_packed_linear(int t, const uint8_t *xq, const uint8_t *w, float *y,
                              const float *add, int64_t m_dim, int64_t n_dim, int64_t k_dim,
                              int64_t ldy, int num_threads) {
    const int64_t rb = tidegate_packed_row_bytes(t, k_dim);
    if (rb == 0 || t == T_F32 || t == T_F16 || t == T_BF16 || k_dim % 32) return -1;
    const struct row_source src = {t, w, rb, 0, 0, NULL, NULL, t == T_Q6_K};
    return q8_linear(&src, xq, y, add, m_dim, n_dim, k_dim, ldy, num_threads);
}

/* The same over an integer matrix (int_weight.py): q [N, K * bits / 8], scales and zeros
 * [N, K / group]. Returns -1 for bits other than 4 and 8, K not whole blocks of 32, or a group
 * that is not whole steps of 16 columns. */
int tidegate_q8_int_linear(int bits, int64_t group, const uint8_t *xq, const uint8_t *q,
                           const float *scales, const uint8_t *zeros, float *y, const float *add,
                           int64_t m_dim, int64_t n_dim, int64_t k_dim, int64_t ldy,
                           int num_threads) {
    if ((bits != 4 && bits != 8) || group <= 0 || k_dim % group || k_dim % 32 || group % 16)
        return -1;
    const struct row_source src = {-1, q, k_dim * bits / 8, bits, group, scales, zeros,
                                  group % 32 != 0};
    return q8_linear(&src, xq, y, add, m_dim, n_dim, k_dim, ldy, num_threads);
}
