// y[M, N] = x[M, K] @ W[N, K]^T over 16-bit float weights (F16 or BF16, row-major as the checkpoint
// has them) and fp32 activations: each weight widened to fp32 in registers, products summed in
// fp32, so the only difference from an fp32 matmul over the same values is the order of the sums.
// A decode step streams the weights once; keeping them at 2 bytes halves what an fp32 copy reads.
//
// Each output's sum runs in `dot`'s order (decode.c): four 8-lane accumulators over 32 weights at a
// time, added pairwise, then hsum8; the portable loop below keeps that order, so every build gives
// the same bits. K is a multiple of 32 (the loader keeps other shapes in fp32).
//
// BF16 rows are kept pair-interleaved (HalfLinear repacks them at load): in each 16 weights, weight i
// (i < 8) at 16-bit slot 2 i and weight 8 + i at slot 2 i + 1, so one 256-bit load gives two 8-lane
// fp32 vectors with a shift (the even slots) and a mask (the odd ones), in x's order, where the
// row-major layout took a widening shuffle per 8 weights (SmolLM2's BF16 file decoded at 0.72x its
// F16 file's speed). F16 rows stay row-major: vcvtph2ps widens 8 at a time.
//
// The decode steps (decode.c, decode_rows.c) take these weights as qlinear kinds 10 (f16) and 11
// (bf16) through the same team / serial / rows entry points as the quantized kinds, with the rows'
// activations as floats in place of int8 blocks; every one runs half_dots per output, so a row gets
// the same bits alone, in a batch or in a verify.
//
// This file is #included by qgemm.c, before decode.c.

#define HALF_OUTPUTS 4  // outputs that share each load of x
// Weights prefetched this far ahead of the ones read (8 KB): the hardware prefetchers alone kept too
// few lines in flight (Gemma 3's 262,144 x 640 BF16 head on 2 Zen 4 cores: 9.4 -> 8.1-8.5 ms, 35 -> 40
// GB/s; 1 KB ahead gained less, 16 KB no more). A prefetch past the end is harmless: it never faults.
#define HALF_PREFETCH 4096

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

// Where weight e (0 .. 15) of a 16-weight chunk sits in a pair-interleaved BF16 row.
static inline int bf16_slot(int e) { return 2 * (e % 8) + e / 8; }

// Weight j + 8 a + l (a 0 .. 3, l 0 .. 7) of a row of this kind, widened.
static inline float half_weight(const uint16_t* row, int64_t j, int a, int l, int bf16) {
    return bf16 ? bf16_to_f32(row[j + 16 * (a / 2) + bf16_slot(8 * (a % 2) + l)]) : f16_to_f32(row[j + 8 * a + l]);
}

