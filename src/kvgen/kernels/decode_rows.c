// The rows step: every block for rows of one-token rows (decodes of many sequences, or several
// tokens of one: a verify, a prompt), each row computed as the batch-1 step computes a lone token.
//
// This file is #included by decode.c (after paged_codes_attention.c).

// Scratch for a step of `rows` one-token rows (decode_rows): each buffer holds every row.
typedef struct {
    float* x;        // [rows, widest]: normed inputs, then the MLP's activations
    float* y;        // [rows, hidden]: sublayer outputs before the residual add
    float* qkv_out;  // [rows, (heads + 2 kv_heads) * head_dim]
    float* attn;     // [rows, heads * head_dim]
    float* mlp;      // [rows, 2 * intermediate]
    void* xq;        // activation blocks for [rows, widest]
} rows_scratch;

// Where a step of one-token rows keeps keys and values. Each row's new key/value go to
// (base, tables + r * table_width, write_pos[r]) as kv_layout addresses them. A pool split into
// layer groups (kv/layer_groups.py) keeps layer l in slot layer_slot[l] of each block and reads it
// through its group's tables, tables + layer_group[l] * rows * table_width; NULL: slot l, one table. Attention reads the same
// fp32 store (codes == NULL), or, over a pool of K/V codes, the row's code blocks plus the fp32 run
// that starts at its staging slot (kv/paged_codes.py): then tables hold each row's slot and
// write_pos its offset in the block.
typedef struct {
    float *k_base, *v_base;
    int64_t layer_stride, head_stride, pos_stride, block_stride, block_size;
    const int64_t* tables;
    int64_t table_width;
    const int64_t* write_pos;
    const packed_codes* key_codes;    // [layers], or NULL
    const packed_codes* value_codes;  // [layers]
    const int64_t* code_tables;       // [rows, code_table_width] pool block ids
    int64_t code_table_width, code_block_size;
    const int64_t* num_code_blocks;   // [rows]
    const int64_t* layer_slot;        // [layers], or NULL
    const int64_t* layer_group;       // [layers], or NULL
} rows_kv;

static float* layer_store(const rows_kv* kv, float* base, int64_t layer) {
    return base + (kv->layer_slot != NULL ? kv->layer_slot[layer] : layer) * kv->layer_stride;
}

// Row r's block table for `layer` (its layer group's).
static const int64_t* row_table(const rows_kv* kv, int64_t layer, int64_t rows, int64_t r) {
    const int64_t group = kv->layer_group != NULL ? kv->layer_group[layer] : 0;
    return kv->tables + (group * rows + r) * kv->table_width;
}

static void linear_rows(const qlinear* l, const float* x, void* xq, float* y, int64_t rows) {
    if (l->kind == 0) {
        kvgen_linear_q4x8((const block_q4x8*)l->blocks, x, (block_x8*)xq, y, rows, l->n, l->k);
    } else if (l->kind == 1) {
        kvgen_linear_q8x8((const block_q8x8*)l->blocks, x, (block_x8*)xq, y, rows, l->n, l->k);
    } else if (l->kind == 2) {
        kvgen_linear_q8sx8((const block_q8sx8*)l->blocks, x, (block_x8*)xq, y, rows, l->n, l->k);
    } else if (l->kind == 3) {
        kvgen_linear_q5x8((const block_q5x8*)l->blocks, x, (block_x8*)xq, y, rows, l->n, l->k);
    } else if (l->kind == 4) {
        kvgen_linear_q4kx8((const block_q4kx8*)l->blocks, x, (block_x8*)xq, y, rows, l->n, l->k);
    } else {
        kvgen_linear_q6kx8((const block_q6kx8*)l->blocks, x, (block_x8*)xq, y, rows, l->n, l->k);
    }
    if (l->has_bias) {
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < l->n; i++) y[r * l->n + i] += l->bias[i];
    }
}

