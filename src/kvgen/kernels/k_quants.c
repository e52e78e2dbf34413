// GGUF's Q4_K weights kept as they are in the file, repacked eight rows at a time (q4kx8).
//
// A Q4_K super-block holds 256 weights of a row in 144 bytes: f16 d and dmin, twelve bytes of
// 6-bit scales sc[8] and mins mn[8] (one each per 32-weight sub-block), and 4-bit q in [0, 15]:
// sub-block j's weight l is d * sc[j] * q - dmin * mn[j]. q4kx8 keeps the 8 rows' d and dmin as
// f16, their scales and mins unpacked to one byte each ([sub-block][row], so a sub-block's 8 rows
// load as one vector), and each sub-block's nibbles in q4x8's interleaved layout:
//   1184 bytes per 8 rows x 256 weights (4.625 bits a weight, against 6 for the q4x8 copy of it).
//
// Numerics. Sub-block j of a row is q4x8's block with d = float(d) * sc[j] and m = -(float(dmin) *
// mn[j]) (both products exact in float: an 11-bit mantissa times a 6-bit integer), so each output
// is sum over blocks, in order, of float(idot) * (d * d_x) + m * s_x with the same integer dots:
// the bits do not depend on the row count or the instruction set, and a dequantized weight
// d * q + m is gguf's value bit for bit. This file is #included by interleaved.c.

#define QK_K 256
#define SUBS (QK_K / QK)  // 32-weight sub-blocks per super-block

typedef struct {
    uint16_t d[XROWS];          // f16 bits
    uint16_t dmin[XROWS];       // f16 bits
    uint8_t sc[SUBS][XROWS];    // 6-bit scale of sub-block j, row r
    uint8_t mn[SUBS][XROWS];    // 6-bit min of sub-block j, row r
    uint8_t qs[SUBS][XROWS * QK / 2];  // sub-block j's nibbles, laid out as q4x8's
} block_q4kx8;

// GGUF's 12 bytes of packed scales -> sub-block j's scale and min (llama.cpp's get_scale_min_k4).
static inline void q4k_scale_min(const uint8_t* s, int j, uint8_t* sc, uint8_t* mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
        *mn = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

// GGUF Q4_K rows [n, k / 256 * 144 bytes] -> groups [ceil(n / 8), k / 256]; padding rows are zero.
void kvgen_repack_q4kx8(const uint8_t* w, block_q4kx8* out, int64_t n, int64_t k) {
    const int64_t nsb = k / QK_K, groups = x8_groups(n);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t s = 0; s < nsb; s++) {
            block_q4kx8* o = out + g * nsb + s;
            memset(o, 0, sizeof *o);
            for (int r = 0; r < XROWS && g * XROWS + r < n; r++) {
                const uint8_t* src = w + ((g * XROWS + r) * nsb + s) * 144;
                const uint8_t* qs = src + 16;
                memcpy(&o->d[r], src, 2);
                memcpy(&o->dmin[r], src + 2, 2);
                for (int j = 0; j < SUBS; j++) {
                    q4k_scale_min(src + 4, j, &o->sc[j][r], &o->mn[j][r]);
                    for (int l = 0; l < QK; l++) {  // sub-blocks 2p and 2p + 1 share 32 bytes: low, high nibbles
                        const uint8_t v = (j % 2 == 0) ? (qs[32 * (j / 2) + l] & 0x0F) : (qs[32 * (j / 2) + l] >> 4);
                        const int t = l % 16;  // q4x8: byte t holds element t (low nibble) and t + 16 (high)
                        o->qs[j][(t / 4) * 32 + r * 4 + t % 4] |= (uint8_t)(l < 16 ? v : v << 4);
                    }
                }
            }
        }
    }
}

static inline float q4kx8_d(const block_q4kx8* blk, int j, int r) { return f16_to_f32(blk->d[r]) * (float)blk->sc[j][r]; }
static inline float q4kx8_m(const block_q4kx8* blk, int j, int r) { return -(f16_to_f32(blk->dmin[r]) * (float)blk->mn[j][r]); }
static inline int q4kx8_value(const block_q4kx8* blk, int j, int r, int l) {
    const int t = l % 16;
    const uint8_t byte = blk->qs[j][(t / 4) * 32 + r * 4 + t % 4];
    return l < 16 ? (byte & 0x0F) : (byte >> 4);
}

