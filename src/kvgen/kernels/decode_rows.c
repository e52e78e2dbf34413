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
    void* xq;        // activation blocks for [rows, widest] (the 16-bit float kinds: the rows' floats)
} rows_scratch;

// Where a step of one-token rows keeps keys and values. Each row's new key/value go to
// (base, tables + r * table_width, write_pos[r]) as kv_layout addresses them. A pool split into
// layer groups (kv/layer_groups.py) keeps layer l in slot layer_slot[l] of each block and reads it
// through its group's tables, tables + layer_group[l] * rows * table_width; NULL: slot l, one table. Attention reads the same
// fp32 store (codes == NULL), or, over a pool of K/V codes, the row's code blocks plus the fp32 run
// that starts at its staging slot (kv/paged_codes.py): then tables hold each row's slot and
// write_pos its offset in the block. Rows that each keep their own buffers (a hybrid model's
// contiguous caches, one per sequence) give row_stores instead of a base and tables.
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
    const int64_t* tails;             // [rows, tail_width]: a token tree's paths (kv_layout's tail), or NULL
    int64_t tail_width, tail_start;
    // [layers, rows, 3]: row r's own keys and values of a layer (the addresses of its [kv_heads,
    // capacity, d] buffers) and their head stride; positions pos_stride apart. NULL: the base's.
    const int64_t* row_stores;
} rows_kv;

static float* layer_store(const rows_kv* kv, float* base, int64_t layer) {
    return base + (kv->layer_slot != NULL ? kv->layer_slot[layer] : layer) * kv->layer_stride;
}

// Row r's block table for `layer` (its layer group's).
static const int64_t* row_table(const rows_kv* kv, int64_t layer, int64_t rows, int64_t r) {
    const int64_t group = kv->layer_group != NULL ? kv->layer_group[layer] : 0;
    return kv->tables + (group * rows + r) * kv->table_width;
}

// Where row r reads and writes one layer's keys (values == 0) or values.
static kv_layout row_layout(const rows_kv* kv, int values, int64_t layer, int64_t rows, int64_t r) {
    if (kv->row_stores != NULL) {  // the row's own buffer, one strided run of positions
        const int64_t* own = kv->row_stores + (layer * rows + r) * 3;
        return (kv_layout){(const float*)(intptr_t)own[values], own[2], kv->pos_stride, 0, 0, NULL, NULL, 0};
    }
    return (kv_layout){layer_store(kv, values ? kv->v_base : kv->k_base, layer), kv->head_stride, kv->pos_stride,
                       kv->block_stride, kv->block_size, row_table(kv, layer, rows, r),
                       kv->tails != NULL ? kv->tails + r * kv->tail_width : NULL, kv->tail_start};
}

// The rows step runs in one OpenMP parallel region for all its layers, as the batch-1 step does
// (decode.c, thread_scratch): each matmul is the GEMM's team function over every row, the per-row
// work (norms, RoPE, the new keys and values, residuals, the activation, quantizing the next
// linear's input) is split over the team by rows, attention by head units, and a barrier closes
// each phase. A fork and join per matmul, attention and activation cost ~1.2 us each on two Zen 4
// cores, with the per-row work and a linear's bias run by one thread between them. Every output
// is computed by one thread in the order it had before, so a row's bits do not depend on the team.

// The codes branch's shared scratch (attention over a pool of K/V codes: paged_codes_attention_team).
typedef struct {
    float* q;             // [rows, widest heads * d]: each row's rotated queries, packed
    int64_t* plan;        // [5 * rows]: query counts, first positions, recent K and V addresses, head strides
    codes_work* items;    // [rows * most kv heads]: one per row and kv head
    int64_t* q_offsets;   // [rows + 1]: row r's query is query r
    int64_t d, group;     // the widest head and head group (each thread's codes_scratch)
} rows_codes;

