// Two adjacent groups of 8 interleaved weight rows at once, in 512-bit registers (AVX-512 builds):
// a tile of 16 outputs x up to PAIR_ROWS activation rows. #included by interleaved.c after the
// 8-output kernels (*_rows), which every other build, and the groups left over here, run.
//
// Why: with one group per 256-bit vector each broadcast of 4 activation bytes feeds 8 outputs, and
// on Zen 4 the broadcast then costs as much as the multiply-add (5.6 G multiply-adds/s per core
// against 7.3 without broadcasts); one broadcast feeding 16 outputs runs at 7.0. A 512-bit op does
// the same lanes' work as two 256-bit ones, so the numerics are the 8-output kernels' lane for
// lane: the same exact integer dots, then acc = fma(float(idot), d_w * d_x, acc) (and
// acc = fma(m_w, s_x, acc)) block after block, in order.
//
// pair_rows(w0, w1, ...): outputs of group w0 then group w1 (16 contiguous y values per row);
// both groups must be full (8 real rows each). Builds without AVX-512 VNNI run the 8-output kernel
// on each group. (q4kx8's and q6kx8's pair kernels are in k_quants.c.) Per 16x16x32 step at 512 rows on one
// core of the Intel Xeon, AMX tiles off (amx_tiles.c), the 512-bit kernels took q5 56-58 ns and
// q8s 69, against 76-78 and 91-93 for the 8-output kernel on each group (q4kx8's: 49-51 against 77).

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define PAIR_ROWS 8

static inline __m512i pair_load(const void* a, const void* b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a)),
                              _mm256_loadu_si256((const __m256i*)b), 1);
}

static inline __m512 pair_load_ps(const float* a, const float* b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a))),
                                               _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}

static inline __m512i broadcast4_512(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

// q4: as Q4X8_DOTS, 16 rows per vector (VNNI: the nibble sums go straight into int32).
#define Q4X8_PAIR_DOTS(R) NIBBLE_PAIR_DOTS(R, b0->qs, b1->qs, NO_FIFTH_BITS)
// q5: the same with each unpacked vector's fifth bits (Q5X8_DOTS), then less 16 x the activations' sums
// (q5m: not, its offset is a float).
#define Q5X8_PAIR_DOTS(R)                                                                            \
    FIVE_BIT_PAIR_DOTS(R)                                                                            \
    for (int t = 0; t < R; t++) dot[t] = _mm512_sub_epi32(dot[t], _mm512_set1_epi32(16 * xsum[t * x_stride + b]));
#define FIVE_BIT_PAIR_DOTS(R)                                                                        \
    const __m512i planes = pair_load(b0->qh, b1->qh);                                                \
    NIBBLE_PAIR_DOTS(R, b0->qs, b1->qs, Q5_FIFTH_BITS)
#define Q5_FIFTH_BIT_512(planes, v)                                                                  \
    _mm512_and_si512((v) <= 4 ? _mm512_slli_epi16((planes), 4 - (v)) : _mm512_srli_epi16((planes), (v) - 4), \
                     _mm512_set1_epi8(0x10))
#define NO_FIFTH_BITS(lo, hi, i)
// iq4 and mx4: each nibble becomes its level + 128 (LEVEL_DOTS), then less 128 x the activations' sums.
#define IQ4X8_PAIR_DOTS(R) LEVEL_PAIR_DOTS(R, IQ4_LEVELS)
#define MX4X8_PAIR_DOTS(R) LEVEL_PAIR_DOTS(R, MXFP4_LEVELS)
#define LEVEL_PAIR_DOTS(R, TABLE)                                                                    \
    const __m512i biased = _mm512_add_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(TABLE))), \
                                           _mm512_set1_epi8((char)128));                             \
    NIBBLE_PAIR_DOTS(R, b0->qs, b1->qs, IQ4_BIASED_LEVELS)                                           \
    for (int t = 0; t < R; t++) dot[t] = _mm512_sub_epi32(dot[t], _mm512_set1_epi32(128 * xsum[t * x_stride + b]));
