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
 *
 * The int8 KV cache (--kv-cache-dtype int8) keeps each (token, kv head) as a record of d + 4 bytes:
 * d int8 values, then their float32 scale (max |x| / 127; the values are x / scale rounded to nearest
 * even), which kv_store_i8 writes and decode_attention reads (pipeline/models/kv_cache.py has the
 * same arithmetic in PyTorch).
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

/* One row of float32 -> uint8 = x / scale + 128 rounded to nearest (ties up), *scale = max |x| / 127
 * (at least 1e-30 / 127). As the eager code: top = max(max x, -min x); factor = (1 / top) * 127;
 * u = (uint8)(x * factor + 128.5). */
static inline void quantize_row(const float *xf, int64_t cols, uint8_t *o, float *scale) {
    float hi = -INFINITY, lo = INFINITY;
#pragma omp simd reduction(max : hi) reduction(min : lo)
    for (int64_t c = 0; c < cols; c++) {
        hi = xf[c] > hi ? xf[c] : hi;
        lo = xf[c] < lo ? xf[c] : lo;
    }
    float top = hi > -lo ? hi : -lo;
    if (!(top >= 1e-30f)) top = 1e-30f;
    float factor = (1.0f / top) * 127.0f;
#pragma omp simd
    for (int64_t c = 0; c < cols; c++) {
        float t = xf[c] * factor;
        t = t + 128.5f; /* in [1.5, 255.5]: truncation rounds x * factor to nearest */
        o[c] = (uint8_t)(int32_t)t;
    }
    *scale = top / 127.0f;
}

/* `width` elements of x from element `offset` on, as float32: x itself, or converted from bfloat16
 * into buf */
static inline const float *as_f32(const void *x, int64_t offset, int64_t width, int dtype, float *buf) {
    if (dtype != 1) return (const float *)x + offset;
    const uint16_t *xb = (const uint16_t *)x + offset;
#pragma omp simd
    for (int64_t c = 0; c < width; c++) buf[c] = bf16_to_f32(xb[c]);
    return buf;
}

/* x (rows, cols), row stride `stride` elements -> out (rows, cols) uint8 and scale (rows): quantize_row
 * of each row, bit for bit the eager pipeline.models.int8.quantize_tokens. */
void quantize_rows_u8(const void *x, int64_t rows, int64_t cols, int64_t stride, int dtype, uint8_t *out,
                      float *scale) {
    float buf[dtype == 1 ? cols : 1];
    for (int64_t r = 0; r < rows; r++)
        quantize_row(as_f32(x, r * stride, cols, dtype, buf), cols, out + r * cols, scale + r);
}

/* out (rows, cols) in `dtype` = acc (rows, cols) float32 * w[c] (float32, may be NULL) * s[r] (+ bias[c],
 * float32, may be NULL), multiplied in that order (pipeline.models.kernels.int8.epilogue's eager order).
 * out may be acc itself when dtype is float32. */
void scale_rows(const float *acc, int64_t rows, int64_t cols, const float *s, const float *w, const float *bias,
                int dtype, void *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *a = acc + r * cols;
        const float sr = s[r];
        float t[cols];
        if (w) {
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) t[c] = (a[c] * w[c]) * sr;
        } else {
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) t[c] = a[c] * sr;
        }
        if (bias) {
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) t[c] = bias[c] + t[c];
        }
        if (dtype == 1) {
            uint16_t *o = (uint16_t *)out + r * cols;
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) o[c] = f32_to_bf16(t[c]);
        } else {
            float *o = (float *)out + r * cols;
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) o[c] = t[c];
        }
    }
}

/* exp(x) for x <= 0 (softmax after subtracting the maximum), vectorizable: 2^n * p(r) with
 * n = round(x / ln 2) and r = x - n ln 2 (Cody-Waite), p a degree-6 polynomial; relative error
 * about 2e-7 on [-87, 0]. n is rounded by adding and subtracting 1.5 * 2^23 (to nearest even):
 * gcc does not vectorize floorf without -fno-trapping-math, and this loop runs once per key. */
static inline __attribute__((always_inline)) float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
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

/* What feeds an int8 projection, computed in float32 and quantized in the same pass (the float
 * input is never written):
 *   prologue 1, RMSNorm: x (rows, cols) -> x * rsqrt(mean(x^2) + eps) * w[c]
 *   prologue 2, SiLU-gated: x (rows, 2 cols) = [gate | up] -> silu(gate) * up
 * x in `dtype` with row stride `stride`; out (rows, cols) uint8, scale (rows) as quantize_rows_u8. */
