// 4-bit K/V codes scored and summed as integers (quantized_attention.c's decode attention), as
// group_tiles.c does for int8 codes; the tiles are never decoded to floats.
//
// Keys (KIVI, codecs.py KiviKeyCodec): k[i][j] = c[i][j] x step[j] + low[j], fp16 step/low per
// channel per block, so q . k[i] = sum_j (q[j] step[j]) c[i][j] + sum_j q[j] low[j]. Per block and
// query head, q x step is rounded to int16 codes (its max / 32512, as the int8 path rounds q once
// per step), dotted exactly with the 4-bit codes (int32), and the block's q . low (a fp32 dot)
// added: score = dot x factor + offset. A score depends only on the query and its block, never on
// where a tile or a work item starts.
// Values (per position, 32 channels a group): v[i][j] = c[i][j] x step[i][g] + low[i][g], so
// sum_i w[i] v[i][j] = sum_i (w[i] step[i][g]) c[i][j] + sum_i w[i] low[i][g]: per head and group
// the weights times the steps are rounded to 15 bits of the tile's largest (as int8 values' are with
// their scales), summed exactly with the codes, and the low term added once per group and tile.
//
// Within every 8 channels the query's codes are kept in the order 0,2,4,6,1,3,5,7: a dword of
// packed codes (8 channels, low nibble first) splits by a mask and a shift into exactly those two
// halves, so key codes are never reordered. Float sums run in one order in every build (dot(),
// 8 lanes reduced as hsum8), integer sums are exact, so AVX-512, AVX2 and scalar give the same bits.
//
// This file is #included by quantized_attention.c (after group_tiles.c).

#define INT4_GROUPS_MAX (512 / TOKEN_GROUP)  // value channel groups of the widest head (d <= 512)

// The channel at position p of the query-code order (within 8: 0,2,4,6,1,3,5,7), and back.
static inline int64_t int4_channel(int64_t p) {
    const int64_t r = p & 7;
    return (p & ~(int64_t)7) + (r < 4 ? 2 * r : 2 * (r - 4) + 1);
}
static inline int64_t int4_position(int64_t c) {
    const int64_t r = c & 7;
    return (c & ~(int64_t)7) + (r & 1 ? 4 + r / 2 : r / 2);
}

// q [d] in the code order (once per step and head).
static void int4_order_query(const float* q, int64_t d, float* out) {
    for (int64_t p = 0; p < d; p++) out[p] = q[int4_channel(p)];
}

// A block's fp16 per-channel steps or lows, as fp32 in the code order.
static void int4_order_halves(const uint16_t* h, int64_t d, float* out) {
    int64_t p = 0;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    static const int16_t INT4_ORDER[32] = {0,  2,  4,  6,  1,  3,  5,  7,  8,  10, 12, 14, 9,  11, 13, 15,
                                           16, 18, 20, 22, 17, 19, 21, 23, 24, 26, 28, 30, 25, 27, 29, 31};
    const __m512i order32 = _mm512_loadu_si512((const void*)INT4_ORDER);
    for (; p + 32 <= d; p += 32) {
        const __m512i x = _mm512_permutexvar_epi16(order32, _mm512_loadu_si512((const void*)(h + p)));
        _mm512_storeu_ps(out + p, _mm512_cvtph_ps(_mm512_castsi512_si256(x)));
        _mm512_storeu_ps(out + p + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(x, 1)));
    }
#endif
#if defined(__AVX2__) && defined(__F16C__)
    const __m128i order = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    for (; p + 8 <= d; p += 8)
        _mm256_storeu_ps(out + p, _mm256_cvtph_ps(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i*)(h + p)), order)));
#endif
    for (; p < d; p++) out[p] = half_to_float(h[int4_channel(p)]);
}

