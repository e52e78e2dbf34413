// Attention of a ragged batch over the engine's paged pool when its blocks hold K/V codes
// (kv/paged_codes.py): the quantized_attention.c tiles, with blocks found through each row's block
// table instead of one sequence's contiguous blocks, and many queries per row (chunked prefill,
// speculative verification) as well as one (decode).
//
// Row r has q_counts[r] queries at positions q_first[r], q_first[r] + 1, ...; its keys are positions
// 0 .. q_first[r] + q_counts[r] - 1: the first num_code_blocks[r] blocks of its table hold codes,
// and the positions after them are one fp32 run per row, "recent" [kv_heads, n, d] (the staged start
// of the row's current block and this forward's new tokens). A query at p sees positions <= p, and
// with window > 0 only those > p - window.
//
// int8 keys and values are read as integers, as the single-sequence cache reads them
// (group_tiles.c): each query head rounded once to int16 codes, a block's keys scored by exact
// integer dots and its values summed with integer weights, block by block, for each query alone.
// Other codecs decode one block's tile for one kv head to fp32, scored by every query of the head
// group in a chunk of queries, and dropped. Either way a query's result depends only on its row's
// blocks and fp32 run, never on the other rows or queries of the batch.
//
// This file is #included by decode.c (after quantized_attention.c).

#define QUERY_CHUNK 16  // queries of one row sharing each decoded tile

typedef struct {
    int64_t row, kv_head, first_query, num_queries;
} codes_work;

// One thread's scratch for attend_codes_item: a decoded key and value tile, and the running
// softmax and sums of a chunk of queries of a head group, for heads up to `d` wide; for int8 codes,
// the chunk's query heads as int16 codes (group_tiles.c group_query) and one tile's scores.
typedef struct {
    float* tiles;
    float* acc;
    softmax_state* states;
    int16_t* q_codes;  // [QUERY_CHUNK * group, d]
    int8_t* q_planes;  // [QUERY_CHUNK * group, 2 * padded_dim(d)]
    float* q_factor;   // [QUERY_CHUNK * group]
    int32_t* q_bias;   // [QUERY_CHUNK * group]
    float* scores;     // [group, MAX_TILE]
} codes_scratch;

static codes_scratch codes_scratch_new(int64_t d, int64_t group) {
    const int64_t heads = QUERY_CHUNK * group;
    return (codes_scratch){malloc(sizeof(float) * (size_t)(2 * MAX_TILE * d)), malloc(sizeof(float) * (size_t)(heads * d)),
                           malloc(sizeof(softmax_state) * (size_t)heads), malloc(sizeof(int16_t) * (size_t)(heads * d)),
                           malloc((size_t)(heads * 2 * padded_dim(d))), malloc(sizeof(float) * (size_t)heads),
                           malloc(sizeof(int32_t) * (size_t)heads), malloc(sizeof(float) * (size_t)(group * MAX_TILE))};
}

static void codes_scratch_free(const codes_scratch* t) {
    free(t->scores), free(t->q_bias), free(t->q_factor), free(t->q_planes), free(t->q_codes);
    free(t->states), free(t->acc), free(t->tiles);
}

// Query i's head group of an item as group_tiles.c reads it (int8 codes prepared in t).
static group_query item_query(const codes_scratch* t, const float* q, int64_t i, int64_t group, int64_t d) {
    const int64_t h = i * group;
    return (group_query){q, t->q_codes + h * d, t->q_factor + h, t->q_planes + h * 2 * padded_dim(d), t->q_bias + h, NULL};
}