#define IQ4_BIASED_LEVELS(lo, hi, i)                                                                 \
    lo = _mm512_shuffle_epi8(biased, lo);                                                            \
    hi = _mm512_shuffle_epi8(biased, hi);
#define Q5_FIFTH_BITS(lo, hi, i)                                                                     \
    lo = _mm512_or_si512(lo, Q5_FIFTH_BIT_512(planes, 2 * (i)));                                     \
    hi = _mm512_or_si512(hi, Q5_FIFTH_BIT_512(planes, 2 * (i) + 1));
// The nibbles of QS0 / QS1's block (FIFTH_BITS: q5's, from `planes`, or none).
#define NIBBLE_PAIR_DOTS(R, QS0, QS1, FIFTH_BITS)                                                    \
    for (int i = 0; i < 4; i++) {                                                                    \
        const __m512i packed = pair_load((QS0) + 32 * i, (QS1) + 32 * i);                            \
        __m512i lo = _mm512_and_si512(packed, _mm512_set1_epi8(0x0F));                               \
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), _mm512_set1_epi8(0x0F));        \
        FIFTH_BITS(lo, hi, i)                                                                        \
        for (int t = 0; t < R; t++) {                                                                \
            const int8_t* xq = x[t * x_stride + b].qs;                                               \
            dot[t] = _mm512_dpbusd_epi32(dot[t], lo, broadcast4_512(xq + 4 * i));                    \
            dot[t] = _mm512_dpbusd_epi32(dot[t], hi, broadcast4_512(xq + 16 + 4 * i));               \
        }                                                                                            \
    }
// q8: as Q8X8_DOTS, |w| the unsigned side and the activations negated where w < 0 (AVX-512 has
// no vpsignb: a masked subtraction, which leaves x where w is 0, whose |w| makes the product 0).
#define Q8X8_PAIR_DOTS(R)                                                                            \
    for (int i = 0; i < 8; i++) {                                                                    \
        const __m512i w = pair_load(b0->qs + 32 * i, b1->qs + 32 * i);                               \
        const __m512i magnitude = _mm512_abs_epi8(w);                                                \
        const __mmask64 negative = _mm512_movepi8_mask(w);                                           \
        for (int t = 0; t < R; t++) {                                                                \
            const __m512i xs = broadcast4_512(x[t * x_stride + b].qs + 4 * i);                       \
            const __m512i signed_xs = _mm512_mask_sub_epi8(xs, negative, _mm512_setzero_si512(), xs);  \
            dot[t] = _mm512_dpbusd_epi32(dot[t], magnitude, signed_xs);                              \
        }                                                                                            \
    }

// Two groups' 8 f16 values each as 16 floats (exact, as f16x8_to_f32).
static inline __m512 pair_load_ph(const uint16_t* a, const uint16_t* b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)a)),
                                                   _mm_loadu_si128((const __m128i*)b), 1));
}

// The formats without offsets (q8sx8, q5x8: f16 scales; iq4x8: f32): acc += float(idot) * (d_w * d_x).
#define APPLY_PAIR_F16_SCALES(R) APPLY_PAIR_GIVEN_SCALES(R, pair_load_ph(b0->d, b1->d))
#define APPLY_PAIR_F32_SCALES(R) APPLY_PAIR_GIVEN_SCALES(R, pair_load_ps(b0->d, b1->d))
#define APPLY_PAIR_GIVEN_SCALES(R, D)                                                                \
    const __m512 d = (D);                                                                            \
    for (int t = 0; t < R; t++) {                                                                    \
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(x[t * x_stride + b].d));                \
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), scale, acc[t]);                         \
    }
