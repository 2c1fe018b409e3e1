/* Element-wise loops around the CPU int8 products (pipeline/models/native.py builds and loads this).
 *
 * The oneDNN int8 GEMM itself is PyTorch's; what surrounds it per projection (the per-token
 * quantization of the activations before, the per-row scale after) is a handful of eager PyTorch
 * operators, each a dispatch and a fresh tensor. On decode-sized inputs (a few dozen rows) those
 * cost about as much as the product itself. Here each is one pass over the rows, with exactly the
 * eager arithmetic (same float32 operations in the same order, no contraction into FMA: the
 * results are bit-for-bit those of pipeline.models.int8's eager code, which the tests assert).
 *
 * dtype codes: 0 float32, 1 bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* round to nearest even, NaN to the canonical quiet NaN: c10::BFloat16's conversion */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* x (rows, cols), row stride `stride` elements -> out (rows, cols) uint8 = x / scale + 128 rounded
 * to nearest (ties up), scale[r] = max |x[r]| / 127 (at least 1e-30 / 127).
 * As the eager code: top = max(max x, -min x); factor = (1 / top) * 127; u = (uint8)(x * factor + 128.5). */
void quantize_rows_u8(const void *x, int64_t rows, int64_t cols, int64_t stride, int dtype, uint8_t *out,
                      float *scale) {
    float buf[dtype == 1 ? cols : 1];
    for (int64_t r = 0; r < rows; r++) {
        const float *xf = (const float *)x + r * stride;
        if (dtype == 1) {
            const uint16_t *xb = (const uint16_t *)x + r * stride;
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) buf[c] = bf16_to_f32(xb[c]);
            xf = buf;
        }
        float hi = -INFINITY, lo = INFINITY;
#pragma omp simd reduction(max : hi) reduction(min : lo)
        for (int64_t c = 0; c < cols; c++) {
            hi = xf[c] > hi ? xf[c] : hi;
            lo = xf[c] < lo ? xf[c] : lo;
        }
        float top = hi > -lo ? hi : -lo;
        if (!(top >= 1e-30f)) top = 1e-30f;
        float factor = (1.0f / top) * 127.0f;
        uint8_t *o = out + r * cols;
#pragma omp simd
        for (int64_t c = 0; c < cols; c++) {
            float t = xf[c] * factor;
            t = t + 128.5f; /* in [1.5, 255.5]: truncation rounds x * factor to nearest */
            o[c] = (uint8_t)(int32_t)t;
        }
        scale[r] = top / 127.0f;
    }
}

/* out (rows, cols) in `dtype` = acc (rows, cols) float32 * s[r] (+ bias[c], float32, may be NULL).
 * out may be acc itself when dtype is float32. */
void scale_rows(const float *acc, int64_t rows, int64_t cols, const float *s, const float *bias, int dtype,
                void *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *a = acc + r * cols;
        const float sr = s[r];
        if (dtype == 1) {
            uint16_t *o = (uint16_t *)out + r * cols;
            if (bias) {
#pragma omp simd
                for (int64_t c = 0; c < cols; c++) o[c] = f32_to_bf16(bias[c] + a[c] * sr);
            } else {
#pragma omp simd
                for (int64_t c = 0; c < cols; c++) o[c] = f32_to_bf16(a[c] * sr);
            }
        } else {
            float *o = (float *)out + r * cols;
            if (bias) {
#pragma omp simd
                for (int64_t c = 0; c < cols; c++) o[c] = bias[c] + a[c] * sr;
            } else {
#pragma omp simd
                for (int64_t c = 0; c < cols; c++) o[c] = a[c] * sr;
            }
        }
    }
}