// One work item: queries first_query.. of a row, one kv head (its whole query group).
static void attend_codes_item(const codes_work* w, const float* q, float* out, const int64_t* q_offsets,
                              const int64_t* q_first, int64_t heads, int64_t kv_heads, int64_t d, float scale,
                              float cap, const float* sinks, int64_t window, const packed_codes* key_codes, const packed_codes* value_codes,
                              int64_t block_size, const int64_t* table, int64_t num_code_blocks,
                              const float* recent_k, const float* recent_v, int64_t recent_head_stride,
                              const codes_scratch* t) {
    const int64_t group = heads / kv_heads, nq = w->num_queries, coded_end = num_code_blocks * block_size;
    const int64_t first_pos = q_first[w->row] + w->first_query, last_pos = first_pos + nq - 1;
    const int64_t lo = window > 0 && first_pos + 1 > window ? first_pos + 1 - window : 0;
    const int integer = key_codes->kind == CODES_INT8_KEYS && value_codes->kind == CODES_INT8;
    const int64_t G = key_group(key_codes->code_block_stride / d);
    softmax_state* states = t->states;
    float* acc = t->acc;
    float* key_tile = t->tiles;
    float* value_tile = t->tiles + MAX_TILE * d;
    for (int64_t i = 0; i < nq * group; i++) {
        // query i / group's head i % group of the kv head's group
        states[i] = softmax_start(cap, sinks ? sinks + w->kv_head * group + i % group : NULL);
        for (int64_t j = 0; j < d; j++) acc[i * d + j] = 0.0f;
    }
    const float* queries = q + ((q_offsets[w->row] + w->first_query) * heads + w->kv_head * group) * d;  // query i: + i heads d
    if (integer)
        for (int64_t i = 0; i < nq * group; i++) {
            const float* query = queries + (i / group * heads + i % group) * d;
            quantize_query(query, d, scale, t->q_codes + i * d, t->q_factor + i);
            query_planes(t->q_codes + i * d, d, t->q_planes + i * 2 * padded_dim(d), t->q_bias + i);
        }
    for (int64_t pos = lo; pos <= last_pos;) {
        int64_t count;
        const float *keys = NULL, *values = NULL;
        const int64_t index = pos / block_size, offset = pos % block_size;
        if (pos < coded_end) {
            count = block_size - offset;
            if (count > last_pos + 1 - pos) count = last_pos + 1 - pos;
            if (count > MAX_TILE) count = MAX_TILE;
            if (!integer) {
                decode_tile(key_codes, w->kv_head, table[index], offset, count, d, pos, key_tile);
                decode_tile(value_codes, w->kv_head, table[index], offset, count, d, pos, value_tile);
                keys = key_tile, values = value_tile;
            }
        } else {
            count = last_pos + 1 - pos;
            if (count > MAX_TILE) count = MAX_TILE;
            keys = recent_k + w->kv_head * recent_head_stride + (pos - coded_end) * d;
            values = recent_v + w->kv_head * recent_head_stride + (pos - coded_end) * d;
        }
        const float *key_rows[MAX_TILE], *value_rows[MAX_TILE];
        for (int64_t i = 0; keys != NULL && i < count; i++) key_rows[i] = keys + i * d, value_rows[i] = values + i * d;
        for (int64_t i = 0; i < nq; i++) {  // the part of the tile query i sees: [from, to)
            const int64_t p = first_pos + i;
            const int64_t start = window > 0 && p + 1 > window ? p + 1 - window : 0;
            const int64_t from = start > pos ? start : pos, to = p + 1 < pos + count ? p + 1 : pos + count;
            if (from >= to) continue;
            if (keys == NULL) {  // int8 codes of one block: integer scores and value sums
                const int64_t block = table[index], first = offset + from - pos, n = to - from;
                const group_query gq = item_query(t, queries + i * heads * d, i, group, d);
                const codes_part k = codes_at(key_codes, w->kv_head, block, first, d);
                const codes_part v = codes_at(value_codes, w->kv_head, block, first, d);
                int8_key_scores(&gq, group, (const int8_t*)codes_at(key_codes, w->kv_head, block, 0, d).codes, G, first,
                                k.step, n, d, t->scores);
                for (int64_t g = 0; g < group; g++)
                    softmax_fold(t->scores + g * MAX_TILE, n, &states[i * group + g], acc + (i * group + g) * d, d);
                group_weighted_sums(t->scores, (const int8_t*)v.codes, v.step, NULL, n, d, group, acc + i * group * d, d);
                continue;
            }
            for (int64_t g = 0; g < group; g++)
                attend_tile(queries + (i * heads + g) * d, key_rows + (from - pos), value_rows + (from - pos), to - from,
                            d, scale, &states[i * group + g], acc + (i * group + g) * d);
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

// The items, spread over every thread of a team (t: this thread's scratch); returns after a
// barrier. Arguments as kvgen_paged_codes_attention's (cap: see softmax_state); q_offsets: [rows +
// 1] each row's first query.
static void paged_codes_attention_team(const codes_work* items, int64_t num_items, const float* q, float* out,
                                       const int64_t* q_offsets, const int64_t* q_first, int64_t heads,
                                       int64_t kv_heads, int64_t d, float scale, float cap, const float* sinks,
                                       int64_t window,
                                       const packed_codes* key_codes, const packed_codes* value_codes,
                                       int64_t block_size, const int64_t* tables, int64_t table_width,
                                       const int64_t* num_code_blocks, const int64_t* recent_k,
                                       const int64_t* recent_v, const int64_t* recent_head_stride,
                                       const codes_scratch* t) {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; i++) {
        const int64_t r = items[i].row;
        attend_codes_item(&items[i], q, out, q_offsets, q_first, heads, kv_heads, d, scale, cap, sinks, window, key_codes,
                          value_codes, block_size, tables + r * table_width, num_code_blocks[r],
                          (const float*)(intptr_t)recent_k[r], (const float*)(intptr_t)recent_v[r],
                          recent_head_stride[r], t);
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
        paged_codes_attention_team(items, num_items, q, out, q_offsets, q_first, heads, kv_heads, d, scale, 0.0f, NULL, window,
                                   key_codes, value_codes, block_size, tables, table_width, num_code_blocks,
                                   recent_k, recent_v, recent_head_stride, &t);
        codes_scratch_free(&t);
    }
    free(q_offsets);
    free(items);
}