#define APPLY_PAIR_SCALES_OFFSETS(R) APPLY_PAIR_GIVEN(R, pair_load_ps(b0->d, b1->d), pair_load_ps(b0->m, b1->m))
#define APPLY_PAIR_F16_SCALES_OFFSETS(R) APPLY_PAIR_GIVEN(R, pair_load_ph(b0->d, b1->d), pair_load_ph(b0->m, b1->m))
#define APPLY_PAIR_GIVEN(R, D, M)                                                                    \
    const __m512 d = (D), m = (M);                                                                   \
    for (int t = 0; t < R; t++) {                                                                    \
        const block_x8* xb = x + t * x_stride + b;                                                   \
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), _mm512_mul_ps(d, _mm512_set1_ps(xb->d)), acc[t]); \
        acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xb->s), acc[t]);                                  \
    }

#define PAIR_LOOP(BLOCK, DOTS, APPLY, R)                                                             \
    for (int64_t b = 0; b < nb; b++) {                                                               \
        const BLOCK* b0 = w0 + b;                                                                    \
        const BLOCK* b1 = w1 + b;                                                                    \
        prefetch_ahead(b0, sizeof(BLOCK)); /* two streams, one group apart */                        \
        prefetch_ahead(b1, sizeof(BLOCK));                                                           \
        __m512i dot[R];                                                                              \
        for (int t = 0; t < R; t++) dot[t] = _mm512_setzero_si512();                                 \
        DOTS(R)                                                                                      \
        APPLY(R)                                                                                     \
    }

#define PAIR_KERNEL(NAME, BLOCK, DOTS, APPLY) PAIR_KERNEL_LOOPED(NAME, BLOCK, PAIR_LOOP, DOTS, APPLY)
// LOOP(BLOCK, DOTS, APPLY, R): the blocks' loop (PAIR_LOOP; the k-quants walk sub-blocks,
// SUB_BLOCK_PAIR_LOOP in k_quants.c).
#define PAIR_KERNEL_LOOPED(NAME, BLOCK, LOOP, DOTS, APPLY)                                           \
    static inline void NAME(const BLOCK* w0, const BLOCK* w1, const block_x8* x, const int32_t* xsum, \
                            int64_t x_stride, float* y, int64_t y_stride, int rows, int64_t nb) {    \
        (void)xsum;                                                                                  \
        __m512 acc[PAIR_ROWS];                                                                       \
        for (int t = 0; t < PAIR_ROWS; t++) acc[t] = _mm512_setzero_ps();                            \
        switch (rows) {                                                                              \
            case 8: LOOP(BLOCK, DOTS, APPLY, 8) break;                                               \
            case 7: LOOP(BLOCK, DOTS, APPLY, 7) break;                                               \
            case 6: LOOP(BLOCK, DOTS, APPLY, 6) break;                                               \
            case 5: LOOP(BLOCK, DOTS, APPLY, 5) break;                                               \
            case 4: LOOP(BLOCK, DOTS, APPLY, 4) break;                                               \
            case 3: LOOP(BLOCK, DOTS, APPLY, 3) break;                                               \
            case 2: LOOP(BLOCK, DOTS, APPLY, 2) break;                                               \
            default: LOOP(BLOCK, DOTS, APPLY, 1) break;                                              \
        }                                                                                            \
        for (int t = 0; t < rows; t++) _mm512_storeu_ps(y + t * y_stride, acc[t]);                   \
    }

