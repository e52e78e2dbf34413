// 4- and 8-bit weights repacked eight rows at a time (q4x8, q4hx8, q8x8, q8sx8, q5x8), and the one matmul over
// them that every row count runs: decode (1 row), batched decode and verify (a few rows) and
// prefill (hundreds).
//
// Layout. For each group of 8 weight rows and each 32-element block: the 8 rows' scales d[8] (and,
// for q4x8 / q8x8, offsets m[8]: w = d * q + m), then their integers, four consecutive elements of
// one row per 32-bit lane: one 32-byte load holds 4 elements of each of the 8 rows, so a broadcast
// of 4 activation bytes yields 8 row dots in one multiply-add (as ik_llama.cpp's repacked _R8
// types do), and the scales of 8 rows apply in one vector FMA instead of 8 scalar ones.
//   q4x8:  byte i * 32 + r * 4 + e holds row r's element 4i + e (low nibble) and 16 + 4i + e (high), i < 4
//   q4hx8: the q4x8 integers with f16 scales and offsets: GGUF's Q4_1 blocks (20 bytes per 32
//          weights, as in the file, against q4x8's 24; a decode step of SmolLM2 reads 13 MB less)
//   q8x8:  byte i * 32 + r * 4 + e holds row r's element 4i + e, i < 8
//   q8sx8: the q8x8 integers with f16 scales and no offsets (w = d * q): GGUF's Q8_0 blocks
//          (34 bytes per 32 weights, as in the file, against q8x8's 40)
//   q5x8:  GGUF's Q5_0 (w = d * (u - 16), u in [0, 31], f16 d; 22 bytes per 32 weights): the low
//          nibbles of u laid out as q4x8's, then their fifth bits in 32 bytes of bit planes: bit v
//          of byte c is the fifth bit of byte c of unpacked vector v (v = 2i: q4x8's low nibbles of
//          load i, v = 2i + 1: its high nibbles), so one shift and one mask give a vector's bits.
//   q5mx8: 5-bit u in [0, 31] with f32 scales and offsets (w = d * u + m; GGUF's Q5_K, whose
//          d * sc and dmin * mn per 32 weights are exact in f32, and Q5_1): q5x8's nibbles and planes
//   iq4x8: IQ4_NL / IQ4_XS's 4-bit indices into 16 int8 levels (IQ4_LEVELS), laid out as q4x8's
//          nibbles, with f32 scales (w = d * level; IQ4_XS's d * (ls - 32) is exact in f32, not f16).
// Rows are padded to a multiple of 8 (zero scales); the repacking is one pass at load.
//
// Numerics. Each output is sum over blocks, in order, of float(idot) * (d_w * d_x) + m_w * s_x
// (q8sx8, q5x8, iq4x8: without the offset term), with idot the exact integer dot of the block (q5x8:
// sum(u * x) - 16 * sum(x), the signed integers' dot; iq4x8 with VNNI: sum((level + 128) * x) -
// 128 * sum(x)). Nothing depends on how many activation rows
// are multiplied together or on the instruction set (VNNI or AVX2's multiply-add pair compute the
// same integer, F16C's conversion is exact), so a row's logits are the same alone, batched,
// verified or prefilled. A decode step (one row) is bound by memory: one Zen 4 core runs these
// kernels at 29-54 GB/s of blocks with the weights in cache, against 18-20 GB/s streamed from
// memory. Many rows are bound by compute: there 512-bit tiles of 16 outputs (interleaved_pairs.c)
// halve the activation broadcasts.

#define XROWS 8

typedef struct { float d[XROWS]; float m[XROWS]; uint8_t qs[XROWS * QK / 2]; } block_q4x8;
typedef struct { uint16_t d[XROWS]; uint16_t m[XROWS]; uint8_t qs[XROWS * QK / 2]; } block_q4hx8;  // f16 bits
typedef struct { float d[XROWS]; float m[XROWS]; int8_t qs[XROWS * QK]; } block_q8x8;
typedef struct { uint16_t d[XROWS]; int8_t qs[XROWS * QK]; } block_q8sx8;  // d: f16 bits
typedef struct { uint16_t d[XROWS]; uint8_t qs[XROWS * QK / 2]; uint8_t qh[QK]; } block_q5x8;
typedef struct { float d[XROWS]; uint8_t qs[XROWS * QK / 2]; } block_iq4x8;
typedef struct { float d[XROWS]; float m[XROWS]; uint8_t qs[XROWS * QK / 2]; uint8_t qh[QK]; } block_q5mx8;

