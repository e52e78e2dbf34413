// Decode attention straight over a QuantizedCache's stored codes (kv/quantized.py): one query per
// head over a fp32 sink, packed blocks of codes, and a fp32 tail, with no fp32 copy of the history.
// Each packed block is read for one kv head as one tile and scored by every query head of its
// group (group_tiles.c): int8 codes as integers, other codecs decoded into a small fp32 tile
// (registers / L1) and dropped. The work is split over kv heads and fixed position ranges
// (flash-decoding) and the partial softmaxes are merged in position order, so the result does not
// depend on the number of threads.
//
// This file is #included by decode.c (after attention_tiles.c).
#include <stdlib.h>

enum {
    CODES_FP32 = 0,
    CODES_FP16 = 1,
    CODES_BF16 = 2,
    CODES_FP8 = 3,         // float8 e4m3fn codes, one fp16 scale per position (lut: the 256 values)
    CODES_INT8 = 4,        // int8 codes, one fp16 scale per position
    CODES_INT4_CHANNEL = 5,  // KIVI keys: two 4-bit codes per byte, fp16 step/low per channel per block
    CODES_INT4_TOKEN = 6,    // 4-bit codes, fp16 step/low per position per 32 channels
    CODES_KVQ3_KEY = 7,      // kvquant3 keys: 3-bit codebook codes, fp16 span/low per channel per block,
                             // exact outliers per position, stored before RoPE (rotated on reading)
    CODES_KVQ3_VALUE = 8,    // kvquant3 values: 3-bit codebook codes, fp16 span/low per position per 32 channels
    CODES_INT8_KEYS = 9,     // int8 codes, one fp16 scale per position, in key groups (below)
};
#define TOKEN_GROUP 32  // channels sharing a step in CODES_INT4_TOKEN (codecs.py CHANNEL_GROUP)

// CODES_INT8_KEYS (codecs.py Int8KeyCodec): a block of B positions is B / G groups of G keys, G =
// key_group(B) (16 for 32-position blocks); a group is d / 4 rows of G x 4 bytes, row w holding
// channels 4w..4w+3 of each key in turn, so 16 keys' dwords of one channel quad are one 64-byte row.
static inline int64_t key_group(int64_t block_positions) {
    const int64_t lowest = block_positions & -block_positions;
    return lowest < 16 ? lowest : 16;
}

// The byte of key i (counted from a group boundary), channel j, in groups of G keys of d channels.
static inline int64_t key_byte(int64_t i, int64_t j, int64_t d, int64_t G) {
    return i / G * G * d + j / 4 * G * 4 + i % G * 4 + j % 4;
}

// One codec's stored tensors for one layer (PackedStore.parts[name][layer]: [H, max_blocks, ...]).
typedef struct {
    int32_t kind;
    int32_t rope_width;                           // pre-RoPE keys: the channels RoPE turns (rope_cos's width)
    const uint8_t* codes;     // codes (or the fp16/bf16/fp32 values)
    const uint16_t* step;     // fp16 scale / step, or NULL
    const uint16_t* low;      // fp16 offset, or NULL
    const float* lut;         // fp8: the value of each byte
    int64_t code_head_stride, code_block_stride;  // bytes
    int64_t step_head_stride, step_block_stride;  // fp16 elements (step and low alike)
    const float* codebook;                        // kvquant3: the layer's 8 levels in [0, 1]
    const uint8_t* outlier_index;                 // kvquant3: [.., B, outliers] channel of each exact value
    const uint16_t* outlier_value;                // its fp16 value
    int64_t outliers, outlier_head_stride, outlier_block_stride;  // elements
    const float* rope_cos;                        // keys stored before RoPE: [positions, rope_width] tables
    const float* rope_sin;
} packed_codes;

static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000 | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {  // zero or subnormal: mantissa * 2^-24
        const float v = (float)mantissa * 5.9604644775390625e-08f;
        memcpy(&bits, &v, sizeof bits);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
#endif
}

#ifdef __AVX2__
// The 32 4-bit codes of 16 bytes (low nibble first), as floats in four registers.
static inline void nibbles32(const uint8_t* bytes, __m256 out[4]) {
    const __m128i b = _mm_loadu_si128((const __m128i*)bytes), mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);  // codes 0-15, 16-31
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(first));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(first, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(second));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(second, 8)));
}
#endif

