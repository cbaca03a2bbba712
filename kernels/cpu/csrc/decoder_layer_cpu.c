/* A whole decoder layer of a step in one call (CPU, 8-bit activations).
 *
 * A decode step of a small model is a few hundred kernel calls, and on the CPU each costs more
 * around it (Python dispatch, ctypes, tensor allocation, an OpenMP fork) than the layer's own
 * work at one row: about 10 calls per layer made a third of a 20 ms step. Here a step's layer
 * is the same kernels, called in the same order, from C: RMSNorm (with the residual add), the
 * q/k/v projection, rotary + KV store, paged attention, the output projection, RMSNorm,
 * gate/up, SwiGLU, down. Every row (token) of the step is one query row of the attention
 * kernel with its own block table and context length (its position + 1): decodes and prompt
 * chunks alike, as the kernel computes a prompt chunk row by row anyway. Every step computes
 * what the op-by-op path (kernels/ops.py) computes, bit for bit, so a sequence's tokens do not
 * depend on which path its steps took.
 *
 * Layouts: hidden, residual, out, out_residual [rows, hidden] contiguous float32; the caches
 * as paged_decode_cpu.c's (float32, or 8-bit heads with kv_int8); positions and slots [rows]
 * int64; block_tables [rows, width] int32 (each row its sequence's); seq_lens [rows] int32 (each
 * row's context: its position + 1); rope [max_positions, head_dim] float32 (cos | sin halves).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The neighbours' entry points (one shared object). */
void tidegate_rms_norm_f32(const float *x, int64_t ldx, const float *res, int64_t ldr,
                           const float *w, float eps, float *out, float *new_res, int64_t m,
                           int64_t h, int num_threads);
void tidegate_rotary_store_kv_f32(float *q, int64_t ldq, float *k, int64_t ldk, const float *v,
                                  int64_t ldv, const int64_t *positions, const float *cache,
                                  void *key_cache, void *value_cache, const int64_t *slots,
                                  int64_t t, int64_t hq, int64_t hk, int64_t d, int kv_int8,
                                  int num_threads);
int tidegate_paged_decode_f32(const float *q, const void *key_cache, const void *value_cache,
                              const int32_t *block_tables, const int32_t *seq_lens, float *out,
                              int64_t b, int64_t hq, int64_t hk, int64_t d, int64_t block_size,
                              int64_t max_blocks, float scale, int kv_int8, int num_threads);
void tidegate_silu_mul_f32(const float *x, int64_t ldx, float *out, int64_t m, int64_t i,
                           int num_threads);
int64_t tidegate_q8_row_bytes(int64_t k);
void tidegate_quantize_rows_q8(const float *x, int64_t ldx, int64_t m, int64_t k, uint8_t *out,
                               int num_threads);
int tidegate_q8_packed_linear(int t, const uint8_t *xq, const uint8_t *w, float *y,
                              const float *add, int64_t m_dim, int64_t n_dim, int64_t k_dim,
                              int64_t ldy, int num_threads);
int tidegate_q8_lanes8_linear(int t, const uint8_t *xq, const uint8_t *w, float *y,
                              const float *add, int64_t m_dim, int64_t n_dim, int64_t k_dim,
                              int64_t ldy, int num_threads);
int tidegate_q8_int_linear(int bits, int64_t group, const uint8_t *xq, const uint8_t *q,
                           const float *scales, const uint8_t *zeros, float *y, const float *add,
                           int64_t m_dim, int64_t n_dim, int64_t k_dim, int64_t ldy,
                           int num_threads);

/* One projection's weights: a GGML type's packed rows (or, with lanes8, the same blocks
 * repacked 8 rows to a group: q8_linear_cpu.c), or integers with group scales (no act-order
 * permutation). */
struct tidegate_projection {
    int64_t ggml_type; /* >= 0: GGML rows; -1: integers */
    int64_t bits, group;
    const uint8_t *w;
    const float *scales;
    const uint8_t *zeros;
    int64_t rows;
    int64_t lanes8;
};

struct tidegate_decoder_layer {
    int64_t hidden, intermediate, heads, kv_heads, head_dim;
    double eps, scale;
    const float *input_norm, *post_norm;
    struct tidegate_projection qkv, o, gate_up, down;
};

struct tidegate_step_rows {
    int64_t rows, block_size, table_width;
    int64_t kv_int8; /* the caches hold 8-bit heads (paged_decode_cpu.c) */
    const int64_t *positions, *slots;
    const int32_t *block_tables, *seq_lens;
    const float *rope;
};

/* y[rows, p->rows] = x[rows, k] @ w^T, x rounded to 8-bit rows in xq first (as
 * NativeCpuKernels.packed_linear / int_linear do). */
