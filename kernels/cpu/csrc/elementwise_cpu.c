/* The per-layer elementwise steps of a CPU forward pass, each one call instead of a dozen
 * tensor ops: RMSNorm with its residual add, rotary embedding with the KV-cache store, and
 * SwiGLU's silu(gate) * up.
 *
 * At a decode step of a small model the tensor ops around the projections cost more than the
 * projections' arithmetic: RMSNorm is ten of them (add, cast, pow, mean, rsqrt, mul ...) and
 * rotary plus the store about thirty, each a few microseconds of dispatch on a few hundred
 * floats. Here each is one loop over the rows; threads split the rows of large inputs only.
 *
 * float32 throughout; sums in float32 like the reference (summation order differs).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "exp_poly.h"

/* out[r] = normed(x[r] + res[r]) * w, new_res[r] = x[r] + res[r] (res may be NULL: then
 * new_res is not written). Rows of h floats with row strides ldx / ldr; out and new_res are
 * contiguous [m, h]. */
void tidegate_rms_norm_f32(const float *x, int64_t ldx, const float *res, int64_t ldr,
                           const float *w, float eps, float *out, float *new_res, int64_t m,
                           int64_t h, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m >= 64)
    for (int64_t r = 0; r < m; ++r) {
        const float *xr = x + r * ldx;
        float *o = out + r * h;
        const float *src = xr;
        if (res != NULL) {
            float *nr = new_res + r * h;
            const float *rr = res + r * ldr;
            for (int64_t i = 0; i < h; ++i) nr[i] = xr[i] + rr[i];
            src = nr;
        }
        float ss = 0.0f;
        for (int64_t i = 0; i < h; ++i) ss += src[i] * src[i];
        const float scale = 1.0f / sqrtf(ss / (float)h + eps);
        for (int64_t i = 0; i < h; ++i) o[i] = (src[i] * scale) * w[i];
    }
}

/* One head's d values into the 8-bit cache's layout: d int8 values, then the float32 scale
 * s = max|x| * (1/127), x ~= s * q (the attention kernel's reading of it: paged_decode_cpu.c). */
static void store_head_q8(const float *x, int64_t d, int8_t *dst) {
    float amax = 0.0f;
    for (int64_t i = 0; i < d; ++i) amax = fmaxf(amax, fabsf(x[i]));
    /* through volatiles, as q8_linear_cpu.c's rows: the compiler may not fold 1 / s into
     * 127 / amax, which rounds differently from the reference */
    volatile float sv = amax * (1.0f / 127.0f);
    const float s = sv;
    volatile float iv = s > 0.0f ? 1.0f / s : 0.0f;
    const float inv = iv;
    for (int64_t i = 0; i < d; ++i) dst[i] = (int8_t)nearbyintf(x[i] * inv);
    memcpy(dst + d, &s, 4);
}

/* Rotate q [t, hq, d] and k [t, hk, d] in place by their positions (rotate-half: pairs i and
 * i + d/2, cos and sin from cache[pos] = [cos(d/2) | sin(d/2)]), then store each token's rotated
 * key and its value v [t, hk, d] at its slot of key_cache / value_cache [slots, hk, d] (float32,
 * or with kv_int8 int8 [slots, hk, d + 4]: store_head_q8); a slot < 0 is skipped. Token strides
 * ldq, ldk, ldv (floats); heads are d apart. */
void tidegate_rotary_store_kv_f32(float *q, int64_t ldq, float *k, int64_t ldk, const float *v,
                                  int64_t ldv, const int64_t *positions, const float *cache,
                                  void *key_cache, void *value_cache, const int64_t *slots,
                                  int64_t t, int64_t hq, int64_t hk, int64_t d, int kv_int8,
                                  int num_threads) {
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (t >= 64)
    for (int64_t i = 0; i < t; ++i) {
        const float *cs = cache + positions[i] * d;
        const float *cosv = cs, *sinv = cs + half;
        for (int64_t head = 0; head < hq + hk; ++head) {
            float *x = head < hq ? q + i * ldq + head * d : k + i * ldk + (head - hq) * d;
            for (int64_t j = 0; j < half; ++j) {
                const float x1 = x[j], x2 = x[j + half];
                x[j] = x1 * cosv[j] - x2 * sinv[j];
                x[j + half] = x2 * cosv[j] + x1 * sinv[j];
            }
        }
        const int64_t slot = slots[i];
        if (slot < 0) continue;
        for (int64_t head = 0; head < hk; ++head) {
            const float *kh = k + i * ldk + head * d, *vh = v + i * ldv + head * d;
            if (kv_int8) {
                const int64_t at = (slot * hk + head) * (d + 4);
                store_head_q8(kh, d, (int8_t *)key_cache + at);
                store_head_q8(vh, d, (int8_t *)value_cache + at);
            } else {
                const int64_t at = (slot * hk + head) * d;
                memcpy((float *)key_cache + at, kh, (size_t)d * 4);
                memcpy((float *)value_cache + at, vh, (size_t)d * 4);
            }
        }
    }
}

/* SwiGLU: out[r, j] = silu(x[r, j]) * x[r, i + j] for rows x [m, 2i] (gate, then up; row
 * stride ldx), out [m, i] contiguous. silu(g) = g / (1 + exp(-g)). */
void tidegate_silu_mul_f32(const float *x, int64_t ldx, float *out, int64_t m, int64_t i,
                           int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (m >= 64)
    for (int64_t r = 0; r < m; ++r) {
        const float *g = x + r * ldx, *u = g + i;
        float *o = out + r * i;
        for (int64_t j = 0; j < i; ++j) {
            /* exp(-g) clamped to exp(+-87): silu is g or 0 to float precision long before */
            const float e = -g[j] < -87.0f ? -87.0f : -g[j] > 87.0f ? 87.0f : -g[j];
            o[j] = g[j] / (1.0f + exp_poly(e)) * u[j];
        }
    }
}