void quantize_rows_u8_fused(const void *x, int64_t rows, int64_t cols, int64_t stride, int dtype, int prologue,
                            const float *w, float eps, uint8_t *out, float *scale) {
    const int64_t width = prologue == 2 ? 2 * cols : cols;
    float in[width], buf[cols];
    for (int64_t r = 0; r < rows; r++) {
        const float *xf = as_f32(x, r * stride, width, dtype, in);
        if (prologue == 1) {
            float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
            for (int64_t c = 0; c < cols; c++) ss += xf[c] * xf[c];
            const float inv = 1.0f / sqrtf(ss / (float)cols + eps);
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) buf[c] = xf[c] * inv * w[c];
        } else {
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) buf[c] = exp_nonpositive(-fabsf(xf[c])); /* e^-|g| */
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) { /* sigmoid(g) = 1 / (1 + e^-g), or e^g / (1 + e^g) below 0 */
                const float g = xf[c], t = buf[c];
                buf[c] = g * ((g >= 0.0f ? 1.0f : t) / (1.0f + t)) * xf[cols + c];
            }
        }
        quantize_row(buf, cols, out + r * cols, scale + r);
    }
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

/* The scale stored after the d int8 values of a record */
static inline float record_scale(const int8_t *rec, int64_t d) {
    float s;
    memcpy(&s, rec + d, 4);
    return s;
}

#ifdef __AVX512F__
#include <immintrin.h>

/* records ahead that the int8 loops ask the cache for: a task's keys and values are new memory each
 * time, and the hardware prefetcher alone left the kernel at ~60% of its in-cache speed */
#define PREFETCH 32
/* 16 int8 values from p as float32 lanes */
static inline __m512 i8x16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* The lane sums of a0..a3 as four floats: 128-bit lanes paired across the vectors, then within
 * lanes (8 shuffles for four keys where four _mm512_reduce_add_ps take 16) */
static inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 t01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
    const __m512 t23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
    __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(t01, t23, 0x88), _mm512_shuffle_f32x4(t01, t23, 0xDD));
    u = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E)); /* lane i: four partial sums of key i */
    u = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));
    return _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, u));
}

/* s[c] = (qf . key c) * key c's scale, n int8 records of d + 4 bytes (d % 16 == 0), four keys at a time */
static void scores_i8(const float *qf, const int8_t *k, int64_t n, int64_t d, float *s) {
    const int64_t rs = d + 4;
    int64_t c = 0;
    for (; c + 4 <= n; c += 4) {
        const int8_t *k0 = k + c * rs;
        for (int64_t ahead = 0; ahead < 4 * rs; ahead += 64)
            _mm_prefetch((const char *)k0 + PREFETCH * rs + ahead, _MM_HINT_T0);
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t e = 0; e < d; e += 16) {
            const __m512 qv = _mm512_loadu_ps(qf + e);
            a0 = _mm512_fmadd_ps(qv, i8x16(k0 + e), a0);
            a1 = _mm512_fmadd_ps(qv, i8x16(k0 + rs + e), a1);
            a2 = _mm512_fmadd_ps(qv, i8x16(k0 + 2 * rs + e), a2);
            a3 = _mm512_fmadd_ps(qv, i8x16(k0 + 3 * rs + e), a3);
        }
        const __m128 scales = _mm_setr_ps(record_scale(k0, d), record_scale(k0 + rs, d), record_scale(k0 + 2 * rs, d),
                                          record_scale(k0 + 3 * rs, d));
        _mm_storeu_ps(s + c, _mm_mul_ps(sum4(a0, a1, a2, a3), scales));
    }
    for (; c < n; c++) {
        __m512 a0 = _mm512_setzero_ps();
        for (int64_t e = 0; e < d; e += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qf + e), i8x16(k + c * rs + e), a0);
        s[c] = _mm512_reduce_add_ps(a0) * record_scale(k + c * rs, d);
    }
}

/* acc (D) += sum over c of p[c] * value c's scale * value c, n int8 records of D + 4 bytes: D / 16
 * accumulators held in registers (D a compile-time 64, 128 or 256) */
