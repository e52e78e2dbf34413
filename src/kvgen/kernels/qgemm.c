// Weight-only quantized matmuls for kvgen: y[M, N] = x[M, K] @ W[N, K]^T, W in 32-element blocks.
//
// Activations are quantized per 32-block to int8 (scale d, and s = d * sum(q) for asymmetric
// weights), then dotted with the weight's integers, as llama.cpp does. AVX2 path with a portable
// fallback; rows of W are split across torch's OpenMP pool (torch ships libgomp.so.1, which this
// library binds to when loaded after torch).
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

// Sum of 4 adjacent u8 x s8 products per int32 lane: one VNNI instruction where the CPU has it
// (AVX-512 VNNI with VL, or AVX-VNNI), else AVX2's multiply-add pair (no overflow either way: the
// unsigned side is a 4-bit weight or |int8|, so pairs stay within int16).
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __m256i unpack_nibbles(const uint8_t* qs) {  // byte j -> elements j (low) and j + 16 (high)
    const __m128i packed = _mm_loadu_si128((const __m128i*)qs);
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), mask), _mm_and_si128(packed, mask));
}
#endif

// Up to 8 activation rows share each loaded weight block (8 accumulators + the block fit the 16 ymm registers).
#define TILE 8
// One activation row (decode): each weight row is streamed once, front to back (what the hardware
// prefetcher handles best). Its sums run in exactly the order of the tiled GEMM below (one
// accumulator per row, blocks in order, then the minimums), so a row's output is bit for bit the
// same whether it is decoded alone or in a batch: greedy output does not depend on the batch.
#ifdef __AVX2__
// acc + (integer dot of one block) * d_w * d_x, as one FMA.
static inline __m256 dot_q4(__m256 acc, const block_q4* w, const block_x8* x) {
    const __m256i xq = _mm256_loadu_si256((const __m256i*)x->qs);
    const __m256i dot = dot_u8s8(unpack_nibbles(w->qs), xq);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(w->d * x->d), acc);
}

static inline __m256 dot_q8(__m256 acc, const block_q8* w, const block_x8* x) {
    const __m256i xq = _mm256_loadu_si256((const __m256i*)x->qs);
    const __m256i q = _mm256_loadu_si256((const __m256i*)w->qs);
    const __m256i dot = dot_u8s8(_mm256_sign_epi8(xq, xq), _mm256_sign_epi8(q, xq));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(w->d * x->d), acc);
}

#define GEMV(NAME, BLOCK, DOT)                                                                      \
    static void NAME(const BLOCK* w, const block_x8* x, float* y, int64_t n, int64_t k) {           \
        const int64_t nb = k / QK;                                                                   \
        _Pragma("omp parallel for schedule(static)")                                                 \
        for (int64_t row = 0; row < n; row++) {                                                      \
            const BLOCK* wr = w + row * nb;                                                          \
            __m256 acc = _mm256_setzero_ps();                                                        \
            float mins = 0.0f;                                                                       \
            for (int64_t b = 0; b < nb; b++) {                                                       \
                acc = DOT(acc, wr + b, x + b);                                                       \
                mins += wr[b].m * x[b].s;                                                            \
            }                                                                                        \
            y[row] = hsum8(acc) + mins;                                                              \
        }                                                                                            \
    }

GEMV(gemv_q4, block_q4, dot_q4)
GEMV(gemv_q8, block_q8, dot_q8)
#endif

// Portable block dots (the fallback without AVX2, and the reference the AVX2 versions implement).
static inline float dot_q4_scalar(const block_q4* w, const block_x8* x) {
    int dot = 0;
    for (int j = 0; j < QK / 2; j++) dot += (w->qs[j] & 0x0F) * x->qs[j] + (w->qs[j] >> 4) * x->qs[j + QK / 2];
    return w->d * x->d * (float)dot + w->m * x->s;
}

static inline float dot_q8_scalar(const block_q8* w, const block_x8* x) {
    int dot = 0;
    for (int j = 0; j < QK; j++) dot += w->qs[j] * x->qs[j];
    return w->d * x->d * (float)dot + w->m * x->s;
}

// Several activation rows: TILE rows share each loaded weight block.
#ifdef __AVX2__
// q4: the weight block is unpacked once and dotted with every row of the tile (the unpacking is
// as much work as the dot itself, so doing it per row halved the batched throughput).
#define Q4_ROW_STEP(t)                                                                               \
    {                                                                                                \
        const block_x8* xb = x + (m0 + (t)) * nb + b;                                                \
        const __m256i xq = _mm256_loadu_si256((const __m256i*)xb->qs);                               \
        const __m256i dot = dot_u8s8(wq, xq);                                                        \
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(wd * xb->d), acc[t]);      \
        mins[t] += wm * xb->s;                                                                       \
    }
#define GEMM_TILE_BODY_Q4                                                                            \
    __m256 acc[TILE];                                                                                \
    float mins[TILE] = {0};                                                                          \
    for (int t = 0; t < TILE; t++) acc[t] = _mm256_setzero_ps();                                     \
    for (int64_t b = 0; b < nb; b++) {                                                               \
        const __m256i wq = unpack_nibbles(wr[b].qs);                                                 \
        const float wd = wr[b].d, wm = wr[b].m;                                                      \
        if (mt == TILE) { /* a constant trip count: the accumulators stay in registers */           \
            for (int t = 0; t < TILE; t++) Q4_ROW_STEP(t)                                            \
        } else {                                                                                     \
            for (int t = 0; t < mt; t++) Q4_ROW_STEP(t)                                              \
        }                                                                                            \
    }                                                                                                \
    for (int t = 0; t < mt; t++) y[(m0 + t) * n + row] = hsum8(acc[t]) + mins[t];