#ifdef __AVX2__
static inline __m256 u8x8_to_f32(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

// The 8-output kernel over up to 4 activation rows around a super-block loop TILE(R) that adds
// into acc[0..R-1]; rows beyond out_count (a last, partial group) are not stored.
#define KQUANT_ROWS(NAME, BLOCK, TILE)                                                               \
    static inline void NAME(const BLOCK* wg, const block_x8* x, const int32_t* xsum, int64_t x_stride, \
                            float* y, int64_t y_stride, int rows, int64_t nb, int out_count) {       \
        (void)xsum;                                                                                  \
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()}; \
        switch (rows) {                                                                              \
            case 4: TILE(4) break;                                                                   \
            case 3: TILE(3) break;                                                                   \
            case 2: TILE(2) break;                                                                   \
            default: TILE(1) break;                                                                  \
        }                                                                                            \
        for (int t = 0; t < rows; t++) {                                                             \
            float lanes[XROWS];                                                                      \
            _mm256_storeu_ps(lanes, acc[t]);                                                         \
            memcpy(y + t * y_stride, lanes, (size_t)out_count * sizeof(float));                      \
        }                                                                                            \
    }

#define Q4K_TILE(R)                                                                                  \
    for (int64_t s = 0; s < nb / SUBS; s++) {                                                        \
        const block_q4kx8* sb = wg + s;                                                              \
        const __m256 dsuper = f16x8_to_f32(sb->d), msuper = f16x8_to_f32(sb->dmin);                  \
        for (int j = 0; j < SUBS; j++) {                                                             \
            prefetch_ahead((const char*)sb + j * (sizeof *sb / SUBS), sizeof *sb / SUBS);            \
            const int64_t b = s * SUBS + j;                                                          \
            __m256i dot[R];                                                                          \
            for (int t = 0; t < R; t++) dot[t] = _mm256_setzero_si256();                             \
            NIBBLE_DOTS(R, sb->qs[j])                                                                \
            const __m256 d = _mm256_mul_ps(dsuper, u8x8_to_f32(sb->sc[j]));                          \
            const __m256 m = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(msuper, u8x8_to_f32(sb->mn[j]))); \
            for (int t = 0; t < R; t++) {                                                            \
                const block_x8* xb = x + t * x_stride + b;                                           \
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]), _mm256_mul_ps(d, _mm256_set1_ps(xb->d)), acc[t]); \
                acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(xb->s), acc[t]);                          \
            }                                                                                        \
        }                                                                                            \
    }

KQUANT_ROWS(q4kx8_rows, block_q4kx8, Q4K_TILE)
#else
// Portable path: the same sums in the same order, one lane at a time.
static void q4kx8_rows(const block_q4kx8* wg, const block_x8* x, const int32_t* xsum, int64_t x_stride,
                       float* y, int64_t y_stride, int rows, int64_t nb, int out_count) {
    (void)xsum;
    for (int t = 0; t < rows; t++) {
        for (int r = 0; r < out_count; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const block_q4kx8* sb = wg + b / SUBS;
                const int j = (int)(b % SUBS);
                const block_x8* xb = x + t * x_stride + b;
                int dot = 0;
                for (int l = 0; l < QK; l++) dot += q4kx8_value(sb, j, r, l) * xb->qs[l];
                acc = fmaf((float)dot, q4kx8_d(sb, j, r) * xb->d, acc);
                acc = fmaf(q4kx8_m(sb, j, r), xb->s, acc);
            }
            y[t * y_stride + r] = acc;
        }
    }
}
#endif

// Rows a k-quant's pair call takes: the 512-bit pair kernel's, or 4 where the pair is its 8-output
// kernel on each group.
#ifdef PAIR_KERNELS_512
#define K_PAIR_ROWS PAIR_ROWS
#else
#define K_PAIR_ROWS 4
#endif

