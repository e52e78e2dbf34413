// Many rows (a prompt) through 16-bit float weights with AVX512-BF16's dot products: y[M, N] = x[M, K]
// @ W[N, K]^T, the activations rounded to bf16 once, the products summed in fp32 and the outputs fp32.
// Where a decode step is bound by the bytes it reads (half_linear.c keeps activations fp32), a prompt
// is bound by its multiplies: vdpbf16ps does 32 multiply-adds an instruction against an fp32 FMA's 16
// (SmolLM2's linears at 128 rows on 2 Zen 4 cores: 640-810 GFLOPS against the widened fp32 GEMM's
// ~185; oneDNN's bf16 GEMM runs as fast but rounds its outputs to bf16 too).
//
// BF16 weights are read as HalfLinear keeps them (pair-interleaved, half_linear.c): a dot product does
// not care in which order its terms come, so the activations are rounded into the same order. F16
// weights are split, a tile of outputs at a time, into a bf16 part and the rest (exact in bf16: an F16
// value has 11 significant bits, bf16 8), both dotted with the activations: the file's values exactly,
// for twice the multiplies (still ~2.4x the fp32 GEMM).
//
// Each output of each row is one 16-lane accumulator over K in order, then one fixed reduction,
// whatever the tile, so a row's outputs do not depend on the other rows (row-invariant, as the C
// decode kernels are). K is a multiple of 32 (the loaders keep other shapes fp32).
//
// Built where the compiler targets AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids and later);
// elsewhere the entry points return -1 and HalfLinear keeps its fp32 GEMM.
//
// This file is #included by qgemm.c, after decode.c (omp.h).

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define BF16_GEMM_BUILT 1
#define BF16_TILE_ROWS 4     // rows that share each load of a weight vector
#define BF16_TILE_OUTPUTS 4  // outputs that share each load of an activation vector
// Rows whose bf16 activations (at most this many bytes) stay in L2 while every tile of outputs runs
// over them: the weights are read from memory once a panel. With the shared reduction above, in
// place of panels of 64 rows and four reductions: Gemma 3's 4096 x 640 at 128 rows 1.35 -> 1.11 ms
// with its weights cold, 1.07 -> 0.92 hot; SmolLM2's 3072 x 576 0.90 -> 0.77 and 0.74 -> 0.62.
#define BF16_PANEL_BYTES (256 * 1024)

static inline __m512bh bf16x32(const uint16_t* p) {
    const __m512i v = _mm512_loadu_si512(p);
    __m512bh b;
    memcpy(&b, &v, sizeof b);
    return b;
}

// count floats -> bf16 (round to nearest even), in each 16 value i at slot 2 i and 8 + i at 2 i + 1
// (pair-interleaved) or in order.
static void floats_to_bf16(const float* x, uint16_t* out, int64_t count, int interleave) {
    for (int64_t i = 0; i < count; i += 16) {
        const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
        __m256i v;
        memcpy(&v, &b, sizeof v);
        if (interleave) {
            const __m128i first = _mm256_castsi256_si128(v), second = _mm256_extracti128_si256(v, 1);
            _mm_storeu_si128((__m128i*)(out + i), _mm_unpacklo_epi16(first, second));
            _mm_storeu_si128((__m128i*)(out + i + 8), _mm_unpackhi_epi16(first, second));
        } else {
            _mm256_storeu_si256((__m256i*)(out + i), v);
        }
    }
}

// outputs F16 rows [outputs, k] -> each as 2 k bf16 values: the rounded part, then the rest.
static void split_f16_rows(const uint16_t* w, uint16_t* out, int outputs, int64_t k) {
    for (int o = 0; o < outputs; o++)
        for (int64_t j = 0; j < k; j += 16) {
            const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w + o * k + j)));
            const __m256bh rounded = _mm512_cvtneps_pbh(v);
            __m256i bits;  // widened back by a shift: _mm512_cvtpbh_ps needs GCC 12
            memcpy(&bits, &rounded, sizeof bits);
            const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
            const __m256bh rest = _mm512_cvtneps_pbh(_mm512_sub_ps(v, back));
            memcpy(out + o * 2 * k + j, &rounded, sizeof rounded);
            memcpy(out + o * 2 * k + k + j, &rest, sizeof rest);
        }
}

// Four outputs' 16-lane accumulators -> their four sums, stored to y[0 .. outputs). Each output's
// lanes are added in one fixed tree whatever the other three hold, so a full tile and an edge tile
// (zeros for the outputs it lacks) give an output the same bits. One tree for four outputs takes
// ~13 instructions where four _mm512_reduce_add_ps took ~32, against a tile's 4 x 4 dot products
// per 32 values of k: a third of them at K = 640.
static inline void store_sums4(__m512 a, __m512 b, __m512 c, __m512 d, float* y, int outputs) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));  // a b c d in each 128 bits
    const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
    if (outputs == 4) {
        _mm_storeu_ps(y, sums);
    } else {
        float all[4];
        _mm_storeu_ps(all, sums);
        for (int o = 0; o < outputs; o++) y[o] = all[o];
    }
}

