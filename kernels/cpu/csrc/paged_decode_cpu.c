/* Paged attention on the CPU, reading K/V blocks where they lie in the cache: decodes, and
 * prompt chunks computed row by row with the decodes' arithmetic (tidegate_paged_prefill_f32).
 *
 * The plain-torch path must first copy every sequence's blocks into a padded contiguous tensor
 * (an index_select as large as the attention's own reads) before SDPA can use them; on a
 * memory-bound CPU that copy is as expensive as the attention. Here each (sequence, kv head)
 * reads its keys and values once, through the block table.
 *
 * Layouts (all contiguous, float32):
 *   q, out       [B, Hq, D]           one query token per sequence, at position seq_len - 1
 *   key_cache    [num_blocks, bs, Hk, D]        (kv_int8: int8 [num_blocks, bs, Hk, D + 4])
 *   value_cache  [num_blocks, bs, Hk, D]
 *   block_tables [B, W] int32         W * bs >= max(seq_lens)
 *   seq_lens     [B] int32
 * Query heads h*G .. h*G+G-1 share kv head h (GQA, G = Hq / Hk).
 *
 * An 8-bit cache (kv_int8) holds each token's head as D int8 values and then its float32 scale
 * (s = max|x| / 127, x ~= s * q: D + 4 bytes per head, elementwise_cpu.c writes them): a third
 * of the float32 cache's bytes, and decode attention at batch 32 is a stream over the cache.
 *
 * Two passes per (sequence, kv head): scores for all G queries (one read of K), softmax, then
 * the weighted sum of V (one read of V). Threads come from the OpenMP runtime torch already
 * loaded (same soname), so they do not fight torch's own pool.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_poly.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* exp(x) for x <= 0 (softmax: a score minus the row's maximum). */
static inline float exp_nonpositive(float x) { return exp_poly(x < -87.0f ? -87.0f : x); }

/* Ask for the next block while this one is computed: blocks lie anywhere in the cache, so
 * the hardware prefetcher cannot guess where the next one starts. */
static inline void prefetch_block(const void *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i, 0, 3);
}

/* q . k over d values: a float32 key, or an 8-bit one times its scale (stored after it). */
static inline float dot_key(const float *qh, const void *kh, int64_t d, int kv_int8) {
    float s = 0.0f;
    if (kv_int8) {
        const int8_t *k8 = kh;
        float sk;
        memcpy(&sk, k8 + d, 4);
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < d; ++i) s += qh[i] * (float)k8[i];
        return s * sk;
    }
    const float *k = kh;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < d; ++i) s += qh[i] * k[i];
    return s;
}

/* ah += w * v over d values (an 8-bit value row: w times its scale first). */
static inline void add_value(float *ah, float w, const void *vh, int64_t d, int kv_int8) {
    if (kv_int8) {
        const int8_t *v8 = vh;
        float sv;
        memcpy(&sv, v8 + d, 4);
        const float ws = w * sv;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) ah[i] += ws * (float)v8[i];
        return;
    }
    const float *v = vh;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) ah[i] += w * v[i];
}

#if defined(__AVX512F__)
/* A kv head's d values (d a multiple of 16, at most 256) as d / 16 float vectors; an 8-bit
 * head widened (its scale applied by the caller). */
static inline void load_head(const void *h, int64_t d, int kv_int8, __m512 *out) {
    for (int64_t j = 0; j < d / 16; ++j)
        out[j] = kv_int8 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                               _mm_loadu_si128((const __m128i *)((const int8_t *)h + 16 * j))))
                         : _mm512_loadu_ps((const float *)h + 16 * j);
}

/* r[i] = the sum of v[i]'s 16 lanes: the 16 vectors reduced together, 45 instructions for 16
 * sums instead of a reduction each. */
static inline __m512 sum16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; ++i)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                         _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

/* Scores of 16 consecutive tokens (rows kb, row bytes apart) for every query head: per kv
 * head, each token's key widened once for its group of query heads, each query head's 16 dot
 * products reduced together (sum16). scores[hq * len + t] for t in 0..15. */
