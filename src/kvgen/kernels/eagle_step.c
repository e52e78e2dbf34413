// The EAGLE head's draft positions in one call each (speculative/eagle_fast.py), #included by
// qgemm.c after decode.c: in torch a position was the input map's norms, the fc linear, the C
// block, the residual and, for a draft token, the target's final norm and the draft-vocabulary
// linear, ~15 tensor operations and three ctypes calls (~0.1 ms of Python per position against
// ~0.07 ms of arithmetic with the weights in cache).

// Rows through one of the head's 8-bit linears: q8s blocks, or q8 where requantizing met a scale
// outside f16's range (formats.py's requantize). A row gets the same bits at any row count.
static void eagle_linear(const qlinear* l, const float* x, int64_t rows, block_x8* scratch, float* y) {
    if (l->kind == 2) {
        kvgen_linear_q8sx8((const block_q8sx8*)l->blocks, x, scratch, y, rows, l->n, l->k);
    } else {
        kvgen_linear_q8x8((const block_q8x8*)l->blocks, x, scratch, y, rows, l->n, l->k);
    }
}

// The input map of `rows` positions: x = fc(rms(feature) * scales[:h] ++ rms(embedding) * scales[h:])
// into out. pairs: [rows, 2h] scratch; scratch: rows * 2h / 32 activation blocks.
static void eagle_input_map(const qlinear* fc, const float* scales, float eps, int64_t h, const float* features,
                            const float* embeddings, int64_t rows, float* pairs, block_x8* scratch, float* out) {
    for (int64_t r = 0; r < rows; r++) {
        rms_norm(features + r * h, scales, eps, h, pairs + r * 2 * h);
        rms_norm(embeddings + r * h, scales + h, eps, h, pairs + r * 2 * h + h);
    }
    eagle_linear(fc, pairs, rows, scratch, out);
}

// One position: the input map, the head's block (its keys and values at `position` of k_base /
// v_base, [kv_heads, capacity, head_dim]), and out = feature + x: the predicted next feature.
void kvgen_eagle_position(const block_t* block, const qlinear* fc, const float* scales, float eps,
                          const float* feature, const float* embedding, float* pair, block_x8* scratch,
                          const float* rope, const int64_t* zero, float* k_base, float* v_base, int64_t head_stride,
                          int64_t pos_stride, int64_t position, float* out) {
    const int64_t h = block->hidden;
    eagle_input_map(fc, scales, eps, h, feature, embedding, 1, pair, scratch, out);
    kvgen_decode_layers(block, 1, out, rope, zero, zero, k_base, v_base, 0, head_stride, pos_stride, 0, 1, NULL,
                        position, NULL, -1);
    for (int64_t i = 0; i < h; i++) out[i] += feature[i];
}

// Positions [position, position + n) in one call, each row's bits those kvgen_eagle_position gives
// it: the input map over the n rows, the block by the rows step (row i attends to the positions
// before it and its own, as the one-token step does; `tables`: n zeros, the one buffer's block for
// each row; `positions`: position .. position + n - 1), then the residual. A batch of positions
// (the tokens decoded while drafting paused, a verify's accepted ones) reads the head's weights
// once instead of once a position. rope: [n, 2, head_dim]; s: the rows step's scratch for n rows
// of the head's widths.
void kvgen_eagle_positions(const block_t* block, const qlinear* fc, const float* scales, float eps,
                           const float* features, const float* embeddings, int64_t n, float* pairs,
                           block_x8* scratch, const float* rope, const int64_t* zero, float* k_base, float* v_base,
                           int64_t head_stride, int64_t pos_stride, int64_t position, const int64_t* tables,
                           const int64_t* positions, const rows_scratch* s, float* out) {
    const int64_t h = block->hidden;
    eagle_input_map(fc, scales, eps, h, features, embeddings, n, pairs, scratch, out);
    kvgen_decode_rows(block, 1, n, out, rope, 1, zero, zero, k_base, v_base, 0, head_stride, pos_stride, 0,
                      position + n, tables, 1, NULL, NULL, positions, s, NULL, NULL);
    for (int64_t i = 0; i < n * h; i++) out[i] += features[i];
}

// A predicted feature -> its draft-vocabulary logits: the target's final norm (weights `norm`),
// then the draft rows of its output head (`project`, 8-bit).
void kvgen_eagle_logits(const float* feature, const float* norm, float eps, float* normed, const qlinear* project,
                        block_x8* scratch, float* logits) {
    rms_norm(feature, norm, eps, project->k, normed);
    eagle_linear(project, normed, 1, scratch, logits);
}