// 4-bit codes of one position (d / 2 bytes) to x = code * step + low, with step/low per channel
// (step_stride 1) or per 32 channels (given as one value each: step_stride 0).
static void decode_nibbles(const uint8_t* row, const float* step, const float* low, int64_t step_stride, int64_t d,
                           float* x) {
    int64_t j = 0;
#ifdef __AVX2__
    for (; j + 32 <= d; j += 32) {
        __m256 codes[4];
        nibbles32(row + j / 2, codes);
        for (int r = 0; r < 4; r++) {
            const int64_t c = j + 8 * r;
            const __m256 s = step_stride ? _mm256_loadu_ps(step + c) : _mm256_set1_ps(step[j / TOKEN_GROUP]);
            const __m256 o = step_stride ? _mm256_loadu_ps(low + c) : _mm256_set1_ps(low[j / TOKEN_GROUP]);
            _mm256_storeu_ps(x + c, _mm256_fmadd_ps(codes[r], s, o));
        }
    }
#endif
    for (; j < d; j += 2) {
        const int64_t c0 = step_stride ? j : j / TOKEN_GROUP, c1 = step_stride ? j + 1 : j / TOKEN_GROUP;
        x[j] = (float)(row[j / 2] & 0x0F) * step[c0] + low[c0];
        x[j + 1] = (float)(row[j / 2] >> 4) * step[c1] + low[c1];
    }
}

// 3-bit codes of one position (8 per 3 bytes, code i at bit 3i of a little-endian word) through a
// codebook: x = codebook[code] * span + low, span/low per channel (stride 1) or per 32 channels (0).
static void decode_codebook(const uint8_t* row, const float* codebook, const float* span, const float* low,
                            int64_t span_stride, int64_t d, float* x) {
    int64_t j = 0;
#ifdef __AVX2__
    // 8 codes of a 3-byte word: variable shifts, and the 8-level codebook is one register to permute.
    const __m256 levels = _mm256_loadu_ps(codebook);
    const __m256i shifts = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21), mask = _mm256_set1_epi32(7);
    for (; j + 8 <= d; j += 8) {
        const uint8_t* b = row + j / 8 * 3;
        const int word = (int)((uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16);
        const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), mask);
        const __m256 s = span_stride ? _mm256_loadu_ps(span + j) : _mm256_set1_ps(span[j / TOKEN_GROUP]);
        const __m256 o = span_stride ? _mm256_loadu_ps(low + j) : _mm256_set1_ps(low[j / TOKEN_GROUP]);
        _mm256_storeu_ps(x + j, _mm256_fmadd_ps(_mm256_permutevar8x32_ps(levels, codes), s, o));
    }
#endif
    for (; j < d; j += 8) {
        const uint8_t* b = row + j / 8 * 3;
        const uint32_t word = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16;
        for (int64_t i = 0; i < 8; i++) {
            const int64_t c = span_stride ? j + i : (j + i) / TOKEN_GROUP;
            x[j + i] = codebook[(word >> (3 * i)) & 7] * span[c] + low[c];
        }
    }
}

// kvquant3 keys and values of positions first..first+n-1 of a block (absolute position `position`
// for the first): codebook, exact outliers, and for keys stored before RoPE the rotation back.
static void decode_kvquant3(const packed_codes* c, const uint8_t* codes, const uint16_t* span, const uint16_t* low,
                            int64_t head, int64_t block, int64_t first, int64_t n, int64_t d, int64_t position,
                            float* out) {
    const int64_t per_channel = c->kind == CODES_KVQ3_KEY;
    float s[512], o[512];
    if (per_channel)
        for (int64_t j = 0; j < d; j++) s[j] = half_to_float(span[j]), o[j] = half_to_float(low[j]);
    const int64_t outliers = head * c->outlier_head_stride + block * c->outlier_block_stride;
    for (int64_t p = 0; p < n; p++) {
        float* x = out + p * d;
        if (!per_channel)
            for (int64_t g = 0; g < d / TOKEN_GROUP; g++) {
                s[g] = half_to_float(span[(first + p) * (d / TOKEN_GROUP) + g]);
                o[g] = half_to_float(low[(first + p) * (d / TOKEN_GROUP) + g]);
            }
        decode_codebook(codes + (first + p) * (3 * d / 8), c->codebook, s, o, per_channel, d, x);
        for (int64_t k = 0; k < c->outliers; k++) {
            const int64_t at = outliers + (first + p) * c->outliers + k;
            x[c->outlier_index[at]] = half_to_float(c->outlier_value[at]);
        }
        const int64_t w = c->rope_width;
        if (c->rope_cos) rotate_half(x, c->rope_cos + (position + p) * w, c->rope_sin + (position + p) * w, w);
    }
}