// A mixture's routing of the rows (blocks with experts): each row's top_k experts and weights, and
// per expert the rows routed to it (ascending), where in their top_k, and their sums of outputs.
typedef struct {
    int64_t* ids;      // [rows, top_k] ascending, from route_experts
    float* weights;    // [rows, top_k]
    float* scores;     // [rows, most experts]: router scores
    int64_t* starts;   // [most experts + 1]: expert e's rows are members[starts[e] .. starts[e + 1])
    int64_t* fill;     // [most experts]: while listing them, where expert e's next member goes
    int64_t* members;  // [rows * top_k]: row r * top_k + j
    float* sum;        // [rows, hidden]: each row's weighted sum of its experts
} rows_experts;

// One rows step's arguments and shared scratch (see decode_rows).
typedef struct {
    const block_t* blocks;
    int64_t num_layers, rows;
    float* h;  // [rows, hidden]
    const float* rope;
    int64_t num_rope_kinds;
    const int64_t *rope_kind, *window;
    const rows_kv* kv;
    const int64_t* positions;
    const rows_scratch* s;
    const lora_linear* lora;
    const int64_t* lora_slots;
    int32_t* sums;  // [rows, widest / 32]: activation blocks' code sums (the q5 and iq4 kernels' offsets)
    float* xa;      // [rows, widest LoRA]: A x of each row
    rows_codes codes;
    rows_experts experts;
} rows_step;

static inline int kind_takes_sums(int32_t kind) {
#define SUMS_OF(STEM, SUMS) return (SUMS);
    FOR_KIND(kind, SUMS_OF)
#undef SUMS_OF
}

// Row r of x [rows, l->k] as the activation blocks linear l reads (s->xq [rows, l->k / 32]), with
// their code sums where its kernel takes them: each block's codes depend on its 32 values alone.
static void quantize_row(const rows_step* st, const qlinear* l, const float* x, int64_t r) {
    if (kind_is_half(l->kind)) {  // these kinds read the floats
        memcpy((float*)st->s->xq + r * l->k, x + r * l->k, (size_t)l->k * sizeof(float));
        return;
    }
    const int64_t nb = l->k / QK;
    block_x8* xq = (block_x8*)st->s->xq;
    quantize_x8_range(x, r * nb, (r + 1) * nb, xq);
    if (kind_takes_sums(l->kind)) x8_sums_into(xq + r * nb, nb, st->sums + r * nb);
}

// y [rows, l->n] = linear l of the first `rows` quantized rows (s->xq) + its bias, by the team;
// returns after the GEMM's barrier. Each output is summed as any other row count sums it (interleaved.c).
static void gemm_rows_team(const rows_step* st, const qlinear* l, float* y, int64_t rows) {
    const block_x8* xq = (const block_x8*)st->s->xq;
    const float* bias = l->has_bias ? l->bias : NULL;
#define GEMM_OF(STEM, SUMS) \
    kvgen_gemm_##STEM##_team((const block_##STEM*)l->blocks, xq, (SUMS) ? st->sums : NULL, y, rows, l->n, l->k, bias);
    FOR_KIND(l->kind, GEMM_OF)
#undef GEMM_OF
}

static void linear_rows_team(const rows_step* st, const qlinear* l, float* y) { gemm_rows_team(st, l, y, st->rows); }

// One row of linear l's input (l->k values) quantized into slot `to` of s->xq (and its sums).
static void quantize_row_into(const rows_step* st, const qlinear* l, const float* row, int64_t to) {
    if (kind_is_half(l->kind)) {
        memcpy((float*)st->s->xq + to * l->k, row, (size_t)l->k * sizeof(float));
        return;
    }
    const int64_t nb = l->k / QK;
    block_x8* xq = (block_x8*)st->s->xq + to * nb;
    quantize_x8_range(row, 0, nb, xq);
    if (kind_takes_sums(l->kind)) x8_sums_into(xq, nb, st->sums + to * nb);
}