// One query head's view of one block of 4-bit keys: q x step as int16 codes (code order), and
// score = dot(codes, key codes) x factor + offset.
static inline void int4_block_query(const float* q, const float* step, const float* low, int64_t d, float scale,
                             int16_t* codes, float* factor, float* offset) {
    float scaled[512], amax = 0.0f;
    int64_t p = 0;
#ifdef __AVX2__
    __m256 top = _mm256_setzero_ps();
    for (; p + 8 <= d; p += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(q + p), _mm256_loadu_ps(step + p));
        _mm256_storeu_ps(scaled + p, x);
        top = _mm256_max_ps(top, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
#endif
    for (; p < d; p++) {
        scaled[p] = q[p] * step[p];
        amax = fabsf(scaled[p]) > amax ? fabsf(scaled[p]) : amax;
    }
    const float inverse = amax > 0.0f ? (float)Q16_MAX / amax : 0.0f;
    p = 0;
#ifdef __AVX2__
    for (; p + 8 <= d; p += 8) {  // cvtps rounds to nearest even as lrintf does
        __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(scaled + p), _mm256_set1_ps(inverse)));
        c = _mm256_max_epi32(_mm256_min_epi32(c, _mm256_set1_epi32(Q16_MAX)), _mm256_set1_epi32(-Q16_MAX));
        _mm_storeu_si128((__m128i*)(codes + p), _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)));
    }
#endif
    for (; p < d; p++) {
        const long c = lrintf(scaled[p] * inverse);
        codes[p] = (int16_t)(c > Q16_MAX ? Q16_MAX : c < -Q16_MAX ? -Q16_MAX : c);
    }
    *factor = amax / (float)Q16_MAX * scale;
    *offset = dot(q, low, d) * scale;
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// int4_block_query in 16 lanes, its codes written as planes [2, padded d]: high and low signed
// bytes (code = 256 x high + low), zero past d. The same values (every step is per element, the
// maximum exact, the offset the same dot()).
static void int4_block_planes(const float* q, const float* step, const float* low, int64_t d, int64_t padded,
                              float scale, int8_t* planes, float* factor, float* offset) {
    __m512 scaled[512 / 16], top = _mm512_setzero_ps();
    for (int64_t p = 0; p < d; p += 16) {
        scaled[p / 16] = _mm512_mul_ps(_mm512_loadu_ps(q + p), _mm512_loadu_ps(step + p));
        top = _mm512_max_ps(top, _mm512_abs_ps(scaled[p / 16]));
    }
    const float amax = _mm512_reduce_max_ps(top);
    const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? (float)Q16_MAX / amax : 0.0f);
    for (int64_t p = 0; p < d; p += 16) {
        // |scaled x inverse| <= Q16_MAX (1 + 2^-22): it rounds to at most Q16_MAX, as the clamp of
        // int4_block_query would leave it.
        const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(scaled[p / 16], inverse));
        const __m512i high = _mm512_srai_epi32(_mm512_add_epi32(c, _mm512_set1_epi32(128)), 8);
        _mm_storeu_si128((__m128i*)(planes + p), _mm512_cvtepi32_epi8(high));
        _mm_storeu_si128((__m128i*)(planes + padded + p), _mm512_cvtepi32_epi8(_mm512_sub_epi32(c, _mm512_slli_epi32(high, 8))));
    }
    for (int64_t p = d; p < padded; p++) planes[p] = planes[padded + p] = 0;
    *factor = amax / (float)Q16_MAX * scale;
    *offset = dot(q, low, d) * scale;
}

// The permutations of int4_transpose (16 keys x 8 dwords -> 8 vectors of one dword of 16 keys).
typedef struct {
    __m512i first[2], second[2], third[2];
} int4_transpose_index;

// Stage 1: two vectors of 2 keys x 8 dwords -> 4 keys x 4 dwords (half: dwords 0-3 or 4-7), lane =
// dword x 4 + key: (k1 < 2 ? 0 : 16) + (k1 % 2) x 8 + w1 + 4 half for lane (w1, k1). Stage 2: ->
// 8 keys x 2 dwords, lane = dword x 8 + key: (k2 < 4 ? 0 : 16) + (w2 + 2 half) x 4 + k2 % 4.
// Stage 3: -> 16 keys x 1 dword, lane = key: (k < 8 ? 0 : 16) + 8 half + k % 8.
static const int32_t INT4_STAGES[3][2][16] = {
    {{0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27}, {4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31}},
    {{0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23}, {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31}},
    {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}, {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}},
};