#ifdef __AVX2__
// The low 8 signed bytes of `bytes`, each times s: (float)byte * s, as the scalar loop computes it.
static inline __m256 scaled_bytes8(__m128i bytes, float s) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), _mm256_set1_ps(s));
}
#endif

// Positions first..first+n-1 of block `block`, kv head `head`, decoded into out [n, d].
static void decode_tile(const packed_codes* c, int64_t head, int64_t block, int64_t first, int64_t n, int64_t d,
                        int64_t position, float* out) {
    const uint8_t* codes = c->codes + head * c->code_head_stride + block * c->code_block_stride;
    const int64_t scales = head * c->step_head_stride + block * c->step_block_stride;
    const uint16_t* step = c->step ? c->step + scales : NULL;
    const uint16_t* low = c->low ? c->low + scales : NULL;
    switch (c->kind) {
        case CODES_FP32:
            memcpy(out, (const float*)codes + first * d, (size_t)(n * d) * sizeof(float));
            break;
        case CODES_FP16:
        {
            const uint16_t* x = (const uint16_t*)codes + first * d;
            int64_t i = 0;
#ifdef __F16C__
            for (; i + 8 <= n * d; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(x + i))));
#endif
            for (; i < n * d; i++) out[i] = half_to_float(x[i]);
        }
            break;
        case CODES_BF16: {
            int64_t i = 0;
#ifdef __AVX2__
            for (; i + 8 <= n * d; i += 8) {  // a bf16's bits are the top half of its fp32's
                const __m128i x = _mm_loadu_si128((const __m128i*)((const uint16_t*)codes + first * d + i));
                _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16)));
            }
#endif
            for (; i < n * d; i++) {
                const uint32_t bits = (uint32_t)((const uint16_t*)codes)[first * d + i] << 16;
                memcpy(out + i, &bits, sizeof bits);
            }
            break;
        }
        case CODES_FP8:
            for (int64_t p = 0; p < n; p++) {
                const float s = half_to_float(step[first + p]);
                const uint8_t* row = codes + (first + p) * d;
                int64_t j = 0;
#if defined(__AVX2__) && defined(__F16C__)
                // e4m3 bits moved into a fp16's (exponent 4 -> 5 bits, bias 7 -> 15 after x 2^8):
                // exact for normals and subnormals alike; NaN is never stored (codes are clamped).
                const __m256 rescale = _mm256_set1_ps(256.0f * s);
                for (; j + 8 <= d; j += 8) {
                    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(row + j)));
                    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7),
                                                   _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
                    _mm256_storeu_ps(out + p * d + j, _mm256_mul_ps(_mm256_cvtph_ps(h), rescale));
                }
