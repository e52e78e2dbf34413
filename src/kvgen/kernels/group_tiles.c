// One kv head's query group over a tile of positions (quantized_attention.c's decode attention):
// scores, one online-softmax update per query head, and the weighted sum of the values.
//
// int8 keys are scored with integer dot products against the query, quantized once per step to
// int16 codes (vpdpbusd over its byte planes on AVX-512 VNNI, pmaddwd on AVX2), reading the keys
// in their stored groups of 16 (quantized_attention.c key_byte): the int32 sums are exact, and the
// per-position fp16 scale multiplies the dot, so no key is ever decoded to floats. int8 values
// are summed as codes times (softmax weight x position scale), all heads of the group per row.
// Every other tile comes as fp32 rows (sink, tail, or a block decoded by decode_tile).
//
// Every float sum runs in one fixed order, the same with AVX-512, AVX2 or none: value sums one
// position after another with one fma each, softmax sums in 8 lanes reduced as hsum8 does, exp by
// one polynomial in vector and scalar form, key dots over fp32 rows in 4 x 8 lanes. A result thus
// does not depend on the machine's vector width (tests/unit/test_quantized_kv_attention.py builds
// the kernel for each and compares bits).
//
// This file is #included by quantized_attention.c.

// int8 key groups and value rows are asked for this far ahead of the ones being multiplied. On a
// 2-core Intel Xeon (AVX-512 + AMX, KVM) the hardware prefetchers alone left one step's int8
// attention over 8,192 SmolLM2 positions at 6.9-7.1 ms (14 GB/s); asked 1-3 KiB ahead, 4.7-5.0 ms
// (benchmarks/attention_bandwidth.py, separate processes in turns), and 8,192-position decode
// 81-84 -> 90-97 tok/s. (Farther, 4-16 KiB: 5.5-6.5 ms.) build.py sets 0 (none) on AMD CPUs, where
// the hardware prefetchers follow these streams.
#ifndef CODES_PREFETCH_BYTES
#define CODES_PREFETCH_BYTES 2048
#endif

#define Q16_MAX 32512  // int16 query codes: |code| <= 127 * 256, so 512 channels x 127 x Q16_MAX fits int32
#define GROUP_BLOCK 4  // query heads sharing each key and value row read (accumulators in registers)
#define W15_MAX 32767  // int8 values' weights as 15-bit integers (int16 pairs for vpdpwssd / pmaddwd)

// A kv head's query group, quantized for integer key scores.
typedef struct {
    const float* q;   // [group, d] fp32 (fp32 key rows)
    int16_t* codes;   // [group, d] int16 codes of q
    float* factor;    // [group] q's step x the softmax scale: score = dot(codes, key codes) x factor x key scale
    int8_t* planes;   // [group, 2, padded d] the codes as 256 x high + low bytes, zero past d (vpdpbusd)
    int32_t* bias;    // [group] 128 x sum of the codes (vpdpbusd reads keys as unsigned: code + 128)
    const float* q4;  // [group, d] q in 4-bit keys' code order (int4_tiles.c), when the keys are 4-bit
} group_query;

// d rounded up to whole 64-byte rows of key codes.
static inline int64_t padded_dim(int64_t d) { return (d + 63) / 64 * 64; }

// q [d] -> int16 codes and factor (the step, times `scale`); a zero query gets zero codes.
static void quantize_query(const float* q, int64_t d, float scale, int16_t* codes, float* factor) {
    float amax = 0.0f;
    for (int64_t j = 0; j < d; j++) amax = fmaxf(amax, fabsf(q[j]));
    const float inverse = amax > 0.0f ? (float)Q16_MAX / amax : 0.0f;
    for (int64_t j = 0; j < d; j++) {
        long code = lrintf(q[j] * inverse);
        codes[j] = (int16_t)(code > Q16_MAX ? Q16_MAX : code < -Q16_MAX ? -Q16_MAX : code);
    }
    *factor = amax / (float)Q16_MAX * scale;
}