// Qwen2-MoE's shared expert over every row, by the team: added to each row's sum after its routed
// experts, scaled by its gate, as the batch-1 step adds it.
static void shared_expert_rows_team(const rows_step* st, const block_t* b) {
    const rows_scratch* s = st->s;
    const int64_t rows = st->rows, hidden = b->hidden, m = b->shared_intermediate;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) quantize_row_into(st, &b->shared_gate_up, s->x + r * hidden, r);
    gemm_rows_team(st, &b->shared_gate_up, s->mlp, rows);
    const int64_t width = b->shared_gate_up.n;  // 2 m gated, m for an ungated up projection (act 3)
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float* gate = s->mlp + r * width;
        gated_activation(gate, gate + m, gate, m, b);
        quantize_row_into(st, &b->shared_down, gate, r);
    }
    gemm_rows_team(st, &b->shared_down, s->y, rows);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float w = shared_expert_gate(b, s->x + r * hidden);
        float* sum = st->experts.sum + r * hidden;
        for (int64_t c = 0; c < hidden; c++) sum[c] += w * s->y[r * hidden + c];
    }
}

// The mixture for every row, by the team (s->x: the rows' normed inputs; leaves each row's sum of
// weight * expert in e->sum). Experts run in ascending order, each once over the rows routed to
// it, gathered into one GEMM: a row's bits are the batch-1 step's (experts_team in decode.c).
static void experts_rows_team(const rows_step* st, const block_t* b) {
    const rows_scratch* s = st->s;
    const rows_experts* e = &st->experts;
    const int64_t rows = st->rows, hidden = b->hidden, inter = b->intermediate, k = b->top_k;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float* scores = e->scores + r * b->num_experts;
        for (int64_t x = 0; x < b->num_experts; x++) scores[x] = router_score(b, x, s->x + r * hidden);
        route_experts(b, scores, e->ids + r * k, e->weights + r * k);
        for (int64_t i = 0; i < hidden; i++) e->sum[r * hidden + i] = 0.0f;
    }
#pragma omp single
    {  // per expert, its rows in ascending order
        for (int64_t x = 0; x <= b->num_experts; x++) e->starts[x] = 0;
        for (int64_t m = 0; m < rows * k; m++) e->starts[e->ids[m] + 1]++;
        for (int64_t x = 0; x < b->num_experts; x++) e->starts[x + 1] += e->starts[x];
        for (int64_t x = 0; x < b->num_experts; x++) e->fill[x] = e->starts[x];
        for (int64_t m = 0; m < rows * k; m++) e->members[e->fill[e->ids[m]]++] = m;
    }
    for (int64_t x = 0; x < b->num_experts; x++) {
        const int64_t first = e->starts[x], count = e->starts[x + 1] - first;
        if (count == 0) continue;
        const qlinear *gate_up = &b->expert_gate_up[x], *down = &b->expert_down[x];
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++) quantize_row_into(st, gate_up, s->x + (e->members[first + i] / k) * hidden, i);
        gemm_rows_team(st, gate_up, s->mlp, count);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++) {  // act(gate) * up in place of gate, then quantized for down()
            float* gate = s->mlp + i * gate_up->n;  // 2 inter gated, inter for an ungated up projection
            gated_activation(gate, gate + inter, gate, inter, b);
            quantize_row_into(st, down, gate, i);
        }
        gemm_rows_team(st, down, s->y, count);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++) {
            const int64_t m = e->members[first + i];
            const float w = e->weights[m];
            float* sum = e->sum + (m / k) * hidden;
            for (int64_t c = 0; c < hidden; c++) sum[c] += w * s->y[i * hidden + c];
        }
    }
    if (b->shared_intermediate > 0) shared_expert_rows_team(st, b);
}

// A linear of the rows, then the LoRA delta of each row with an adapter (x: the linear's input).
static void linear_lora_rows_team(const rows_step* st, int64_t layer, int which, const qlinear* l, const float* x,
                                  float* y) {
    linear_rows_team(st, l, y);
    const lora_linear* lora = st->lora ? st->lora + layer * LORA_LINEARS : NULL;
    lora_team(lora, which, l, x, y, st->rows, st->lora_slots, st->xa);
}

// Row r's input to `layer`: its normed h, quantized for the QKV linear.
static void row_input(const rows_step* st, int64_t layer, int64_t r) {
    const block_t* b = &st->blocks[layer];
    float* x = st->s->x + r * b->hidden;
    norm_input(st->h + r * b->hidden, b->input_norm, b->eps, b->hidden, x);
    quantize_row(st, &b->qkv, st->s->x, r);
}