#ifdef PAIR_KERNELS_512
// Two groups' 8 bytes (a sub-block's scales or mins) as 16 floats.
static inline __m512 q4k_pair_bytes(const uint8_t* a, const uint8_t* b) {
    const __m128i both = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)a), _mm_loadl_epi64((const __m128i*)b));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(both));
}
// Block b (sub-block b % SUBS of super-block b / SUBS) of the pair: Q4K_TILE's d and m, 16 lanes.
#define APPLY_PAIR_Q4K(R)                                                                            \
    const block_q4kx8* s0 = w0 + b / SUBS;                                                           \
    const block_q4kx8* s1 = w1 + b / SUBS;                                                           \
    const int j = (int)(b % SUBS);                                                                   \
    APPLY_PAIR_GIVEN(R, _mm512_mul_ps(pair_load_ph(s0->d, s1->d), q4k_pair_bytes(s0->sc[j], s1->sc[j])), \
                     _mm512_sub_ps(_mm512_setzero_ps(),                                              \
                                   _mm512_mul_ps(pair_load_ph(s0->dmin, s1->dmin), q4k_pair_bytes(s0->mn[j], s1->mn[j]))))
// PAIR_LOOP over sub-blocks (the k-quants): block b is sub-block b % SUBS of super-block b / SUBS.
#define SUB_BLOCK_PAIR_LOOP(BLOCK, DOTS, APPLY, R)                                                         \
    for (int64_t b = 0; b < nb; b++) {                                                               \
        const int64_t sub = (b % SUBS) * (sizeof(BLOCK) / SUBS);                                     \
        prefetch_ahead((const char*)(w0 + b / SUBS) + sub, sizeof(BLOCK) / SUBS);                    \
        prefetch_ahead((const char*)(w1 + b / SUBS) + sub, sizeof(BLOCK) / SUBS);                    \
        __m512i dot[R];                                                                              \
        for (int t = 0; t < R; t++) dot[t] = _mm512_setzero_si512();                                 \
        DOTS(R)                                                                                      \
        APPLY(R)                                                                                     \
    }
#define Q4K_PAIR_DOTS(R)                                                                             \
    NIBBLE_PAIR_DOTS(R, w0[b / SUBS].qs[b % SUBS], w1[b / SUBS].qs[b % SUBS], NO_FIFTH_BITS)
// 16 outputs x up to PAIR_ROWS rows in 512-bit registers (interleaved_pairs.c), Q4K_TILE's sums.
PAIR_KERNEL_LOOPED(q4kx8_pair_rows, block_q4kx8, SUB_BLOCK_PAIR_LOOP, Q4K_PAIR_DOTS, APPLY_PAIR_Q4K)
#else
PAIR_OF_GROUPS(q4kx8_pair_rows, block_q4kx8, q4kx8_rows)
#endif
#ifdef AMX_KERNELS
// In AMX tiles (amx_tiles.c): sub-block j's nibbles are q4x8's block.
#define AMX_UNPACK_Q4K(b, tile)                                                                      \
    amx_unpack_nibbles(w0[(b) / SUBS].qs[(b) % SUBS], w1[(b) / SUBS].qs[(b) % SUBS], NULL, NULL, tile)
AMX_PAIR_KERNEL(q4kx8_amx_rows, block_q4kx8, q4kx8_pair_rows, K_PAIR_ROWS, 16, AMX_UNPACK_Q4K, AMX_BLOCK_SUD,
                APPLY_PAIR_Q4K)
#else
#define q4kx8_amx_rows q4kx8_pair_rows
#endif
GEMM_X8_GROUPED(kvgen_gemm_q4kx8, kvgen_linear_q4kx8, block_q4kx8, q4kx8_rows, q4kx8_amx_rows, 0, nb / SUBS, 4,
                CALL_ROWS(K_PAIR_ROWS))

// Dequantizing (instantiated in qgemm.c next to the other formats' dequantizers).
#define DEQUANTIZE_Q4KX8(NAME, OUT_T, CONVERT)                                                       \
    void NAME(const block_q4kx8* w, OUT_T* out, int64_t n, int64_t k) {                              \
        const int64_t nsb = k / QK_K;                                                                \
        _Pragma("omp parallel for schedule(static)")                                                 \
        for (int64_t row = 0; row < n; row++) {                                                      \
            const block_q4kx8* wg = w + (row / XROWS) * nsb;                                         \
            const int r = (int)(row % XROWS);                                                        \
            for (int64_t b = 0; b < nsb * SUBS; b++) {                                               \
                const block_q4kx8* sb = wg + b / SUBS;                                               \
                const int j = (int)(b % SUBS);                                                       \
                const float d = q4kx8_d(sb, j, r), m = q4kx8_m(sb, j, r);                            \
                for (int l = 0; l < QK; l++) out[row * k + b * QK + l] = CONVERT(d * (float)q4kx8_value(sb, j, r, l) + m); \
            }                                                                                        \
        }                                                                                            \
    }

