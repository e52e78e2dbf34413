// The EAGLE head's draft positions in one call each (speculative/eagle_fast.py), #included by
// qgemm.c after decode.c: in torch a position was the input map's norms, the fc linear, the C
// block, the residual and, for a draft token, the target's final norm and the draft-vocabulary
// linear, ~15 tensor operations and three ctypes calls (~0.1 ms of Python per position against
// ~0.07 ms of arithmetic with the weights in cache).

// One position: x = fc(rms(feature) * scales[:h] ++ rms(embedding) * scales[h:]) (8-bit q8sx8
// blocks), through the head's block (its keys and values at `position` of k_base / v_base,
// [kv_heads, capacity, head_dim]), and out = feature + x: the predicted next feature.
// pair: [2h] scratch; scratch: 2h / 32 activation blocks.
void kvgen_eagle_position(const block_t* block, const void* fc_blocks, const float* scales, float eps,
                          const float* feature, const float* embedding, float* pair, block_x8* scratch,
                          const float* rope, const int64_t* zero, float* k_base, float* v_base, int64_t head_stride,
                          int64_t pos_stride, int64_t position, float* out) {
    const int64_t h = block->hidden;
    rms_norm(feature, scales, eps, h, pair);
    rms_norm(embedding, scales + h, eps, h, pair + h);
    kvgen_linear_q8sx8((const block_q8sx8*)fc_blocks, pair, scratch, out, 1, h, 2 * h);
    kvgen_decode_layers(block, 1, out, rope, zero, zero, k_base, v_base, 0, head_stride, pos_stride, 0, 1, NULL,
                        position, NULL, -1);
    for (int64_t i = 0; i < h; i++) out[i] += feature[i];
}

// A predicted feature -> its draft-vocabulary logits: the target's final norm (weights `norm`),
// then the draft rows of its output head (q8sx8 blocks, n rows).
void kvgen_eagle_logits(const float* feature, const float* norm, float eps, int64_t h, float* normed,
                        const void* blocks, int64_t n, block_x8* scratch, float* logits) {
    rms_norm(feature, norm, eps, h, normed);
    kvgen_linear_q8sx8((const block_q8sx8*)blocks, normed, scratch, logits, 1, n, h);
}
