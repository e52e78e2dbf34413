// y[M, N] = x[M, K] @ W[N, K]^T over 16-bit float weights (F16 or BF16, row-major as the checkpoint
// has them) and fp32 activations: each weight widened to fp32 in registers, products summed in
// fp32, so the only difference from an fp32 matmul over the same values is the order of the sums.
// A decode step streams the weights once; keeping them at 2 bytes halves what an fp32 copy reads.
//
// Each output's sum runs in `dot`'s order (decode.c): four 8-lane accumulators over 32 weights at a
// time, added pairwise, then hsum8; the portable loop below keeps that order, so every build gives
// the same bits. K is a multiple of 32 (the loader keeps other shapes in fp32).
//
// The decode steps (decode.c, decode_rows.c) take these weights as qlinear kinds 10 (f16) and 11
// (bf16) through the same team / serial / rows entry points as the quantized kinds, with the rows'
// activations as floats in place of int8 blocks; every one runs half_dots per output, so a row gets
// the same bits alone, in a batch or in a verify.
//
// This file is #included by qgemm.c, before decode.c.

#define HALF_OUTPUTS 4  // outputs that share each load of x

// 8 consecutive 16-bit weights -> fp32 lanes.
#ifdef __AVX2__
static inline __m256 bf16x8_to_f32(const uint16_t* h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)h)), 16));
}
#endif

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

// outputs (1 .. HALF_OUTPUTS) rows of w, each dotted with x (k values), into y[0 .. outputs).
static void half_dots(const uint16_t* w, int64_t k, int outputs, int bf16, const float* x, float* y) {
#ifdef __AVX2__
    __m256 acc[HALF_OUTPUTS][4];
    for (int o = 0; o < outputs; o++)
        for (int a = 0; a < 4; a++) acc[o][a] = _mm256_setzero_ps();
    for (int64_t j = 0; j < k; j += 32) {
        __m256 xv[4];
        for (int a = 0; a < 4; a++) xv[a] = _mm256_loadu_ps(x + j + 8 * a);
        for (int o = 0; o < outputs; o++) {
            const uint16_t* row = w + o * k + j;
            for (int a = 0; a < 4; a++) {
                const __m256 wv = bf16 ? bf16x8_to_f32(row + 8 * a) : f16x8_to_f32(row + 8 * a);
                acc[o][a] = _mm256_fmadd_ps(wv, xv[a], acc[o][a]);
            }
        }
    }
    for (int o = 0; o < outputs; o++)
        y[o] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[o][0], acc[o][1]), _mm256_add_ps(acc[o][2], acc[o][3])));
#else
    for (int o = 0; o < outputs; o++) {
        const uint16_t* row = w + o * k;
        float acc[4][8] = {{0.0f}}, lanes[8];
        for (int64_t j = 0; j < k; j += 32)
            for (int a = 0; a < 4; a++)
                for (int l = 0; l < 8; l++) {
                    const uint16_t h = row[j + 8 * a + l];
                    acc[a][l] = fmaf(bf16 ? bf16_to_f32(h) : f16_to_f32(h), x[j + 8 * a + l], acc[a][l]);
                }
        for (int l = 0; l < 8; l++) lanes[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
        y[o] = sum_lanes(lanes);
    }
#endif
}

// The threads split the outputs in groups of HALF_OUTPUTS; a group runs every row of x while its
// weights are in cache, so M rows read the weights from memory once. (Widening a group's weights
// once into an fp32 buffer for all the rows ran slower on Zen 4: a load per FMA either way, and the
// buffer's stores on top.)
static void half_linear(const uint16_t* w, int bf16, const float* x, float* y, int64_t m, int64_t n, int64_t k) {
    const int64_t groups = (n + HALF_OUTPUTS - 1) / HALF_OUTPUTS;
#pragma omp parallel for schedule(static) if (n * k * (m < 4 ? m : 4) > 65536)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t o = g * HALF_OUTPUTS;
        const int outputs = (int)(n - o < HALF_OUTPUTS ? n - o : HALF_OUTPUTS);
        float out[HALF_OUTPUTS];
        for (int64_t r = 0; r < m; r++) {
            half_dots(w + o * k, k, outputs, bf16, x + r * k, out);
            memcpy(y + r * n + o, out, (size_t)outputs * sizeof(float));
        }
    }
}

typedef uint16_t block_f16;   // FOR_KIND's names: a row's weights, 16 bits each
typedef uint16_t block_bf16;

// Outputs [first, end) of one row by the calling thread.
static void half_outputs(const uint16_t* w, int bf16, const float* x, float* y, int64_t first, int64_t end, int64_t k,
                         const float* bias) {
    for (int64_t o = first; o < end; o += HALF_OUTPUTS) {
        const int outputs = (int)(end - o < HALF_OUTPUTS ? end - o : HALF_OUTPUTS);
        half_dots(w + o * k, k, outputs, bf16, x, y + o);
        for (int j = 0; bias != NULL && j < outputs; j++) y[o + j] += bias[j + o];
    }
}

// Rows of activations (floats, [rows, k]) by every thread of a team: each takes its share of the
// output groups for every row; the closing barrier of `omp for` makes y whole.
static void half_rows_team(const uint16_t* w, int bf16, const float* x, float* y, int64_t rows, int64_t n, int64_t k,
                           const float* bias) {
    const int64_t groups = (n + HALF_OUTPUTS - 1) / HALF_OUTPUTS;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t o = g * HALF_OUTPUTS, end = o + HALF_OUTPUTS < n ? o + HALF_OUTPUTS : n;
        for (int64_t r = 0; r < rows; r++) half_outputs(w, bf16, x + r * k, y + r * n, o, end, k, bias);
    }
}

// The entry points FOR_KIND names (decode.c): the scratch and sums the quantized kinds take go unused;
// the rows step hands its rows' floats where the quantized kinds get int8 blocks (decode_rows.c).
#define HALF_KIND(STEM, BF16)                                                                           \
    static void kvgen_linear_##STEM##_team(const block_##STEM* w, const float* x, block_x8* scratch, int32_t* sums, \
                                           float* y, int64_t n, int64_t k, const float* bias) {        \
        (void)scratch, (void)sums;                                                                      \
        half_rows_team(w, BF16, x, y, 1, n, k, bias);                                                   \
    }                                                                                                   \
    static void kvgen_linear_##STEM##_serial(const block_##STEM* w, const float* x, block_x8* scratch, int32_t* sums, \
                                             float* y, int64_t n, int64_t k) {                          \
        (void)scratch, (void)sums;                                                                      \
        half_outputs(w, BF16, x, y, 0, n, k, NULL);                                                     \
    }                                                                                                   \
    static void kvgen_gemm_##STEM##_team(const block_##STEM* w, const block_x8* rows_as_floats, const int32_t* sums, \
                                         float* y, int64_t rows, int64_t n, int64_t k, const float* bias) { \
        (void)sums;                                                                                     \
        half_rows_team(w, BF16, (const float*)rows_as_floats, y, rows, n, k, bias);                     \
    }
HALF_KIND(f16, 0)
HALF_KIND(bf16, 1)

static inline int kind_is_half(int32_t kind) { return kind == 10 || kind == 11; }

void kvgen_linear_f16(const uint16_t* w, const float* x, float* y, int64_t m, int64_t n, int64_t k) {
    half_linear(w, 0, x, y, m, n, k);
}

void kvgen_linear_bf16(const uint16_t* w, const float* x, float* y, int64_t m, int64_t n, int64_t k) {
    half_linear(w, 1, x, y, m, n, k);
}