// One layer's attention for every row, the new keys/values already stored.
static void attend_rows(const block_t* b, int64_t layer, int64_t rows, const rows_kv* kv, const int64_t* positions,
                        int64_t window, const rows_scratch* s) {
    const int64_t d = b->head_dim, nq = b->num_heads * d, qkv_width = nq + 2 * b->num_kv_heads * d;
    float* k_layer = layer_store(kv, kv->k_base, layer);
    float* v_layer = layer_store(kv, kv->v_base, layer);
    if (kv->key_codes != NULL) {
        int64_t* plan = malloc(sizeof(int64_t) * (size_t)(5 * rows));  // counts, firsts, recent K, V, strides
        float* q = malloc(sizeof(float) * (size_t)(rows * nq));
        for (int64_t r = 0; r < rows; r++) {
            const kv_layout kl = {k_layer, kv->head_stride, kv->pos_stride, kv->block_stride, kv->block_size, kv->tables + r * kv->table_width};
            const kv_layout vl = {v_layer, kv->head_stride, kv->pos_stride, kv->block_stride, kv->block_size, kv->tables + r * kv->table_width};
            plan[r] = 1, plan[rows + r] = positions[r];
            plan[2 * rows + r] = (int64_t)(intptr_t)kv_at(&kl, 0, 0);
            plan[3 * rows + r] = (int64_t)(intptr_t)kv_at(&vl, 0, 0);
            plan[4 * rows + r] = kv->head_stride;
            memcpy(q + r * nq, s->qkv_out + r * qkv_width, (size_t)nq * sizeof(float));
        }
        kvgen_paged_codes_attention(q, s->attn, rows, plan, plan + rows, b->num_heads, b->num_kv_heads, d, b->scale,
                                    window, &kv->key_codes[layer], &kv->value_codes[layer], kv->code_block_size,
                                    kv->code_tables, kv->code_table_width, kv->num_code_blocks, plan + 2 * rows,
                                    plan + 3 * rows, plan + 4 * rows);
        free(q);
        free(plan);
        return;
    }
    const head_units units = attention_units(rows, b->num_heads, b->num_kv_heads);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t u = 0; u < rows * units.kv_heads * units.parts; u++) {
        int64_t r, head;
        const int64_t count = unit_heads(&units, u, &r, &head), end = positions[r] + 1;
        const int64_t start = window > 0 && end > window ? end - window : 0;
        const kv_layout kl = {k_layer, kv->head_stride, kv->pos_stride, kv->block_stride, kv->block_size, row_table(kv, layer, rows, r)};
        const kv_layout vl = {v_layer, kv->head_stride, kv->pos_stride, kv->block_stride, kv->block_size, row_table(kv, layer, rows, r)};
        attend_heads(s->qkv_out + r * qkv_width + head * d, s->attn + r * nq + head * d, count, &kl, &vl,
                     head / units.group, start, end, b->scale, d);
    }
}

// Every block for a batch of one-token rows: as kvgen_decode_layers does for one row, with the
// matmuls of all rows in one tiled GEMM per weight. Row r is at positions[r] and has its own RoPE:
// rope [rows, kinds, 2, d]. Keys and values: see rows_kv. lora: [num_layers, LORA_LINEARS] adapter
// deltas or NULL; lora_slots[r]: row r's adapter slot (-1: none; rows without one get the bits of
// the base-only step).
static void decode_rows(const block_t* blocks, int64_t num_layers, int64_t rows, float* h, const float* rope,
                        int64_t num_rope_kinds, const int64_t* rope_kind, const int64_t* window, const rows_kv* kv,
                        const int64_t* positions, const rows_scratch* s, const lora_linear* lora,
                        const int64_t* lora_slots) {
    for (int64_t layer = 0; layer < num_layers; layer++) {
        const block_t* b = &blocks[layer];
        const lora_linear* ll = lora ? lora + layer * LORA_LINEARS : NULL;
        const int64_t hidden = b->hidden, d = b->head_dim, nq = b->num_heads * d, nkv = b->num_kv_heads * d;
        const int64_t qkv_width = nq + 2 * nkv, inter = b->intermediate;
        float* k_layer = layer_store(kv, kv->k_base, layer);
        float* v_layer = layer_store(kv, kv->v_base, layer);
        for (int64_t r = 0; r < rows; r++) rms_norm(h + r * hidden, b->input_norm, b->eps, hidden, s->x + r * hidden);
        linear_rows(&b->qkv, s->x, s->xq, s->qkv_out, rows);
        if (ll) lora_rows(&ll[LORA_QKV], &b->qkv, s->x, s->qkv_out, rows, lora_slots);
        for (int64_t r = 0; r < rows; r++) {  // QK-norm, RoPE, and the new key/value into the row's slot
            const float* cos = rope + (r * num_rope_kinds + rope_kind[layer]) * 2 * d;
            float* q = s->qkv_out + r * qkv_width;
            float* k = q + nq;
            const float* v = k + nkv;
            const kv_layout kl = {k_layer, kv->head_stride, kv->pos_stride, kv->block_stride, kv->block_size, row_table(kv, layer, rows, r)};
            const kv_layout vl = {v_layer, kv->head_stride, kv->pos_stride, kv->block_stride, kv->block_size, row_table(kv, layer, rows, r)};
            for (int64_t head = 0; head < b->num_heads; head++) {
                if (b->q_norm) rms_norm(q + head * d, b->q_norm, b->eps, d, q + head * d);
                rotate_half(q + head * d, cos, cos + d, d);
            }
            for (int64_t head = 0; head < b->num_kv_heads; head++) {
                if (b->k_norm) rms_norm(k + head * d, b->k_norm, b->eps, d, k + head * d);
                rotate_half(k + head * d, cos, cos + d, d);
                memcpy((float*)kv_at(&kl, head, kv->write_pos[r]), k + head * d, (size_t)d * sizeof(float));
                memcpy((float*)kv_at(&vl, head, kv->write_pos[r]), v + head * d, (size_t)d * sizeof(float));
            }
        }
        attend_rows(b, layer, rows, kv, positions, window[layer], s);
        linear_rows(&b->o, s->attn, s->xq, s->y, rows);
        if (ll) lora_rows(&ll[LORA_O], &b->o, s->attn, s->y, rows, lora_slots);
        for (int64_t r = 0; r < rows; r++) {
            add_residual(h + r * hidden, s->y + r * hidden, b->attn_out_norm, b->eps, hidden);
            rms_norm(h + r * hidden, b->mlp_in_norm, b->eps, hidden, s->x + r * hidden);
        }
        linear_rows(&b->gate_up, s->x, s->xq, s->mlp, rows);
        if (ll) lora_rows(&ll[LORA_GATE_UP], &b->gate_up, s->x, s->mlp, rows, lora_slots);
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < rows; r++)  // act(gate) * up, packed [rows, inter] into x for down()
            gated_activation(s->mlp + r * 2 * inter, s->mlp + r * 2 * inter + inter, s->x + r * inter, inter, b->gelu);
        linear_rows(&b->down, s->x, s->xq, s->y, rows);
        if (ll) lora_rows(&ll[LORA_DOWN], &b->down, s->x, s->y, rows, lora_slots);
        for (int64_t r = 0; r < rows; r++) add_residual(h + r * hidden, s->y + r * hidden, b->mlp_out_norm, b->eps, hidden);
    }
}

