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

// The engine's rows (HybridStep.step_rows): row r a token of its sequence at positions[r], a
// sequence's rows consecutive and run as a chain, every layer over all rows in one call each, as
// the Python loop made them. kv [rows, 4]: each row's cache buffers (keys, values: addresses) with
// their layer and head strides; each attention layer's row stores (decode_rows.c's row_stores)
// are built from them. conv_in/conv_out/ssm_in/ssm_out: [state slot * rows + r] (a chain's NULLs
// as kvgen_mamba2_step_from reads them); trace: NULL, or state slot s's at s * rows * trace_width.
// lora: [num_layers, LORA_LINEARS] or NULL; lora_slots[r]: row r's adapter slot (NULL: none).
void kvgen_hybrid_rows(const hybrid_layer_t* layers, int64_t num_layers, int64_t rows, float* h, float* x_copy, int64_t hidden,
                       const float* rope, const int64_t* kv, int64_t pos_stride, const int64_t* positions,
                       const rows_scratch* scratch, const float* const* conv_in, float* const* conv_out,
                       const float* const* ssm_in, float* const* ssm_out, float* trace, int64_t trace_width,
                       const lora_linear* lora, const int64_t* lora_slots) {
    const int64_t one_layer[1] = {0};  // rope kind 0 and full attention (window 0) for the one block a call runs
    int64_t* stores = malloc(sizeof(int64_t) * (size_t)(3 * rows));
    for (int64_t l = 0; l < num_layers; l++) {
        const hybrid_layer_t* layer = &layers[l];
        const lora_linear* deltas = lora ? lora + l * LORA_LINEARS : NULL;
        const int parallel = layer->attention && (layer->mamba2 || layer->conv);
        if (parallel) memcpy(x_copy, h, (size_t)(rows * hidden) * sizeof(float));
        if (layer->attention) {
            for (int64_t r = 0; r < rows; r++) {
                const int64_t* row = kv + 4 * r;  // keys, values, layer stride, head stride
                stores[3 * r] = row[0] + (int64_t)sizeof(float) * layer->kv_slot * row[2];
                stores[3 * r + 1] = row[1] + (int64_t)sizeof(float) * layer->kv_slot * row[2];
                stores[3 * r + 2] = row[3];
            }
            kvgen_decode_rows_own(layer->attention, 1, rows, h, rope, 1, one_layer, one_layer, stores, pos_stride, positions,
                                  scratch, deltas, lora_slots);
        }
        const int64_t at = layer->state_slot * rows;
        if (layer->mamba2)
            kvgen_mamba2_step_from(layer->mamba2, 1, rows, parallel ? x_copy : h, h, conv_in + at, conv_out + at, ssm_in + at,
                                   ssm_out + at, deltas, lora_slots, trace ? trace + at * trace_width : NULL);
        else if (layer->conv)
            kvgen_short_conv_step(layer->conv, rows, h, conv_in + at, conv_out + at, deltas, lora_slots);
        if (layer->mlp) kvgen_mlp_rows(layer->mlp, rows, h, scratch, deltas, lora_slots);
    }
    free(stores);
}