#define VALUES_I8(D)                                                                                           \
    static void values_i8_##D(const float *p, const int8_t *v, int64_t n, float *acc) {                      \
        __m512 a[D / 16];                                                                                      \
        for (int b = 0; b < D / 16; b++) a[b] = _mm512_loadu_ps(acc + 16 * b);                               \
        for (int64_t c = 0; c < n; c++) {                                                                      \
            const int8_t *r = v + c * (D + 4);                                                                 \
            _mm_prefetch((const char *)r + PREFETCH * (D + 4), _MM_HINT_T0);                                    \
            _mm_prefetch((const char *)r + PREFETCH * (D + 4) + 64, _MM_HINT_T0);                               \
            const __m512 w = _mm512_set1_ps(p[c] * record_scale(r, D));                                        \
            for (int b = 0; b < D / 16; b++) a[b] = _mm512_fmadd_ps(w, i8x16(r + 16 * b), a[b]);              \
        }                                                                                                      \
        for (int b = 0; b < D / 16; b++) _mm512_storeu_ps(acc + 16 * b, a[b]);                                \
    }
VALUES_I8(64)
VALUES_I8(128)
VALUES_I8(256)
#undef VALUES_I8

/* acc (d) += sum over c of p[c] * value c's scale * value c, n int8 records (d % 16 == 0) */
static void values_i8(const float *p, const int8_t *v, int64_t n, int64_t d, float *acc) {
    if (d == 64) return values_i8_64(p, v, n, acc);
    if (d == 128) return values_i8_128(p, v, n, acc);
    if (d == 256) return values_i8_256(p, v, n, acc);
    const int64_t rs = d + 4;
    int64_t c = 0;
    for (; c + 4 <= n; c += 4) {
        const int8_t *v0 = v + c * rs;
        const __m512 p0 = _mm512_set1_ps(p[c] * record_scale(v0, d));
        const __m512 p1 = _mm512_set1_ps(p[c + 1] * record_scale(v0 + rs, d));
        const __m512 p2 = _mm512_set1_ps(p[c + 2] * record_scale(v0 + 2 * rs, d));
        const __m512 p3 = _mm512_set1_ps(p[c + 3] * record_scale(v0 + 3 * rs, d));
        for (int64_t e = 0; e < d; e += 16) {
            __m512 a = _mm512_loadu_ps(acc + e);
            a = _mm512_fmadd_ps(p0, i8x16(v0 + e), a);
            a = _mm512_fmadd_ps(p1, i8x16(v0 + rs + e), a);
            a = _mm512_fmadd_ps(p2, i8x16(v0 + 2 * rs + e), a);
            a = _mm512_fmadd_ps(p3, i8x16(v0 + 3 * rs + e), a);
            _mm512_storeu_ps(acc + e, a);
        }
    }
    for (; c < n; c++) {
        const __m512 p0 = _mm512_set1_ps(p[c] * record_scale(v + c * rs, d));
        for (int64_t e = 0; e < d; e += 16)
            _mm512_storeu_ps(acc + e, _mm512_fmadd_ps(p0, i8x16(v + c * rs + e), _mm512_loadu_ps(acc + e)));
    }
}
#endif

/* Quantize n tokens' keys or values into the int8 cache: x (n, kv_heads, d) in `dtype` at strides
 * (x_tok, x_head, 1); token i goes to cache row rows[i], column cols_at[i] of the layer's cache
 * (cache rows, kv_heads, cols, d + 4) int8. Each (token, head): scale = max |x| / 127, values
 * x * (127 / max |x|) rounded to nearest even (0 for an all-zero vector). */
void kv_store_i8(const void *x, int64_t n, int64_t kv_heads, int64_t d, int64_t x_tok, int64_t x_head, int dtype,
                 int8_t *cache, int64_t cols, const int64_t *rows, const int64_t *cols_at) {
    float buf[d];
    for (int64_t i = 0; i < n; i++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const float *xf = as_f32(x, i * x_tok + h * x_head, d, dtype, buf);
            float top = 0.0f;
#pragma omp simd reduction(max : top)
            for (int64_t e = 0; e < d; e++) top = fabsf(xf[e]) > top ? fabsf(xf[e]) : top;
            const float inv = top > 0.0f ? 127.0f / top : 0.0f, scale = top / 127.0f;
            int8_t *rec = cache + ((rows[i] * kv_heads + h) * cols + cols_at[i]) * (d + 4);
#pragma omp simd
            for (int64_t e = 0; e < d; e++) rec[e] = (int8_t)nearbyintf(xf[e] * inv);
            memcpy(rec + d, &scale, 4);
        }
    }
}