#endif
                for (; j < d; j++) out[p * d + j] = c->lut[row[j]] * s;
            }
            break;
        case CODES_INT8:
            for (int64_t p = 0; p < n; p++) {
                const float s = half_to_float(step[first + p]);
                const int8_t* row = (const int8_t*)codes + (first + p) * d;
                int64_t j = 0;
#ifdef __AVX2__
                for (; j + 8 <= d; j += 8) _mm256_storeu_ps(out + p * d + j, scaled_bytes8(_mm_loadl_epi64((const __m128i*)(row + j)), s));
#endif
                for (; j < d; j++) out[p * d + j] = (float)row[j] * s;
            }
            break;
        case CODES_INT8_KEYS: {  // a key's channel quads lie 4 G bytes apart
            const int64_t G = key_group(c->code_block_stride / d);
            for (int64_t p = 0; p < n; p++) {
                const float s = half_to_float(step[first + p]);
                const int8_t* key = (const int8_t*)codes + key_byte(first + p, 0, d, G);  // channel quad 0
                int64_t j = 0;
#ifdef __AVX2__
                for (; j + 8 <= d; j += 8) {
                    int32_t low, high;
                    memcpy(&low, key + j / 4 * G * 4, sizeof low);
                    memcpy(&high, key + (j / 4 + 1) * G * 4, sizeof high);
                    _mm256_storeu_ps(out + p * d + j, scaled_bytes8(_mm_setr_epi32(low, high, 0, 0), s));
                }
#endif
                for (; j < d; j++) out[p * d + j] = (float)key[j / 4 * G * 4 + j % 4] * s;
            }
            break;
        }
        case CODES_INT4_CHANNEL: {
            float s[512], o[512];  // per channel of this block (d <= 512)
            for (int64_t j = 0; j < d; j++) s[j] = half_to_float(step[j]), o[j] = half_to_float(low[j]);
            for (int64_t p = 0; p < n; p++) decode_nibbles(codes + (first + p) * (d / 2), s, o, 1, d, out + p * d);
            break;
        }
        case CODES_INT4_TOKEN:
            for (int64_t p = 0; p < n; p++) {
                float s[512 / TOKEN_GROUP], o[512 / TOKEN_GROUP];
                for (int64_t g = 0; g < d / TOKEN_GROUP; g++) {
                    s[g] = half_to_float(step[(first + p) * (d / TOKEN_GROUP) + g]);
                    o[g] = half_to_float(low[(first + p) * (d / TOKEN_GROUP) + g]);
                }
                decode_nibbles(codes + (first + p) * (d / 2), s, o, 0, d, out + p * d);
            }
            break;
        case CODES_KVQ3_KEY:
        case CODES_KVQ3_VALUE:
            decode_kvquant3(c, codes, step, low, head, block, first, n, d, position, out);
            break;
    }
}

#include "group_tiles.c"
#include "int4_tiles.c"

// Positions each work item covers: fixed ranges of absolute positions, so the split (and with it
// the merge, and every bit of the result) is the same for any number of threads. The range is the
// smallest power of two from MIN_SPLIT up that cuts a layer's positions into about ITEMS_PER_LAYER
// items over all its kv heads: every item restarts the hardware prefetchers' streams over its
// codes, and SmolLM2 at 8,192 positions in 256-position items ran 2,880 items a step at 113 tok/s,
// against 179 tok/s in items of 4,096 (6 a layer); a layer of one kv head still gets ~8 items, so
// that every thread streams.
#define MIN_SPLIT 256
#define ITEMS_PER_LAYER 8
#define MOST_SPLITS (ITEMS_PER_LAYER + 2)  // per kv head, for any range and kv head count

static int64_t split_positions(int64_t start, int64_t end, int64_t kv_heads) {
    int64_t split = MIN_SPLIT;
    while (split * ITEMS_PER_LAYER < (end - start) * kv_heads) split *= 2;
    return split;
}

// Where one layer's keys and values live for the attention of one step.
typedef struct {
    int64_t heads, kv_heads, d;
    float scale, softcap;  // softcap: see softmax_state
    const float* sinks;    // the query heads' sink logits (block_t), or NULL
    const float *sink_k, *sink_v;
    int64_t sink_head_stride, sink_len;
    const packed_codes *key_codes, *value_codes;
    int64_t num_blocks, block_size;
    const float *tail_k, *tail_v;
    int64_t tail_head_stride;
} codes_attention;

// A block's codes and per-position scales from position `offset` on, for one kv head (int8, fp32).
typedef struct {
    const uint8_t* codes;
    const uint16_t* step;
} codes_part;

static codes_part codes_at(const packed_codes* c, int64_t head, int64_t block, int64_t offset, int64_t d) {
    const uint8_t* codes = c->codes + head * c->code_head_stride + block * c->code_block_stride;
    const int64_t bytes = c->kind == CODES_FP32 ? (int64_t)sizeof(float) : 1;
    const uint16_t* step = c->step ? c->step + head * c->step_head_stride + block * c->step_block_stride + offset : NULL;
    return (codes_part){codes + offset * d * bytes, step};
}

