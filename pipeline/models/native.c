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