// GGUF's Q6_K weights as they are in the file, repacked eight rows at a time (q6kx8).
//
// A Q6_K super-block holds 256 weights of a row in 210 bytes: 6-bit u in [0, 63] (low nibbles in
// ql, top two bits in qh), an int8 scale per 16 weights and an f16 d: weight e is
// d * sc[e / 16] * (u - 32). q6kx8 keeps the bytes' count (210 per row and super-block): the 8
// rows' d, their 16 scales ([sixteenth][row]), then per 32-weight block the low nibbles of u as
// q4x8 lays them out and the top bits as 2-bit planes: bits 2 (v % 4) of byte c of plane v / 4
// are the top bits of byte c of unpacked vector v (v = 2i: the low nibbles of load i, elements
// 4i..4i+3, the block's first 16; v = 2i + 1: its high nibbles, the last 16).
//
// Numerics. A 32-weight block's integer dot is sc[2j] * dot(first 16) + sc[2j + 1] * dot(last 16)
// over the signed u - 32 (exact in int32 and in float: |idot| < 2^24), and each output is the sum
// over blocks, in order, of float(idot) * (d * d_x): no dependence on row count or instruction set.

typedef struct {
    uint8_t qs[XROWS * QK / 2];  // low nibbles of u, as q4x8's
    uint8_t qh[2][QK];           // top two bits of u, 2-bit planes
} q6k_sub;
typedef struct {
    uint16_t d[XROWS];              // f16 bits
    int8_t sc[2 * SUBS][XROWS];     // scale of sixteenth s, row r
    q6k_sub sub[SUBS];
} block_q6kx8;

// Element l (< 32) of a block: its unpacked vector and byte within it (row r).
static inline int q6k_vector(int l) { return 2 * ((l % 16) / 4) + (l >= 16); }
static inline int q6k_byte(int r, int l) { return r * 4 + l % 4; }

// GGUF Q6_K rows [n, k / 256 * 210 bytes] -> groups [ceil(n / 8), k / 256]; padding rows are zero.
void kvgen_repack_q6kx8(const uint8_t* w, block_q6kx8* out, int64_t n, int64_t k) {
    const int64_t nsb = k / QK_K, groups = x8_groups(n);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t s = 0; s < nsb; s++) {
            block_q6kx8* o = out + g * nsb + s;
            memset(o, 0, sizeof *o);
            for (int r = 0; r < XROWS && g * XROWS + r < n; r++) {
                const uint8_t* src = w + ((g * XROWS + r) * nsb + s) * 210;
                const uint8_t *ql = src, *qh = src + 128;
                const int8_t* sc = (const int8_t*)(src + 192);
                memcpy(&o->d[r], src + 208, 2);
                for (int t = 0; t < 2 * SUBS; t++) o->sc[t][r] = sc[t];
                for (int e = 0; e < QK_K; e++) {  // llama.cpp's dequantize_row_q6_K order
                    const int half = e / 128, m = (e % 128) / 32, l = e % 32;
                    const uint8_t byte = ql[64 * half + l + 32 * (m % 2)];  // m: 0, 1 low nibbles; 2, 3 high
                    const uint8_t low = m < 2 ? byte & 0x0F : byte >> 4;
                    const uint8_t top = (qh[32 * half + l] >> (2 * m)) & 3;
                    const int j = e / QK, el = e % QK, t = el % 16, v = q6k_vector(el), c = q6k_byte(r, el);
                    o->sub[j].qs[(t / 4) * 32 + r * 4 + t % 4] |= (uint8_t)(el < 16 ? low : low << 4);
                    o->sub[j].qh[v / 4][c] |= (uint8_t)(top << (2 * (v % 4)));
                }
            }
        }
    }
}