// codes [d] -> planes [2, padded d] (high and low signed bytes: code = 256 x high + low) and bias.
static void query_planes(const int16_t* codes, int64_t d, int8_t* planes, int32_t* bias) {
    const int64_t padded = padded_dim(d);
    int32_t sum = 0;
    memset(planes, 0, (size_t)(2 * padded));
    for (int64_t j = 0; j < d; j++) {
        const int32_t high = ((int32_t)codes[j] + 128) >> 8;  // floor: low = code - 256 x high in [-128, 127]
        planes[j] = (int8_t)high, planes[padded + j] = (int8_t)(codes[j] - 256 * high);
        sum += codes[j];
    }
    *bias = 128 * sum;
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// dots[h][i] (rows MAX_TILE apart) for G query heads over m int8 keys (a multiple of 16) stored in
// groups of 16 (quantized_attention.c key_byte): each 64-byte row is 16 keys' dwords of one channel
// quad, so one vpdpbusd of a broadcast query dword advances all 16 dots. Keys are read as unsigned
// (xor 0x80, `bias` taken off), the query as its two byte planes. Integer and exact: wrap-around
// on the way cancels (the true dot fits int32).
static inline __attribute__((always_inline)) void key_dots_vnni(const int G, const int8_t* planes, const int32_t* bias,
                                                                int64_t padded, const int8_t* keys, int64_t m,
                                                                int64_t d, int32_t* dots) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t i = 0; i < m; i += 16) {
        const int8_t* group = keys + i * d;
        prefetch_span(group, CODES_PREFETCH_BYTES, 16 * d);
        __m512i high[GROUP_BLOCK], low[GROUP_BLOCK];
        for (int h = 0; h < G; h++) high[h] = _mm512_setzero_si512(), low[h] = _mm512_setzero_si512();
        for (int64_t w = 0; w < d / 4; w++) {
            const __m512i r = _mm512_xor_si512(_mm512_loadu_si512((const void*)(group + 64 * w)), flip);
            for (int h = 0; h < G; h++) {
                const int8_t* q = planes + 2 * h * padded + 4 * w;
                int32_t qh, ql;
                memcpy(&qh, q, 4), memcpy(&ql, q + padded, 4);
                high[h] = _mm512_dpbusd_epi32(high[h], r, _mm512_set1_epi32(qh));
                low[h] = _mm512_dpbusd_epi32(low[h], r, _mm512_set1_epi32(ql));
            }
        }
        for (int h = 0; h < G; h++) {
            const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(high[h], 8), low[h]), _mm512_set1_epi32(bias[h]));
            _mm512_storeu_si512((void*)(dots + h * MAX_TILE + i), dot);
        }
    }
}
#endif

#ifdef __AVX2__
// dots[h][i] (rows MAX_TILE apart) for H query heads (int16 codes, rows d apart) over m keys in
// groups of G >= 4, 4 x C keys at a time: each key's quad widened to int16 once and pmaddwd'ed
// with every head's quad, two partial sums per key added at the end.
static inline __attribute__((always_inline)) void int8_key_dots_avx2(const int H, const int C, const int16_t* q,
                                                                     const int8_t* keys, int64_t m, int64_t d,
                                                                     int64_t G, int32_t* dots) {
    for (int64_t i = 0; i < m; i += G)
        for (int64_t k = 0; k < G; k += 4 * C) {
            const int8_t* first = keys + i * d + k * 4;  // key k of the group, channel quad 0
            __m256i acc[GROUP_BLOCK][2];
            for (int h = 0; h < H; h++) acc[h][0] = acc[h][1] = _mm256_setzero_si256();
            for (int64_t w = 0; w < d / 4; w++) {
                __m256i x[2];
                for (int c = 0; c < C; c++) x[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(first + w * G * 4 + 16 * c)));
                for (int h = 0; h < H; h++) {
                    int64_t quad;
                    memcpy(&quad, q + h * d + 4 * w, sizeof quad);
                    const __m256i qw = _mm256_set1_epi64x(quad);
                    for (int c = 0; c < C; c++) acc[h][c] = _mm256_add_epi32(acc[h][c], _mm256_madd_epi16(x[c], qw));
                }
            }
            for (int h = 0; h < H; h++)
                for (int c = 0; c < C; c++) {  // [k0 k0 k1 k1 | k2 k2 k3 k3] -> k0..k3
                    const __m256i sums = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[h][c], acc[h][c]), 0x08);
                    _mm_storeu_si128((__m128i*)(dots + h * MAX_TILE + i + k + 4 * c), _mm256_castsi256_si128(sums));
                }
        }
}
#endif