/* element i of a float32 or bfloat16 block */
static inline __attribute__((always_inline)) float load(const void *p, int64_t i, const int dtype) {
    return dtype == 1 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
/* element e of key / value c in a block of the cache: float32 / bfloat16 rows of d, or int8 records
 * of d + 4 bytes (kv8) */
static inline __attribute__((always_inline)) float kv_at(const void *p, int64_t c, int64_t e, int64_t d,
                                                         const int dtype, const int kv8) {
    return kv8 ? (float)((const int8_t *)p)[c * (d + 4) + e] : load(p, c * d + e, dtype);
}
#define AT(p, c, e) kv_at((p), (c), (e), d, dtype, kv8)
/* key / value c's scale: an int8 record's, else 1 */
#define SCALE(p, c) (kv8 ? record_scale((const int8_t *)(p) + (c) * (d + 4), d) : 1.0f)

/* One query per row against that row's own cached keys and values (decode), every row and head of
 * a layer in one call, threads over (row, kv head) pairs.
 *   q      (rows, heads, d) at strides (q_row, q_head, 1)
 *   k, v   the layer's cache (cache rows, kv_heads, cols, d), contiguous, in q's dtype; with kv8 the
 *          int8 cache (cache rows, kv_heads, cols, d + 4) of records (kv_store_i8)
 *   cache_row[i], end[i]: row i reads cache row cache_row[i], columns [max(0, end - window), end)
 *                (window 0: from column 0)
 *   out    (rows, heads, d) contiguous; dtype 0 float32, 1 bfloat16 (q and out alike)
 * Keys go four at a time through one vector loop over d (four independent sums), values likewise;
 * an int8 key's scale multiplies its score, an int8 value's its softmax weight.
 * Scores, softmax and sums in float32; exp as exp_nonpositive. */
static inline __attribute__((always_inline)) void decode_task(
    int64_t task, const void *q, int64_t heads, int64_t q_row, int64_t q_head, const void *k, const void *v,
    int64_t kv_heads, int64_t cols, int64_t d, const int64_t *cache_row, const int64_t *end, int64_t window,
    float scale, const int dtype, const int kv8, void *out) {
    const int64_t g = heads / kv_heads;
    const size_t record = kv8 ? (size_t)d + 4 : (size_t)d * (dtype == 1 ? 2 : 4);
    {
        const int64_t i = task / kv_heads, kh = task % kv_heads;
        const int64_t stop = end[i], first = window > 0 && stop > window ? stop - window : 0, n = stop - first;
        const char *kb = (const char *)k + ((cache_row[i] * kv_heads + kh) * cols + first) * record;
        const char *vb = (const char *)v + ((cache_row[i] * kv_heads + kh) * cols + first) * record;
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
            if (dtype == 1 && !kv8 && d % 32 == 0) { /* bf16 pairs straight into float32 sums: no conversion */
                scores_bf16(((const uint16_t *)q) + i * q_row + (kh * g + j) * q_head, (const uint16_t *)kb, n, d,
                            scale, s);
                c = n;
            }
#endif
#ifdef __AVX512F__
            if (kv8 && d % 16 == 0) {
                scores_i8(qf, (const int8_t *)kb, n, d, s);
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
                s[c] = d0 * SCALE(kb, c), s[c + 1] = d1 * SCALE(kb, c + 1);
                s[c + 2] = d2 * SCALE(kb, c + 2), s[c + 3] = d3 * SCALE(kb, c + 3);
            }
            for (; c < n; c++) {
                float d0 = 0.0f;
#pragma omp simd reduction(+ : d0)
                for (int64_t e = 0; e < d; e++) d0 = fmaf(qf[e], AT(kb, c, e), d0);
                s[c] = d0 * SCALE(kb, c);
            }
            for (c = 0; c < n; c++) top = s[c] > top ? s[c] : top;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (c = 0; c < n; c++) {
                s[c] = exp_nonpositive(s[c] - top);
                sum += s[c];
            }
            for (int64_t e = 0; e < d; e++) acc[e] = 0.0f;
            c = 0;
#ifdef __AVX512F__
            if (kv8 && d % 16 == 0) {
                values_i8(s, (const int8_t *)vb, n, d, acc);
                c = n;
            }
#endif
            for (; c + 4 <= n; c += 4) {
                const float p0 = s[c] * SCALE(vb, c), p1 = s[c + 1] * SCALE(vb, c + 1);
                const float p2 = s[c + 2] * SCALE(vb, c + 2), p3 = s[c + 3] * SCALE(vb, c + 3);
#pragma omp simd
                for (int64_t e = 0; e < d; e++)
                    acc[e] = fmaf(p3, AT(vb, c + 3, e), fmaf(p2, AT(vb, c + 2, e),
                             fmaf(p1, AT(vb, c + 1, e), fmaf(p0, AT(vb, c, e), acc[e]))));
            }
            for (; c < n; c++) {
                const float p0 = s[c] * SCALE(vb, c);
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

/* kv8: k and v are int8 record caches (see decode_task) */
void decode_attention(const void *q, int64_t rows, int64_t heads, int64_t q_row, int64_t q_head, const void *k,
                      const void *v, int64_t kv_heads, int64_t cols, int64_t d, const int64_t *cache_row,
                      const int64_t *end, int64_t window, float scale, int dtype, int kv8, void *out) {
    const int64_t tasks = rows * kv_heads;
#define TASKS(DT, KV8)                                                                                          \
    _Pragma("omp parallel for schedule(dynamic, 1)") for (int64_t task = 0; task < tasks; task++)            \
        decode_task(task, q, heads, q_row, q_head, k, v, kv_heads, cols, d, cache_row, end, window, scale, DT, KV8, out)
    /* the element types compile-time constants in each loop */
    if (dtype == 1 && kv8) {
        TASKS(1, 1);
    } else if (dtype == 1) {
        TASKS(1, 0);
    } else if (kv8) {
        TASKS(0, 1);
    } else {
        TASKS(0, 0);
    }
#undef TASKS
}

/* ---- int8 x int8 products for --quantize int8 (the "native" kernel of pipeline.models.kernels.int8) ----
 * acc (rows, n) int32 = sum over c of (u[r][c] - 128) * w[o][c], exactly: u (rows, k) uint8 is the
 * activations' int8 values + 128 (what quantize_rows_u8 writes), w the layer's (n, k) int8 weight.
 * With AVX512-VNNI the weight is repacked once into blocks of 16 outputs (pack_vnni), vpdpbusd adds four
 * u8 x s8 products into each int32 lane (no saturation) and 128 * wsum[o] (wsum[o] = the sum of w's row
 * o) is subtracted; with AVX2 (plain layout) vpsignb / vpmaddubsw / vpmaddwd (dot_tile_avx2).
 * Every step is exact in int32 (|u . w| <= 255 * 127 * k < 2^31 for k < 66,000), so the result is the
 * integers oneDNN or torch._int_mm compute, whatever the order. Threads over blocks of outputs; rows go
 * a few at a time against a block's weights (kept in cache): at decode sizes each weight is read once. */
#define OB 8 /* outputs of an AVX2 tile */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* The VNNI layout of an (n, k) int8 weight (k % 4 == 0): blocks of 16 outputs, each step of 4 input
 * features one 64-byte vector, output j's 4 values in lanes 4j..4j+3:
 *   p[((b * (k / 4) + e) * 16 + j) * 4 + t] = w[16 b + j][4 e + t]   (outputs past n: 0)
 * so vpdpbusd of one vector against a row's 4 activations broadcast adds 16 outputs' partial sums,
 * with no reduction across lanes; the weights stream once per block of rows. */
void pack_vnni(const int8_t *w, int64_t n, int64_t k, int8_t *p) {
    const int64_t blocks = (n + 15) / 16, steps = k / 4;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t e = 0; e < steps; e++)
            for (int64_t j = 0; j < 16; j++) {
                int8_t *dst = p + ((b * steps + e) * 16 + j) * 4;
                const int64_t o = 16 * b + j;
                for (int t = 0; t < 4; t++) dst[t] = o < n ? w[o * k + 4 * e + t] : 0;
            }
}

/* rows r0..r0+R-1 against output blocks b0, b0+1 (32 outputs): 2R accumulators of 16 lanes */
#define VNNI_ROWS(R)                                                                                          \
    static void vnni_rows_##R(const uint8_t *u, int64_t r0, int64_t k, const int8_t *p, int64_t b0, int64_t nb, \
                              __m512i *out) {                                                                  \
        const int64_t steps = k / 4;                                                                           \
        const int8_t *p0 = p + b0 * steps * 64, *p1 = p + (b0 + (nb > 1)) * steps * 64;                       \
        __m512i a0[R], a1[R];                                                                                  \
        for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_si512();                                    \
        for (int64_t e = 0; e < steps; e++) {                                                                  \
            const __m512i w0 = _mm512_loadu_si512(p0 + e * 64), w1 = _mm512_loadu_si512(p1 + e * 64);          \
            for (int r = 0; r < R; r++) {                                                                      \
                int32_t four;                                                                                  \
                memcpy(&four, u + (r0 + r) * k + 4 * e, 4);                                                    \
                const __m512i x = _mm512_set1_epi32(four);                                                     \
                a0[r] = _mm512_dpbusd_epi32(a0[r], x, w0);                                                     \
                a1[r] = _mm512_dpbusd_epi32(a1[r], x, w1);                                                     \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < R; r++) out[2 * r] = a0[r], out[2 * r + 1] = a1[r];                                \
    }
VNNI_ROWS(8)
VNNI_ROWS(4)
VNNI_ROWS(2)
VNNI_ROWS(1)
#undef VNNI_ROWS

/* acc (rows, n) int32 = (u - 128) . w for w in the VNNI layout (pack_vnni), wsum as int8_products */
void int8_products_vnni(const uint8_t *u, int64_t rows, int64_t k, const int8_t *p, int64_t n, const int32_t *wsum,
                        int32_t *acc) {
    const int64_t blocks = (n + 15) / 16, pairs = (blocks + 1) / 2;
#pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < pairs; q++) {
        const int64_t b0 = 2 * q, nb = blocks - b0 < 2 ? blocks - b0 : 2;
        __m512i sums[16];
        for (int64_t r0 = 0; r0 < rows;) {
            const int64_t left = rows - r0, R = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            if (R == 8) vnni_rows_8(u, r0, k, p, b0, nb, sums);
            else if (R == 4) vnni_rows_4(u, r0, k, p, b0, nb, sums);
            else if (R == 2) vnni_rows_2(u, r0, k, p, b0, nb, sums);
            else vnni_rows_1(u, r0, k, p, b0, nb, sums);
            for (int64_t r = 0; r < R; r++)
                for (int64_t h = 0; h < nb; h++) {
                    int32_t lanes[16];
                    _mm512_storeu_si512(lanes, sums[2 * r + h]);
                    const int64_t o0 = 16 * (b0 + h);
                    for (int64_t j = 0; j < 16 && o0 + j < n; j++)
                        acc[(r0 + r) * n + o0 + j] = lanes[j] - 128 * wsum[o0 + j];
                }
            r0 += R;
        }
    }
}

int has_vnni(void) { return 1; }
#else
int has_vnni(void) { return 0; }
void pack_vnni(const int8_t *w, int64_t n, int64_t k, int8_t *p) { (void)w, (void)n, (void)k, (void)p; }
void int8_products_vnni(const uint8_t *u, int64_t rows, int64_t k, const int8_t *p, int64_t n, const int32_t *wsum,
                        int32_t *acc) {
    (void)u, (void)rows, (void)k, (void)p, (void)n, (void)wsum, (void)acc;
}
#endif

#if defined(__AVX2__)
#include <immintrin.h>
/* The same sums without VNNI, 32 input features a step: u - 128 is u ^ 0x80 as a signed byte (s), and
 * s * w = |s| * (w with s's sign) (vpsignb), |s| <= 128 unsigned and w's signed copy within +-127 (the
 * weights are -127..127: quantize's QMAX), so vpmaddubsw's pair sums (<= 2 x 128 x 127 = 32,512) never
 * saturate; vpmaddwd against ones widens them into int32. A tile is R rows (s and |s| made once a step)
 * against O outputs (each weight vector loaded once a step for all R rows): R x O int32 accumulators. */
static inline __attribute__((always_inline)) void dot_tile_avx2(const uint8_t *u, int R, int64_t k, const int8_t *w,
                                                                int O, int64_t n, int32_t *acc) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256i sums[2][8];
    for (int r = 0; r < R; r++)
        for (int o = 0; o < O; o++) sums[r][o] = _mm256_setzero_si256();
    int64_t e = 0;
    for (; e + 32 <= k; e += 32) {
        __m256i sv[2], av[2];
        for (int r = 0; r < R; r++) {
            sv[r] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(u + r * k + e)), flip);
            av[r] = _mm256_abs_epi8(sv[r]);
        }
        for (int o = 0; o < O; o++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + o * k + e));
            for (int r = 0; r < R; r++)
                sums[r][o] = _mm256_add_epi32(sums[r][o], _mm256_madd_epi16(
                    _mm256_maddubs_epi16(av[r], _mm256_sign_epi8(wv, sv[r])), ones));
        }
    }
    if (e < k) { /* k % 32 == 16: one step of 16 */
        const __m128i flip16 = _mm_set1_epi8((char)0x80), ones16 = _mm_set1_epi16(1);
        for (int r = 0; r < R; r++) {
            const __m128i sv = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(u + r * k + e)), flip16);
            const __m128i av = _mm_abs_epi8(sv);
            for (int o = 0; o < O; o++) {
                const __m128i wv = _mm_loadu_si128((const __m128i *)(w + o * k + e));
                const __m128i part = _mm_madd_epi16(_mm_maddubs_epi16(av, _mm_sign_epi8(wv, sv)), ones16);
                sums[r][o] = _mm256_add_epi32(sums[r][o], _mm256_inserti128_si256(_mm256_setzero_si256(), part, 0));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int o = 0; o < O; o++) {
            __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sums[r][o]), _mm256_extracti128_si256(sums[r][o], 1));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
            acc[r * n + o] = _mm_cvtsi128_si32(h); /* of u - 128 already: no wsum correction */
        }
}
#endif