// fp32 rows of positions [pos, pos + n) of one kv head's sink or tail (n inside the segment).
static void segment_rows(const codes_attention* a, int64_t kv_head, int64_t pos, int64_t n, const float** keys,
                         const float** values) {
    const int64_t packed_end = a->sink_len + a->num_blocks * a->block_size;
    const int64_t tail = pos >= packed_end;
    const int64_t offset = (tail ? pos - packed_end : pos) * a->d;
    const int64_t head = kv_head * (tail ? a->tail_head_stride : a->sink_head_stride);
    const float* k = (tail ? a->tail_k : a->sink_k) + head + offset;
    const float* v = (tail ? a->tail_v : a->sink_v) + head + offset;
    for (int64_t i = 0; i < n; i++) keys[i] = k + i * a->d, values[i] = v + i * a->d;
}

// One kv head's query group over positions [first, end): the partial softmax of each query head
// into acc (per head: max, sum, out[d]). scores: [group, MAX_TILE]; decoded: [2, MAX_TILE, d].
static void attend_codes_range(const codes_attention* a, const group_query* gq, int64_t kv_head, int64_t first,
                               int64_t end, float* scores, float* decoded, uint8_t* prepared, float* acc) {
    const int64_t d = a->d, group = a->heads / a->kv_heads, stride = d + 2;
    const int64_t packed_end = a->sink_len + a->num_blocks * a->block_size;
    const packed_codes *kc = a->key_codes, *vc = a->value_codes;
    // 4-bit keys: the query group of every block the range touches, prepared up front.
    const int64_t first_block = first > a->sink_len ? (first - a->sink_len) / a->block_size : 0;
    const int64_t prepared_bytes = int4_prepared_bytes(group, d);
    if (kc->kind == CODES_INT4_CHANNEL)
        for (int64_t b = first_block; b < a->num_blocks && a->sink_len + b * a->block_size < end; b++)
            int4_prepare_block(gq->q4, group, kc, kv_head, b, d, a->scale, prepared + (b - first_block) * prepared_bytes);
    for (int64_t g = 0; g < group; g++) {
        acc[g * stride] = -INFINITY, acc[g * stride + 1] = 0.0f;
        for (int64_t j = 0; j < d; j++) acc[g * stride + 2 + j] = 0.0f;
    }
    for (int64_t pos = first; pos < end;) {
        // The tile: positions [pos, pos + n) inside one segment (sink, one packed block, or tail).
        int64_t n, block = -1, offset = 0;
        if (pos < a->sink_len) {
            n = a->sink_len - pos;
        } else if (pos < packed_end) {
            block = (pos - a->sink_len) / a->block_size, offset = (pos - a->sink_len) % a->block_size;
            n = a->block_size - offset;
        } else {
            n = end - pos;
        }
        // int8 keys and values of two blocks contiguous in memory: one tile of both (an even block
        // and the next, whole), which halves the per-tile work (softmax bookkeeping, weight
        // rounding, reductions). Pairs fall on even blocks, so the tiles of a position range do not
        // depend on the thread count or on how the range was reached.
        if (block >= 0 && offset == 0 && block % 2 == 0 && block + 1 < a->num_blocks && pos + 2 * a->block_size <= end &&
            2 * a->block_size <= MAX_TILE && kc->kind == CODES_INT8_KEYS && vc->kind == CODES_INT8 &&
            kc->code_block_stride == a->block_size * d && vc->code_block_stride == a->block_size * d &&
            kc->step_block_stride == a->block_size && vc->step_block_stride == a->block_size)
            n = 2 * a->block_size;
        if (n > end - pos) n = end - pos;
        if (n > MAX_TILE) n = MAX_TILE;
        const float *key_rows[MAX_TILE], *value_rows[MAX_TILE];
        const int8_t *key_codes = NULL, *value_codes = NULL;  // int8 keys: the block's start (offset: key_first)
        int64_t key_first = 0;
        int scored = 0, int4_values = 0;  // keys scored / values summed from 4-bit codes as integers
        const uint16_t *key_scales = NULL, *value_scales = NULL;
        if (block < 0) {
            segment_rows(a, kv_head, pos, n, key_rows, value_rows);
        } else {
            const codes_part k = codes_at(kc, kv_head, block, offset, d), v = codes_at(vc, kv_head, block, offset, d);
            if (kc->kind == CODES_INT8_KEYS) {
                key_codes = (const int8_t*)codes_at(kc, kv_head, block, 0, d).codes, key_first = offset, key_scales = k.step;
            } else if (kc->kind == CODES_INT4_CHANNEL) {
                int4_key_scores(prepared + (block - first_block) * prepared_bytes, group, kc, kv_head, block, offset, n,
                                d, scores), scored = 1;
            } else {
                const float* keys = (const float*)k.codes;
                if (kc->kind != CODES_FP32) decode_tile(kc, kv_head, block, offset, n, d, pos, decoded), keys = decoded;
                for (int64_t i = 0; i < n; i++) key_rows[i] = keys + i * d;
            }
            if (vc->kind == CODES_INT8) {
                value_codes = (const int8_t*)v.codes, value_scales = v.step;
            } else if (vc->kind == CODES_INT4_TOKEN) {
                int4_values = 1;
            } else {
                const float* values = (const float*)v.codes;
                if (vc->kind != CODES_FP32) {
                    values = decoded + MAX_TILE * d;
                    decode_tile(vc, kv_head, block, offset, n, d, pos, (float*)values);
                }
                for (int64_t i = 0; i < n; i++) value_rows[i] = values + i * d;
            }
        }
        if (key_codes)
            int8_key_scores(gq, group, key_codes, key_group(kc->code_block_stride / d), key_first, key_scales, n, d, scores),
                scored = 1;
        for (int64_t g = 0; g < group; g++) {
            float* s = scores + g * MAX_TILE;
            if (!scored)
                for (int64_t i = 0; i < n; i++) s[i] = dot(gq->q + g * d, key_rows[i], d) * a->scale;
            softmax_state st = {acc[g * stride], acc[g * stride + 1], a->softcap};
            softmax_fold(s, n, &st, acc + g * stride + 2, d);
            acc[g * stride] = st.max, acc[g * stride + 1] = st.sum;
        }
        if (int4_values)
            int4_value_sums(scores, vc, kv_head, block, offset, n, d, group, acc + 2, stride);
        else
            group_weighted_sums(scores, value_codes, value_scales, value_rows, n, d, group, acc + 2, stride);
        pos += n;
    }
}