static int4_transpose_index int4_transpose_indices(void) {
    const int32_t(*s1)[16] = INT4_STAGES[0], (*s2)[16] = INT4_STAGES[1], (*s3)[16] = INT4_STAGES[2];
    int4_transpose_index t;
    for (int half = 0; half < 2; half++) {
        t.first[half] = _mm512_loadu_si512(s1[half]);
        t.second[half] = _mm512_loadu_si512(s2[half]);
        t.third[half] = _mm512_loadu_si512(s3[half]);
    }
    return t;
}

// z[m]: keys 2m (lanes 0-7) and 2m+1 (lanes 8-15), 8 dwords each -> out[w]: dword w of keys 0..15.
static inline void int4_transpose(const int4_transpose_index* t, const __m512i z[8], __m512i out[8]) {
    __m512i a[2][4], b[2][2][2];
    for (int p = 0; p < 4; p++)
        for (int half = 0; half < 2; half++) a[half][p] = _mm512_permutex2var_epi32(z[2 * p], t->first[half], z[2 * p + 1]);
    for (int r = 0; r < 2; r++)  // dwords 4r..4r+3
        for (int q = 0; q < 2; q++)
            for (int half = 0; half < 2; half++)
                b[r][half][q] = _mm512_permutex2var_epi32(a[r][2 * q], t->second[half], a[r][2 * q + 1]);
    for (int r = 0; r < 2; r++)
        for (int half = 0; half < 2; half++)  // dwords 4r + 2 half ..
            for (int e = 0; e < 2; e++)
                out[4 * r + 2 * half + e] = _mm512_permutex2var_epi32(b[r][half][0], t->third[e], b[r][half][1]);
}