static void scores16(const float *qb, const char *kb, int64_t row, int64_t head_bytes,
                     int64_t num_q_heads, int64_t num_kv_heads, int64_t d, int kv_int8,
                     float scale, float *scores, int64_t len) {
    const int64_t group = num_q_heads / num_kv_heads;
    if (d == 64) { /* one query head at a time: its 16 partials and q stay in registers */
        for (int64_t hq = 0; hq < num_q_heads; ++hq) {
            const int64_t h = hq / group;
            const float *qh = qb + hq * 64;
            const __m512 q0 = _mm512_loadu_ps(qh), q1 = _mm512_loadu_ps(qh + 16),
                         q2 = _mm512_loadu_ps(qh + 32), q3 = _mm512_loadu_ps(qh + 48);
            __m512 part[16];
            float sk[16];
            for (int t = 0; t < 16; ++t) {
                const char *kh = kb + t * row + h * head_bytes;
                __m512 k[16];
                load_head(kh, 64, kv_int8, k);
                if (kv_int8) memcpy(&sk[t], kh + 64, 4);
                __m512 p = _mm512_mul_ps(q0, k[0]);
                p = _mm512_fmadd_ps(q1, k[1], p);
                p = _mm512_fmadd_ps(q2, k[2], p);
                part[t] = _mm512_fmadd_ps(q3, k[3], p);
            }
            __m512 s = sum16(part);
            if (kv_int8) s = _mm512_mul_ps(s, _mm512_loadu_ps(sk));
            _mm512_storeu_ps(scores + hq * len, _mm512_mul_ps(s, _mm512_set1_ps(scale)));
        }
        return;
    }
    for (int64_t h = 0; h < num_kv_heads; ++h) {
        for (int64_t g0 = 0; g0 < group; g0 += 4) { /* up to 4 query heads: 64 partials */
            const int64_t ng = group - g0 < 4 ? group - g0 : 4;
            __m512 part[4][16], k[16];
            float sk[16];
            for (int t = 0; t < 16; ++t) {
                const char *kh = kb + t * row + h * head_bytes;
                load_head(kh, d, kv_int8, k);
                if (kv_int8) memcpy(&sk[t], kh + d, 4);
                for (int64_t g = 0; g < ng; ++g) {
                    const float *qh = qb + (h * group + g0 + g) * d;
                    __m512 p = _mm512_mul_ps(_mm512_loadu_ps(qh), k[0]);
                    for (int64_t j = 1; j < d / 16; ++j)
                        p = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * j), k[j], p);
                    part[g][t] = p;
                }
            }
            for (int64_t g = 0; g < ng; ++g) {
                __m512 s = sum16(part[g]);
                if (kv_int8) s = _mm512_mul_ps(s, _mm512_loadu_ps(sk));
                _mm512_storeu_ps(scores + (h * group + g0 + g) * len, _mm512_mul_ps(
                    s, _mm512_set1_ps(scale)));
            }
        }
    }
}

/* values_block for heads of 64 and groups of up to 4 query heads: the group's sums stay in
 * registers for the whole block (the same operations in the same order: the same bits). */
static inline void values_block_64(const float *p, int64_t len, const char *vb, int64_t n,
                                   int64_t row, int64_t head_bytes, int64_t h, int64_t group,
                                   int kv_int8, float *acc) {
    __m512 a[4][4];
    for (int64_t g = 0; g < group; ++g)
        for (int j = 0; j < 4; ++j) a[g][j] = _mm512_loadu_ps(acc + (h * group + g) * 64 + 16 * j);
    for (int64_t t = 0; t < n; ++t) {
        const char *vh = vb + t * row + h * head_bytes;
        __m512 v[16];
        load_head(vh, 64, kv_int8, v);
        float sv = 1.0f;
        if (kv_int8) memcpy(&sv, vh + 64, 4);
        for (int64_t g = 0; g < group; ++g) {
            const float pw = p[(h * group + g) * len + t];
            const __m512 w = _mm512_set1_ps(kv_int8 ? pw * sv : pw);
            for (int j = 0; j < 4; ++j) a[g][j] = _mm512_fmadd_ps(w, v[j], a[g][j]);
        }
    }
    for (int64_t g = 0; g < group; ++g)
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + (h * group + g) * 64 + 16 * j, a[g][j]);
}