/* whether this build has the plain-layout loop for k input features (AVX2, k % 16 == 0) */
int int8_products_path(int64_t k) {
#if defined(__AVX2__)
    return k % 16 == 0;
#else
    (void)k;
    return 0;
#endif
}

/* acc (rows, n) int32 = (u - 128) . w, w plain (n, k) with values -127..127; returns 0 when this build has
 * no path for k. Threads over blocks of 8 outputs; rows 2 at a time against a block (in cache). */
int int8_products(const uint8_t *u, int64_t rows, int64_t k, const int8_t *w, int64_t n, const int32_t *wsum,
                  int32_t *acc) {
    (void)wsum;
    if (!int8_products_path(k)) return 0;
#if defined(__AVX2__)
#define TILE(R, O) dot_tile_avx2(u + r0 * k, R, k, w + o0 * k, O, n, acc + r0 * n + o0)
    const int64_t blocks = (n + OB - 1) / OB;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t o0 = b * OB;
        if (o0 + OB <= n)
            for (int64_t r0 = 0; r0 < rows; r0 += 2) {
                if (r0 + 2 <= rows) TILE(2, OB);
                else TILE(1, OB);
            }
        else
            for (int64_t o = o0; o < n; o++)
                for (int64_t r0 = 0; r0 < rows; r0++) dot_tile_avx2(u + r0 * k, 1, k, w + o * k, 1, n, acc + r0 * n + o);
    }