// IQ4_NL and IQ4_XS's levels (llama.cpp's kvalues_iq4nl), indexed by a weight's 4 bits.
static const int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// MXFP4's e2m1 levels doubled (llama.cpp's kvalues_mxfp4). mx4x8 is iq4x8's layout with these levels,
// its f32 scale a power of two: gpt-oss's experts, as OpenAI ships them, at the file's 4.25 bits.
static const int8_t MXFP4_LEVELS[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
typedef block_iq4x8 block_mx4x8;

static inline int64_t x8_groups(int64_t n) { return (n + XROWS - 1) / XROWS; }

// A thread streams its share of a weight in order; the lines WEIGHT_PREFETCH_BYTES ahead of the
// block it multiplies are asked for now. The hardware prefetchers alone kept too few lines in flight
// on a 2-core Intel Xeon (KVM, AVX-512 + AMX): a cold 4-row multiply by SmolLM2's 28.7 MiB head took
// 1.92 ms against 1.27 for one row, and batch-1 decode ran at 188 tok/s; asking 8-12 KiB ahead gave
// 1.29 ms (at 2 KiB) and 367-381 tok/s (512 B: 1.52 ms; 32 KiB: 338 tok/s, lines evicted unused).
// The 16-output tiles ask too: 16 batched decode rows 977-1008 -> 1243-1257 tok/s there.
#ifndef WEIGHT_PREFETCH_BYTES
#define WEIGHT_PREFETCH_BYTES 12288
#endif
// Asks for the lines of [p + distance, p + distance + bytes); a distance of 0 asks for nothing (the
// hardware prefetchers alone). Also the int8 attention's (group_tiles.c).
static inline void prefetch_span(const void* p, int64_t distance, int64_t bytes) {
    if (distance <= 0) return;
    const char* ahead = (const char*)p + distance;
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(ahead + off);
}
static inline void prefetch_ahead(const void* p, size_t bytes) {
    prefetch_span(p, WEIGHT_PREFETCH_BYTES, (int64_t)bytes);
}

// Row-major blocks [n, k / 32] -> groups [ceil(n / 8), k / 32]; padding rows are zero.
#define REPACK(NAME, SRC, DST, COPY_ROW)                                                             \
    void NAME(const SRC* w, DST* out, int64_t n, int64_t k) {                                        \
        const int64_t nb = k / QK, groups = x8_groups(n);                                            \
        _Pragma("omp parallel for schedule(static)")                                                 \
        for (int64_t g = 0; g < groups; g++) {                                                       \
            for (int64_t b = 0; b < nb; b++) {                                                       \
                DST* o = out + g * nb + b;                                                           \
                memset(o, 0, sizeof *o);                                                             \
                for (int r = 0; r < XROWS && g * XROWS + r < n; r++) {                               \
                    const SRC* src = w + (g * XROWS + r) * nb + b;                                   \
                    COPY_ROW                                                                         \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
    }
// q4 source byte j holds elements j (low) and j + 16 (high): it moves whole.
REPACK(kvgen_repack_q4x8, block_q4, block_q4x8, o->d[r] = src->d; o->m[r] = src->m; for (int j = 0; j < QK / 2; j++) o->qs[(j / 4) * 32 + r * 4 + j % 4] = src->qs[j];)
REPACK(kvgen_repack_q4hx8, block_q4h, block_q4hx8, o->d[r] = src->d; o->m[r] = src->m; for (int j = 0; j < QK / 2; j++) o->qs[(j / 4) * 32 + r * 4 + j % 4] = src->qs[j];)
REPACK(kvgen_repack_q8x8, block_q8, block_q8x8, o->d[r] = src->d; o->m[r] = src->m; for (int j = 0; j < QK; j++) o->qs[(j / 4) * 32 + r * 4 + j % 4] = src->qs[j];)
REPACK(kvgen_repack_q8sx8, block_q8s, block_q8sx8, o->d[r] = src->d; for (int j = 0; j < QK; j++) o->qs[(j / 4) * 32 + r * 4 + j % 4] = src->qs[j];)
REPACK(kvgen_repack_iq4x8, block_iq4, block_iq4x8, o->d[r] = src->d; for (int j = 0; j < QK / 2; j++) o->qs[(j / 4) * 32 + r * 4 + j % 4] = src->qs[j];)
void kvgen_repack_mx4x8(const block_iq4* w, block_mx4x8* out, int64_t n, int64_t k) { kvgen_repack_iq4x8(w, out, n, k); }

// A 5-bit row's block into an interleaved one (row r): the nibbles move as q4's; fifth bit j goes to
// its vector's plane.
static inline void repack_q5_row(const uint8_t* src_qh, const uint8_t* src_qs, int r, uint8_t* qs, uint8_t* qh) {
    uint32_t high;
    memcpy(&high, src_qh, sizeof high);
    for (int j = 0; j < QK / 2; j++) qs[(j / 4) * 32 + r * 4 + j % 4] = src_qs[j];
    for (int j = 0; j < QK; j++) {  // element j: load i = (j % 16) / 4, high nibble if j >= 16
        const int v = 2 * ((j % 16) / 4) + (j >= 16), c = r * 4 + j % 4;
        qh[c] |= (uint8_t)(((high >> j) & 1) << v);
    }
}
REPACK(kvgen_repack_q5x8, block_q5_0, block_q5x8, o->d[r] = src->d; repack_q5_row(src->qh, src->qs, r, o->qs, o->qh);)
REPACK(kvgen_repack_q5mx8, block_q5m, block_q5mx8, o->d[r] = src->d; o->m[r] = src->m; repack_q5_row(src->qh, src->qs, r, o->qs, o->qh);)

// Element j of row r in a block (dequantizing and the portable path).
static inline int nibble_value(const uint8_t* qs, int r, int j) {
    const int low = j < QK / 2;
    const int jj = low ? j : j - QK / 2;
    const uint8_t byte = qs[(jj / 4) * 32 + r * 4 + jj % 4];
    return low ? (byte & 0x0F) : (byte >> 4);
}
static inline int q4x8_value(const block_q4x8* blk, int r, int j) { return nibble_value(blk->qs, r, j); }
static inline int q4hx8_value(const block_q4hx8* blk, int r, int j) { return nibble_value(blk->qs, r, j); }
static inline int iq4x8_value(const block_iq4x8* blk, int r, int j) { return IQ4_LEVELS[nibble_value(blk->qs, r, j)]; }
static inline int mx4x8_value(const block_mx4x8* blk, int r, int j) { return MXFP4_LEVELS[nibble_value(blk->qs, r, j)]; }

static inline int q8x8_value(const block_q8x8* blk, int r, int j) { return blk->qs[(j / 4) * 32 + r * 4 + j % 4]; }
static inline int q8sx8_value(const block_q8sx8* blk, int r, int j) { return blk->qs[(j / 4) * 32 + r * 4 + j % 4]; }
static inline int five_bit_value(const uint8_t* qs, const uint8_t* qh, int r, int j) {  // u in [0, 31]
    const int v = 2 * ((j % 16) / 4) + (j >= 16), c = r * 4 + j % 4;
    const int low = j < QK / 2 ? qs[((j % 16) / 4) * 32 + c] & 0x0F : qs[((j % 16) / 4) * 32 + c] >> 4;
    return low | (((qh[c] >> v) & 1) << 4);
}
static inline int q5x8_value(const block_q5x8* blk, int r, int j) { return five_bit_value(blk->qs, blk->qh, r, j) - 16; }
static inline int q5mx8_value(const block_q5mx8* blk, int r, int j) { return five_bit_value(blk->qs, blk->qh, r, j); }

// Weight j of row r as a float (dequantizing).
static inline float q4x8_weight(const block_q4x8* blk, int r, int j) { return blk->d[r] * (float)q4x8_value(blk, r, j) + blk->m[r]; }
static inline float q4hx8_weight(const block_q4hx8* blk, int r, int j) {
    return f16_to_f32(blk->d[r]) * (float)q4hx8_value(blk, r, j) + f16_to_f32(blk->m[r]);
}
static inline float q8x8_weight(const block_q8x8* blk, int r, int j) { return blk->d[r] * (float)q8x8_value(blk, r, j) + blk->m[r]; }
static inline float q8sx8_weight(const block_q8sx8* blk, int r, int j) { return f16_to_f32(blk->d[r]) * (float)q8sx8_value(blk, r, j); }
static inline float q5x8_weight(const block_q5x8* blk, int r, int j) { return f16_to_f32(blk->d[r]) * (float)q5x8_value(blk, r, j); }
static inline float iq4x8_weight(const block_iq4x8* blk, int r, int j) { return blk->d[r] * (float)iq4x8_value(blk, r, j); }
static inline float mx4x8_weight(const block_mx4x8* blk, int r, int j) { return blk->d[r] * (float)mx4x8_value(blk, r, j); }
static inline float q5mx8_weight(const block_q5mx8* blk, int r, int j) { return blk->d[r] * (float)q5mx8_value(blk, r, j) + blk->m[r]; }

#ifdef __AVX2__
static inline __m256i broadcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

// Exact integer dots of one block for R activation rows (R constant at each call site, so the
// accumulators stay in registers): idot[t] lane r = row r's dot with activation row t.
// q4: the unsigned nibbles are the u8 side. AVX2 sums the u8 x s8 pairs in int16 (|sum| <= 8 * 2
// * 15 * 127 = 30480, no saturation) and widens once; VNNI adds into int32 directly.
// q8: signed weights take the sign trick (|w| as u8, the activation takes w's sign); one pair
// reaches 2 * 128 * 127, so AVX2 widens every multiply-add.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT16(acc, w, x) (acc) = _mm256_dpbusd_epi32((acc), (w), (x))
#define WIDEN16(acc) (acc)
#define DOT32(acc, w, x) (acc) = _mm256_dpbusd_epi32((acc), (w), (x))
// The 4 activation bytes at p broadcast inside the multiply-add ({1to8}): one instruction where
// gcc emits a broadcast and a multiply-add, which relieves the front end of the many-row tiles.
#define DOT_BCAST(acc, w, p) __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t*)(p)))
#define DOT16_BCAST DOT_BCAST
#define DOT32_BCAST DOT_BCAST
#elif defined(__AVXVNNI__)
#define DOT16(acc, w, x) (acc) = _mm256_dpbusd_avx_epi32((acc), (w), (x))
#define WIDEN16(acc) (acc)
#define DOT32(acc, w, x) (acc) = _mm256_dpbusd_avx_epi32((acc), (w), (x))
#else
#define DOT16(acc, w, x) (acc) = _mm256_add_epi16((acc), _mm256_maddubs_epi16((w), (x)))
#define WIDEN16(acc) _mm256_madd_epi16((acc), _mm256_set1_epi16(1))
#define DOT32(acc, w, x) (acc) = _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((w), (x)), _mm256_set1_epi16(1)))
#endif
#ifndef DOT_BCAST
#define DOT16_BCAST(acc, w, p) DOT16(acc, w, broadcast4(p))
#define DOT32_BCAST(acc, w, p) DOT32(acc, w, broadcast4(p))
#endif

#define Q4X8_DOTS(R) NIBBLE_DOTS(R, blk->qs)
#define NIBBLE_DOTS(R, QS)                                                                           \
    for (int i = 0; i < 4; i++) {                                                                    \
        const __m256i packed = _mm256_loadu_si256((const __m256i*)((QS) + 32 * i));                 \
        const __m256i lo = _mm256_and_si256(packed, _mm256_set1_epi8(0x0F));                         \
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), _mm256_set1_epi8(0x0F));  \
        for (int t = 0; t < R; t++) {                                                                \
            const int8_t* xq = x[t * x_stride + b].qs;                                               \
            DOT16_BCAST(dot[t], lo, xq + 4 * i);                                                     \
            DOT16_BCAST(dot[t], hi, xq + 16 + 4 * i);                                                \
        }                                                                                            \
    }                                                                                                \
    for (int t = 0; t < R; t++) dot[t] = WIDEN16(dot[t]);

#define Q8X8_DOTS(R)                                                                                 \
    for (int i = 0; i < 8; i++) {                                                                    \
        const __m256i w = _mm256_loadu_si256((const __m256i*)(blk->qs + 32 * i));                   \
        const __m256i magnitude = _mm256_abs_epi8(w);                                                \
        for (int t = 0; t < R; t++) {                                                                \
            const __m256i xs = _mm256_sign_epi8(broadcast4(x[t * x_stride + b].qs + 4 * i), w);     \
            DOT32(dot[t], magnitude, xs);                                                            \
        }                                                                                            \
    }

// q5: u = nibble | fifth bit << 4 is the u8 side; one pair reaches 2 * 31 * 127, so AVX2 widens
// every multiply-add. The 16 * sum(x) of the offset is subtracted as an integer (xsum, per block);
// q5m's offset is a float, applied with its scale (APPLY_SCALES_OFFSETS).
#define Q5_FIFTH_BIT(planes, v) _mm256_and_si256((v) <= 4 ? _mm256_slli_epi16((planes), 4 - (v)) : _mm256_srli_epi16((planes), (v) - 4), _mm256_set1_epi8(0x10))
#define Q5X8_DOTS(R)                                                                                 \
    FIVE_BIT_DOTS(R)                                                                                 \
    for (int t = 0; t < R; t++) dot[t] = _mm256_sub_epi32(dot[t], _mm256_set1_epi32(16 * xsum[t * x_stride + b]));
#define FIVE_BIT_DOTS(R)                                                                             \
    const __m256i planes = _mm256_loadu_si256((const __m256i*)blk->qh);                              \
    UNPACKED_NIBBLE_DOTS(R, Q5_FIFTH_BITS_256)
#define Q5_FIFTH_BITS_256(lo, hi, i)                                                                 \
    lo = _mm256_or_si256(lo, Q5_FIFTH_BIT(planes, 2 * (i)));                                         \
    hi = _mm256_or_si256(hi, Q5_FIFTH_BIT(planes, 2 * (i) + 1));
// The block's nibbles, load i's low and high ones each turned into the u8 side by UNPACK(lo, hi, i)
// (q5's fifth bits, iq4's levels), dotted with every activation row, widened as DOT32 widens.
#define UNPACKED_NIBBLE_DOTS(R, UNPACK)                                                              \
    for (int i = 0; i < 4; i++) {                                                                    \
        const __m256i packed = _mm256_loadu_si256((const __m256i*)(blk->qs + 32 * i));              \
        __m256i lo = _mm256_and_si256(packed, _mm256_set1_epi8(0x0F));                               \
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), _mm256_set1_epi8(0x0F));        \
        UNPACK(lo, hi, i)                                                                            \
        for (int t = 0; t < R; t++) {                                                                \
            const int8_t* xq = x[t * x_stride + b].qs;                                               \
            DOT32_BCAST(dot[t], lo, xq + 4 * i);                                                     \
            DOT32_BCAST(dot[t], hi, xq + 16 + 4 * i);                                                \
        }                                                                                            \
    }

