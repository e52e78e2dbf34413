// Decode attention straight over a QuantizedCache's stored codes (kv/quantized.py): one query per
// head over a fp32 sink, packed blocks of codes, and a fp32 tail, with no fp32 copy of the history.
// Each packed block is decoded for one kv head into a small tile (registers / L1), scored by every
// query head of its group, and dropped; the work is split over kv heads and position ranges
// (flash-decoding) and the partial softmaxes are merged at the end.
//
// This file is #included by decode.c (after attention_tiles.c).
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

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
};
#define TOKEN_GROUP 32  // channels sharing a step in CODES_INT4_TOKEN (codecs.py CHANNEL_GROUP)

// One codec's stored tensors for one layer (PackedStore.parts[name][layer]: [H, max_blocks, ...]).
typedef struct {
    int32_t kind, pad;
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
    const float* rope_cos;                        // keys stored before RoPE: [positions, d] tables
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
        if (c->rope_cos) rotate_half(x, c->rope_cos + (position + p) * d, c->rope_sin + (position + p) * d, d);
    }
}

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
        case CODES_BF16:
            for (int64_t i = 0; i < n * d; i++) {
                const uint32_t bits = (uint32_t)((const uint16_t*)codes)[first * d + i] << 16;
                memcpy(out + i, &bits, sizeof bits);
            }
            break;
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
                for (int64_t j = 0; j < d; j++) out[p * d + j] = (float)row[j] * s;
            }
            break;
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

// A run of positions in one storage segment: the sink or tail (fp32 rows), or part of a block.
typedef struct {
    int64_t first, count;  // first position, number of positions (<= MAX_TILE)
    int64_t block;         // packed block index, or -1 for fp32 rows
    int64_t offset;        // index of `first` inside its block or fp32 segment
    int32_t tail;          // fp32 rows of the tail (else of the sink)
} tile_t;

// Tiles of positions [start, end): fp32 sink [0, sink_len), blocks, fp32 tail [packed_end, end).
static int64_t make_tiles(tile_t* tiles, int64_t start, int64_t end, int64_t sink_len, int64_t num_blocks,
                          int64_t block_size) {
    const int64_t packed_end = sink_len + num_blocks * block_size;
    int64_t count = 0;
    for (int64_t pos = start; pos < end;) {
        tile_t t = {pos, 0, -1, 0, 0};
        int64_t limit;
        if (pos < sink_len) {
            t.offset = pos, limit = sink_len;
        } else if (pos < packed_end) {
            t.block = (pos - sink_len) / block_size, t.offset = (pos - sink_len) % block_size;
            limit = sink_len + (t.block + 1) * block_size;
        } else {
            t.tail = 1, t.offset = pos - packed_end, limit = end;
        }
        t.count = limit < end ? limit - pos : end - pos;
        if (t.count > MAX_TILE) t.count = MAX_TILE;
        tiles[count++] = t;
        pos += t.count;
    }
    return count;
}