// dots[h][i] = sum_j q[h][j] * key i's code j exactly (int32; rows MAX_TILE apart) for H <=
// GROUP_BLOCK query heads (int16 codes, rows d apart) over m int8 keys (a multiple of G) stored in
// groups of G (quantized_attention.c key_byte).
static void int8_key_dots(int H, const int16_t* q, const int8_t* keys, int64_t m, int64_t d, int64_t G, int32_t* dots) {
#ifdef __AVX2__
    if (G >= 4) {
        const int C = G >= 8 ? 2 : 1;
        switch (H * 2 + C - 1) {  // heads and chunks known to the compiler: accumulators in registers
            case 2: int8_key_dots_avx2(1, 1, q, keys, m, d, G, dots); return;
            case 3: int8_key_dots_avx2(1, 2, q, keys, m, d, G, dots); return;
            case 4: int8_key_dots_avx2(2, 1, q, keys, m, d, G, dots); return;
            case 5: int8_key_dots_avx2(2, 2, q, keys, m, d, G, dots); return;
            case 6: int8_key_dots_avx2(3, 1, q, keys, m, d, G, dots); return;
            case 7: int8_key_dots_avx2(3, 2, q, keys, m, d, G, dots); return;
            case 8: int8_key_dots_avx2(4, 1, q, keys, m, d, G, dots); return;
            default: int8_key_dots_avx2(4, 2, q, keys, m, d, G, dots); return;
        }
    }
#endif
    for (int h = 0; h < H; h++)
        for (int64_t i = 0; i < m; i += G)
            for (int64_t k = 0; k < G; k++) {
                const int8_t* key = keys + i * d + k * 4;
                int32_t sum = 0;
                for (int64_t w = 0; w < d / 4; w++)
                    for (int e = 0; e < 4; e++) sum += (int32_t)q[h * d + 4 * w + e] * key[w * G * 4 + e];
                dots[h * MAX_TILE + i + k] = sum;
            }
}

// scores[h][i] = dot(q codes of head h, key codes first + i) x factor[h] x scale_i for the group's
// heads (rows MAX_TILE apart) over n int8 keys stored in groups of G from `keys` (a group's start,
// first counted from there; scales given from first on). Dots are taken over whole groups.
static void int8_key_scores(const group_query* gq, int64_t group, const int8_t* keys, int64_t G, int64_t first,
                            const uint16_t* scales, int64_t n, int64_t d, float* scores) {
    int32_t dots[GROUP_BLOCK * MAX_TILE];
    const int64_t skip = first % G, m = (skip + n + G - 1) / G * G;  // whole groups: the dots of keys from first - skip
    keys += (first - skip) * d;
    for (int64_t g0 = 0; g0 < group; g0 += GROUP_BLOCK) {
        const int64_t G4 = group - g0 < GROUP_BLOCK ? group - g0 : GROUP_BLOCK;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
        if (G == 16) {
            const int64_t padded = padded_dim(d);
            const int8_t* planes = gq->planes + 2 * g0 * padded;
            switch (G4) {
                case 1: key_dots_vnni(1, planes, gq->bias + g0, padded, keys, m, d, dots); break;
                case 2: key_dots_vnni(2, planes, gq->bias + g0, padded, keys, m, d, dots); break;
                case 3: key_dots_vnni(3, planes, gq->bias + g0, padded, keys, m, d, dots); break;
                default: key_dots_vnni(4, planes, gq->bias + g0, padded, keys, m, d, dots); break;
            }
        } else
#endif
            int8_key_dots((int)G4, gq->codes + g0 * d, keys, m, d, G, dots);
        for (int64_t h = 0; h < G4; h++) {
            float* s = scores + (g0 + h) * MAX_TILE;
            const int32_t* dot = dots + h * MAX_TILE + skip;
            const float factor = gq->factor[g0 + h];
            int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
            for (; i + 8 <= n; i += 8) {
                const __m256 step = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(scales + i)));
                const __m256 x = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)(dot + i)));
                _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_mul_ps(x, _mm256_set1_ps(factor)), step));
            }