// iq4 and mx4: each nibble looks up its level in TABLE (vpshufb over the 16 levels). With VNNI the
// u8 side is level + 128 (1..241) and 128 * sum(x) comes off after (xsum); AVX2's u8 x s8 pairs
// would overflow int16 there, so it takes q8's sign trick: |level| the u8 side, x negated where the
// level is. IQ4_SUMS: whether the level formats take the activations' sums.
#define IQ4X8_DOTS(R) LEVEL_DOTS(R, IQ4_LEVELS)
#define MX4X8_DOTS(R) LEVEL_DOTS(R, MXFP4_LEVELS)
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define IQ4_SUMS 1
#define LEVEL_DOTS(R, TABLE)                                                                         \
    const __m256i biased = _mm256_add_epi8(levels_256(TABLE), _mm256_set1_epi8((char)128));          \
    UNPACKED_NIBBLE_DOTS(R, IQ4_BIASED_LEVELS_256)                                                   \
    for (int t = 0; t < R; t++) dot[t] = _mm256_sub_epi32(dot[t], _mm256_set1_epi32(128 * xsum[t * x_stride + b]));
#define IQ4_BIASED_LEVELS_256(lo, hi, i)                                                             \
    lo = _mm256_shuffle_epi8(biased, lo);                                                            \
    hi = _mm256_shuffle_epi8(biased, hi);