// Every block for one-token rows over one fp32 paged store: row r reads its blocks through
// tables[r * table_width ..] (per layer group, with layer_slot / layer_group: see rows_kv).
void kvgen_decode_rows(const block_t* blocks, int64_t num_layers, int64_t rows, float* h, const float* rope,
                       int64_t num_rope_kinds, const int64_t* rope_kind, const int64_t* window, float* k_base,
                       float* v_base, int64_t layer_stride, int64_t head_stride, int64_t pos_stride,
                       int64_t block_stride, int64_t block_size, const int64_t* tables, int64_t table_width,
                       const int64_t* layer_slot, const int64_t* layer_group, const int64_t* positions,
                       const rows_scratch* s, const lora_linear* lora, const int64_t* lora_slots) {
    const rows_kv kv = {k_base, v_base, layer_stride, head_stride, pos_stride, block_stride, block_size, tables,
                        table_width, positions, NULL, NULL, NULL, 0, 0, NULL, layer_slot, layer_group};
    decode_rows(blocks, num_layers, rows, h, rope, num_rope_kinds, rope_kind, window, &kv, positions, s, lora, lora_slots);
}

// Every block for one-token rows over a pool of K/V codes (kv/paged_codes.py): the new key/value go
// to the row's staging slot (stage_* [layers, slots, kv_heads, block_size, d], slots[r], at
// positions[r] % block_size); attention reads the row's code blocks and the slot.
void kvgen_decode_rows_over_codes(const block_t* blocks, int64_t num_layers, int64_t rows, float* h,
                                  const float* rope, int64_t num_rope_kinds, const int64_t* rope_kind,
                                  const int64_t* window, float* stage_k, float* stage_v, int64_t layer_stride,
                                  int64_t head_stride, int64_t slot_stride, int64_t block_size, const int64_t* slots,
                                  const int64_t* offsets, const packed_codes* key_codes,
                                  const packed_codes* value_codes, const int64_t* code_tables,
                                  int64_t code_table_width, const int64_t* num_code_blocks, const int64_t* positions,
                                  const rows_scratch* s, const lora_linear* lora, const int64_t* lora_slots) {
    const int64_t d = blocks[0].head_dim;
    const rows_kv kv = {stage_k, stage_v, layer_stride, head_stride, d, slot_stride, block_size, slots, 1, offsets,
                        key_codes, value_codes, code_tables, code_table_width, block_size, num_code_blocks, NULL, NULL};
    decode_rows(blocks, num_layers, rows, h, rope, num_rope_kinds, rope_kind, window, &kv, positions, s, lora, lora_slots);
}