#endif
            for (; i < n; i++) s[i] = (float)dot[i] * factor * half_to_float(scales[i]);
        }
    }
}

// Folds a tile's n scores (soft-capped where st->cap > 0) into one head's running softmax: s becomes p = e^(s - max) (0 past n,
// up to a multiple of 8), and the head's sum and unnormalised output `out` [d] are rescaled when
// the maximum grows.
static void softmax_fold(float* s, int64_t n, softmax_state* st, float* out, int64_t d) {
    if (st->cap > 0.0f) soft_cap(s, n, st->cap);
    const float tile_max = tile_maximum(s, n);
    if (tile_max > st->max) {
        const float correction = exp_lane(st->max - tile_max);
        st->sum *= correction;
        for (int64_t j = 0; j < d; j++) out[j] *= correction;
        st->max = tile_max;
    }
    const int64_t padded = (n + 7) / 8 * 8;
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 m = _mm256_set1_ps(st->max);
    __m256 total = _mm256_setzero_ps();
    for (; i < padded; i += 8) {
        __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
        if (i + 8 > n) {  // lanes past n weigh nothing
            const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            p = _mm256_and_ps(p, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - i)), lane)));
        }
        _mm256_storeu_ps(s + i, p);
        total = _mm256_add_ps(total, p);
    }
    st->sum += hsum8(total);
#else
    float lanes[8] = {0.0f};
    for (; i < padded; i++) {
        s[i] = i < n ? exp_lane(s[i] - st->max) : 0.0f;
        lanes[i % 8] += s[i];
    }
    st->sum += sum_lanes(lanes);
#endif
}

// out[h][j] += sum_i w[h][i] * rows[i][j] for G <= GROUP_BLOCK heads over fp32 rows (w rows
// MAX_TILE apart, out rows out_stride apart), each row read once for all heads. Positions in
// order, one fma each.
static inline __attribute__((always_inline)) void weighted_rows(const int G, const float* w, const float* const* rows,
                                                                int64_t n, int64_t d, float* out, int64_t out_stride) {
    int64_t j = 0;
#ifdef __AVX2__
    for (; j + 16 <= d; j += 16) {
        __m256 acc[GROUP_BLOCK][2];
        for (int h = 0; h < G; h++)
            acc[h][0] = _mm256_loadu_ps(out + h * out_stride + j), acc[h][1] = _mm256_loadu_ps(out + h * out_stride + j + 8);
        for (int64_t i = 0; i < n; i++) {
            const __m256 v0 = _mm256_loadu_ps(rows[i] + j), v1 = _mm256_loadu_ps(rows[i] + j + 8);
            for (int h = 0; h < G; h++) {
                const __m256 wi = _mm256_set1_ps(w[h * MAX_TILE + i]);
                acc[h][0] = _mm256_fmadd_ps(wi, v0, acc[h][0]);
                acc[h][1] = _mm256_fmadd_ps(wi, v1, acc[h][1]);
            }
        }
        for (int h = 0; h < G; h++)
            _mm256_storeu_ps(out + h * out_stride + j, acc[h][0]), _mm256_storeu_ps(out + h * out_stride + j + 8, acc[h][1]);
    }
#endif
    if (j < d)
        for (int h = 0; h < G; h++)
            for (int64_t i = 0; i < n; i++)
                for (int64_t c = j; c < d; c++)
                    out[h * out_stride + c] = fmaf(w[h * MAX_TILE + i], rows[i][c], out[h * out_stride + c]);
}