// dots[h][i] (rows MAX_TILE apart) for G query heads over n <= MAX_TILE keys of d 4-bit codes
// (rows d / 2 bytes apart), 16 keys at a time: 64 channels of 16 keys (8 dwords each) transposed so
// that each vector holds one dword of every key, split into its low and high nibbles, and one
// vpdpbusd of a broadcast query dword (code order) advances 16 dots. Keys are unsigned already.
static inline __attribute__((always_inline)) void int4_key_dots_vnni(const int G, const int8_t* planes, int64_t padded,
                                                                     const int4_transpose_index* t, const uint8_t* keys,
                                                                     int64_t n, int64_t d, int32_t* dots) {
    const int64_t row = d / 2;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t i = 0; i < n; i += 16) {
        __m512i high[GROUP_BLOCK], low[GROUP_BLOCK];
        for (int h = 0; h < G; h++) high[h] = _mm512_setzero_si512(), low[h] = _mm512_setzero_si512();
        for (int64_t c = 0; c < d; c += 64) {
            const int words = d - c >= 64 ? 8 : (int)((d - c) / 8);
            __m512i z[8], w[8];
            for (int m = 0; m < 8; m++) {  // past n: the last key again (its dots are not used)
                const int64_t k0 = i + 2 * m < n ? i + 2 * m : n - 1, k1 = i + 2 * m + 1 < n ? i + 2 * m + 1 : n - 1;
                const uint8_t* r0 = keys + k0 * row + c / 2;
                if (row == 32 && k1 == k0 + 1) {
                    z[m] = _mm512_loadu_si512((const void*)r0);
                } else if (words == 8) {
                    z[m] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)r0)),
                                              _mm256_loadu_si256((const __m256i*)(keys + k1 * row + c / 2)), 1);
                } else {  // 32 channels: 16 bytes of each key
                    z[m] = _mm512_inserti64x4(_mm512_zextsi256_si512(_mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)r0))),
                                              _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)(keys + k1 * row + c / 2))), 1);
                }
            }
            int4_transpose(t, z, w);
            for (int v = 0; v < words; v++) {
                const __m512i even = _mm512_and_si512(w[v], nibble);                          // channels 0,2,4,6
                const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(w[v], 4), nibble);      // channels 1,3,5,7
                for (int h = 0; h < G; h++) {
                    const int8_t* q = planes + 2 * h * padded + c + 8 * v;
                    int32_t he, ho, le, lo;
                    memcpy(&he, q, 4), memcpy(&ho, q + 4, 4), memcpy(&le, q + padded, 4), memcpy(&lo, q + padded + 4, 4);
                    high[h] = _mm512_dpbusd_epi32(high[h], even, _mm512_set1_epi32(he));
                    low[h] = _mm512_dpbusd_epi32(low[h], even, _mm512_set1_epi32(le));
                    high[h] = _mm512_dpbusd_epi32(high[h], odd, _mm512_set1_epi32(ho));
                    low[h] = _mm512_dpbusd_epi32(low[h], odd, _mm512_set1_epi32(lo));
                }
            }
        }
        for (int h = 0; h < G; h++)
            _mm512_storeu_si512((void*)(dots + h * MAX_TILE + i), _mm512_add_epi32(_mm512_slli_epi32(high[h], 8), low[h]));
    }
}
#else
#ifdef __AVX2__
// 8 vectors of 8 int32 -> one vector of their 8 sums, in order.
static inline __m256i sum8_epi32(const __m256i a[8]) {
    __m256i t[4], u[2];
    for (int k = 0; k < 4; k++)
        t[k] = _mm256_add_epi32(_mm256_unpacklo_epi32(a[2 * k], a[2 * k + 1]), _mm256_unpackhi_epi32(a[2 * k], a[2 * k + 1]));
    for (int k = 0; k < 2; k++)
        u[k] = _mm256_add_epi32(_mm256_unpacklo_epi64(t[2 * k], t[2 * k + 1]), _mm256_unpackhi_epi64(t[2 * k], t[2 * k + 1]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(u[0], u[1], 0x20), _mm256_permute2x128_si256(u[0], u[1], 0x31));
}
#endif

// dots[i] = sum_j q[j] * keys[i][j] exactly (int32) for n <= MAX_TILE keys of d 4-bit codes, q the
// int16 codes in code order.
static void int4_key_dots(const int16_t* q, const uint8_t* keys, int64_t n, int64_t d, int32_t* dots) {
    const int64_t row = d / 2;
    int64_t i = 0;
#if defined(__AVX2__)
    const __m128i nibble = _mm_set1_epi8(0x0F);
    for (; i < n; i += 8) {
        __m256i acc[8];
        const uint8_t* rows[8];
        for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_si256(), rows[k] = keys + (i + k < n ? i + k : n - 1) * row;
        for (int64_t c = 0; c < d; c += 32) {  // 16 bytes of codes: the code order's positions c..c+31
            const __m256i qa = _mm256_loadu_si256((const __m256i*)(q + c)), qb = _mm256_loadu_si256((const __m256i*)(q + c + 16));
            for (int k = 0; k < 8; k++) {
                const __m128i x = _mm_loadu_si128((const __m128i*)(rows[k] + c / 2));
                const __m128i even = _mm_and_si128(x, nibble), odd = _mm_and_si128(_mm_srli_epi16(x, 4), nibble);
                const __m256i a = _mm256_cvtepu8_epi16(_mm_unpacklo_epi32(even, odd));
                const __m256i b = _mm256_cvtepu8_epi16(_mm_unpackhi_epi32(even, odd));
                acc[k] = _mm256_add_epi32(acc[k], _mm256_add_epi32(_mm256_madd_epi16(a, qa), _mm256_madd_epi16(b, qb)));
            }
        }
        _mm256_storeu_si256((__m256i*)(dots + i), sum8_epi32(acc));
    }
#endif
    for (; i < n; i++) {
        int32_t sum = 0;
        for (int64_t m = 0; m < row; m++) {
            const uint8_t b = keys[i * row + m];
            sum += (int32_t)q[int4_position(2 * m)] * (b & 0x0F) + (int32_t)q[int4_position(2 * m + 1)] * (b >> 4);
        }
        dots[i] = sum;
    }
}
#endif

// Bytes of one block's prepared query group (int4_prepare_block): per head its codes (byte
// planes [2, padded d] with VNNI, else int16 [d]), then factor [group] and offset [group].
static inline int64_t int4_prepared_bytes(int64_t group, int64_t d) {
    return group * (2 * padded_dim(d) + 2 * (int64_t)sizeof(float));
}

// The group's query codes, factors and offsets for block `block` of kv head `head` (into
// `prepared`, int4_prepared_bytes). Done for all blocks of a work item before its tiles, so the
// blocks' independent chains (max, division, rounding) overlap instead of stalling each tile.
static void int4_prepare_block(const float* q4, int64_t group, const packed_codes* kc, int64_t head, int64_t block,
                               int64_t d, float scale, uint8_t* prepared) {
    const int64_t scales = head * kc->step_head_stride + block * kc->step_block_stride, row = 2 * padded_dim(d);
    float step[512], low[512];
    float* factor = (float*)(prepared + group * row);
    int4_order_halves(kc->step + scales, d, step);
    int4_order_halves(kc->low + scales, d, low);
    for (int64_t h = 0; h < group; h++)
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
        int4_block_planes(q4 + h * d, step, low, d, padded_dim(d), scale, (int8_t*)(prepared + h * row), factor + h,
                          factor + group + h);
#else
        int4_block_query(q4 + h * d, step, low, d, scale, (int16_t*)(prepared + h * row), factor + h, factor + group + h);
#endif
}

// scores[h][i] (rows MAX_TILE apart) of the group's heads over positions offset..offset+n-1 of one
// block of 4-bit keys (kv head `head`), its query group prepared by int4_prepare_block.
static void int4_key_scores(const uint8_t* prepared, int64_t group, const packed_codes* kc, int64_t head,
                            int64_t block, int64_t offset, int64_t n, int64_t d, float* scores) {
    const uint8_t* keys = kc->codes + head * kc->code_head_stride + block * kc->code_block_stride + offset * (d / 2);
    const int64_t padded = padded_dim(d), row = 2 * padded;
    const float* factor = (const float*)(prepared + group * row);
    const float* offsets = factor + group;
    int32_t dots[GROUP_BLOCK * MAX_TILE];
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    const int4_transpose_index t = int4_transpose_indices();
#endif
    for (int64_t g0 = 0; g0 < group; g0 += GROUP_BLOCK) {
        const int64_t G = group - g0 < GROUP_BLOCK ? group - g0 : GROUP_BLOCK;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
        const int8_t* planes = (const int8_t*)(prepared + g0 * row);
        switch (G) {
            case 1: int4_key_dots_vnni(1, planes, padded, &t, keys, n, d, dots); break;
            case 2: int4_key_dots_vnni(2, planes, padded, &t, keys, n, d, dots); break;
            case 3: int4_key_dots_vnni(3, planes, padded, &t, keys, n, d, dots); break;
            default: int4_key_dots_vnni(4, planes, padded, &t, keys, n, d, dots); break;
        }
#else
        for (int64_t h = 0; h < G; h++)
            int4_key_dots((const int16_t*)(prepared + (g0 + h) * row), keys, n, d, dots + h * MAX_TILE);
#endif
        for (int64_t h = 0; h < G; h++) {
            float* s = scores + (g0 + h) * MAX_TILE;
            const int32_t* dot = dots + h * MAX_TILE;
            const float f = factor[g0 + h], o = offsets[g0 + h];
            int64_t i = 0;
#ifdef __AVX2__
            for (; i + 8 <= n; i += 8)
                _mm256_storeu_ps(s + i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)(dot + i))),
                                                        _mm256_set1_ps(f), _mm256_set1_ps(o)));