#else
#define IQ4_SUMS 0
#define LEVEL_DOTS(R, TABLE)                                                                         \
    const __m256i levels = levels_256(TABLE);                                                        \
    for (int i = 0; i < 4; i++) {                                                                    \
        const __m256i packed = _mm256_loadu_si256((const __m256i*)(blk->qs + 32 * i));              \
        const __m256i lo = _mm256_shuffle_epi8(levels, _mm256_and_si256(packed, _mm256_set1_epi8(0x0F))); \
        const __m256i hi = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(packed, 4), _mm256_set1_epi8(0x0F))); \
        const __m256i lo_magnitude = _mm256_abs_epi8(lo), hi_magnitude = _mm256_abs_epi8(hi);        \
        for (int t = 0; t < R; t++) {                                                                \
            const int8_t* xq = x[t * x_stride + b].qs;                                               \
            DOT32(dot[t], lo_magnitude, _mm256_sign_epi8(broadcast4(xq + 4 * i), lo));               \
            DOT32(dot[t], hi_magnitude, _mm256_sign_epi8(broadcast4(xq + 16 + 4 * i), hi));          \
        }                                                                                            \
    }
#endif
static inline __m256i levels_256(const int8_t* table) {  // the 16 levels in each 128-bit lane, as vpshufb reads
    const __m128i levels = _mm_loadu_si128((const __m128i*)table);
    return _mm256_broadcastsi128_si256(levels);
}