// scaled[0..n) (all >= 0, the largest given) as 15-bit integers of the largest: w15[i] =
// round(scaled[i] x W15_MAX / largest), 0 from n up to the next even count. Returns the unit.
static inline __attribute__((always_inline)) float weights_to_w15(const float* scaled, int64_t n, float largest, int16_t* w15) {
    int64_t i = 0;
    const float inverse = largest > 0.0f ? (float)W15_MAX / largest : 0.0f;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) {  // cvtps rounds to nearest even as lrintf does; packs clamps to W15_MAX
        const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(scaled + i), _mm256_set1_ps(inverse)));
        _mm_storeu_si128((__m128i*)(w15 + i), _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)));
    }
#endif
    for (; i < n; i++) {
        const long q = lrintf(scaled[i] * inverse);
        w15[i] = (int16_t)(q > W15_MAX ? W15_MAX : q);
    }
    if (n % 2) w15[n] = 0;
    return largest / (float)W15_MAX;
}

// A head's weights over a tile of int8 values, w[i] x the fp16 scale of position i, as 15-bit
// integers: w15[i] = round(w[i] x scale_i / step) with step = the largest / W15_MAX, 0 from n up to
// the next even count (rows go in pairs). Returns the step. (Relative to the tile's largest
// weight the rounding is 1.5e-5, against int8 values' own 4e-3.)
static float integer_weights(const float* w, const uint16_t* scales, int64_t n, int16_t* w15) {
    float scaled[MAX_TILE], largest = 0.0f;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
    __m256 top = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(scales + i))));
        _mm256_storeu_ps(scaled + i, x);
        top = _mm256_max_ps(top, x);
    }
    largest = max8(top);
#endif
    for (; i < n; i++) {
        scaled[i] = w[i] * half_to_float(scales[i]);
        largest = scaled[i] > largest ? scaled[i] : largest;
    }
    return weights_to_w15(scaled, n, largest, w15);
}

// out[h][j] += step[h] x sum_i w15[h][i] * codes[i][j] for G <= GROUP_BLOCK heads (w15 rows
// W15_ROW apart) over n int8 value rows: the sums are int32 and exact (rows in pairs through
// vpdpwssd / pmaddwd, or one by one), so every instruction set gets the same bits.
#define W15_ROW (MAX_TILE + 2)
static inline __attribute__((always_inline)) void int8_value_rows(const int G, const int16_t* w15, const float* step,
                                                                  const int8_t* codes, int64_t n, int64_t d,
                                                                  float* out, int64_t out_stride) {
    int64_t j = 0;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    // Channels j..j+31 of rows i, i+1 as int16 pairs: `low` holds channels 8L..8L+3 of each 128-bit
    // lane L, `high` 8L+4..8L+7; the sums are put back in channel order at the end.
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (; j + 32 <= d; j += 32) {
        __m512i low[GROUP_BLOCK], high[GROUP_BLOCK];
        for (int h = 0; h < G; h++) low[h] = _mm512_setzero_si512(), high[h] = _mm512_setzero_si512();
        for (int64_t i = 0; i < n; i += 2) {
            const int8_t* next = codes + (i + 1 < n ? i + 1 : i) * d + j;  // an odd count's last pair: weight 0
            if (j == 0) prefetch_span(codes + i * d, CODES_PREFETCH_BYTES, 2 * d);  // the first slice's pass reads each row first
            const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(codes + i * d + j)));
            const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)next));
            const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
            for (int h = 0; h < G; h++) {
                int32_t pair;
                memcpy(&pair, w15 + h * W15_ROW + i, sizeof pair);
                low[h] = _mm512_dpwssd_epi32(low[h], lo, _mm512_set1_epi32(pair));
                high[h] = _mm512_dpwssd_epi32(high[h], hi, _mm512_set1_epi32(pair));
            }
        }
        for (int h = 0; h < G; h++) {
            float* o = out + h * out_stride + j;
            const __m512 s = _mm512_set1_ps(step[h]);
            const __m512 x0 = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(low[h], first, high[h]));
            const __m512 x1 = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(low[h], second, high[h]));
            _mm512_storeu_ps(o, _mm512_fmadd_ps(x0, s, _mm512_loadu_ps(o)));
            _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(x1, s, _mm512_loadu_ps(o + 16)));
        }
    }