static inline int q6kx8_value(const block_q6kx8* sb, int j, int r, int l) {  // the signed u - 32
    const int t = l % 16, v = q6k_vector(l);
    const uint8_t byte = sb->sub[j].qs[(t / 4) * 32 + r * 4 + t % 4];
    const int low = l < 16 ? (byte & 0x0F) : (byte >> 4);
    return (low | (((sb->sub[j].qh[v / 4][q6k_byte(r, l)] >> (2 * (v % 4))) & 3) << 4)) - 32;
}

#ifdef __AVX2__
// Vector v's top bits moved to bits 4-5 of each byte (the shifted-in neighbours are masked off).
#define Q6K_TOP(planes, v)                                                                           \
    _mm256_and_si256((v) % 4 < 2 ? _mm256_slli_epi16((planes)[(v) / 4], 4 - 2 * ((v) % 4))          \
                                 : _mm256_srli_epi16((planes)[(v) / 4], 2 * ((v) % 4) - 4),          \
                     _mm256_set1_epi8(0x30))

#define Q6K_TILE(R)                                                                                  \
    for (int64_t s = 0; s < nb / SUBS; s++) {                                                        \
        const block_q6kx8* sb = wg + s;                                                              \
        const __m256 dsuper = f16x8_to_f32(sb->d);                                                   \
        for (int j = 0; j < SUBS; j++) {                                                             \
            prefetch_ahead((const char*)sb + j * (sizeof *sb / SUBS), sizeof *sb / SUBS);            \
            const int64_t b = s * SUBS + j;                                                          \
            const q6k_sub* sub = &sb->sub[j];                                                        \
            const __m256i planes[2] = {_mm256_loadu_si256((const __m256i*)sub->qh[0]),               \
                                       _mm256_loadu_si256((const __m256i*)sub->qh[1])};              \
            __m256i first[R], second[R];                                                             \
            for (int t = 0; t < R; t++) first[t] = second[t] = _mm256_setzero_si256();               \
            for (int i = 0; i < 4; i++) {                                                            \
                const __m256i packed = _mm256_loadu_si256((const __m256i*)(sub->qs + 32 * i));      \
                const __m256i lo = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(packed, _mm256_set1_epi8(0x0F)), \
                                                                   Q6K_TOP(planes, 2 * i)), _mm256_set1_epi8(32)); \
                const __m256i hi = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), \
                                                                                    _mm256_set1_epi8(0x0F)), \
                                                                   Q6K_TOP(planes, 2 * i + 1)), _mm256_set1_epi8(32)); \
                const __m256i lo_mag = _mm256_abs_epi8(lo), hi_mag = _mm256_abs_epi8(hi);           \
                for (int t = 0; t < R; t++) {                                                        \
                    const int8_t* xq = x[t * x_stride + b].qs;                                       \
                    DOT32(first[t], lo_mag, _mm256_sign_epi8(broadcast4(xq + 4 * i), lo));           \
                    DOT32(second[t], hi_mag, _mm256_sign_epi8(broadcast4(xq + 16 + 4 * i), hi));     \
                }                                                                                    \
            }                                                                                        \
            const __m256i sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)sb->sc[2 * j]));     \
            const __m256i sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)sb->sc[2 * j + 1])); \
            for (int t = 0; t < R; t++) {                                                            \
                const __m256i idot = _mm256_add_epi32(_mm256_mullo_epi32(first[t], sc0), _mm256_mullo_epi32(second[t], sc1)); \
                const block_x8* xb = x + t * x_stride + b;                                           \
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot), _mm256_mul_ps(dsuper, _mm256_set1_ps(xb->d)), acc[t]); \
            }                                                                                        \
        }                                                                                            \
    }

KQUANT_ROWS(q6kx8_rows, block_q6kx8, Q6K_TILE)
#else
static void q6kx8_rows(const block_q6kx8* wg, const block_x8* x, const int32_t* xsum, int64_t x_stride,
                       float* y, int64_t y_stride, int rows, int64_t nb, int out_count) {
    (void)xsum;
    for (int t = 0; t < rows; t++) {
        for (int r = 0; r < out_count; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const block_q6kx8* sb = wg + b / SUBS;
                const int j = (int)(b % SUBS);
                const block_x8* xb = x + t * x_stride + b;
                int first = 0, second = 0;
                for (int l = 0; l < QK / 2; l++) first += q6kx8_value(sb, j, r, l) * xb->qs[l];
                for (int l = QK / 2; l < QK; l++) second += q6kx8_value(sb, j, r, l) * xb->qs[l];
                const int dot = sb->sc[2 * j][r] * first + sb->sc[2 * j + 1][r] * second;
                acc = fmaf((float)dot, f16_to_f32(sb->d[r]) * xb->d, acc);
            }
            y[t * y_stride + r] = acc;
        }
    }
}
#endif