// Up to TILE_ROWS activation rows share each loaded weight block; y rows are y_stride apart.
// AVX-512VL gives 32 vector registers: 8 rows' integer dots and float sums stay in registers, and
// each unpacked weight vector feeds 8 multiply-adds instead of 4. AVX2's 16 registers hold 4 rows,
// and for q4 6 (12 accumulators, the two unpacked weight vectors and the nibble mask): a 512-token
// SmolLM2 prompt on the AVX2 build ran 1.04x as fast as with 4 (in-process turns on Zen 4, same
// tokens), while Gemma 3's q5 / q8 kernels, which keep more vectors live, ran 0.98x with 6.
// The tile height changes which rows share a weight load, never a row's sums.
#define CASES_8_TO_5(BLOCK, DOTS, APPLY)                                                             \
    case 8: TILE_LOOP(BLOCK, DOTS, APPLY, 8) break;                                                  \
    case 7: TILE_LOOP(BLOCK, DOTS, APPLY, 7) break;                                                  \
    case 6: TILE_LOOP(BLOCK, DOTS, APPLY, 6) break;                                                  \
    case 5: TILE_LOOP(BLOCK, DOTS, APPLY, 5) break;
#define CASES_6_TO_5(BLOCK, DOTS, APPLY)                                                             \
    case 6: TILE_LOOP(BLOCK, DOTS, APPLY, 6) break;                                                  \
    case 5: TILE_LOOP(BLOCK, DOTS, APPLY, 5) break;
#define NO_CASES(BLOCK, DOTS, APPLY)
#ifdef __AVX512VL__
#define TILE_ROWS 8
#define TILE_CASES CASES_8_TO_5
#define Q4_TILE_ROWS 8
#define Q4_TILE_CASES CASES_8_TO_5
#else
#define TILE_ROWS 4
#define TILE_CASES NO_CASES
#define Q4_TILE_ROWS 6
#define Q4_TILE_CASES CASES_6_TO_5
#endif
#define ROWS_KERNEL(NAME, BLOCK, DOTS, APPLY) ROWS_KERNEL_TILED(NAME, BLOCK, DOTS, APPLY, TILE_ROWS, TILE_CASES)
#define ROWS_KERNEL_TILED(NAME, BLOCK, DOTS, APPLY, ROWS, CASES)                                     \
    static inline void NAME(const BLOCK* wg, const block_x8* x, const int32_t* xsum, int64_t x_stride, \
                            float* y, int64_t y_stride, int rows, int64_t nb, int out_count) {       \
        (void)xsum;                                                                                  \
        __m256 acc[ROWS];                                                                            \
        for (int t = 0; t < ROWS; t++) acc[t] = _mm256_setzero_ps();                                 \
        switch (rows) {                                                                              \
            CASES(BLOCK, DOTS, APPLY)                                                                \
            case 4: TILE_LOOP(BLOCK, DOTS, APPLY, 4) break;                                          \
            case 3: TILE_LOOP(BLOCK, DOTS, APPLY, 3) break;                                          \
            case 2: TILE_LOOP(BLOCK, DOTS, APPLY, 2) break;                                          \
            default: TILE_LOOP(BLOCK, DOTS, APPLY, 1) break;                                         \
        }                                                                                            \
        for (int t = 0; t < rows; t++) {                                                             \
            if (out_count == XROWS) {                                                                \
                _mm256_storeu_ps(y + t * y_stride, acc[t]);                                          \
            } else {                                                                                 \
                float lanes[XROWS];                                                                  \
                _mm256_storeu_ps(lanes, acc[t]);                                                     \
                memcpy(y + t * y_stride, lanes, (size_t)out_count * sizeof(float));                  \
            }                                                                                        \
        }                                                                                            \
    }
#define TILE_LOOP(BLOCK, DOTS, APPLY, R)                                                             \
    for (int64_t b = 0; b < nb; b++) {                                                               \
        const BLOCK* blk = wg + b;                                                                   \
        prefetch_ahead(blk, sizeof(BLOCK));                                                          \
        __m256i dot[R];                                                                              \
        for (int t = 0; t < R; t++) dot[t] = _mm256_setzero_si256();                                 \
        DOTS(R)                                                                                      \
        APPLY(R)                                                                                     \
    }
// acc += float(idot) * (d_w * d_x) (+ m_w * s_x where the format has offsets), one FMA each.
#define APPLY_SCALES_OFFSETS(R) APPLY_GIVEN_SCALES_OFFSETS(R, _mm256_loadu_ps(blk->d), _mm256_loadu_ps(blk->m))
#define APPLY_F16_SCALES_OFFSETS(R) APPLY_GIVEN_SCALES_OFFSETS(R, f16x8_to_f32(blk->d), f16x8_to_f32(blk->m))
#define APPLY_GIVEN_SCALES_OFFSETS(R, D, M)                                                          \
    const __m256 d = (D), m = (M);                                                                   \
    for (int t = 0; t < R; t++) {                                                                    \
        const block_x8* xb = x + t * x_stride + b;                                                   \
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]), _mm256_mul_ps(d, _mm256_set1_ps(xb->d)), acc[t]); \
        acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(xb->s), acc[t]);                                  \
    }