#endif
            for (; i < n; i++) s[i] = fmaf((float)dot[i], f, o);
        }
    }
}

// A head's weights over a tile times one value group's steps, as 15-bit integers of the largest:
// w15[i] = round(w[i] x step[i] / unit), 0 from n up to the next even count. Returns unit.
static float int4_weights(const float* w, const float* step, int64_t n, int16_t* w15) {
    float scaled[MAX_TILE], largest = 0.0f;
    int64_t i = 0;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    if (n == 32) {  // a whole block in two vectors (the same products, maximum and rounding)
        const __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(w), _mm512_loadu_ps(step));
        const __m512 x1 = _mm512_mul_ps(_mm512_loadu_ps(w + 16), _mm512_loadu_ps(step + 16));
        largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x0, x1), _mm512_setzero_ps()));
        const __m512 inverse = _mm512_set1_ps(largest > 0.0f ? (float)W15_MAX / largest : 0.0f);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inverse)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inverse));
        _mm256_storeu_si256((__m256i*)w15, _mm512_cvtsepi32_epi16(q0));  // saturates at W15_MAX as packs does
        _mm256_storeu_si256((__m256i*)(w15 + 16), _mm512_cvtsepi32_epi16(q1));
        return largest / (float)W15_MAX;
    }
#endif
#ifdef __AVX2__
    __m256 top = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(step + i));
        _mm256_storeu_ps(scaled + i, x);
        top = _mm256_max_ps(top, x);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    for (int l = 0; l < 8; l++) largest = lanes[l] > largest ? lanes[l] : largest;
