// Weight-only quantized matmuls for kvgen: y[M, N] = x[M, K] @ W[N, K]^T, W in 32-element blocks.
//
// Activations are quantized per 32-block to int8 (scale d, and s = d * sum(q) for asymmetric
// weights), then dotted with the weight's integers, as llama.cpp does. The weights are repacked
// eight rows at a time at load (interleaved.c). AVX2 path with a portable fallback; work is split
// across torch's OpenMP pool (torch ships libgomp.so.1, which this library binds to when loaded
// after torch).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define QK 32

typedef struct { float d; float m; uint8_t qs[QK / 2]; } block_q4;  // w = d * q + m, q in [0, 15]
typedef struct { uint16_t d; uint16_t m; uint8_t qs[QK / 2]; } block_q4h;  // the same with f16 d, m: GGUF's Q4_1 block
typedef struct { float d; float m; int8_t qs[QK]; } block_q8;       // w = d * q + m, q in [-128, 127]
typedef struct { uint16_t d; int8_t qs[QK]; } block_q8s;           // w = d * q, d f16: GGUF's Q8_0 block
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; } block_q5_0;  // GGUF's Q5_0: w = d * (u - 16)
typedef struct { float d; uint8_t qs[QK / 2]; } block_iq4;  // w = d * IQ4_LEVELS[index]: IQ4_NL / IQ4_XS's indices
typedef struct { float d; float m; uint8_t qh[4]; uint8_t qs[QK / 2]; } block_q5m;  // w = d * u + m, u in [0, 31]: Q5_K, Q5_1
typedef struct { float d; float s; int8_t qs[QK]; } block_x8;       // x = d * q, s = d * sum(q)

// f16 bits -> float, exactly (every f16 is a float); the portable twin of F16C's vcvtph2ps.
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24 is exact in float
        const float v = ldexpf((float)mantissa, -24);
        return sign ? -v : v;
    }
    bits = sign | (exponent == 31 ? 0x7F800000u | (mantissa << 13) : ((exponent + 112) << 23) | (mantissa << 13));
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

#ifdef __AVX2__
static inline __m256 f16x8_to_f32(const uint16_t* h) {
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)h));
#else
    return _mm256_setr_ps(f16_to_f32(h[0]), f16_to_f32(h[1]), f16_to_f32(h[2]), f16_to_f32(h[3]),
                          f16_to_f32(h[4]), f16_to_f32(h[5]), f16_to_f32(h[6]), f16_to_f32(h[7]));
#endif
}
#endif

#ifdef __AVX2__
// One block, vectorised: the same amax, scale, rounding (cvtps rounds to nearest even under the
// default MXCSR, as lrintf does) and sum as the portable loop below, so both give the same codes.
static inline void quantize_block_x8(const float* v, block_x8* out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a[4];
    for (int j = 0; j < 4; j++) a[j] = _mm256_loadu_ps(v + 8 * j);
    __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a[0]), _mm256_andnot_ps(sign, a[1])),
                                _mm256_max_ps(_mm256_andnot_ps(sign, a[2]), _mm256_andnot_ps(sign, a[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.0f;
    const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    __m256i q[4];
    for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(a[j], id));
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
    const __m256i packed16 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    const __m256i ordered = _mm256_permutevar8x32_epi32(packed16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)out->qs, ordered);
    out->d = d;
    out->s = d * (float)_mm_cvtsi128_si32(t4);
}
#endif

// Blocks [first, last) of the activations (each block's codes depend on its 32 values alone).
static inline void quantize_x8_range(const float* x, int64_t first, int64_t last, block_x8* out) {
    for (int64_t i = first; i < last; i++) {
        const float* v = x + i * QK;
#ifdef __AVX2__
        quantize_block_x8(v, out + i);
#else
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
#endif
    }
}

// Rows of activations -> blocks, by the calling thread alone.
static void quantize_x8_serial(const float* x, int64_t m_rows, int64_t k, block_x8* out) {
    quantize_x8_range(x, 0, m_rows * (k / QK), out);
}