// The attention's scratch shared by a team, for at most `heads` heads of at most d over at most
// `splits` position ranges: the partial softmaxes, and the query of every head as int16 codes
// (and their byte planes), prepared once per step.
typedef struct {
    float* partial;  // [kv_heads * MOST_SPLITS, group, d + 2]
    int16_t* codes;  // [heads, d]
    int8_t* planes;  // [heads, 2 * padded_dim(d)]
    float* factor;   // [heads]
    int32_t* bias;   // [heads]
    float* ordered;  // [heads, d]: 4-bit keys: q in their code order
} codes_shared;

static codes_shared codes_shared_new(int64_t heads, int64_t d) {
    return (codes_shared){malloc(sizeof(float) * (size_t)(heads * MOST_SPLITS * (d + 2))),
                          malloc(sizeof(int16_t) * (size_t)(heads * d)), malloc((size_t)(heads * 2 * padded_dim(d))),
                          malloc(sizeof(float) * (size_t)heads), malloc(sizeof(int32_t) * (size_t)heads),
                          malloc(sizeof(float) * (size_t)(heads * d))};
}

static void codes_shared_free(const codes_shared* c) {
    free(c->ordered), free(c->bias), free(c->factor), free(c->planes), free(c->codes), free(c->partial);
}

// One thread's scratch: a tile's scores and decoded keys/values, and (4-bit keys) the prepared
// query groups of every block one work item touches; for query groups up to `group`, heads up to d,
// items up to `split` positions.
typedef struct {
    float* scores;  // [group + 2 d, MAX_TILE]
    uint8_t* prepared;
} codes_thread;

static codes_thread codes_thread_new(int64_t group, int64_t d, int64_t block_size, int int4_keys, int64_t split) {
    return (codes_thread){malloc(sizeof(float) * (size_t)((group + 2 * d) * MAX_TILE)),
                          int4_keys ? malloc((size_t)((split / block_size + 2) * int4_prepared_bytes(group, d))) : NULL};
}

static void codes_thread_free(const codes_thread* t) {
    free(t->prepared);
    free(t->scores);
}

// The splits (ranges of `split` positions) that positions [start, end) touch, and the first.
static int64_t codes_splits(int64_t start, int64_t end, int64_t split, int64_t* first_split) {
    *first_split = start / split;
    return (end - 1) / split + 1 - *first_split;
}

