// Attention of a ragged batch over the engine's paged pool when its blocks hold K/V codes
// (kv/paged_codes.py): the quantized_attention.c tiles, with blocks found through each row's block
// table instead of one sequence's contiguous blocks, and many queries per row (chunked prefill,
// speculative verification) as well as one (decode).
//
// Row r has q_counts[r] queries at positions q_first[r], q_first[r] + 1, ...; its keys are positions
// 0 .. q_first[r] + q_counts[r] - 1: the first num_code_blocks[r] blocks of its table hold codes
// (decoded one tile at a time for one kv head, scored by every query of the head group in a chunk
// of queries, and dropped), and the positions after them are one fp32 run per row, "recent"
// [kv_heads, n, d] (the staged start of the row's current block and this forward's new tokens).
// A query at p sees positions <= p, and with window > 0 only those > p - window.
//
// This file is #included by decode.c (after quantized_attention.c).

#define QUERY_CHUNK 16  // queries of one row sharing each decoded tile

typedef struct {
    int64_t row, kv_head, first_query, num_queries;
} codes_work;

// One work item: queries first_query.. of a row, one kv head (its whole query group).
static void attend_codes_item(const codes_work* w, const float* q, float* out, const int64_t* q_offsets,
                              const int64_t* q_first, int64_t heads, int64_t kv_heads, int64_t d, float scale,
                              int64_t window, const packed_codes* key_codes, const packed_codes* value_codes,
                              int64_t block_size, const int64_t* table, int64_t num_code_blocks,
                              const float* recent_k, const float* recent_v, int64_t recent_head_stride,
                              float* tiles, softmax_state* states, float* acc) {
    const int64_t group = heads / kv_heads, nq = w->num_queries, coded_end = num_code_blocks * block_size;
    const int64_t first_pos = q_first[w->row] + w->first_query, last_pos = first_pos + nq - 1;
    const int64_t lo = window > 0 && first_pos + 1 > window ? first_pos + 1 - window : 0;
    float* key_tile = tiles;
    float* value_tile = tiles + MAX_TILE * d;
    for (int64_t i = 0; i < nq * group; i++) {
        states[i].max = -INFINITY, states[i].sum = 0.0f;
        for (int64_t j = 0; j < d; j++) acc[i * d + j] = 0.0f;
    }
    for (int64_t pos = lo; pos <= last_pos;) {
        int64_t count;
        const float *keys, *values;
        if (pos < coded_end) {
            const int64_t index = pos / block_size, offset = pos % block_size;
            count = block_size - offset;
            if (count > last_pos + 1 - pos) count = last_pos + 1 - pos;
            if (count > MAX_TILE) count = MAX_TILE;
            decode_tile(key_codes, w->kv_head, table[index], offset, count, d, pos, key_tile);
            decode_tile(value_codes, w->kv_head, table[index], offset, count, d, pos, value_tile);
            keys = key_tile, values = value_tile;
        } else {
            count = last_pos + 1 - pos;
            if (count > MAX_TILE) count = MAX_TILE;
            keys = recent_k + w->kv_head * recent_head_stride + (pos - coded_end) * d;
            values = recent_v + w->kv_head * recent_head_stride + (pos - coded_end) * d;
        }
        const float *key_rows[MAX_TILE], *value_rows[MAX_TILE];
        for (int64_t i = 0; i < count; i++) key_rows[i] = keys + i * d, value_rows[i] = values + i * d;
        for (int64_t i = 0; i < nq; i++) {  // the part of the tile query i sees: [from, to)
            const int64_t p = first_pos + i;
            const int64_t start = window > 0 && p + 1 > window ? p + 1 - window : 0;
            const int64_t from = start > pos ? start : pos, to = p + 1 < pos + count ? p + 1 : pos + count;
            if (from >= to) continue;
            for (int64_t g = 0; g < group; g++) {
                const float* query = q + ((q_offsets[w->row] + w->first_query + i) * heads + w->kv_head * group + g) * d;
                attend_tile(query, key_rows + (from - pos), value_rows + (from - pos), to - from, d, scale,
                            &states[i * group + g], acc + (i * group + g) * d);
            }
        }
        pos += count;
    }
    for (int64_t i = 0; i < nq; i++)
        for (int64_t g = 0; g < group; g++) {
            float* o = out + ((q_offsets[w->row] + w->first_query + i) * heads + w->kv_head * group + g) * d;
            const float inv = 1.0f / states[i * group + g].sum;
            for (int64_t j = 0; j < d; j++) o[j] = acc[(i * group + g) * d + j] * inv;
        }
}