// outputs (1 .. HALF_OUTPUTS) rows of w, each dotted with x (k values), into y[0 .. outputs).
static void half_dots(const uint16_t* w, int64_t k, int outputs, int bf16, const float* x, float* y) {
#ifdef __AVX2__
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 acc[HALF_OUTPUTS][4];
    for (int o = 0; o < outputs; o++)
        for (int a = 0; a < 4; a++) acc[o][a] = _mm256_setzero_ps();
    for (int64_t j = 0; j < k; j += 32) {
        __m256 xv[4];
        for (int a = 0; a < 4; a++) xv[a] = _mm256_loadu_ps(x + j + 8 * a);
        for (int o = 0; o < outputs; o++) {
            const uint16_t* row = w + o * k + j;
            _mm_prefetch((const char*)(row + HALF_PREFETCH), _MM_HINT_T0);
            if (bf16) {
                for (int c = 0; c < 2; c++) {
                    const __m256i pairs = _mm256_loadu_si256((const __m256i*)(row + 16 * c));
                    const __m256 first = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));  // weights 0 .. 7
                    const __m256 second = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));  // 8 .. 15
                    acc[o][2 * c] = _mm256_fmadd_ps(first, xv[2 * c], acc[o][2 * c]);
                    acc[o][2 * c + 1] = _mm256_fmadd_ps(second, xv[2 * c + 1], acc[o][2 * c + 1]);
                }
            } else {
                for (int a = 0; a < 4; a++) acc[o][a] = _mm256_fmadd_ps(f16x8_to_f32(row + 8 * a), xv[a], acc[o][a]);
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
                for (int l = 0; l < 8; l++) acc[a][l] = fmaf(half_weight(row, j, a, l, bf16), x[j + 8 * a + l], acc[a][l]);
        for (int l = 0; l < 8; l++) lanes[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
        y[o] = sum_lanes(lanes);
    }
#endif
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define HALF_ROW_PAIRS 1
// Two rows through HALF_OUTPUTS weight rows, each (row, output) summed exactly as half_dots sums it:
// its four 8-lane accumulators held as the halves of two 16-lane ones (a 16-lane FMA is two 8-lane
// ones, lane by lane). Each 32 weights are widened once for both rows, where half_dots widens them
// per row: batched decode of 16-bit weights is bound by its multiplies and the widening beside them
// (SmolLM2 BF16 at 16 rows ran ~480 tok/s, the same file's q4 ~2,000).
static void half_dots_2rows(const uint16_t* w, int64_t k, int bf16, const float* x0, const float* x1, float* y0,
                            float* y1) {
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 acc[2][HALF_OUTPUTS][2];
    for (int r = 0; r < 2; r++)
        for (int o = 0; o < HALF_OUTPUTS; o++) acc[r][o][0] = acc[r][o][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 32) {
        __m512 xv[2][2];
        for (int r = 0; r < 2; r++) {
            const float* x = (r ? x1 : x0) + j;
            if (bf16) {  // beside the widened pairs: x 0 .. 7 with 16 .. 23, x 8 .. 15 with 24 .. 31
                xv[r][0] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(x)), _mm256_loadu_ps(x + 16), 1);
                xv[r][1] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(x + 8)), _mm256_loadu_ps(x + 24), 1);
            } else {
                xv[r][0] = _mm512_loadu_ps(x), xv[r][1] = _mm512_loadu_ps(x + 16);
            }
        }
        for (int o = 0; o < HALF_OUTPUTS; o++) {
            const uint16_t* row = w + o * k + j;
            _mm_prefetch((const char*)(row + HALF_PREFETCH), _MM_HINT_T0);
            __m512 wv[2];
            if (bf16) {  // weights 0 .. 7 | 16 .. 23 (half_dots' acc 0 | 2), 8 .. 15 | 24 .. 31 (acc 1 | 3)
                const __m512i pairs = _mm512_loadu_si512(row);
                wv[0] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
                wv[1] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
            } else {  // weights 0 .. 15 (acc 0 | 1), 16 .. 31 (acc 2 | 3)
                wv[0] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)row));
                wv[1] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(row + 16)));
            }
            for (int r = 0; r < 2; r++) {
                acc[r][o][0] = _mm512_fmadd_ps(wv[0], xv[r][0], acc[r][o][0]);
                acc[r][o][1] = _mm512_fmadd_ps(wv[1], xv[r][1], acc[r][o][1]);
            }
        }
    }
    for (int r = 0; r < 2; r++)
        for (int o = 0; o < HALF_OUTPUTS; o++) {
            const __m512 a = acc[r][o][0], b = acc[r][o][1];
            __m256 sum;  // half_dots' (acc 0 + acc 1) + (acc 2 + acc 3)
            if (bf16) {
                const __m512 pairs = _mm512_add_ps(a, b);  // acc 0 + acc 1 | acc 2 + acc 3
                sum = _mm256_add_ps(_mm512_castps512_ps256(pairs), _mm512_extractf32x8_ps(pairs, 1));
            } else {
                sum = _mm256_add_ps(_mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)),
                                    _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1)));
            }
            (r ? y1 : y0)[o] = hsum8(sum);
        }
}
#else
#define HALF_ROW_PAIRS 0
#endif

// Whether rows run two at a time (HalfLinear then takes every row count here, prompts included:
// SmolLM2's linears at 128 rows ran 2.1x (BF16) and 1.5x (F16) faster than widening for fp32 GEMM).
int32_t kvgen_half_row_pairs_built(void) { return HALF_ROW_PAIRS; }

// rows x k pair-interleaved BF16 weights -> fp32 in row-major order (a GEMM's widened slice).
void kvgen_widen_bf16_pairs(const uint16_t* w, float* out, int64_t rows, int64_t k) {
    for (int64_t i = 0; i < rows * k; i += 16) {
#ifdef __AVX2__
        const __m256i pairs = _mm256_loadu_si256((const __m256i*)(w + i));
        _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)));
        _mm256_storeu_ps(out + i + 8, _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32((int)0xFFFF0000u))));
#else
        for (int e = 0; e < 16; e++) out[i + e] = bf16_to_f32(w[i + bf16_slot(e)]);
#endif
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
        int64_t r = 0;
#if HALF_ROW_PAIRS
        for (; end - o == HALF_OUTPUTS && r + 2 <= rows; r += 2) {
            float* y0 = y + r * n + o;
            float* y1 = y0 + n;
            half_dots_2rows(w + o * k, k, bf16, x + r * k, x + (r + 1) * k, y0, y1);
            for (int j = 0; bias != NULL && j < HALF_OUTPUTS; j++) y0[j] += bias[o + j], y1[j] += bias[o + j];
        }
#endif
        for (; r < rows; r++) half_outputs(w, bf16, x + r * k, y + r * n, o, end, k, bias);
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

// HalfLinear's call: m rows by a team of its own (one thread where the work is small). A group of
// outputs runs every row while its weights are in cache, so M rows read the weights from memory
// once. (Widening a group's weights once into an fp32 buffer for all the rows ran slower on Zen 4:
// a load per FMA either way, and the buffer's stores on top.)
static void half_linear(const uint16_t* w, int bf16, const float* x, float* y, int64_t m, int64_t n, int64_t k) {
#pragma omp parallel if (n * k * (m < 4 ? m : 4) > 65536)
    half_rows_team(w, bf16, x, y, m, n, k, NULL);
}

void kvgen_linear_f16(const uint16_t* w, const float* x, float* y, int64_t m, int64_t n, int64_t k) {
    half_linear(w, 0, x, y, m, n, k);
}

void kvgen_linear_bf16(const uint16_t* w, const float* x, float* y, int64_t m, int64_t n, int64_t k) {
    half_linear(w, 1, x, y, m, n, k);
}