// The attention of kvgen_quantized_decode_attention by every thread of a team (c: the team's
// shared scratch, t: this thread's); returns after a barrier, with out whole. Each query head is
// prepared, each work item computed and each head's partials merged as one thread alone does.
static void quantized_attention_team(const float* q, float* out, const codes_attention* a, int64_t start, int64_t end,
                                     const codes_shared* c, const codes_thread* t) {
    const int64_t heads = a->heads, d = a->d, group = heads / a->kv_heads, stride = d + 2, padded = padded_dim(d);
    int64_t first_split;
    const int64_t split = split_positions(start, end, a->kv_heads);
    const int64_t splits = codes_splits(start, end, split, &first_split), items = a->kv_heads * splits;
#pragma omp for schedule(static)
    for (int64_t head = 0; head < heads; head++) {
        quantize_query(q + head * d, d, a->scale, c->codes + head * d, c->factor + head);
        query_planes(c->codes + head * d, d, c->planes + head * 2 * padded, c->bias + head);
        if (a->key_codes->kind == CODES_INT4_CHANNEL) int4_order_query(q + head * d, d, c->ordered + head * d);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++) {
        const int64_t kv_head = item / splits, range = first_split + item % splits;
        const int64_t lo = range * split, hi = lo + split;
        const int64_t h0 = kv_head * group;
        const group_query gq = {q + h0 * d, c->codes + h0 * d, c->factor + h0, c->planes + h0 * 2 * padded,
                                c->bias + h0, c->ordered + h0 * d};
        attend_codes_range(a, &gq, kv_head, lo > start ? lo : start, hi < end ? hi : end, t->scores,
                           t->scores + group * MAX_TILE, t->prepared, c->partial + item * group * stride);
    }
#pragma omp for schedule(static)
    for (int64_t head = 0; head < heads; head++) {  // its partial softmaxes merged in position order
        const int64_t kv_head = head / group, g = head % group;
        float max = a->sinks ? a->sinks[head] : -INFINITY, sum = 0.0f;
        float* o = out + head * d;
        for (int64_t split = 0; split < splits; split++) {
            const float m = c->partial[((kv_head * splits + split) * group + g) * stride];
            if (m > max) max = m;
        }
        if (a->sinks) sum = exp_lane(a->sinks[head] - max);  // the sink first: weight, no value
        for (int64_t j = 0; j < d; j++) o[j] = 0.0f;
        for (int64_t split = 0; split < splits; split++) {
            const float* p = c->partial + ((kv_head * splits + split) * group + g) * stride;
            const float w = exp_lane(p[0] - max);
            sum = fmaf(p[1], w, sum);
            for (int64_t j = 0; j < d; j++) o[j] = fmaf(w, p[2 + j], o[j]);
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < d; j++) o[j] *= inv;
    }
}

// q, out [heads, d]; sink_* and tail_* are [kv_heads, *, d] fp32 with the given head strides.
// Work items: kv heads x fixed ranges of positions (flash-decoding, split_positions), each a
// partial softmax; the partials are merged in position order.
void kvgen_quantized_decode_attention(const float* q, float* out, int64_t heads, int64_t kv_heads, int64_t d,
                                      float scale, const float* sink_k, const float* sink_v, int64_t sink_head_stride,
                                      int64_t sink_len, const packed_codes* key_codes, const packed_codes* value_codes,
                                      int64_t num_blocks, int64_t block_size, const float* tail_k, const float* tail_v,
                                      int64_t tail_head_stride, int64_t start, int64_t end) {
    const codes_attention a = {heads, kv_heads, d, scale, 0.0f, NULL, sink_k, sink_v, sink_head_stride, sink_len, key_codes,
                               value_codes, num_blocks, block_size, tail_k, tail_v, tail_head_stride};
    const codes_shared c = codes_shared_new(heads, d);
#pragma omp parallel
    {
        const codes_thread t = codes_thread_new(heads / kv_heads, d, block_size, key_codes->kind == CODES_INT4_CHANNEL,
                                                split_positions(start, end, kv_heads));
        quantized_attention_team(q, out, &a, start, end, &c, &t);
        codes_thread_free(&t);
    }
    codes_shared_free(&c);
}