PAIR_KERNEL(q4x8_pair_rows, block_q4x8, Q4X8_PAIR_DOTS, APPLY_PAIR_SCALES_OFFSETS)
PAIR_KERNEL(q4hx8_pair_rows, block_q4hx8, Q4X8_PAIR_DOTS, APPLY_PAIR_F16_SCALES_OFFSETS)
PAIR_KERNEL(q5x8_pair_rows, block_q5x8, Q5X8_PAIR_DOTS, APPLY_PAIR_F16_SCALES)
PAIR_KERNEL(q8x8_pair_rows, block_q8x8, Q8X8_PAIR_DOTS, APPLY_PAIR_SCALES_OFFSETS)
PAIR_KERNEL(q8sx8_pair_rows, block_q8sx8, Q8X8_PAIR_DOTS, APPLY_PAIR_F16_SCALES)
PAIR_KERNEL(iq4x8_pair_rows, block_iq4x8, IQ4X8_PAIR_DOTS, APPLY_PAIR_F32_SCALES)
PAIR_KERNEL(mx4x8_pair_rows, block_mx4x8, MX4X8_PAIR_DOTS, APPLY_PAIR_F32_SCALES)
PAIR_KERNEL(q5mx8_pair_rows, block_q5mx8, FIVE_BIT_PAIR_DOTS, APPLY_PAIR_SCALES_OFFSETS)
#define PAIR_KERNELS_512 1
#endif

// The 8-output kernel on each group of the pair, for formats (or builds) without a 512-bit kernel.
#define PAIR_OF_GROUPS(NAME, BLOCK, ROWS_FN)                                                         \
    static inline void NAME(const BLOCK* w0, const BLOCK* w1, const block_x8* x, const int32_t* xsum, \
                            int64_t x_stride, float* y, int64_t y_stride, int rows, int64_t nb) {    \
        ROWS_FN(w0, x, xsum, x_stride, y, y_stride, rows, nb, XROWS);                                \
        ROWS_FN(w1, x, xsum, x_stride, y + XROWS, y_stride, rows, nb, XROWS);                        \
    }
#ifndef PAIR_KERNELS_512
PAIR_OF_GROUPS(q4x8_pair_rows, block_q4x8, q4x8_rows)
PAIR_OF_GROUPS(q4hx8_pair_rows, block_q4hx8, q4hx8_rows)
PAIR_OF_GROUPS(q8x8_pair_rows, block_q8x8, q8x8_rows)
PAIR_OF_GROUPS(q8sx8_pair_rows, block_q8sx8, q8sx8_rows)
PAIR_OF_GROUPS(q5x8_pair_rows, block_q5x8, q5x8_rows)
PAIR_OF_GROUPS(iq4x8_pair_rows, block_iq4x8, iq4x8_rows)
PAIR_OF_GROUPS(mx4x8_pair_rows, block_mx4x8, mx4x8_rows)
PAIR_OF_GROUPS(q5mx8_pair_rows, block_q5mx8, q5mx8_rows)
#endif
#ifndef PAIR_ROWS
#define PAIR_ROWS TILE_ROWS
#define Q4_PAIR_ROWS Q4_TILE_ROWS  // q4's pairs of groups are two calls of its 8-output kernel
#else
#define Q4_PAIR_ROWS PAIR_ROWS
#endif

// The formats without an AMX kernel (iq4x8, mx4x8, q5mx8; amx_tiles.c): where pair calls take a whole
// chunk of rows, they run their pair kernel PAIR_ROWS rows at a time.
#define STEPPED_PAIRS(NAME, BLOCK, PAIR_FN)                                                          \
    static inline void NAME(const BLOCK* w0, const BLOCK* w1, const block_x8* x, const int32_t* xsum, \
                            int64_t x_stride, float* y, int64_t y_stride, int rows, int64_t nb) {    \
        for (int m0 = 0; m0 < rows; m0 += PAIR_ROWS) {                                               \
            const int r = rows - m0 < PAIR_ROWS ? rows - m0 : PAIR_ROWS;                             \
            PAIR_FN(w0, w1, x + m0 * x_stride, xsum != NULL ? xsum + m0 * x_stride : NULL, x_stride, \
                    y + m0 * y_stride, y_stride, r, nb);                                             \
        }                                                                                            \
    }
STEPPED_PAIRS(iq4x8_stepped_rows, block_iq4x8, iq4x8_pair_rows)
STEPPED_PAIRS(mx4x8_stepped_rows, block_mx4x8, mx4x8_pair_rows)
STEPPED_PAIRS(q5mx8_stepped_rows, block_q5mx8, q5mx8_pair_rows)
