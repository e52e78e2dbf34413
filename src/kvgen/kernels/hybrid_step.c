// A hybrid's decode step for one token with every layer in one call (models/hybrid_decode.py's
// HybridStep.step: Granite 4.0-H, Bamba, LFM2, Nemotron-H, Falcon-H1). Each layer makes the calls
// the step made from Python one by one, in the same order with the same arguments, so the same
// bits; what the one call saves is the Python between them (Falcon-H1's 36 layers made 144 calls
// a token, and the Python around them cost about a quarter of its step).
// #included by qgemm.c after decode.c and mamba_step.c.

typedef struct {
    const block_t* attention;         // attention (and the MLP where the block carries it), or NULL
    const mamba2_block_t* mamba2;     // a Mamba-2 mixer, or NULL
    const short_conv_block_t* conv;   // an LFM2 short-conv mixer, or NULL
    const block_t* mlp;               // the MLP or mixture the attention block does not carry, or NULL
    int64_t state_slot, kv_slot;      // its state's and its keys' index in the cache (-1: none)
} hybrid_layer_t;

// h [hidden] (updated in place) at `position`; x_copy [hidden]: a parallel layer's mixer input
// (Falcon-H1: attention and mixer read the same h and both add into it). keys, values: the cache's
// buffers, layer kv_slot at kv_slot * layer_stride floats, the new key and value written at
// `position`. conv_in/conv_out/ssm_in/ssm_out: each state slot's states (never in place). lora:
// [num_layers, LORA_LINEARS] adapter deltas or NULL, for adapter slot `slot`.
void kvgen_hybrid_step(const hybrid_layer_t* layers, int64_t num_layers, float* h, float* x_copy, int64_t hidden,
                       const float* cos, const float* sin, float* keys, float* values, int64_t layer_stride,
                       int64_t head_stride, int64_t pos_stride, int64_t position, const float* const* conv_in,
                       float* const* conv_out, const float* const* ssm_in, float* const* ssm_out,
                       const lora_linear* lora, int64_t slot) {
    const int64_t* slots = lora ? &slot : NULL;  // the mixers take one slot per row
    for (int64_t l = 0; l < num_layers; l++) {
        const hybrid_layer_t* layer = &layers[l];
        const lora_linear* deltas = lora ? lora + l * LORA_LINEARS : NULL;
        const int parallel = layer->attention && (layer->mamba2 || layer->conv);
        if (parallel) memcpy(x_copy, h, (size_t)hidden * sizeof(float));
        if (layer->attention) {
            float* k = keys + layer->kv_slot * layer_stride;
            float* v = values + layer->kv_slot * layer_stride;
            kvgen_block_pre_into(layer->attention, h, cos, sin, k + position * pos_stride, v + position * pos_stride,
                                 head_stride, deltas, slot);
            kvgen_block_post(layer->attention, h, k, head_stride, pos_stride, v, head_stride, pos_stride, 0, position + 1,
                             deltas, slot);
        }
        const int64_t s = layer->state_slot;
        if (layer->mamba2)
            kvgen_mamba2_step_from(layer->mamba2, 1, 1, parallel ? x_copy : h, h, conv_in + s, conv_out + s, ssm_in + s,
                                   ssm_out + s, deltas, slots, NULL);
        else if (layer->conv)
            kvgen_short_conv_step(layer->conv, 1, h, conv_in + s, conv_out + s, deltas, slots);
        if (layer->mlp) kvgen_block_mlp(layer->mlp, h, deltas, slot);
    }
}