#undef TILE
#endif
    return 1;
}
#undef OB

/* ---- products of bfloat16 in float32: the head's logits (pipeline.models.kernels.logits) and, on CPUs
 * without bf16 instructions, the layers' projections (pipeline.models.kernels.packed) ----
 * out (rows, vocab) float32 = x (rows, h) . w (vocab, h), both bfloat16 (h % 32 == 0), with the
 * AVX512-BF16 dot product: the products of bfloat16 pairs are exact in float32 and accumulate in float32
 * (16 lanes, then one fixed reduction), so no logit is rounded to bfloat16 and the weight is read as it
 * is stored: no float32 copy of the table. Each logit is one thread's sum in one order whatever the rows
 * beside it or the threads: a row's logits do not depend on its micro-batch. A tile is R rows of x
 * against 4 vocabulary rows (4R accumulators); threads split the vocabulary. */
#ifdef __AVX512BF16__
#define BF16_VT 32 /* vocabulary rows a thread takes at a time: 256 KB of a 4096-wide table, in L2 */
static inline __attribute__((always_inline)) void bf16_tile(const uint16_t *x, int R, int64_t h, const uint16_t *w,
                                                            int V, int64_t vocab, int64_t v0, float *out) {
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t e = 0; e < h; e += 32) {
        __m512bh wv[4];
        for (int v = 0; v < V; v++) wv[v] = (__m512bh)_mm512_loadu_si512(w + v * h + e);
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * h + e);
            for (int v = 0; v < V; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, wv[v]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) out[r * vocab + v0 + v] = _mm512_reduce_add_ps(acc[r][v]);
}