#endif
    for (; i < n; i++) {
        scaled[i] = w[i] * step[i];
        largest = scaled[i] > largest ? scaled[i] : largest;
    }
    return weights_to_w15(scaled, n, largest, w15);
}

// sum_i w[i] x low[i] over a tile padded to 8 (both zero past n) in 8 lanes, reduced as hsum8.
static float int4_low_sum(const float* w, const float* low, int64_t n) {
    const int64_t padded = (n + 7) / 8 * 8;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < padded; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(low + i), acc);
    return hsum8(acc);
#else
    float lanes[8] = {0.0f};
    for (int64_t i = 0; i < padded; i++) lanes[i % 8] = fmaf(w[i], low[i], lanes[i % 8]);
    return sum_lanes(lanes);
#endif
}

// out[h][j] += unit[h][g] x sum_i w15[h][g][i] * codes[i][j] + base[h][g] for G <= GROUP_BLOCK heads
// over n rows of 4-bit value codes (d / 2 bytes each), g = j / 32. The integer sums are exact: two
// rows' codes of a byte go into the halves of a dword (even channels by a mask, odd by a shift)
// and meet a pair of weights in vpdpwssd / pmaddwd; the sums are put back in channel order.
#define INT4_W_ROW (MAX_TILE + 2)
static inline __attribute__((always_inline)) void int4_value_rows(const int G, const int16_t* w15, const float* unit,
                                                                  const float* base, const uint8_t* codes, int64_t n,
                                                                  int64_t d, float* out, int64_t out_stride) {
    const int64_t row = d / 2, groups = d / TOKEN_GROUP;
    int64_t j = 0;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512i nibbles = _mm512_set1_epi32(0x000F000F);  // the high nibble of each row's byte, shifted down
    for (; j + 32 <= d; j += 32) {  // one channel group: 16 bytes a row
        const int64_t g = j / TOKEN_GROUP;
        __m512i even[GROUP_BLOCK], odd[GROUP_BLOCK];
        for (int h = 0; h < G; h++) even[h] = _mm512_setzero_si512(), odd[h] = _mm512_setzero_si512();
        for (int64_t i = 0; i < n; i += 2) {
            const uint8_t* next = codes + (i + 1 < n ? i + 1 : i) * row + j / 2;  // an odd count's last pair: weight 0
            const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(codes + i * row + j / 2)));
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)next));
            // dword m: byte m of row i | of row i+1 << 16 (the whole bytes: low + 16 x high nibble)
            const __m512i x = _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
            const __m512i o = _mm512_and_si512(_mm512_srli_epi32(x, 4), nibbles);
            for (int h = 0; h < G; h++) {
                int32_t pair;
                memcpy(&pair, w15 + (h * INT4_GROUPS_MAX + g) * INT4_W_ROW + i, sizeof pair);
                even[h] = _mm512_dpwssd_epi32(even[h], x, _mm512_set1_epi32(pair));
                odd[h] = _mm512_dpwssd_epi32(odd[h], o, _mm512_set1_epi32(pair));
            }
        }
        for (int h = 0; h < G; h++) {  // lanes m: channels 2m (even), 2m + 1 (odd)
            even[h] = _mm512_sub_epi32(even[h], _mm512_slli_epi32(odd[h], 4));  // the low nibbles' sums
            float* o = out + h * out_stride + j;
            const __m512 u = _mm512_set1_ps(unit[h * INT4_GROUPS_MAX + g]), c = _mm512_set1_ps(base[h * INT4_GROUPS_MAX + g]);
            const __m512i lo = _mm512_unpacklo_epi32(even[h], odd[h]), hi = _mm512_unpackhi_epi32(even[h], odd[h]);
            const __m512 x0 = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo, first, hi));
            const __m512 x1 = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo, second, hi));
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_fmadd_ps(x0, u, c)));
            _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_loadu_ps(o + 16), _mm512_fmadd_ps(x1, u, c)));
        }
    }