// One thread's scratch for attend_codes_item: a decoded key and value tile, and the running
// softmax and sums of a chunk of queries of a head group, for heads up to `d` wide.
typedef struct {
    float* tiles;
    float* acc;
    softmax_state* states;
} codes_scratch;

static codes_scratch codes_scratch_new(int64_t d, int64_t group) {
    return (codes_scratch){malloc(sizeof(float) * (size_t)(2 * MAX_TILE * d)),
                           malloc(sizeof(float) * (size_t)(QUERY_CHUNK * group * d)),
                           malloc(sizeof(softmax_state) * (size_t)(QUERY_CHUNK * group))};
}

static void codes_scratch_free(const codes_scratch* t) {
    free(t->states);
    free(t->acc);
    free(t->tiles);
}

// The items, spread over every thread of a team (t: this thread's scratch); returns after a
// barrier. Arguments as kvgen_paged_codes_attention's; q_offsets: [rows + 1] each row's first query.
static void paged_codes_attention_team(const codes_work* items, int64_t num_items, const float* q, float* out,
                                       const int64_t* q_offsets, const int64_t* q_first, int64_t heads,
                                       int64_t kv_heads, int64_t d, float scale, int64_t window,
                                       const packed_codes* key_codes, const packed_codes* value_codes,
                                       int64_t block_size, const int64_t* tables, int64_t table_width,
                                       const int64_t* num_code_blocks, const int64_t* recent_k,
                                       const int64_t* recent_v, const int64_t* recent_head_stride,
                                       const codes_scratch* t) {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; i++) {
        const int64_t r = items[i].row;
        attend_codes_item(&items[i], q, out, q_offsets, q_first, heads, kv_heads, d, scale, window, key_codes,
                          value_codes, block_size, tables + r * table_width, num_code_blocks[r],
                          (const float*)(intptr_t)recent_k[r], (const float*)(intptr_t)recent_v[r],
                          recent_head_stride[r], t->tiles, t->states, t->acc);
    }
}

// q, out: [sum(q_counts), heads, d]. tables: [rows, table_width] pool block ids. recent_k/v: per row
// the address of its fp32 run, with recent_head_stride[r] floats between kv heads.
void kvgen_paged_codes_attention(const float* q, float* out, int64_t rows, const int64_t* q_counts,
                                 const int64_t* q_first, int64_t heads, int64_t kv_heads, int64_t d, float scale,
                                 int64_t window, const packed_codes* key_codes, const packed_codes* value_codes,
                                 int64_t block_size, const int64_t* tables, int64_t table_width,
                                 const int64_t* num_code_blocks, const int64_t* recent_k, const int64_t* recent_v,
                                 const int64_t* recent_head_stride) {
    int64_t num_items = 0;
    for (int64_t r = 0; r < rows; r++) num_items += kv_heads * ((q_counts[r] + QUERY_CHUNK - 1) / QUERY_CHUNK);
    codes_work* items = malloc(sizeof(codes_work) * (size_t)(num_items > 0 ? num_items : 1));
    int64_t* q_offsets = malloc(sizeof(int64_t) * (size_t)(rows + 1));
    int64_t n = 0;
    q_offsets[0] = 0;
    for (int64_t r = 0; r < rows; r++) {
        q_offsets[r + 1] = q_offsets[r] + q_counts[r];
        for (int64_t c = 0; c < q_counts[r]; c += QUERY_CHUNK)
            for (int64_t h = 0; h < kv_heads; h++) {
                const int64_t count = q_counts[r] - c < QUERY_CHUNK ? q_counts[r] - c : QUERY_CHUNK;
                items[n++] = (codes_work){r, h, c, count};
            }
    }
#pragma omp parallel
    {
        const codes_scratch t = codes_scratch_new(d, heads / kv_heads);
        paged_codes_attention_team(items, num_items, q, out, q_offsets, q_first, heads, kv_heads, d, scale, window,
                                   key_codes, value_codes, block_size, tables, table_width, num_code_blocks,
                                   recent_k, recent_v, recent_head_stride, &t);
        codes_scratch_free(&t);
    }
    free(q_offsets);
    free(items);
}