/* exp(x) for x <= 0 (softmax after subtracting the maximum), vectorizable: 2^n * p(r) with
 * n = round(x / ln 2) and r = x - n ln 2 (Cody-Waite), p a degree-6 polynomial; relative error
 * about 2e-7 on [-87, 0], 0 below. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};
    return p * two_n.f;
}

#ifdef __AVX512BF16__
#include <immintrin.h>

/* s[c] = scale * (q . key c) for n keys of d bfloat16 each (d % 32 == 0), with the AVX512-BF16 dot
 * product (pairs of bf16 products summed into float32 lanes), four keys at a time. */
static void scores_bf16(const uint16_t *q, const uint16_t *k, int64_t n, int64_t d, float scale, float *s) {
    int64_t c = 0;
    for (; c + 4 <= n; c += 4) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t e = 0; e < d; e += 32) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + e);
            a0 = _mm512_dpbf16_ps(a0, qv, (__m512bh)_mm512_loadu_si512(k + c * d + e));
            a1 = _mm512_dpbf16_ps(a1, qv, (__m512bh)_mm512_loadu_si512(k + (c + 1) * d + e));
            a2 = _mm512_dpbf16_ps(a2, qv, (__m512bh)_mm512_loadu_si512(k + (c + 2) * d + e));
            a3 = _mm512_dpbf16_ps(a3, qv, (__m512bh)_mm512_loadu_si512(k + (c + 3) * d + e));
        }
        s[c] = _mm512_reduce_add_ps(a0) * scale;
        s[c + 1] = _mm512_reduce_add_ps(a1) * scale;
        s[c + 2] = _mm512_reduce_add_ps(a2) * scale;
        s[c + 3] = _mm512_reduce_add_ps(a3) * scale;
    }
    for (; c < n; c++) {
        __m512 a0 = _mm512_setzero_ps();
        for (int64_t e = 0; e < d; e += 32)
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(q + e), (__m512bh)_mm512_loadu_si512(k + c * d + e));
        s[c] = _mm512_reduce_add_ps(a0) * scale;
    }
}
#endif