void kvgen_quantize_x8(const float* x, int64_t m_rows, int64_t k, block_x8* out) {
    const int64_t blocks = m_rows * (k / QK);
    if (m_rows * k <= 65536) {
        quantize_x8_serial(x, m_rows, k, out);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < blocks; i++) quantize_x8_range(x, i, i + 1, out);
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

// hsum8's order over 8 lane sums: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
static inline float sum_lanes(const float* l) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

#include "interleaved.c"

// Dequantize whole weights (for long prefills, where a GEMM over plain floats beats re-reading
// blocks): to fp32, or to bf16 for machines whose bf16 GEMM is faster (avx512_bf16 / AMX).
static inline float as_fp32(float v) { return v; }
static inline uint16_t as_bf16(float v) {  // round to nearest even (weights are finite)
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

DEQUANTIZE_X8(kvgen_dequantize_q4x8, block_q4x8, q4x8_weight, float, as_fp32)
DEQUANTIZE_X8(kvgen_dequantize_q4hx8, block_q4hx8, q4hx8_weight, float, as_fp32)
DEQUANTIZE_X8(kvgen_dequantize_q8x8, block_q8x8, q8x8_weight, float, as_fp32)
DEQUANTIZE_X8(kvgen_dequantize_q8sx8, block_q8sx8, q8sx8_weight, float, as_fp32)
DEQUANTIZE_X8(kvgen_dequantize_q5x8, block_q5x8, q5x8_weight, float, as_fp32)
DEQUANTIZE_X8(kvgen_dequantize_iq4x8, block_iq4x8, iq4x8_weight, float, as_fp32)
DEQUANTIZE_X8(kvgen_dequantize_mx4x8, block_mx4x8, mx4x8_weight, float, as_fp32)
DEQUANTIZE_X8(kvgen_dequantize_q5mx8, block_q5mx8, q5mx8_weight, float, as_fp32)
DEQUANTIZE_X8(kvgen_dequantize_q4x8_bf16, block_q4x8, q4x8_weight, uint16_t, as_bf16)
DEQUANTIZE_X8(kvgen_dequantize_q4hx8_bf16, block_q4hx8, q4hx8_weight, uint16_t, as_bf16)
DEQUANTIZE_X8(kvgen_dequantize_q8x8_bf16, block_q8x8, q8x8_weight, uint16_t, as_bf16)
DEQUANTIZE_X8(kvgen_dequantize_q8sx8_bf16, block_q8sx8, q8sx8_weight, uint16_t, as_bf16)
DEQUANTIZE_X8(kvgen_dequantize_q5x8_bf16, block_q5x8, q5x8_weight, uint16_t, as_bf16)
DEQUANTIZE_X8(kvgen_dequantize_iq4x8_bf16, block_iq4x8, iq4x8_weight, uint16_t, as_bf16)
DEQUANTIZE_X8(kvgen_dequantize_mx4x8_bf16, block_mx4x8, mx4x8_weight, uint16_t, as_bf16)
DEQUANTIZE_X8(kvgen_dequantize_q5mx8_bf16, block_q5mx8, q5mx8_weight, uint16_t, as_bf16)
DEQUANTIZE_Q4KX8(kvgen_dequantize_q4kx8, float, as_fp32)
DEQUANTIZE_Q4KX8(kvgen_dequantize_q4kx8_bf16, uint16_t, as_bf16)
DEQUANTIZE_Q6KX8(kvgen_dequantize_q6kx8, float, as_fp32)
DEQUANTIZE_Q6KX8(kvgen_dequantize_q6kx8_bf16, uint16_t, as_bf16)

#include "half_linear.c"
#include "decode.c"
#include "bf16_gemm.c"
#include "mamba_step.c"
#include "hybrid_step.c"
#include "eagle_step.c"
#include "rows_ops.c"
#include "vocab_splits.c"