#elif defined(__AVX2__)
    const __m256i nibbles = _mm256_set1_epi32(0x000F000F);
    for (; j + 16 <= d; j += 16) {  // half a channel group: 8 bytes a row
        const int64_t g = j / TOKEN_GROUP;
        __m256i even[GROUP_BLOCK], odd[GROUP_BLOCK];
        for (int h = 0; h < G; h++) even[h] = _mm256_setzero_si256(), odd[h] = _mm256_setzero_si256();
        for (int64_t i = 0; i < n; i += 2) {
            const uint8_t* next = codes + (i + 1 < n ? i + 1 : i) * row + j / 2;
            const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(codes + i * row + j / 2)));
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)next));
            const __m256i x = _mm256_or_si256(a, _mm256_slli_epi32(b, 16));
            const __m256i e = _mm256_and_si256(x, nibbles), o = _mm256_and_si256(_mm256_srli_epi32(x, 4), nibbles);
            for (int h = 0; h < G; h++) {
                int32_t pair;
                memcpy(&pair, w15 + (h * INT4_GROUPS_MAX + g) * INT4_W_ROW + i, sizeof pair);
                const __m256i wp = _mm256_set1_epi32(pair);
                even[h] = _mm256_add_epi32(even[h], _mm256_madd_epi16(e, wp));
                odd[h] = _mm256_add_epi32(odd[h], _mm256_madd_epi16(o, wp));
            }
        }
        for (int h = 0; h < G; h++) {
            float* o = out + h * out_stride + j;
            const __m256 u = _mm256_set1_ps(unit[h * INT4_GROUPS_MAX + g]), c = _mm256_set1_ps(base[h * INT4_GROUPS_MAX + g]);
            const __m256i lo = _mm256_unpacklo_epi32(even[h], odd[h]), hi = _mm256_unpackhi_epi32(even[h], odd[h]);
            const __m256 x0 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo, hi, 0x20));
            const __m256 x1 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo, hi, 0x31));
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), _mm256_fmadd_ps(x0, u, c)));
            _mm256_storeu_ps(o + 8, _mm256_add_ps(_mm256_loadu_ps(o + 8), _mm256_fmadd_ps(x1, u, c)));
        }
    }