// q, out [heads, d]; sink_* and tail_* are [kv_heads, *, d] fp32 with the given head strides.
void kvgen_quantized_decode_attention(const float* q, float* out, int64_t heads, int64_t kv_heads, int64_t d,
                                      float scale, const float* sink_k, const float* sink_v, int64_t sink_head_stride,
                                      int64_t sink_len, const packed_codes* key_codes, const packed_codes* value_codes,
                                      int64_t num_blocks, int64_t block_size, const float* tail_k, const float* tail_v,
                                      int64_t tail_head_stride, int64_t start, int64_t end) {
    const int64_t group = heads / kv_heads;
    tile_t* tiles = malloc(sizeof(tile_t) * (size_t)(end - start + 1));  // at most one per position
    const int64_t num_tiles = make_tiles(tiles, start, end, sink_len, num_blocks, block_size);
    // Enough work items for every thread: kv heads x splits of the tiles.
    int64_t threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    int64_t splits = (4 * threads + kv_heads - 1) / kv_heads;
    if (splits > num_tiles) splits = num_tiles > 0 ? num_tiles : 1;
    const int64_t items = kv_heads * splits, partial_size = group * (d + 2);
    float* partial = malloc(sizeof(float) * (size_t)(items * partial_size));
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++) {
        const int64_t kv_head = item / splits, split = item % splits;
        const int64_t t0 = num_tiles * split / splits, t1 = num_tiles * (split + 1) / splits;
        float* key_tile = malloc(sizeof(float) * (size_t)(2 * MAX_TILE * d));  // decoded K, then V
        float* value_tile = key_tile + MAX_TILE * d;
        float* acc = partial + item * partial_size;  // per query head of the group: max, sum, out[d]
        for (int64_t g = 0; g < group; g++) {
            acc[g * (d + 2)] = -INFINITY, acc[g * (d + 2) + 1] = 0.0f;
            for (int64_t j = 0; j < d; j++) acc[g * (d + 2) + 2 + j] = 0.0f;
        }
        for (int64_t t = t0; t < t1; t++) {
            const tile_t* tile = &tiles[t];
            const float *keys, *values;
            if (tile->block >= 0 && key_codes->kind == CODES_FP32 && value_codes->kind == CODES_FP32) {
                keys = (const float*)(key_codes->codes + kv_head * key_codes->code_head_stride +
                                      tile->block * key_codes->code_block_stride) + tile->offset * d;
                values = (const float*)(value_codes->codes + kv_head * value_codes->code_head_stride +
                                        tile->block * value_codes->code_block_stride) + tile->offset * d;
            } else if (tile->block >= 0) {
                decode_tile(key_codes, kv_head, tile->block, tile->offset, tile->count, d, tile->first, key_tile);
                decode_tile(value_codes, kv_head, tile->block, tile->offset, tile->count, d, tile->first, value_tile);
                keys = key_tile, values = value_tile;
            } else if (tile->tail) {
                keys = tail_k + kv_head * tail_head_stride + tile->offset * d;
                values = tail_v + kv_head * tail_head_stride + tile->offset * d;
            } else {
                keys = sink_k + kv_head * sink_head_stride + tile->offset * d;
                values = sink_v + kv_head * sink_head_stride + tile->offset * d;
            }
            const float *key_rows[MAX_TILE], *value_rows[MAX_TILE];
            for (int64_t i = 0; i < tile->count; i++) key_rows[i] = keys + i * d, value_rows[i] = values + i * d;
            for (int64_t g = 0; g < group; g++) {
                float* a = acc + g * (d + 2);
                softmax_state st = {a[0], a[1]};
                attend_tile(q + (kv_head * group + g) * d, key_rows, value_rows, tile->count, d, scale, &st, a + 2);
                a[0] = st.max, a[1] = st.sum;
            }
        }
        free(key_tile);
    }
    // Merge each query head's partial softmaxes.
    for (int64_t head = 0; head < heads; head++) {
        const int64_t kv_head = head / group, g = head % group;
        float max = -INFINITY, sum = 0.0f;
        float* o = out + head * d;
        for (int64_t split = 0; split < splits; split++) {
            const float m = partial[(kv_head * splits + split) * partial_size + g * (d + 2)];
            if (m > max) max = m;
        }
        for (int64_t j = 0; j < d; j++) o[j] = 0.0f;
        for (int64_t split = 0; split < splits; split++) {
            const float* a = partial + (kv_head * splits + split) * partial_size + g * (d + 2);
            if (a[0] == -INFINITY) continue;  // a split with no positions
            const float w = expf(a[0] - max);
            sum += a[1] * w;
            for (int64_t j = 0; j < d; j++) o[j] += w * a[2 + j];
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < d; j++) o[j] *= inv;
    }
    free(partial);
    free(tiles);
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
    for (int64_t layer = 0; layer < num_layers; layer++) {
        const block_t* b = &blocks[layer];
        const lora_linear* layer_lora = lora ? lora + layer * LORA_LINEARS : NULL;
        const int64_t d = b->head_dim;
        const float* cos = rope + rope_kind[layer] * 2 * d;
        float* sink = kv->sink + layer * kv->sink_layer_stride;
        float* tail = kv->tail + layer * kv->tail_layer_stride;
        if (position < kv->sink_len) {
            block_pre(b, h, cos, cos + d, sink + position * d, sink + kv->sink_kv_stride + position * d,
                      kv->sink_head_stride, layer_lora, &slot);
        } else {
            float* tail_slot = tail + (position - packed_end) * d;
            block_pre(b, h, cos, cos + d, tail_slot, tail_slot + kv->tail_kv_stride, kv->tail_head_stride, layer_lora, &slot);
        }
        const int64_t start = window[layer] > 0 && position + 1 > window[layer] ? position + 1 - window[layer] : 0;
        kvgen_quantized_decode_attention(b->qkv_out, b->attn, b->num_heads, b->num_kv_heads, d, b->scale, sink,
                                         sink + kv->sink_kv_stride, kv->sink_head_stride, kv->sink_len,
                                         &kv->key_codes[layer], &kv->value_codes[layer], num_blocks, kv->block_size,
                                         tail, tail + kv->tail_kv_stride, kv->tail_head_stride, start, position + 1);
        block_finish(b, h, layer_lora, &slot);
    }
}