// Row r's QK-norm and RoPE, its new key and value into its slot and, over codes, its query packed
// and its attention work item for each kv head.
static void row_rotate(const rows_step* st, int64_t layer, int64_t r) {
    const block_t* b = &st->blocks[layer];
    const rows_kv* kv = st->kv;
    const int64_t d = b->head_dim, nq = b->num_heads * d, nkv = b->num_kv_heads * d, rows = st->rows;
    const float* cos = st->rope + (r * st->num_rope_kinds + st->rope_kind[layer]) * 2 * d;
    float* q = st->s->qkv_out + r * (nq + 2 * nkv);
    float* k = q + nq;
    const float* v = b->mla_rank > 0 ? k : k + nkv;  // latent attention's value is its (turned) key
    const kv_layout kl = row_layout(kv, 0, layer, rows, r), vl = row_layout(kv, 1, layer, rows, r);
    qk_norm(b, q, b->q_norm, b->num_heads);
    qk_norm(b, k, b->k_norm, b->num_kv_heads);
    for (int64_t head = 0; head < b->num_heads; head++) rotate_half(q + head * d, cos, cos + d, b->rotary_dim);
    for (int64_t head = 0; head < b->num_kv_heads; head++) {
        rotate_half(k + head * d, cos, cos + d, b->rotary_dim);
        memcpy((float*)kv_at(&kl, head, kv->write_pos[r]), k + head * d, (size_t)d * sizeof(float));
        memcpy((float*)kv_at(&vl, head, kv->write_pos[r]), v + head * d, (size_t)d * sizeof(float));
    }
    if (kv->key_codes != NULL) {  // the row's fp32 run starts at its staging slot's position 0
        const rows_codes* c = &st->codes;
        c->plan[r] = 1, c->plan[rows + r] = st->positions[r];
        c->plan[2 * rows + r] = (int64_t)(intptr_t)kv_at(&kl, 0, 0);
        c->plan[3 * rows + r] = (int64_t)(intptr_t)kv_at(&vl, 0, 0);
        c->plan[4 * rows + r] = kv->head_stride;
        memcpy(c->q + r * nq, q, (size_t)nq * sizeof(float));
        for (int64_t head = 0; head < b->num_kv_heads; head++)
            c->items[r * b->num_kv_heads + head] = (codes_work){r, head, 0, 1};
    }
}

// Whether row r's newest keys are read by its neighbour row too (the rows of one prompt or one
// verify share their block table). Only the speed depends on it, never the bits.
static int row_shares_keys(const rows_kv* kv, int64_t layer, int64_t rows, int64_t r, int64_t end) {
    if (rows < 2 || kv->row_stores != NULL) return 0;
    const int64_t neighbour = r + 1 < rows ? r + 1 : r - 1, block = (end - 1) / kv->block_size;
    return row_table(kv, layer, rows, r)[block] == row_table(kv, layer, rows, neighbour)[block];
}

// Rows attend in blocks of up to ROW_BLOCK, tile by tile in turn: a prompt's rows read the same
// key and value tiles, which then come from L2 once per block instead of once per row (at 2,048
// positions a row's tiles for one kv head are ~1 MB, and its attention waited on L2 loads). Each
// row's tiles are still taken in its own order, so its bits are those of attend_heads alone.
#define ROW_BLOCK 16

// Rows per attention unit, in blocks of equal size give or take a row. Rows that share their keys
// (a prompt's, a verify's) go in blocks as large as leave every thread two units, so that a block
// reads each tile once (a verify of 8 rows at 2,048 positions 1.40x as fast as one row a unit,
// 1.11x at 200; SmolLM2, in-process turns); other rows (a batch of requests, whose lengths differ)
// in blocks that leave every thread 8 or more units, down to one row.
static int64_t rows_per_unit(int64_t rows, int64_t units_per_row, int shared) {
    const int64_t units_per_thread = shared ? 2 : 8;
    int64_t wanted = rows * units_per_row / (units_per_thread * (int64_t)omp_get_num_threads());
    wanted = wanted < 1 ? 1 : wanted > ROW_BLOCK ? ROW_BLOCK : wanted;
    const int64_t blocks = (rows + wanted - 1) / wanted;
    return (rows + blocks - 1) / blocks;
}