// Where one QuantizedCache keeps its fp32 rows (kv/quantized.py `sink_store` / `tail_store`, each
// [K/V, layers, kv_heads, positions, d]) and each layer's packed codes.
typedef struct {
    float* sink;
    int64_t sink_kv_stride, sink_layer_stride, sink_head_stride, sink_len;
    float* tail;
    int64_t tail_kv_stride, tail_layer_stride, tail_head_stride;
    int64_t block_size;
    const packed_codes* key_codes;    // [layers]
    const packed_codes* value_codes;  // [layers]
} quantized_kv;

// Every block for one token over a QuantizedCache, as kvgen_decode_layers does over fp32 storage:
// the new key/value go to their fp32 sink or tail slot (room made by the caller), attention reads
// the codes, and the caller commits. window: per layer (0 = full attention). lora, slot: as
// kvgen_decode_layers takes them.
void kvgen_decode_layers_over_codes(const block_t* blocks, int64_t num_layers, float* h, const float* rope,
                                    const int64_t* rope_kind, const int64_t* window, const quantized_kv* kv,
                                    int64_t num_blocks, int64_t position, const lora_linear* lora, int64_t slot) {
    const int64_t packed_end = kv->sink_len + num_blocks * kv->block_size;
    int64_t heads = 0, widest_d = 0, group = 0, kv_heads = 0;
    int int4_keys = 0;
    for (int64_t layer = 0; layer < num_layers; layer++) {
        const block_t* b = &blocks[layer];
        heads = b->num_heads > heads ? b->num_heads : heads;
        widest_d = b->head_dim > widest_d ? b->head_dim : widest_d;
        group = b->num_heads / b->num_kv_heads > group ? b->num_heads / b->num_kv_heads : group;
        kv_heads = b->num_kv_heads > kv_heads ? b->num_kv_heads : kv_heads;
        int4_keys |= kv->key_codes[layer].kind == CODES_INT4_CHANNEL;
    }
    const codes_shared c = codes_shared_new(heads, widest_d);
    float* xa = malloc(sizeof(float) * (size_t)(lora_width(lora, num_layers * LORA_LINEARS) + 1));  // LoRA's A x
#pragma omp parallel  // one region for every layer, as kvgen_decode_layers (see thread_scratch)
    {
        const thread_scratch t = thread_scratch_new(blocks, num_layers, h);
        const codes_thread ct = codes_thread_new(group, widest_d, kv->block_size, int4_keys,
                                                 split_positions(0, position + 1, kv_heads));  // the widest item
        for (int64_t layer = 0; layer < num_layers; layer++) {
            const block_t* b = &blocks[layer];
            const lora_linear* layer_lora = lora ? lora + layer * LORA_LINEARS : NULL;
            const int64_t d = b->head_dim;
            const float* cos = rope + rope_kind[layer] * 2 * d;
            float* sink = kv->sink + layer * kv->sink_layer_stride;
            float* tail = kv->tail + layer * kv->tail_layer_stride;
            // The new key/value's fp32 slot: in the sink, or in the tail after the packed blocks.
            float* k_out = position < kv->sink_len ? sink + position * d : tail + (position - packed_end) * d;
            float* v_out = k_out + (position < kv->sink_len ? kv->sink_kv_stride : kv->tail_kv_stride);
            const int64_t out_stride = position < kv->sink_len ? kv->sink_head_stride : kv->tail_head_stride;
            block_pre_team(b, &t, cos, cos + d, k_out, v_out, out_stride, layer_lora, &slot, xa);
            const int64_t start = window[layer] > 0 && position + 1 > window[layer] ? position + 1 - window[layer] : 0;
            const codes_attention a = {b->num_heads, b->num_kv_heads, d, b->scale, b->softcap, b->sinks, sink, sink + kv->sink_kv_stride,
                                       kv->sink_head_stride, kv->sink_len, &kv->key_codes[layer],
                                       &kv->value_codes[layer], num_blocks, kv->block_size, tail,
                                       tail + kv->tail_kv_stride, kv->tail_head_stride};
            quantized_attention_team(b->qkv_out, b->attn, &a, start, position + 1, &c, &ct);
            block_finish_team(b, &t, layer_lora, &slot, xa);
        }
        codes_thread_free(&ct);
        free(t.own);
    }
    free(xa);
    codes_shared_free(&c);
}