/* the tile for a constant R and V, so that the accumulators stay in registers */
#define BF16_TILE(R, V) bf16_tile(x + r0 * h, R, h, w + v * h, V, vocab, v, out + r0 * vocab)

void bf16_products(const uint16_t *x, int64_t rows, int64_t h, const uint16_t *w, int64_t vocab, float *out) {
    int64_t tiles = (vocab + BF16_VT - 1) / BF16_VT;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t end = (t + 1) * BF16_VT < vocab ? (t + 1) * BF16_VT : vocab;
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            int64_t R = rows - r0 < 4 ? rows - r0 : 4;
            int64_t v = t * BF16_VT;
            for (; v + 4 <= end; v += 4) {
                if (R == 4) BF16_TILE(4, 4);
                else if (R == 3) BF16_TILE(3, 4);
                else if (R == 2) BF16_TILE(2, 4);
                else BF16_TILE(1, 4);
            }
            for (; v < end; v++) {
                if (R == 4) BF16_TILE(4, 1);
                else if (R == 3) BF16_TILE(3, 1);
                else if (R == 2) BF16_TILE(2, 1);
                else BF16_TILE(1, 1);
            }
        }
    }
}
#undef BF16_TILE
#undef BF16_VT
#elif defined(__AVX2__) && defined(__FMA__)
/* The same product with AVX2: x converted once to float32, each 8 weights widened to float32 (a bfloat16
 * is the high half of its float32) and multiplied by FMA, exact products summed in float32: two sums of 8
 * lanes a logit (the even and the odd blocks of 8), added and reduced in one fixed order at the end. Tiles
 * of 1 row against 4 vocabulary rows, 2 against 2, 3-4 against 1: at most 8 accumulators (the chains
 * that keep the FMA units busy) and 8 weight vectors in the 16 registers, the x values FMA memory
 * operands, at most 4 weight rows streamed at once. A logit's sum runs in the same order in every tile,
 * so it does not depend on the rows beside it either. */