#define GEMM_TILE_BODY(DOT)                                                                          \
    __m256 acc[TILE];                                                                                \
    float mins[TILE] = {0};                                                                          \
    for (int t = 0; t < TILE; t++) acc[t] = _mm256_setzero_ps();                                     \
    for (int64_t b = 0; b < nb; b++) {                                                               \
        for (int t = 0; t < mt; t++) {                                                               \
            const block_x8* xb = x + (m0 + t) * nb + b;                                              \
            acc[t] = DOT(acc[t], wr + b, xb);                                                        \
            mins[t] += wr[b].m * xb->s;                                                              \
        }                                                                                            \
    }                                                                                                \
    for (int t = 0; t < mt; t++) y[(m0 + t) * n + row] = hsum8(acc[t]) + mins[t];
#else
#define GEMM_TILE_BODY(DOT)                                                                          \
    for (int t = 0; t < mt; t++) {                                                                   \
        float sum = 0.0f;                                                                            \
        for (int64_t b = 0; b < nb; b++) sum += DOT##_scalar(wr + b, x + (m0 + t) * nb + b);         \
        y[(m0 + t) * n + row] = sum;                                                                 \
    }
#endif

#define GEMM(NAME, BLOCK, TILE_BODY, GEMV_FN)                                                        \
    void NAME(const BLOCK* w, const block_x8* x, float* y, int64_t m_rows, int64_t n, int64_t k) {   \
        GEMV_FN                                                                                      \
        const int64_t nb = k / QK;                                                                   \
        _Pragma("omp parallel for schedule(static)")                                                 \
        for (int64_t row = 0; row < n; row++) {                                                      \
            const BLOCK* wr = w + row * nb;                                                          \
            for (int64_t m0 = 0; m0 < m_rows; m0 += TILE) {                                          \
                const int mt = (int)(m_rows - m0 < TILE ? m_rows - m0 : TILE);                       \
                TILE_BODY                                                                            \
            }                                                                                        \
        }                                                                                            \
    }

#ifdef __AVX2__
#define SINGLE_ROW(FN) if (m_rows == 1) { FN(w, x, y, n, k); return; }
#else
#define SINGLE_ROW(FN)
#endif

#ifdef __AVX2__
GEMM(kvgen_gemm_q4, block_q4, GEMM_TILE_BODY_Q4, SINGLE_ROW(gemv_q4))
#else
GEMM(kvgen_gemm_q4, block_q4, GEMM_TILE_BODY(dot_q4), SINGLE_ROW(gemv_q4))
#endif
GEMM(kvgen_gemm_q8, block_q8, GEMM_TILE_BODY(dot_q8), SINGLE_ROW(gemv_q8))

// One call per linear layer: quantize the activation rows into `scratch`, then multiply.
void kvgen_linear_q4(const block_q4* w, const float* x, block_x8* scratch, float* y, int64_t m_rows, int64_t n, int64_t k) {
    kvgen_quantize_x8(x, m_rows, k, scratch);
    kvgen_gemm_q4(w, scratch, y, m_rows, n, k);
}

void kvgen_linear_q8(const block_q8* w, const float* x, block_x8* scratch, float* y, int64_t m_rows, int64_t n, int64_t k) {
    kvgen_quantize_x8(x, m_rows, k, scratch);
    kvgen_gemm_q8(w, scratch, y, m_rows, n, k);
}

// Dequantize whole weights (for long prefills, where a GEMM over plain floats beats re-reading
// blocks): to fp32, or to bf16 for machines whose bf16 GEMM is faster (avx512_bf16 / AMX).
static inline float as_fp32(float v) { return v; }
static inline uint16_t as_bf16(float v) {  // round to nearest even (weights are finite)
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

#define DEQUANTIZE_Q4(NAME, OUT_T, CONVERT)                                                          \
    void NAME(const block_q4* w, OUT_T* out, int64_t n, int64_t k) {                                 \
        const int64_t nb = k / QK;                                                                   \
        _Pragma("omp parallel for schedule(static)")                                                 \
        for (int64_t i = 0; i < n * nb; i++) {                                                       \
            OUT_T* o = out + i * QK;                                                                 \
            for (int j = 0; j < QK / 2; j++) {                                                       \
                o[j] = CONVERT(w[i].d * (float)(w[i].qs[j] & 0x0F) + w[i].m);                        \
                o[j + QK / 2] = CONVERT(w[i].d * (float)(w[i].qs[j] >> 4) + w[i].m);                \
            }                                                                                        \
        }                                                                                            \
    }
#define DEQUANTIZE_Q8(NAME, OUT_T, CONVERT)                                                          \
    void NAME(const block_q8* w, OUT_T* out, int64_t n, int64_t k) {                                 \
        const int64_t nb = k / QK;                                                                   \
        _Pragma("omp parallel for schedule(static)")                                                 \
        for (int64_t i = 0; i < n * nb; i++) {                                                       \
            OUT_T* o = out + i * QK;                                                                 \
            for (int j = 0; j < QK; j++) o[j] = CONVERT(w[i].d * (float)w[i].qs[j] + w[i].m);        \
        }                                                                                            \
    }

DEQUANTIZE_Q4(kvgen_dequantize_q4, float, as_fp32)
DEQUANTIZE_Q8(kvgen_dequantize_q8, float, as_fp32)
DEQUANTIZE_Q4(kvgen_dequantize_q4_bf16, uint16_t, as_bf16)
DEQUANTIZE_Q8(kvgen_dequantize_q8_bf16, uint16_t, as_bf16)

#include "decode.c"