// Whether a row's keys are read in tile_scores' `cached` order: where other rows read the same keys
// just before it, those of its block or, in a step of many rows, of the units beside it. A lone row
// of a few streams them (a 2-row verify at 2,048 positions ran 0.95x in the cached order).
#define CACHED_ROWS 16
static int row_keys_cached(const rows_kv* kv, int64_t layer, int64_t rows, int64_t r, int64_t end, int64_t block_rows) {
    return (block_rows >= 2 || rows >= CACHED_ROWS) && row_shares_keys(kv, layer, rows, r, end);
}

// Heads [head, head + count) of rows r0 .. r0 + n - 1 over their keys, tile by tile in turn: each
// row's tile as attend_heads takes it, the tile's addresses listed once for the rows that share them.
static void attend_row_block(const rows_step* st, int64_t layer, int64_t r0, int64_t n, int64_t head, int64_t count,
                             int64_t group) {
    const block_t* b = &st->blocks[layer];
    const rows_kv* kv = st->kv;
    const int64_t d = b->head_dim, nq = b->num_heads * d, qkv_width = nq + 2 * b->num_kv_heads * d, rows = st->rows;
    const int64_t window = st->window[layer], kv_head = head / group;
    kv_layout kl[ROW_BLOCK], vl[ROW_BLOCK];
    softmax_state state[ROW_BLOCK][MAX_HEAD_RUN];
    int64_t start[ROW_BLOCK], end[ROW_BLOCK], tiles = 0;
    int cached[ROW_BLOCK];
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = r0 + i;
        end[i] = st->positions[r] + 1;
        start[i] = window > 0 && end[i] > window ? end[i] - window : 0;
        kl[i] = row_layout(kv, 0, layer, rows, r), vl[i] = row_layout(kv, 1, layer, rows, r);
        cached[i] = row_keys_cached(kv, layer, rows, r, end[i], n);
        attend_begin(st->s->attn + r * nq + head * d, count, d, b->softcap, b->sinks ? b->sinks + head : NULL, state[i]);
        const int64_t row_tiles = (end[i] - start[i] + 31) / 32;
        tiles = row_tiles > tiles ? row_tiles : tiles;
    }
    tile_rows listed = {.first = -1};
#ifdef TRANSPOSED_SCORES
    // A tile's keys transposed once serve the block's rows (from about four rows the transposition
    // costs less than what the rows' scores save).
    float kt[KT_WIDTH * MAX_KT_DIM] __attribute__((aligned(64)));
    listed.kt = n >= 4 ? kt : NULL;
#endif
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t i = 0; i < n; i++) {
            const int64_t first = start[i] + 32 * t;
            if (first >= end[i]) continue;
            attend_listed_tile(&listed, st->s->qkv_out + (r0 + i) * qkv_width + head * d,
                               st->s->attn + (r0 + i) * nq + head * d, count, &kl[i], &vl[i], kv_head, first, end[i],
                               b->scale, d, cached[i], state[i]);
        }
    }
    for (int64_t i = 0; i < n; i++) attend_end(st->s->attn + (r0 + i) * nq + head * d, count, d, state[i]);
}

// Row r's latent-attention query and key into its qkv_out slots, from its raw projection in
// s->mlp; row_rotate then turns and stores them as any row's, the turned key as the value too.
static void mla_row(const rows_step* st, const block_t* b, int64_t r) {
    const int64_t d = b->head_dim, nq = b->num_heads * d, raw_width = b->qkv.n;
    const float* raw = st->s->mlp + r * raw_width;
    float* q = st->s->qkv_out + r * (nq + 2 * d);
    for (int64_t h = 0; h < b->num_heads; h++) mla_query(b, raw, h, q + h * d);
    mla_key(b, raw, q + nq);
}