#endif
    (void)groups;
    for (; j < d; j++)
        for (int h = 0; h < G; h++) {
            const int64_t g = j / TOKEN_GROUP;
            int32_t sum = 0;
            for (int64_t i = 0; i < n; i++) {
                const uint8_t b = codes[i * row + j / 2];
                sum += (int32_t)w15[(h * INT4_GROUPS_MAX + g) * INT4_W_ROW + i] * (j % 2 ? b >> 4 : b & 0x0F);
            }
            float* o = out + h * out_stride + j;
            *o = *o + fmaf((float)sum, unit[h * INT4_GROUPS_MAX + g], base[h * INT4_GROUPS_MAX + g]);
        }
}

// A tile's fp16 value steps or lows [n, groups] -> fp32 per group out[g][i] (exact either way).
static void int4_group_halves(const uint16_t* h, int64_t n, int64_t groups, float out[][MAX_TILE]) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
    if (groups == 2)  // head size 64: 8 positions of both groups, split even / odd
        for (; i + 8 <= n; i += 8) {
            const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + 2 * i)));      // positions i..i+3
            const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + 2 * i + 8)));  // i+4..i+7
            const __m256d first = _mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), second = _mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD));
            _mm256_storeu_ps(out[0] + i, _mm256_castpd_ps(_mm256_permute4x64_pd(first, 0xD8)));
            _mm256_storeu_ps(out[1] + i, _mm256_castpd_ps(_mm256_permute4x64_pd(second, 0xD8)));
        }
#endif
    for (; i < n; i++)
        for (int64_t g = 0; g < groups; g++) out[g][i] = half_to_float(h[i * groups + g]);
}

// The group's value sums over positions offset..offset+n-1 of one block of 4-bit values (kv head
// `head`), w [group, MAX_TILE] the softmax weights (0 from n up to a multiple of 8).
static void int4_value_sums(const float* w, const packed_codes* vc, int64_t head, int64_t block, int64_t offset,
                            int64_t n, int64_t d, int64_t group, float* out, int64_t out_stride) {
    const int64_t groups = d / TOKEN_GROUP;
    const uint8_t* codes = vc->codes + head * vc->code_head_stride + block * vc->code_block_stride + offset * (d / 2);
    const int64_t scales = head * vc->step_head_stride + block * vc->step_block_stride + offset * groups;
    float step[INT4_GROUPS_MAX][MAX_TILE], low[INT4_GROUPS_MAX][MAX_TILE];  // per group, over the tile
    int4_group_halves(vc->step + scales, n, groups, step);
    int4_group_halves(vc->low + scales, n, groups, low);
    for (int64_t g = 0; g < groups; g++)
        for (int64_t i = n; i < (n + 7) / 8 * 8; i++) low[g][i] = 0.0f;
    int16_t w15[GROUP_BLOCK * INT4_GROUPS_MAX * INT4_W_ROW];
    float unit[GROUP_BLOCK * INT4_GROUPS_MAX], base[GROUP_BLOCK * INT4_GROUPS_MAX];
    for (int64_t g0 = 0; g0 < group; g0 += GROUP_BLOCK) {
        const int G = (int)(group - g0 < GROUP_BLOCK ? group - g0 : GROUP_BLOCK);
        for (int h = 0; h < G; h++)
            for (int64_t g = 0; g < groups; g++) {
                const float* wh = w + (g0 + h) * MAX_TILE;
                unit[h * INT4_GROUPS_MAX + g] = int4_weights(wh, step[g], n, w15 + (h * INT4_GROUPS_MAX + g) * INT4_W_ROW);
                base[h * INT4_GROUPS_MAX + g] = int4_low_sum(wh, low[g], n);
            }
        float* o = out + g0 * out_stride;
        switch (G) {
            case 1: int4_value_rows(1, w15, unit, base, codes, n, d, o, out_stride); break;
            case 2: int4_value_rows(2, w15, unit, base, codes, n, d, o, out_stride); break;
            case 3: int4_value_rows(3, w15, unit, base, codes, n, d, o, out_stride); break;
            default: int4_value_rows(4, w15, unit, base, codes, n, d, o, out_stride); break;
        }
    }
}