/* element e of row c of a (rows, d) block in float32 or bfloat16 */
static inline __attribute__((always_inline)) float load(const void *p, int64_t i, const int dtype) {
    return dtype == 1 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
#define AT(p, c, e) load((p), (c) * d + (e), dtype)

/* One query per row against that row's own cached keys and values (decode), every row and head of
 * a layer in one call, threads over (row, kv head) pairs.
 *   q      (rows, heads, d) at strides (q_row, q_head, 1)
 *   k, v   the layer's cache (cache rows, kv_heads, cols, d), contiguous
 *   cache_row[i], end[i]: row i reads cache row cache_row[i], columns [max(0, end - window), end)
 *                (window 0: from column 0)
 *   out    (rows, heads, d) contiguous; dtype 0 float32, 1 bfloat16 (q, k, v and out alike)
 * Keys go four at a time through one vector loop over d (four independent sums), values likewise.
 * Scores, softmax and sums in float32; exp as exp_nonpositive. */
static inline __attribute__((always_inline)) void decode_task(
    int64_t task, const void *q, int64_t heads, int64_t q_row, int64_t q_head, const void *k, const void *v,
    int64_t kv_heads, int64_t cols, int64_t d, const int64_t *cache_row, const int64_t *end, int64_t window,
    float scale, const int dtype, void *out) {
    const int64_t g = heads / kv_heads;
    const size_t esize = dtype == 1 ? 2 : 4;
    {
        const int64_t i = task / kv_heads, kh = task % kv_heads;
        const int64_t stop = end[i], first = window > 0 && stop > window ? stop - window : 0, n = stop - first;
        const char *kb = (const char *)k + ((cache_row[i] * kv_heads + kh) * cols + first) * d * esize;
        const char *vb = (const char *)v + ((cache_row[i] * kv_heads + kh) * cols + first) * d * esize;
        float qf[d], acc[d];
        const size_t sbytes = sizeof(float) * (size_t)(n > 0 ? n : 1);
        float *heap = sbytes > (64 << 10) ? (float *)malloc(sbytes) : NULL; /* long rows: off the thread's stack */
        float *s = heap ? heap : (float *)__builtin_alloca(sbytes);
        for (int64_t j = 0; j < g; j++) {
            const int64_t off = i * q_row + (kh * g + j) * q_head;
            for (int64_t e = 0; e < d; e++)
                qf[e] = load(q, off + e, dtype) * scale;
            float top = -INFINITY;
            int64_t c = 0;
#ifdef __AVX512BF16__
            if (dtype == 1 && d % 32 == 0) { /* bf16 pairs straight into float32 sums: no conversion pass */
                scores_bf16(((const uint16_t *)q) + i * q_row + (kh * g + j) * q_head, (const uint16_t *)kb, n, d,
                            scale, s);
                c = n;
            }
#endif
            for (; c + 4 <= n; c += 4) {
                float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
                for (int64_t e = 0; e < d; e++) {
                    d0 = fmaf(qf[e], AT(kb, c, e), d0);
                    d1 = fmaf(qf[e], AT(kb, c + 1, e), d1);
                    d2 = fmaf(qf[e], AT(kb, c + 2, e), d2);
                    d3 = fmaf(qf[e], AT(kb, c + 3, e), d3);
                }
                s[c] = d0, s[c + 1] = d1, s[c + 2] = d2, s[c + 3] = d3;
            }
            for (; c < n; c++) {
                float d0 = 0.0f;
#pragma omp simd reduction(+ : d0)
                for (int64_t e = 0; e < d; e++) d0 = fmaf(qf[e], AT(kb, c, e), d0);
                s[c] = d0;
            }
            for (c = 0; c < n; c++) top = s[c] > top ? s[c] : top;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (c = 0; c < n; c++) {
                s[c] = exp_nonpositive(s[c] - top);
                sum += s[c];
            }
            for (int64_t e = 0; e < d; e++) acc[e] = 0.0f;
            for (c = 0; c + 4 <= n; c += 4) {
                const float p0 = s[c], p1 = s[c + 1], p2 = s[c + 2], p3 = s[c + 3];
#pragma omp simd
                for (int64_t e = 0; e < d; e++)
                    acc[e] = fmaf(p3, AT(vb, c + 3, e), fmaf(p2, AT(vb, c + 2, e),
                             fmaf(p1, AT(vb, c + 1, e), fmaf(p0, AT(vb, c, e), acc[e]))));
            }
            for (; c < n; c++) {
                const float p0 = s[c];
#pragma omp simd
                for (int64_t e = 0; e < d; e++) acc[e] = fmaf(p0, AT(vb, c, e), acc[e]);
            }
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            const int64_t o = (i * heads + kh * g + j) * d;
            if (dtype == 1) {
                for (int64_t e = 0; e < d; e++) ((uint16_t *)out)[o + e] = f32_to_bf16(acc[e] * inv);
            } else {
                for (int64_t e = 0; e < d; e++) ((float *)out)[o + e] = acc[e] * inv;
            }
        }
        free(heap);
    }
}

void decode_attention(const void *q, int64_t rows, int64_t heads, int64_t q_row, int64_t q_head, const void *k,
                      const void *v, int64_t kv_heads, int64_t cols, int64_t d, const int64_t *cache_row,
                      const int64_t *end, int64_t window, float scale, int dtype, void *out) {
    if (dtype == 1) { /* the element type a compile-time constant in each loop */
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t task = 0; task < rows * kv_heads; task++)
            decode_task(task, q, heads, q_row, q_head, k, v, kv_heads, cols, d, cache_row, end, window, scale, 1, out);
    } else {
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t task = 0; task < rows * kv_heads; task++)
            decode_task(task, q, heads, q_row, q_head, k, v, kv_heads, cols, d, cache_row, end, window, scale, 0, out);
    }
}

/* 1 when this build computes bfloat16 decode scores with the AVX512-BF16 dot product */
int has_bf16_dot(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* 1 when built with OpenMP (decode_attention then uses the process's OpenMP threads) */
int has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