/* acc[hq] += p[hq][t] * v[t] over a block's n tokens for every query head: per kv head,
 * each token's value widened once for its group of query heads. */
static void values_block(const float *p, int64_t len, const char *vb, int64_t n, int64_t row,
                         int64_t head_bytes, int64_t num_q_heads, int64_t num_kv_heads,
                         int64_t d, int kv_int8, float *acc) {
    const int64_t group = num_q_heads / num_kv_heads;
    if (d == 64 && group <= 4) {
        for (int64_t h = 0; h < num_kv_heads; ++h)
            values_block_64(p, len, vb, n, row, head_bytes, h, group, kv_int8, acc);
        return;
    }
    for (int64_t h = 0; h < num_kv_heads; ++h)
        for (int64_t t = 0; t < n; ++t) {
            const char *vh = vb + t * row + h * head_bytes;
            __m512 v[16];
            load_head(vh, d, kv_int8, v);
            float sv = 1.0f;
            if (kv_int8) memcpy(&sv, vh + d, 4);
            for (int64_t g = 0; g < group; ++g) {
                const int64_t hq = h * group + g;
                const __m512 w = _mm512_set1_ps(kv_int8 ? p[hq * len + t] * sv : p[hq * len + t]);
                float *ah = acc + hq * d;
                for (int64_t j = 0; j < d / 16; ++j)
                    _mm512_storeu_ps(ah + 16 * j, _mm512_fmadd_ps(w, v[j],
                                                                  _mm512_loadu_ps(ah + 16 * j)));
            }
        }
}
#endif

/* Query row b attends to the first len(b) tokens of the sequence whose blocks table row b
 * lists: seq_lens[b] with a table per row (decodes), or first_len + b with one table for all
 * rows (a prefill chunk: row b is the token at position first_len - 1 + b, which sees itself
 * and everything before it). Either way a row's arithmetic depends on nothing but its query,
 * its context and its length, so a token gets the same bits in a decode step and in a prompt
 * chunk (8-bit activations magnify any difference between the two into different tokens). */