#elif defined(__AVX2__)
    for (; j + 16 <= d; j += 16) {  // as above, 16 channels: `low` holds 8L..8L+3 of lane L, `high` 8L+4..
        __m256i low[GROUP_BLOCK], high[GROUP_BLOCK];
        for (int h = 0; h < G; h++) low[h] = _mm256_setzero_si256(), high[h] = _mm256_setzero_si256();
        for (int64_t i = 0; i < n; i += 2) {
            const int8_t* next = codes + (i + 1 < n ? i + 1 : i) * d + j;
            const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(codes + i * d + j)));
            const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)next));
            const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
            for (int h = 0; h < G; h++) {
                int32_t pair;
                memcpy(&pair, w15 + h * W15_ROW + i, sizeof pair);
                const __m256i wp = _mm256_set1_epi32(pair);
                low[h] = _mm256_add_epi32(low[h], _mm256_madd_epi16(lo, wp));
                high[h] = _mm256_add_epi32(high[h], _mm256_madd_epi16(hi, wp));
            }
        }
        for (int h = 0; h < G; h++) {
            float* o = out + h * out_stride + j;
            const __m256 s = _mm256_set1_ps(step[h]);
            const __m256 x0 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(low[h], high[h], 0x20));
            const __m256 x1 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(low[h], high[h], 0x31));
            _mm256_storeu_ps(o, _mm256_fmadd_ps(x0, s, _mm256_loadu_ps(o)));
            _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(x1, s, _mm256_loadu_ps(o + 8)));
        }
    }
#endif
    if (j < d)
        for (int h = 0; h < G; h++)
            for (int64_t c = j; c < d; c++) {
                int32_t sum = 0;
                for (int64_t i = 0; i < n; i++) sum += (int32_t)w15[h * W15_ROW + i] * codes[i * d + c];
                out[h * out_stride + c] = fmaf((float)sum, step[h], out[h * out_stride + c]);
            }
}

// The group's value sums over a tile, w [group, MAX_TILE] the softmax weights: over n int8 value
// rows (codes, with their fp16 scales) or fp32 rows.
static void group_weighted_sums(const float* w, const int8_t* codes, const uint16_t* scales,
                                const float* const* rows, int64_t n, int64_t d, int64_t group, float* out,
                                int64_t out_stride) {
    int16_t w15[GROUP_BLOCK * W15_ROW];
    float step[GROUP_BLOCK];
    for (int64_t g = 0; g < group; g += GROUP_BLOCK) {
        const int G = (int)(group - g < GROUP_BLOCK ? group - g : GROUP_BLOCK);
        const float* wg = w + g * MAX_TILE;
        float* o = out + g * out_stride;
        if (codes) {
            for (int h = 0; h < G; h++) step[h] = integer_weights(wg + h * MAX_TILE, scales, n, w15 + h * W15_ROW);
            switch (G) {
                case 1: int8_value_rows(1, w15, step, codes, n, d, o, out_stride); break;
                case 2: int8_value_rows(2, w15, step, codes, n, d, o, out_stride); break;
                case 3: int8_value_rows(3, w15, step, codes, n, d, o, out_stride); break;
                default: int8_value_rows(4, w15, step, codes, n, d, o, out_stride); break;
            }
        } else {
            switch (G) {
                case 1: weighted_rows(1, wg, rows, n, d, o, out_stride); break;
                case 2: weighted_rows(2, wg, rows, n, d, o, out_stride); break;
                case 3: weighted_rows(3, wg, rows, n, d, o, out_stride); break;
                default: weighted_rows(4, wg, rows, n, d, o, out_stride); break;
            }
        }
    }
}