#ifdef PAIR_KERNELS_512
// Vector v's top bits at bits 4-5 of each byte (Q6K_TOP in 512 bits).
#define Q6K_TOP512(planes, v)                                                                        \
    _mm512_and_si512((v) % 4 < 2 ? _mm512_slli_epi16((planes)[(v) / 4], 4 - 2 * ((v) % 4))          \
                                 : _mm512_srli_epi16((planes)[(v) / 4], 2 * ((v) % 4) - 4),          \
                     _mm512_set1_epi8(0x30))
// The signed u - 32 of a pair's load i: low nibbles (elements 4i..4i+3, the block's first half)
// and high nibbles (16 + 4i.., its second half).
#define Q6K_PAIR_VALUES(u0, u1, planes, i, lo, hi)                                                   \
    const __m512i packed = pair_load((u0)->qs + 32 * (i), (u1)->qs + 32 * (i));                      \
    const __m512i lo = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(packed, _mm512_set1_epi8(0x0F)), \
                                                       Q6K_TOP512(planes, 2 * (i))), _mm512_set1_epi8(32)); \
    const __m512i hi = _mm512_sub_epi8(                                                              \
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(packed, 4), _mm512_set1_epi8(0x0F)),      \
                        Q6K_TOP512(planes, 2 * (i) + 1)), _mm512_set1_epi8(32));
// Two groups' 8 int8 scales (one sixteenth's) as 16 int32 lanes.
static inline __m512i q6k_pair_scales(const int8_t* a, const int8_t* b) {
    return _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)a), _mm_loadl_epi64((const __m128i*)b)));
}
// Q6K_TILE's sums for 16 outputs from the halves' dots (dot[t]: elements 0-15, dot2[t]: 16-31):
// idot = sc0 * first + sc1 * second, acc = fma(float(idot), d * d_x, acc).
#define APPLY_PAIR_Q6K(R)                                                                            \
    const block_q6kx8* s0 = w0 + b / SUBS;                                                           \
    const block_q6kx8* s1 = w1 + b / SUBS;                                                           \
    const int j = (int)(b % SUBS);                                                                   \
    const __m512i sc0 = q6k_pair_scales(s0->sc[2 * j], s1->sc[2 * j]);                               \
    const __m512i sc1 = q6k_pair_scales(s0->sc[2 * j + 1], s1->sc[2 * j + 1]);                       \
    const __m512 d = pair_load_ph(s0->d, s1->d);                                                     \
    for (int t = 0; t < R; t++) {                                                                    \
        const __m512i idot = _mm512_add_epi32(_mm512_mullo_epi32(dot[t], sc0), _mm512_mullo_epi32(dot2[t], sc1)); \
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(idot), _mm512_mul_ps(d, _mm512_set1_ps(x[t * x_stride + b].d)), acc[t]); \
    }
// The halves' dots in 512-bit registers, 16 outputs a vector: |w| the unsigned side, the
// activations negated where w < 0 (a masked subtraction, as Q8X8_PAIR_DOTS).
#define Q6K_PAIR_DOTS(R)                                                                             \
    __m512i dot2[R]; /* the second half's; dot[t] holds the first's */                               \
    for (int t = 0; t < R; t++) dot2[t] = _mm512_setzero_si512();                                    \
    const q6k_sub* u0 = &w0[b / SUBS].sub[b % SUBS];                                                 \
    const q6k_sub* u1 = &w1[b / SUBS].sub[b % SUBS];                                                 \
    const __m512i planes[2] = {pair_load(u0->qh[0], u1->qh[0]), pair_load(u0->qh[1], u1->qh[1])};   \
    for (int i = 0; i < 4; i++) {                                                                    \
        Q6K_PAIR_VALUES(u0, u1, planes, i, lo, hi)                                                   \
        const __m512i lo_mag = _mm512_abs_epi8(lo), hi_mag = _mm512_abs_epi8(hi);                    \
        const __mmask64 lo_neg = _mm512_movepi8_mask(lo), hi_neg = _mm512_movepi8_mask(hi);          \
        for (int t = 0; t < R; t++) {                                                                \
            const int8_t* xq = x[t * x_stride + b].qs;                                               \
            const __m512i xl = broadcast4_512(xq + 4 * i), xh = broadcast4_512(xq + 16 + 4 * i);     \
            dot[t] = _mm512_dpbusd_epi32(dot[t], lo_mag, _mm512_mask_sub_epi8(xl, lo_neg, _mm512_setzero_si512(), xl)); \
            dot2[t] = _mm512_dpbusd_epi32(dot2[t], hi_mag, _mm512_mask_sub_epi8(xh, hi_neg, _mm512_setzero_si512(), xh)); \
        }                                                                                            \
    }