static int paged_attend(const float *q, const void *key_cache, const void *value_cache,
                        const int32_t *block_tables, int64_t table_stride,
                        const int32_t *seq_lens, int64_t first_len, float *out, int64_t batch,
                        int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                        int64_t block_size, float scale, int kv_int8, int num_threads) {
    const int64_t group = num_q_heads / num_kv_heads;
    const int64_t d = head_dim;
    const int64_t head_bytes = kv_int8 ? d + 4 : 4 * d;
    const int64_t row = num_kv_heads * head_bytes; /* bytes per cached token */
    const char *keys = (const char *)key_cache, *values = (const char *)value_cache;
    int64_t max_len = seq_lens == NULL ? first_len + batch - 1 : 0;
    for (int64_t b = 0; seq_lens != NULL && b < batch; ++b)
        max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    if (num_threads < 1) num_threads = 1;
    const int64_t per_thread = num_q_heads * (max_len + d);
    float *scratch = malloc(sizeof(float) * (size_t)(per_thread * num_threads + 1));
    if (scratch == NULL) return 1;

#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t len = seq_lens == NULL ? first_len + b : seq_lens[b];
        float *scores = scratch + per_thread * omp_get_thread_num(); /* [Hq, len] */
        float *acc = scores + num_q_heads * max_len;                 /* [Hq, D] */
        const float *qb = q + b * num_q_heads * d;
        const int32_t *table = block_tables + b * table_stride;
        float *ob = out + b * num_q_heads * d;
        if (len <= 0) {
            memset(ob, 0, sizeof(float) * (size_t)(num_q_heads * d));
            continue;
        }
        /* Pass 1: scores of every query head against every cached key. A token's keys for
         * all kv heads are one contiguous row, so a block is read front to back. */
        for (int64_t start = 0; start < len; start += block_size) {
            const int64_t blk = start / block_size;
            const char *kb = keys + (int64_t)table[blk] * block_size * row;
            const int64_t n = len - start < block_size ? len - start : block_size;
            if (start + block_size < len) prefetch_block(keys + (int64_t)table[blk + 1] * block_size * row, n * row);
            int64_t t = 0;
#if defined(__AVX512F__)
            if (d % 16 == 0 && d <= 256) /* whole runs of 16 tokens together */
                for (; t + 16 <= n; t += 16)
                    scores16(qb, kb + t * row, row, head_bytes, num_q_heads, num_kv_heads, d,
                             kv_int8, scale, scores + start + t, len);
#endif
            for (; t < n; ++t)
                for (int64_t hq = 0; hq < num_q_heads; ++hq)
                    scores[hq * len + start + t] =
                        dot_key(qb + hq * d, kb + t * row + (hq / group) * head_bytes, d,
                                kv_int8) * scale;
        }
        /* Softmax per query head, in place. */
        for (int64_t hq = 0; hq < num_q_heads; ++hq) {
            float *sg = scores + hq * len;
            float m = sg[0];
            for (int64_t p = 1; p < len; ++p) m = sg[p] > m ? sg[p] : m;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t p = 0; p < len; ++p) {
                sg[p] = exp_nonpositive(sg[p] - m);
                sum += sg[p];
            }
            const float inv = 1.0f / sum;
#pragma omp simd
            for (int64_t p = 0; p < len; ++p) sg[p] *= inv;
        }
        /* Pass 2: the probability-weighted sum of the values. */
        memset(acc, 0, sizeof(float) * (size_t)(num_q_heads * d));
        for (int64_t start = 0; start < len; start += block_size) {
            const int64_t blk = start / block_size;
            const char *vb = values + (int64_t)table[blk] * block_size * row;
            const int64_t n = len - start < block_size ? len - start : block_size;
            if (start + block_size < len) prefetch_block(values + (int64_t)table[blk + 1] * block_size * row, n * row);
#if defined(__AVX512F__)
            if (d % 16 == 0 && d <= 256) {
                values_block(scores + start, len, vb, n, row, head_bytes, num_q_heads,
                             num_kv_heads, d, kv_int8, acc);
                continue;
            }
#endif
            for (int64_t t = 0; t < n; ++t)
                for (int64_t hq = 0; hq < num_q_heads; ++hq)
                    add_value(acc + hq * d, scores[hq * len + start + t],
                              vb + t * row + (hq / group) * head_bytes, d, kv_int8);
        }
        memcpy(ob, acc, sizeof(float) * (size_t)(num_q_heads * d));
    }
    free(scratch);
    return 0;
}

/* Decodes: q [B, Hq, D], one query per sequence at position seq_lens[b] - 1, block_tables
 * [B, table_width]. Returns 0, or 1 when scratch memory cannot be had. */
int tidegate_paged_decode_f32(const float *q, const void *key_cache, const void *value_cache,
                              const int32_t *block_tables, const int32_t *seq_lens, float *out,
                              int64_t batch, int64_t num_q_heads, int64_t num_kv_heads,
                              int64_t head_dim, int64_t block_size, int64_t table_width,
                              float scale, int kv_int8, int num_threads) {
    return paged_attend(q, key_cache, value_cache, block_tables, table_width, seq_lens, 0, out,
                        batch, num_q_heads, num_kv_heads, head_dim, block_size, scale, kv_int8,
                        num_threads);
}

/* A prefill chunk of one sequence: q [T, Hq, D] the tokens at positions start .. start+T-1
 * (their keys and values already stored), block_table that sequence's blocks; causal. */
int tidegate_paged_prefill_f32(const float *q, const void *key_cache, const void *value_cache,
                               const int32_t *block_table, int64_t start, float *out,
                               int64_t tokens, int64_t num_q_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, float scale, int kv_int8,
                               int num_threads) {
    return paged_attend(q, key_cache, value_cache, block_table, 0, NULL, start + 1, out, tokens,
                        num_q_heads, num_kv_heads, head_dim, block_size, scale, kv_int8,
                        num_threads);
}