// One layer's attention for every row, the new keys/values already stored, by the team (t: this
// thread's codes scratch); returns after a barrier.
static void attend_rows_team(const rows_step* st, int64_t layer, const codes_scratch* t) {
    const block_t* b = &st->blocks[layer];
    const rows_kv* kv = st->kv;
    const int64_t rows = st->rows;
    if (kv->key_codes != NULL) {
        const rows_codes* c = &st->codes;
        paged_codes_attention_team(c->items, rows * b->num_kv_heads, c->q, st->s->attn, c->q_offsets, c->plan + rows,
                                   b->num_heads, b->num_kv_heads, b->head_dim, b->scale, b->softcap, b->sinks, st->window[layer],
                                   &kv->key_codes[layer], &kv->value_codes[layer], kv->code_block_size,
                                   kv->code_tables, kv->code_table_width, kv->num_code_blocks, c->plan + 2 * rows,
                                   c->plan + 3 * rows, c->plan + 4 * rows, t);
        return;
    }
    const head_units units = attention_units(rows, b->num_heads, b->num_kv_heads);
    const int shared = row_shares_keys(kv, layer, rows, 0, st->positions[0] + 1);
    const int64_t per_row = units.kv_heads * units.parts, block = rows_per_unit(rows, per_row, shared);
    const int64_t blocks = (rows + block - 1) / block;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < blocks * per_row; u++) {
        int64_t first_row, head;
        const int64_t count = unit_heads(&units, u % per_row, &first_row, &head);  // first_row: 0 here
        const int64_t r0 = (u / per_row) * block;
        attend_row_block(st, layer, r0, rows - r0 < block ? rows - r0 : block, head, count, units.group);
    }
}

static void mlp_row_input(const rows_step* st, const block_t* b, int64_t r);
static void mlp_rows_team(const rows_step* st, int64_t layer);

// One layer for every row, by the team, each row's input already quantized into s->xq; leaves the
// next layer's quantized (after the last layer: only h).
static void layer_rows_team(const rows_step* st, int64_t layer, const codes_scratch* t) {
    const block_t* b = &st->blocks[layer];
    const rows_scratch* s = st->s;
    const int64_t hidden = b->hidden, rows = st->rows;
    const int mla = b->mla_rank > 0;
    linear_lora_rows_team(st, layer, LORA_QKV, &b->qkv, s->x, mla ? s->mlp : s->qkv_out);
    if (mla) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) mla_row(st, b, r);
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) row_rotate(st, layer, r);
    attend_rows_team(st, layer, t);
    const float* o_in = s->attn;
    if (mla) {  // each row's heads expanded to their values, packed [rows, heads * v] in x
        const int64_t width = b->num_heads * b->mla_v;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t h = 0; h < b->num_heads; h++) mla_value(b, s->attn + r * b->num_heads * b->head_dim, h, s->x + r * width);
        o_in = s->x;
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) quantize_row(st, &b->o, o_in, r);
    linear_lora_rows_team(st, layer, LORA_O, &b->o, o_in, s->y);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        add_residual(b, st->h + r * hidden, s->y + r * hidden, b->attn_out_norm, hidden);
        if (has_mlp(b))
            mlp_row_input(st, b, r);
        else if (layer + 1 < st->num_layers)  // attention alone (Nemotron-H): on to the next layer's input
            row_input(st, layer + 1, r);
    }
    if (has_mlp(b)) mlp_rows_team(st, layer);
}

// Row r's input to the block's MLP: its normed h, quantized for gate_up (a mixture quantizes per expert).
static void mlp_row_input(const rows_step* st, const block_t* b, int64_t r) {
    norm_input(st->h + r * b->hidden, b->mlp_in_norm, b->eps, b->hidden, st->s->x + r * b->hidden);
    if (b->num_experts == 0) quantize_row(st, &b->gate_up, st->s->x, r);
}

// The block's MLP or mixture for every row, by the team, each row's input in s->x (mlp_row_input),
// then the residual; leaves the next layer's input quantized (after the last layer: only h).
static void mlp_rows_team(const rows_step* st, int64_t layer) {
    const block_t* b = &st->blocks[layer];
    const rows_scratch* s = st->s;
    const int64_t hidden = b->hidden, inter = b->intermediate, rows = st->rows;
    float* out = s->y;  // the MLP's output rows
    if (b->num_experts > 0) {
        experts_rows_team(st, b);
        out = st->experts.sum;
    } else {
        linear_lora_rows_team(st, layer, LORA_GATE_UP, &b->gate_up, s->x, s->mlp);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {  // act(gate) * up, packed [rows, inter] into x for down()
            const float* gate = s->mlp + r * b->gate_up.n;  // 2 inter gated, inter for an ungated up projection
            gated_activation(gate, gate + inter, s->x + r * inter, inter, b);
            quantize_row(st, &b->down, s->x, r);
        }
        linear_lora_rows_team(st, layer, LORA_DOWN, &b->down, s->x, s->y);
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        add_residual(b, st->h + r * hidden, out + r * hidden, b->mlp_out_norm, hidden);
        if (layer + 1 < st->num_layers) row_input(st, layer + 1, r);
    }
}

