// Weight-only quantized matmuls for kvgen: y[M, N] = x[M, K] @ W[N, K]^T, W in 32-element blocks.
//
// Activations are quantized per 32-block to int8 (scale d, and s = d * sum(q) for asymmetric
// weights), then dotted with the weight's integers, as llama.cpp does. The weights are repacked
// eight rows at a time at load (interleaved.c). AVX2 path with a portable fallback; work is split
// across torch's OpenMP pool (torch ships libgomp.so.1, which this library binds to when loaded
// after torch).
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define QK 32

typedef struct { float d; float m; uint8_t qs[QK / 2]; } block_q4;  // w = d * q + m, q in [0, 15]
typedef struct { float d; float m; int8_t qs[QK]; } block_q8;       // w = d * q + m, q in [-128, 127]
typedef struct { float d; float s; int8_t qs[QK]; } block_x8;       // x = d * q, s = d * sum(q)

void kvgen_quantize_x8(const float* x, int64_t m_rows, int64_t k, block_x8* out) {
    const int64_t nb = k / QK;
#pragma omp parallel for schedule(static) if (m_rows * k > 65536)
    for (int64_t i = 0; i < m_rows * nb; i++) {
        const float* v = x + i * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(v[j]));
        const float d = amax / 127.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            const int q = (int)lrintf(v[j] * id);
            out[i].qs[j] = (int8_t)q;
            sum += q;
        }
        out[i].d = d;
        out[i].s = d * (float)sum;
    }
}

#ifdef __AVX2__
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

#endif

#include "interleaved.c"

// Dequantize whole weights (for long prefills, where a GEMM over plain floats beats re-reading
// blocks): to fp32, or to bf16 for machines whose bf16 GEMM is faster (avx512_bf16 / AMX).
static inline float as_fp32(float v) { return v; }
static inline uint16_t as_bf16(float v) {  // round to nearest even (weights are finite)
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

DEQUANTIZE_X8(kvgen_dequantize_q4x8, block_q4x8, q4x8_value, float, as_fp32)
DEQUANTIZE_X8(kvgen_dequantize_q8x8, block_q8x8, q8x8_value, float, as_fp32)
DEQUANTIZE_X8(kvgen_dequantize_q4x8_bf16, block_q4x8, q4x8_value, uint16_t, as_bf16)
DEQUANTIZE_X8(kvgen_dequantize_q8x8_bf16, block_q8x8, q8x8_value, uint16_t, as_bf16)

#include "decode.c"