#define APPLY_F32_SCALES(R) APPLY_GIVEN_SCALES(R, _mm256_loadu_ps(blk->d))
#define APPLY_F16_SCALES(R) APPLY_GIVEN_SCALES(R, f16x8_to_f32(blk->d))
#define APPLY_GIVEN_SCALES(R, D)                                                                     \
    const __m256 d = (D);                                                                            \
    for (int t = 0; t < R; t++) {                                                                    \
        const block_x8* xb = x + t * x_stride + b;                                                   \
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]), _mm256_mul_ps(d, _mm256_set1_ps(xb->d)), acc[t]); \
    }

ROWS_KERNEL_TILED(q4x8_rows, block_q4x8, Q4X8_DOTS, APPLY_SCALES_OFFSETS, Q4_TILE_ROWS, Q4_TILE_CASES)
ROWS_KERNEL_TILED(q4hx8_rows, block_q4hx8, Q4X8_DOTS, APPLY_F16_SCALES_OFFSETS, Q4_TILE_ROWS, Q4_TILE_CASES)
ROWS_KERNEL(q8x8_rows, block_q8x8, Q8X8_DOTS, APPLY_SCALES_OFFSETS)
ROWS_KERNEL(q8sx8_rows, block_q8sx8, Q8X8_DOTS, APPLY_F16_SCALES)
ROWS_KERNEL(q5x8_rows, block_q5x8, Q5X8_DOTS, APPLY_F16_SCALES)
ROWS_KERNEL(iq4x8_rows, block_iq4x8, IQ4X8_DOTS, APPLY_F32_SCALES)
ROWS_KERNEL(mx4x8_rows, block_mx4x8, MX4X8_DOTS, APPLY_F32_SCALES)
ROWS_KERNEL(q5mx8_rows, block_q5mx8, FIVE_BIT_DOTS, APPLY_SCALES_OFFSETS)
#else
// Portable path: the same sums in the same order, one lane at a time.
#define ROWS_KERNEL_SCALAR(NAME, BLOCK, VALUE, APPLY)                                                \
    static void NAME(const BLOCK* wg, const block_x8* x, const int32_t* xsum, int64_t x_stride,      \
                     float* y, int64_t y_stride, int rows, int64_t nb, int out_count) {              \
        (void)xsum; /* the values are already signed */                                             \
        for (int t = 0; t < rows; t++) {                                                             \
            for (int r = 0; r < out_count; r++) {                                                    \
                float acc = 0.0f;                                                                    \
                for (int64_t b = 0; b < nb; b++) {                                                   \
                    const block_x8* xb = x + t * x_stride + b;                                       \
                    int dot = 0;                                                                     \
                    for (int j = 0; j < QK; j++) dot += VALUE(wg + b, r, j) * xb->qs[j];             \
                    APPLY                                                                            \
                }                                                                                    \
                y[t * y_stride + r] = acc;                                                           \
            }                                                                                        \
        }                                                                                            \
    }
#define SCALAR_SCALES_OFFSETS acc = fmaf((float)dot, wg[b].d[r] * xb->d, acc); acc = fmaf(wg[b].m[r], xb->s, acc);
#define SCALAR_F16_SCALES acc = fmaf((float)dot, f16_to_f32(wg[b].d[r]) * xb->d, acc);
#define SCALAR_F16_SCALES_OFFSETS SCALAR_F16_SCALES acc = fmaf(f16_to_f32(wg[b].m[r]), xb->s, acc);
ROWS_KERNEL_SCALAR(q4x8_rows, block_q4x8, q4x8_value, SCALAR_SCALES_OFFSETS)
ROWS_KERNEL_SCALAR(q4hx8_rows, block_q4hx8, q4hx8_value, SCALAR_F16_SCALES_OFFSETS)
ROWS_KERNEL_SCALAR(q8x8_rows, block_q8x8, q8x8_value, SCALAR_SCALES_OFFSETS)
ROWS_KERNEL_SCALAR(q8sx8_rows, block_q8sx8, q8sx8_value, SCALAR_F16_SCALES)
ROWS_KERNEL_SCALAR(q5x8_rows, block_q5x8, q5x8_value, SCALAR_F16_SCALES)
#define SCALAR_F32_SCALES acc = fmaf((float)dot, wg[b].d[r] * xb->d, acc);
ROWS_KERNEL_SCALAR(iq4x8_rows, block_iq4x8, iq4x8_value, SCALAR_F32_SCALES)
ROWS_KERNEL_SCALAR(mx4x8_rows, block_mx4x8, mx4x8_value, SCALAR_F32_SCALES)
ROWS_KERNEL_SCALAR(q5mx8_rows, block_q5mx8, q5mx8_value, SCALAR_SCALES_OFFSETS)
#define IQ4_SUMS 0
#endif

// Activation rows are taken in chunks that stay in L2 while every weight group (a few KiB, in L1)
// passes over them; within a chunk, a tile of rows (TILE_ROWS) shares each unpacked weight block.
#define ROW_CHUNK 64
#ifndef TILE_ROWS
#define TILE_ROWS 4  // the portable path: rows of a tile are computed one after another anyway
#define Q4_TILE_ROWS 4
#endif