// Every block for a batch of one-token rows: as kvgen_decode_layers does for one row, with the
// matmuls of all rows in one tiled GEMM per weight. Row r is at positions[r] and has its own RoPE:
// rope [rows, kinds, 2, d]. Keys and values: see rows_kv. lora: [num_layers, LORA_LINEARS] adapter
// deltas or NULL; lora_slots[r]: row r's adapter slot (-1: none; rows without one get the bits of
// the base-only step). mlp_only: the one block's MLP sublayer alone (a hybrid's Mamba layer).
static void decode_rows(const block_t* blocks, int64_t num_layers, int64_t rows, float* h, const float* rope,
                        int64_t num_rope_kinds, const int64_t* rope_kind, const int64_t* window, const rows_kv* kv,
                        const int64_t* positions, const rows_scratch* s, const lora_linear* lora,
                        const int64_t* lora_slots, int mlp_only) {
    int64_t widest = 0, nq = 0, kv_heads = 0, d = 0, group = 0, experts = 0, top_k = 0;
    for (int64_t l = 0; l < num_layers; l++) {
        const block_t* b = &blocks[l];
        experts = b->num_experts > experts ? b->num_experts : experts;
        top_k = b->top_k > top_k ? b->top_k : top_k;
        widest = block_widest(b) > widest ? block_widest(b) : widest;
        nq = b->num_heads * b->head_dim > nq ? b->num_heads * b->head_dim : nq;
        kv_heads = b->num_kv_heads > kv_heads ? b->num_kv_heads : kv_heads;
        d = b->head_dim > d ? b->head_dim : d;
        group = b->num_heads / b->num_kv_heads > group ? b->num_heads / b->num_kv_heads : group;
    }
    rows_step st = {blocks, num_layers, rows, h, rope, num_rope_kinds, rope_kind, window, kv, positions, s, lora,
                    lora_slots, malloc(sizeof(int32_t) * (size_t)(rows * (widest / QK) + 1)),
                    malloc(sizeof(float) * (size_t)(rows * lora_width(lora, num_layers * LORA_LINEARS) + 1)),
                    {NULL, NULL, NULL, NULL, d, group}, {NULL, NULL, NULL, NULL, NULL, NULL, NULL}};
    rows_experts* routed = &st.experts;
    if (experts > 0) {
        routed->ids = malloc(sizeof(int64_t) * (size_t)(rows * top_k));
        routed->weights = malloc(sizeof(float) * (size_t)(rows * top_k));
        routed->scores = malloc(sizeof(float) * (size_t)(rows * experts));
        routed->starts = malloc(sizeof(int64_t) * (size_t)(experts + 1));
        routed->fill = malloc(sizeof(int64_t) * (size_t)experts);
        routed->members = malloc(sizeof(int64_t) * (size_t)(rows * top_k));
        routed->sum = malloc(sizeof(float) * (size_t)(rows * blocks[0].hidden));
    }
    if (kv->key_codes != NULL) {
        st.codes.q = malloc(sizeof(float) * (size_t)(rows * nq));
        st.codes.plan = malloc(sizeof(int64_t) * (size_t)(5 * rows));
        st.codes.items = malloc(sizeof(codes_work) * (size_t)(rows * kv_heads));
        st.codes.q_offsets = malloc(sizeof(int64_t) * (size_t)(rows + 1));
        for (int64_t r = 0; r <= rows; r++) st.codes.q_offsets[r] = r;
    }
#pragma omp parallel
    {
        const codes_scratch t = kv->key_codes != NULL ? codes_scratch_new(d, group) : (codes_scratch){0};
        if (mlp_only) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) mlp_row_input(&st, blocks, r);
            mlp_rows_team(&st, 0);
        } else {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) row_input(&st, 0, r);
            for (int64_t layer = 0; layer < num_layers; layer++) layer_rows_team(&st, layer, &t);
        }
        codes_scratch_free(&t);
    }
    free(routed->ids);
    free(routed->weights);
    free(routed->scores);
    free(routed->starts);
    free(routed->fill);
    free(routed->members);
    free(routed->sum);
    free(st.codes.q_offsets);
    free(st.codes.items);
    free(st.codes.plan);
    free(st.codes.q);
    free(st.xa);
    free(st.sums);
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
    decode_rows(blocks, num_layers, rows, h, rope, num_rope_kinds, rope_kind, window, &kv, positions, s, lora, lora_slots, 0);
}