PAIR_KERNEL_LOOPED(q6kx8_pair_rows, block_q6kx8, SUB_BLOCK_PAIR_LOOP, Q6K_PAIR_DOTS, APPLY_PAIR_Q6K)
#else
PAIR_OF_GROUPS(q6kx8_pair_rows, block_q6kx8, q6kx8_rows)
#endif
#ifdef AMX_KERNELS
// In AMX tiles (amx_tiles.c): a block's halves carry their own scales, so each half is a multiply
// of depth 16 (AMX_BLOCK_HALVES; the weights u - 32 signed), then APPLY_PAIR_Q6K as above.
// A pair's block as the halves' B tiles: load i's low nibbles (elements 4i..4i+3) are K-row i of
// the first, its high nibbles (16 + 4i..) K-row i of the second, 256 bytes on.
static inline void amx_unpack_q6k(const q6k_sub* u0, const q6k_sub* u1, uint8_t* tile) {
    const __m512i planes[2] = {pair_load(u0->qh[0], u1->qh[0]), pair_load(u0->qh[1], u1->qh[1])};
    for (int i = 0; i < 4; i++) {
        Q6K_PAIR_VALUES(u0, u1, planes, i, lo, hi)
        _mm512_storeu_si512(tile + 64 * i, lo);
        _mm512_storeu_si512(tile + 256 + 64 * i, hi);
    }
}
#define AMX_UNPACK_Q6K(b, tile) amx_unpack_q6k(&w0[(b) / SUBS].sub[(b) % SUBS], &w1[(b) / SUBS].sub[(b) % SUBS], tile)
AMX_PAIR_KERNEL_TILES(q6kx8_amx_rows, block_q6kx8, q6kx8_pair_rows, K_PAIR_ROWS, 16, AMX_UNPACK_Q6K, amx_configure_halves,
                      AMX_BLOCK_HALVES, APPLY_PAIR_Q6K)
#else
#define q6kx8_amx_rows q6kx8_pair_rows
#endif
GEMM_X8_GROUPED(kvgen_gemm_q6kx8, kvgen_linear_q6kx8, block_q6kx8, q6kx8_rows, q6kx8_amx_rows, 0, nb / SUBS, 4,
                CALL_ROWS(K_PAIR_ROWS))

// Weight l of a block is (d * sc) * (u - 32), in gguf's order of rounding.
#define DEQUANTIZE_Q6KX8(NAME, OUT_T, CONVERT)                                                       \
    void NAME(const block_q6kx8* w, OUT_T* out, int64_t n, int64_t k) {                              \
        const int64_t nsb = k / QK_K;                                                                \
        _Pragma("omp parallel for schedule(static)")                                                 \
        for (int64_t row = 0; row < n; row++) {                                                      \
            const block_q6kx8* wg = w + (row / XROWS) * nsb;                                         \
            const int r = (int)(row % XROWS);                                                        \
            for (int64_t b = 0; b < nsb * SUBS; b++) {                                               \
                const block_q6kx8* sb = wg + b / SUBS;                                               \
                const int j = (int)(b % SUBS);                                                       \
                for (int l = 0; l < QK; l++) {                                                       \
                    const float scale = f16_to_f32(sb->d[r]) * (float)sb->sc[2 * j + l / 16][r];    \
                    out[row * k + b * QK + l] = CONVERT(scale * (float)q6kx8_value(sb, j, r, l));   \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
    }