#define BF16_VT 32
#define BF16_RC 128
static inline __attribute__((always_inline)) __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __attribute__((always_inline)) float sum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) void bf16_tile(const float *x, int R, int64_t h, const uint16_t *w,
                                                            int V, int64_t vocab, int64_t v0, float *out) {
    __m256 acc[4][4][2];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v][0] = acc[r][v][1] = _mm256_setzero_ps();
    for (int64_t e = 0; e < h; e += 16) {
        __m256 wv[4][2];
        for (int v = 0; v < V; v++) wv[v][0] = bf16x8(w + v * h + e), wv[v][1] = bf16x8(w + v * h + e + 8);
        for (int r = 0; r < R; r++)
            for (int v = 0; v < V; v++) {
                acc[r][v][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * h + e), wv[v][0], acc[r][v][0]);
                acc[r][v][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * h + e + 8), wv[v][1], acc[r][v][1]);
            }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) out[r * vocab + v0 + v] = sum8(_mm256_add_ps(acc[r][v][0], acc[r][v][1]));
}

#define BF16_TILE(R, V) bf16_tile(xf + r0 * h, R, h, w + v * h, V, vocab, v, out + r0 * vocab)

void bf16_products(const uint16_t *x, int64_t rows, int64_t h, const uint16_t *w, int64_t vocab, float *out) {
    float *xf = malloc((size_t)(rows * h) * sizeof(float) + 1);
    if (!xf) {
        for (int64_t i = 0; i < rows * vocab; i++) out[i] = NAN; /* no memory for x's copy: visibly wrong */
        return;
    }
    for (int64_t i = 0; i < rows * h; i++) xf[i] = bf16_to_f32(x[i]);
    int64_t tiles = (vocab + BF16_VT - 1) / BF16_VT;
    /* rows BF16_RC at a time, so that the rows a tile reads again stay in cache (14336 x 4096, 512 rows:
     * 134 GFLOP/s in one sweep, ~180 at 128) */
    for (int64_t c0 = 0; c0 < rows; c0 += BF16_RC) {
        int64_t c1 = c0 + BF16_RC < rows ? c0 + BF16_RC : rows;
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            int64_t end = (t + 1) * BF16_VT < vocab ? (t + 1) * BF16_VT : vocab;
            for (int64_t r0 = c0; r0 < c1; r0 += 4) {
                int64_t R = c1 - r0 < 4 ? c1 - r0 : 4;
                int64_t v = t * BF16_VT;
                if (R == 2)
                    for (; v + 2 <= end; v += 2) BF16_TILE(2, 2);
                else if (R == 1)
                    for (; v + 4 <= end; v += 4) BF16_TILE(1, 4);
                for (; v < end; v++) {
                    if (R == 4) BF16_TILE(4, 1);
                    else if (R == 3) BF16_TILE(3, 1);
                    else if (R == 2) BF16_TILE(2, 1);
                    else BF16_TILE(1, 1);
                }
            }
        }
    }
    free(xf);
}
#undef BF16_TILE
#undef BF16_VT
#undef BF16_RC
#else
void bf16_products(const uint16_t *x, int64_t rows, int64_t h, const uint16_t *w, int64_t vocab, float *out) {
    (void)x, (void)rows, (void)h, (void)w, (void)vocab, (void)out;
}
#endif

/* which loop bf16_products runs: 2 the AVX512-BF16 dot product, 1 AVX2 with FMA, 0 none */
int bf16_path(void) {
#if defined(__AVX512BF16__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
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