// Every block for the rows of a token tree after one sequence's fp32 cache (its block table, or
// table == NULL with block_size 0: one buffer): row r is the token at positions[r] after the cache's
// tail_start positions and its own path, whose keys and values sit at element offsets tails[r *
// tail_width + p - tail_start] for positions p >= tail_start (its own at positions[r]). Each row
// is computed as the one-token step computes its token after that path.
void kvgen_decode_tree(const block_t* blocks, int64_t num_layers, int64_t rows, float* h, const float* rope,
                       int64_t num_rope_kinds, const int64_t* rope_kind, const int64_t* window, float* k_base,
                       float* v_base, int64_t layer_stride, int64_t head_stride, int64_t pos_stride,
                       int64_t block_stride, int64_t block_size, const int64_t* table, const int64_t* tails,
                       int64_t tail_width, int64_t tail_start, const int64_t* positions, const rows_scratch* s) {
    const int64_t one_block = 0;  // one buffer: block 0 holds every position
    const rows_kv kv = {k_base, v_base, layer_stride, head_stride, pos_stride, block_stride,
                        table != NULL ? block_size : tail_start + tail_width, table != NULL ? table : &one_block, 0,
                        positions, NULL, NULL, NULL, 0, 0, NULL, NULL, NULL, tails, tail_width, tail_start};
    decode_rows(blocks, num_layers, rows, h, rope, num_rope_kinds, rope_kind, window, &kv, positions, s, NULL, NULL, 0);
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
    decode_rows(blocks, num_layers, rows, h, rope, num_rope_kinds, rope_kind, window, &kv, positions, s, lora, lora_slots, 0);
}

// Every block for one-token rows of sequences that each keep their own keys and values (a hybrid
// model's contiguous caches): see rows_kv's row_stores. Each row is computed as the batch-1 step
// computes its token. lora, lora_slots: as decode_rows's (a hybrid passes its layer's table alone).
void kvgen_decode_rows_own(const block_t* blocks, int64_t num_layers, int64_t rows, float* h, const float* rope,
                           int64_t num_rope_kinds, const int64_t* rope_kind, const int64_t* window,
                           const int64_t* row_stores, int64_t pos_stride, const int64_t* positions,
                           const rows_scratch* s, const lora_linear* lora, const int64_t* lora_slots) {
    rows_kv kv = {0};
    kv.pos_stride = pos_stride, kv.write_pos = positions, kv.row_stores = row_stores;
    decode_rows(blocks, num_layers, rows, h, rope, num_rope_kinds, rope_kind, window, &kv, positions, s, lora, lora_slots, 0);
}

// One block's MLP sublayer for one-token rows (a hybrid's Mamba layers, whose mixer runs in
// mamba_step.c): h[r] += residual_scale * mlp(norm(h[r])), each row with the bits kvgen_block_mlp
// gives it alone. lora: the layer's LORA_LINEARS deltas or NULL; lora_slots[r]: row r's slot.
void kvgen_mlp_rows(const block_t* block, int64_t rows, float* h, const rows_scratch* s, const lora_linear* lora,
                    const int64_t* lora_slots) {
    const rows_kv none = {0};
    decode_rows(block, 1, rows, h, NULL, 0, NULL, NULL, &none, NULL, s, lora, lora_slots, 1);
}