// Integer sums of each activation block's codes (q5x8's offset), for the vector path only.
static void x8_sums_into(const block_x8* x, int64_t count, int32_t* sums) {
    for (int64_t i = 0; i < count; i++) {
        int32_t s = 0;
        for (int j = 0; j < QK; j++) s += x[i].qs[j];
        sums[i] = s;
    }
}

static int32_t* x8_sums(const block_x8* x, int64_t count) {
    int32_t* sums = malloc((size_t)(count > 0 ? count : 1) * sizeof(int32_t));
    x8_sums_into(x, count, sums);
    return sums;
}

// Work is split over (row chunk, pair of weight groups); a pair whose groups are both full runs
// the 16-output kernel, other groups the 8-output one: a row's outputs have the same bits either way.
// On Zen 4, which runs a 512-bit operation as two halves, fewer than 16 activation rows (a decode
// step, a speculative verify, a small batch) keep the 8-output kernel: with two threads,
// SmolLM2's rows step over all 30 layers took 3.0 ms for 2 rows with it against 5.9 with the pair
// kernel, 5.9 against 7.1 for 8, the same at 12-16, and the pair kernel won from 24 rows (18.7
// against 19.8 ms for 32, 34.6 against 36.9 for 64; rechecked once the pair kernel asked for its
// blocks ahead: batch-1 decode 0.64x). CPUs with AMX (Sapphire Rapids and later Xeons) have two
// 512-bit multiply-add units a core, and there the pair kernel pays from one row.
#ifdef __AMX_INT8__
#define PAIR_MIN_ROWS 1
#else
#define PAIR_MIN_ROWS 16
#endif
// GROUP_BLOCKS: BLOCKs per group of 8 rows (nb 32-element blocks; q4kx8: nb / 8 super-blocks);
// ROWS / PAIR_ROWS_MAX: the most activation rows ROWS_FN / PAIR_FN take at once.
#define GEMM_X8_GROUPED(NAME, LINEAR, BLOCK, ROWS_FN, PAIR_FN, NEEDS_SUMS, GROUP_BLOCKS, ROWS, PAIR_ROWS_MAX) \
    /* Called by every thread of a team (or by one thread outside any): each takes its static    \
       share of (row chunk, pair) items, adds `bias` (or nothing) to the outputs it computed, and \
       the closing barrier of `omp for` makes y whole for all. xsum: the activation blocks' sums \
       where NEEDS_SUMS, else NULL. */                                                           \
    static void NAME##_team(const BLOCK* w, const block_x8* x, const int32_t* xsum, float* y, int64_t m_rows, \
                            int64_t n, int64_t k, const float* bias) {                              \
        const int64_t nb = k / QK, groups = x8_groups(n), pairs = (groups + 1) / 2;                  \
        const int64_t chunks = (m_rows + ROW_CHUNK - 1) / ROW_CHUNK;                                 \
        _Pragma("omp for collapse(2) schedule(static)")                                              \
        for (int64_t c = 0; c < chunks; c++) {                                                       \
            for (int64_t p = 0; p < pairs; p++) {                                                    \
                const int64_t m_end = (c + 1) * ROW_CHUNK < m_rows ? (c + 1) * ROW_CHUNK : m_rows;   \
                const int64_t g = 2 * p;                                                             \
                if (m_rows >= PAIR_MIN_ROWS && n >= (g + 2) * XROWS) {                               \
                    for (int64_t m0 = c * ROW_CHUNK; m0 < m_end; m0 += PAIR_ROWS_MAX) {              \
                        const int rows = (int)(m_end - m0 < PAIR_ROWS_MAX ? m_end - m0 : PAIR_ROWS_MAX); \
                        PAIR_FN(w + g * (GROUP_BLOCKS), w + (g + 1) * (GROUP_BLOCKS), x + m0 * nb,  \
                                xsum != NULL ? xsum + m0 * nb : NULL, nb, y + m0 * n + g * XROWS, n, rows, nb); \
                    }                                                                                \
                } else {                                                                             \
                    for (int64_t h = g; h < g + 2 && h < groups; h++) {                              \
                        const int out_count = (int)(n - h * XROWS < XROWS ? n - h * XROWS : XROWS);  \
                        for (int64_t m0 = c * ROW_CHUNK; m0 < m_end; m0 += (ROWS)) {                 \
                            const int rows = (int)(m_end - m0 < (ROWS) ? m_end - m0 : (ROWS));       \
                            ROWS_FN(w + h * (GROUP_BLOCKS), x + m0 * nb, xsum != NULL ? xsum + m0 * nb : NULL, nb, \
                                    y + m0 * n + h * XROWS, n, rows, nb, out_count);                 \
                        }                                                                            \
                    }                                                                                \
                }                                                                                    \
                const int64_t o_end = (g + 2) * XROWS < n ? (g + 2) * XROWS : n;                     \
                for (int64_t m = c * ROW_CHUNK; bias != NULL && m < m_end; m++)                      \
                    for (int64_t o = g * XROWS; o < o_end; o++) y[m * n + o] += bias[o];             \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    void NAME(const BLOCK* w, const block_x8* x, float* y, int64_t m_rows, int64_t n, int64_t k) {   \
        int32_t* xsum = NEEDS_SUMS ? x8_sums(x, m_rows * (k / QK)) : NULL;                           \
        _Pragma("omp parallel") NAME##_team(w, x, xsum, y, m_rows, n, k, NULL);                      \
        free(xsum);                                                                                  \
    }                                                                                                \
    /* One call per linear layer: quantize the activation rows into `scratch`, then multiply. */    \
    void LINEAR(const BLOCK* w, const float* x, block_x8* scratch, float* y, int64_t m_rows, int64_t n, int64_t k) { \
        kvgen_quantize_x8(x, m_rows, k, scratch);                                                    \
        NAME(w, scratch, y, m_rows, n, k);                                                           \
    }                                                                                                \
    /* The team's one-row linear (the batch-1 decode step): each thread quantizes x into its own  \
       scratch (and sums), the same codes in every thread, then takes its share of the outputs. */ \
    static void LINEAR##_team(const BLOCK* w, const float* x, block_x8* scratch, int32_t* sums, float* y, \
                              int64_t n, int64_t k, const float* bias) {                            \
        quantize_x8_serial(x, 1, k, scratch);                                                        \
        if (NEEDS_SUMS) x8_sums_into(scratch, k / QK, sums);                                         \
        NAME##_team(w, scratch, NEEDS_SUMS ? sums : NULL, y, 1, n, k, bias);                         \
    }                                                                                                \
    /* One row by one thread, outside any worksharing (so callable inside another `omp for`, as    \
       DeepSeek's per-head absorption is): the one-row kernels NAME##_team runs, so the same bits. */ \
    static void LINEAR##_serial(const BLOCK* w, const float* x, block_x8* scratch, int32_t* sums, float* y, \
                                int64_t n, int64_t k) {                                              \
        const int64_t nb = k / QK, groups = x8_groups(n);                                            \
        quantize_x8_serial(x, 1, k, scratch);                                                        \
        if (NEEDS_SUMS) x8_sums_into(scratch, nb, sums);                                             \
        for (int64_t h = 0; h < groups; h++) {                                                       \
            const int out_count = (int)(n - h * XROWS < XROWS ? n - h * XROWS : XROWS);              \
            ROWS_FN(w + h * (GROUP_BLOCKS), scratch, NEEDS_SUMS ? sums : NULL, nb, y + h * XROWS, n, 1, nb, out_count); \
        }                                                                                            \
    }

#ifdef __AVX2__
#define Q5_SUMS 1
#else
#define Q5_SUMS 0
#endif
#include "interleaved_pairs.c"
#include "amx_tiles.c"

GEMM_X8_GROUPED(kvgen_gemm_q4x8, kvgen_linear_q4x8, block_q4x8, q4x8_rows, q4x8_amx_rows, 0, nb, Q4_TILE_ROWS,
                CALL_ROWS(Q4_PAIR_ROWS))
GEMM_X8_GROUPED(kvgen_gemm_q4hx8, kvgen_linear_q4hx8, block_q4hx8, q4hx8_rows, q4hx8_amx_rows, 0, nb, Q4_TILE_ROWS,
                CALL_ROWS(Q4_PAIR_ROWS))
GEMM_X8_GROUPED(kvgen_gemm_q8x8, kvgen_linear_q8x8, block_q8x8, q8x8_rows, q8x8_amx_rows, 0, nb, TILE_ROWS,
                CALL_ROWS(PAIR_ROWS))
GEMM_X8_GROUPED(kvgen_gemm_q8sx8, kvgen_linear_q8sx8, block_q8sx8, q8sx8_rows, q8sx8_amx_rows, 0, nb, TILE_ROWS,
                CALL_ROWS(PAIR_ROWS))
GEMM_X8_GROUPED(kvgen_gemm_q5x8, kvgen_linear_q5x8, block_q5x8, q5x8_rows, q5x8_amx_rows, Q5_SUMS, nb, TILE_ROWS,
                CALL_ROWS(PAIR_ROWS))
GEMM_X8_GROUPED(kvgen_gemm_iq4x8, kvgen_linear_iq4x8, block_iq4x8, iq4x8_rows, iq4x8_stepped_rows, IQ4_SUMS, nb,
                TILE_ROWS, CALL_ROWS(PAIR_ROWS))
GEMM_X8_GROUPED(kvgen_gemm_mx4x8, kvgen_linear_mx4x8, block_mx4x8, mx4x8_rows, mx4x8_stepped_rows, IQ4_SUMS, nb,
                TILE_ROWS, CALL_ROWS(PAIR_ROWS))
GEMM_X8_GROUPED(kvgen_gemm_q5mx8, kvgen_linear_q5mx8, block_q5mx8, q5mx8_rows, q5mx8_stepped_rows, 0, nb, TILE_ROWS,
                CALL_ROWS(PAIR_ROWS))

#include "k_quants.c"

#define DEQUANTIZE_X8(NAME, BLOCK, WEIGHT, OUT_T, CONVERT)                                           \
    void NAME(const BLOCK* w, OUT_T* out, int64_t n, int64_t k) {                                    \
        const int64_t nb = k / QK;                                                                   \
        _Pragma("omp parallel for schedule(static)")                                                 \
        for (int64_t row = 0; row < n; row++) {                                                      \
            const BLOCK* wg = w + (row / XROWS) * nb;                                                \
            const int r = (int)(row % XROWS);                                                        \
            for (int64_t b = 0; b < nb; b++) {                                                       \
                OUT_T* o = out + row * k + b * QK;                                                   \
                for (int j = 0; j < QK; j++) o[j] = CONVERT(WEIGHT(wg + b, r, j));                  \
            }                                                                                        \
        }                                                                                            \
    }