// A full tile: BF16_TILE_ROWS rows x BF16_TILE_OUTPUTS (4) outputs. Weight row o starts at w + o * stride
// and holds `parts` runs of k values, each dotted with the row's k activations.
static void bf16_tile(const uint16_t* x, const uint16_t* w, int64_t stride, int parts, float* y, int64_t n, int64_t k) {
    __m512 acc[BF16_TILE_ROWS][BF16_TILE_OUTPUTS];
    for (int r = 0; r < BF16_TILE_ROWS; r++)
        for (int o = 0; o < BF16_TILE_OUTPUTS; o++) acc[r][o] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 32)
        for (int part = 0; part < parts; part++) {
            __m512bh wv[BF16_TILE_OUTPUTS];
            for (int o = 0; o < BF16_TILE_OUTPUTS; o++) wv[o] = bf16x32(w + o * stride + part * k + j);
            for (int r = 0; r < BF16_TILE_ROWS; r++) {
                const __m512bh xv = bf16x32(x + r * k + j);
                for (int o = 0; o < BF16_TILE_OUTPUTS; o++) acc[r][o] = _mm512_dpbf16_ps(acc[r][o], xv, wv[o]);
            }
        }
    for (int r = 0; r < BF16_TILE_ROWS; r++) store_sums4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], y + r * n, 4);
}

// A partial tile at the edges, each output summed as bf16_tile sums it (the same bits).
static void bf16_tile_edge(const uint16_t* x, const uint16_t* w, int64_t stride, int parts, float* y, int64_t n,
                           int64_t k, int rows, int outputs) {
    for (int r = 0; r < rows; r++) {
        __m512 acc[BF16_TILE_OUTPUTS];
        for (int o = 0; o < BF16_TILE_OUTPUTS; o++) acc[o] = _mm512_setzero_ps();
        for (int64_t j = 0; j < k; j += 32)
            for (int part = 0; part < parts; part++) {
                const __m512bh xv = bf16x32(x + r * k + j);
                for (int o = 0; o < outputs; o++) acc[o] = _mm512_dpbf16_ps(acc[o], xv, bf16x32(w + o * stride + part * k + j));
            }
        store_sums4(acc[0], acc[1], acc[2], acc[3], y + r * n, outputs);
    }
}

// f16: F16 rows split a tile at a time; else pair-interleaved BF16 rows read in place.
static int gemm_half_bf16(const uint16_t* w, int f16, const float* x, float* y, int64_t m, int64_t n, int64_t k) {
    const int threads = omp_get_max_threads();
    const size_t split_size = (size_t)BF16_TILE_OUTPUTS * 2 * k;  // one tile's split F16 rows, per thread
    uint16_t* rows = malloc((size_t)(m * k) * sizeof(uint16_t));
    uint16_t* splits = f16 ? malloc(split_size * threads * sizeof(uint16_t)) : NULL;
    if (rows == NULL || (f16 && splits == NULL)) {
        free(rows), free(splits);
        return -2;
    }
    const int64_t tiles = (n + BF16_TILE_OUTPUTS - 1) / BF16_TILE_OUTPUTS;
    int64_t panel = BF16_PANEL_BYTES / (2 * k) / BF16_TILE_ROWS * BF16_TILE_ROWS;
    panel = panel < BF16_TILE_ROWS ? BF16_TILE_ROWS : panel;
#pragma omp parallel num_threads(threads)
    {
        uint16_t* split = f16 ? splits + split_size * omp_get_thread_num() : NULL;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) floats_to_bf16(x + r * k, rows + r * k, k, !f16);
        for (int64_t first = 0; first < m; first += panel) {
            const int64_t end = first + panel < m ? first + panel : m;
            // nowait: the panels write different rows of y, and every thread reads `rows` only
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t o = t * BF16_TILE_OUTPUTS;
                const int outputs = n - o < BF16_TILE_OUTPUTS ? (int)(n - o) : BF16_TILE_OUTPUTS;
                const uint16_t* tile_w = w + o * k;
                int64_t stride = k;
                if (f16) {
                    split_f16_rows(tile_w, split, outputs, k);
                    tile_w = split, stride = 2 * k;
                }
                for (int64_t r = first; r < end; r += BF16_TILE_ROWS) {
                    const int count = end - r < BF16_TILE_ROWS ? (int)(end - r) : BF16_TILE_ROWS;
                    if (count == BF16_TILE_ROWS && outputs == BF16_TILE_OUTPUTS)
                        bf16_tile(rows + r * k, tile_w, stride, f16 ? 2 : 1, y + r * n + o, n, k);
                    else
                        bf16_tile_edge(rows + r * k, tile_w, stride, f16 ? 2 : 1, y + r * n + o, n, k, count, outputs);
                }
            }
        }
    }
    free(rows), free(splits);
    return 0;
}
#else
#define BF16_GEMM_BUILT 0
static int gemm_half_bf16(const uint16_t* w, int f16, const float* x, float* y, int64_t m, int64_t n, int64_t k) {
    (void)w, (void)f16, (void)x, (void)y, (void)m, (void)n, (void)k;
    return -1;
}
#endif

// Whether this build has the kernel (HalfLinear's many-row path then defaults to it).
int32_t kvgen_bf16_gemm_built(void) { return BF16_GEMM_BUILT; }

// 0 on success; -1 where the build has no AVX512-BF16, -2 when scratch memory could not be had.
int32_t kvgen_gemm_bf16_rows(const uint16_t* w, const float* x, float* y, int64_t m, int64_t n, int64_t k) {
    return gemm_half_bf16(w, 0, x, y, m, n, k);
}

int32_t kvgen_gemm_f16_rows(const uint16_t* w, const float* x, float* y, int64_t m, int64_t n, int64_t k) {
    return gemm_half_bf16(w, 1, x, y, m, n, k);
}