static int project(const struct tidegate_projection *p, const float *x, int64_t rows, int64_t k,
                   uint8_t *xq, float *y, int threads) {
    tidegate_quantize_rows_q8(x, k, rows, k, xq, threads);
    if (p->ggml_type >= 0 && p->lanes8)
        return tidegate_q8_lanes8_linear((int)p->ggml_type, xq, p->w, y, NULL, rows, p->rows, k,
                                         p->rows, threads);
    if (p->ggml_type >= 0)
        return tidegate_q8_packed_linear((int)p->ggml_type, xq, p->w, y, NULL, rows, p->rows, k,
                                         p->rows, threads);
    return tidegate_q8_int_linear((int)p->bits, p->group, xq, p->w, p->scales, p->zeros, y, NULL,
                                  rows, p->rows, k, p->rows, threads);
}

/* hidden (+ residual, or hidden alone when residual is NULL) through the layer: out is the
 * layer's output, out_residual the residual stream after it (the op-by-op path's (hidden,
 * residual)). Returns 0; -1 for weights the 8-bit kernels refuse; -2 when scratch memory
 * cannot be had. */
int tidegate_decoder_layer_q8(const struct tidegate_decoder_layer *L,
                             const struct tidegate_step_rows *B, void *key_cache,
                             void *value_cache, const float *hidden, const float *residual,
                             float *out, float *out_residual, int threads) {
    const int64_t m = B->rows, h = L->hidden, inter = L->intermediate, d = L->head_dim;
    const int64_t q_size = L->heads * d, kv_size = L->kv_heads * d, qkv_size = q_size + 2 * kv_size;
    const int64_t widest = inter > q_size ? (inter > h ? inter : h) : (q_size > h ? q_size : h);
    const float eps = (float)L->eps;
    /* float scratch: normed [m, h], qkv [m, qkv_size], q [m, q_size], attn [m, q_size],
     * gate_up [m, 2 inter], act [m, inter]; then the 8-bit rows of the widest input. */
    const int64_t floats = m * (h + qkv_size + 2 * q_size + 3 * inter);
    float *scratch = malloc((size_t)(floats * 4 + m * tidegate_q8_row_bytes(widest)));
    if (scratch == NULL) return -2;
    float *normed = scratch, *qkv = normed + m * h, *q = qkv + m * qkv_size;
    float *attn = q + m * q_size, *gate_up = attn + m * q_size, *act = gate_up + m * 2 * inter;
    uint8_t *xq = (uint8_t *)(scratch + floats);
    int rc;

    if (residual == NULL) memcpy(out_residual, hidden, (size_t)(m * h) * 4);
    tidegate_rms_norm_f32(hidden, h, residual, h, L->input_norm, eps, normed, out_residual, m,
                          h, threads);
    if ((rc = project(&L->qkv, normed, m, h, xq, qkv, threads)) != 0) goto done;
    tidegate_rotary_store_kv_f32(qkv, qkv_size, qkv + q_size, qkv_size, qkv + q_size + kv_size,
                                 qkv_size, B->positions, B->rope, key_cache, value_cache,
                                 B->slots, m, L->heads, L->kv_heads, d, (int)B->kv_int8, threads);
    for (int64_t r = 0; r < m; ++r) memcpy(q + r * q_size, qkv + r * qkv_size, (size_t)q_size * 4);
    if (tidegate_paged_decode_f32(q, key_cache, value_cache, B->block_tables, B->seq_lens, attn,
                                  m, L->heads, L->kv_heads, d, B->block_size, B->table_width,
                                  (float)L->scale, (int)B->kv_int8, threads) != 0) {
        rc = -2;
        goto done;
    }
    if ((rc = project(&L->o, attn, m, q_size, xq, out, threads)) != 0) goto done;
    /* the residual add goes into the norm, in place: out_residual += out */
    tidegate_rms_norm_f32(out, h, out_residual, h, L->post_norm, eps, normed, out_residual, m, h,
                          threads);
    if ((rc = project(&L->gate_up, normed, m, h, xq, gate_up, threads)) != 0) goto done;
    tidegate_silu_mul_f32(gate_up, 2 * inter, act, m, inter, threads);
    rc = project(&L->down, act, m, inter, xq, out, threads);
done:
    free(scratch);
    return rc;
}

/* Every layer of a step in one call: layers[i] over its caches key_caches[i] and
 * value_caches[i], the first reading hidden and residual (NULL: hidden alone), each later one
 * the stream the one before left in out and out_residual (a layer reads its inputs before it
 * writes its outputs, so they may be the same buffers). At one row a layer's own work is a
 * few hundred microseconds of a small model, and the Python around each layer's call
 * (dispatch, its structs, its outputs) added a fifth to a decode step: here it is paid once.
 * Returns what the first failing layer returns, else 0. */
int tidegate_decoder_layers_q8(const struct tidegate_decoder_layer *const *layers, int64_t n,
                               const struct tidegate_step_rows *B, void *const *key_caches,
                               void *const *value_caches, const float *hidden,
                               const float *residual, float *out, float *out_residual,
                               int threads) {
    for (int64_t i = 0; i < n; ++i) {
        int rc = tidegate_decoder_layer_q8(layers[i], B, key_caches[i], value_caches[i],
                                           i == 0 ? hidden : out, i == 0 ? residual : out_residual,
                                           out, out_residual, threads);
        if (rc != 0) return rc;
    }
    return 0;
}
