// One decode step (one token, batch 1) of a transformer block, for models whose matmul weights are
// quantized. Two calls per block so the KV cache stays behind kvgen's cache contract:
//
//   kvgen_block_pre:  x = norm(h); q, k, v = qkv(x); QK-norm; RoPE     -> k, v handed to cache.update()
//   kvgen_block_post: attention of q over the keys/values update() returned; o-proj; residual;
//                     (Gemma: norms around each sublayer); gated MLP, or a mixture of gated experts; residual.
//
// kvgen_decode_layers runs every block for one token in one call over fp32 storage; kvgen_decode_rows
// (decode_rows.c) runs rows of tokens (decodes of many sequences, or several tokens of one: a verify, a prompt), each
// row computed as a lone token would be, so prompts get the bits of decodes however they are chunked.
//
// This file is #included by qgemm.c so the matmul kernels inline into one library.
#include <math.h>
#include <omp.h>

typedef struct {
    int32_t kind;  // 0: q4 blocks, 1: q8 blocks, 2: q8s blocks, 3: q5 blocks, 4: q4k super-blocks, 5: q6k super-blocks, 6: q4h blocks,
                   // 7: iq4 blocks, 8: q5m blocks, 9: mx4 blocks, 10: f16 rows, 11: bf16 rows (half_linear.c: fp32 activations)
    int32_t has_bias;
    const void* blocks;
    const float* bias;
    int64_t n, k;
} qlinear;

typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
    float softcap;       // attention scores soft-capped to cap tanh(s / cap) (Gemma 2); 0: not
    int32_t act;         // the gate's activation: 0 SiLU (SwiGLU), 1 tanh-GELU (GeGLU), 2 clamped SwiGLU (gpt-oss),
                         // 3 ReLU² of an ungated up projection (Nemotron-H: gate_up is `up` alone, intermediate rows)
    int32_t rotary_dim;  // the channels of a head RoPE turns: head_dim, or fewer (partial rotary, Phi-4-mini)
    int32_t pad;
    const float* input_norm;
    const float* attn_out_norm;  // Gemma's post-attention norm; NULL for Llama
    const float* mlp_in_norm;    // Llama's post_attention_layernorm / Gemma's pre-feedforward norm
    const float* mlp_out_norm;   // Gemma's post-feedforward norm; NULL for Llama
    const float* q_norm;         // Gemma's per-head QK-norm; NULL for Llama
    const float* k_norm;
    qlinear qkv, o, gate_up, down;
    float* x;       // [hidden]: the o-proj's and down's outputs
    float* qkv_out; // [(heads + 2 kv_heads) * head_dim]
    float* attn;    // [heads * head_dim]
    float* mlp;     // [2 * intermediate]
    // A mixture of experts (Mixtral, Qwen3-MoE) when num_experts > 0, in place of gate_up / down:
    // the router's fp32 rows [num_experts, hidden], each expert's gate_up and down (intermediate
    // wide); a token runs its top_k experts, their softmax weights renormalised when normalize.
    int64_t num_experts, top_k, normalize, pad2;
    const float* router;
    float* router_out;  // [num_experts]: the team's router scores
    const qlinear* expert_gate_up;
    const qlinear* expert_down;
    // gpt-oss: per query head a learned sink logit that joins its softmax as a key with no value
    // (NULL: none); the router's bias (NULL: none); act 2's alpha and limit.
    const float* sinks;
    const float* router_bias;
    float swiglu_alpha, swiglu_limit;
    // Qwen2-MoE: a shared expert every token runs beside its routed ones (shared_intermediate wide;
    // 0: none), its output scaled by sigmoid(shared_gate . x), added after theirs.
    int64_t shared_intermediate;
    const float* shared_gate;  // [hidden]; NULL: ungated
    qlinear shared_gate_up, shared_down;
    // DeepSeek-V2's latent attention (mla_rank > 0; models/mla.py): qkv is q_proj and kv_a as one
    // linear into mla_raw (each head's nope + rope query values, then the latent and the RoPE key);
    // w_uk [heads, nope, rank] turns a head's nope part into the latent, w_uv [heads, v, rank] the
    // latent part of its output into its v values (mla_out: o's input). One kv head of head_dim =
    // rope + rank channels, the first rope turned; the value is the key before RoPE.
    int64_t mla_rank, mla_nope, mla_rope, mla_v;
    const float* mla_kv_norm;  // [rank]
    const float* w_uk;
    const float* w_uv;
    float* mla_raw;  // [heads * (nope + rope) + rank + rope]
    float* mla_out;  // [heads * v]
    float routed_scale;  // DeepSeek's routed_scaling_factor on the chosen experts' weights (0: 1)
    float pad3;
    // DeepSeek-V3's routing (route_experts): scores by sigmoid instead of softmax (expert_sigmoid);
    // choice_bias [num_experts] (NULL: none) joins the scores that choose, not the weights; with
    // expert_groups > 1 only the expert_groups_used best groups may be chosen from.
    int64_t expert_sigmoid, expert_groups, expert_groups_used, pad4;
    const float* choice_bias;
    // Latent attention over quantized weights: per head, W_UK[h]^T [rank, nope] and W_UV[h] [v,
    // rank] as linears (arrays of num_heads) in place of w_uk / w_uv (NULL: those fp32 ones).
    const qlinear* mla_uk;
    const qlinear* mla_uv;
    float residual_scale;  // Granite's residual_multiplier on each sublayer's output (0: 1)
    int32_t qk_norm_full;  // OLMo 2: q_norm / k_norm span all heads at once (0: each head's channels)
} block_t;

// e^x as exp8 (attention_tiles.c) computes each lane: the same operations, one lane at a time.
static inline float exp_lane(float x) {
    x = fminf(fmaxf(x, -87.0f), 88.0f);
    const float n = nearbyintf(x * 1.44269504088896341f);
    float r = fmaf(-n, 0.693145751953125f, x);
    r = fmaf(-n, 1.428606765330187045e-06f, r);
    float p = 1.0f / 5040.0f;
    p = fmaf(p, r, 1.0f / 720.0f);
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

// q . k over one head. gcc keeps a float reduction serial without -ffast-math (one FMA chain per
// key), so a length that is a multiple of 32 runs four independent 8-lane accumulators, added
// pairwise and then as hsum8, in that order with AVX2 or without (the same bits either way).
static inline float dot(const float* a, const float* b, int64_t n) {
#ifdef __AVX2__
    if (n % 32 == 0) {
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        __m256 acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j += 32) {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), _mm256_loadu_ps(b + j + 8), acc1);
            acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 16), _mm256_loadu_ps(b + j + 16), acc2);
            acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 24), _mm256_loadu_ps(b + j + 24), acc3);
        }
        return hsum8(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
    }
#else
    if (n % 32 == 0) {
        float acc[4][8] = {{0.0f}}, lanes[8];
        for (int64_t j = 0; j < n; j += 32)
            for (int r = 0; r < 4; r++)
                for (int l = 0; l < 8; l++) acc[r][l] = fmaf(a[j + 8 * r + l], b[j + 8 * r + l], acc[r][l]);
        for (int l = 0; l < 8; l++) lanes[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
        return sum_lanes(lanes);
    }
#endif
    float s = 0.0f;
    for (int64_t j = 0; j < n; j++) s += a[j] * b[j];
    return s;
}

static void rms_norm(const float* x, const float* w, float eps, int64_t n, float* out) {
    const float sum = dot(x, x, n);
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

// A sublayer's input: rms_norm(h), or h itself where the block norms after its sublayers (OLMo 2: w NULL).
static void norm_input(const float* h, const float* w, float eps, int64_t n, float* out) {
    if (w) {
        rms_norm(h, w, eps, n, out);
    } else {
        memcpy(out, h, (size_t)n * sizeof(float));
    }
}

// Each weight kind's interleaved kernels, by qlinear.kind: CALL(STEM, SUMS) with the kernels' name
// stem (kvgen_linear_<STEM>_team, block_<STEM>, ...) and whether they take the activations' block
// sums (the q5 and, with VNNI, iq4 offsets). A new kind is one line here. The 16-bit float kinds
// (half_linear.c) read the activations as floats: their "blocks" are the rows as the step holds them.
#define FOR_KIND(kind, CALL)                                                                         \
    switch (kind) {                                                                                  \
        case 0: CALL(q4x8, 0) break;                                                                 \
        case 1: CALL(q8x8, 0) break;                                                                 \
        case 2: CALL(q8sx8, 0) break;                                                                \
        case 3: CALL(q5x8, Q5_SUMS) break;                                                           \
        case 4: CALL(q4kx8, 0) break;                                                                \
        case 6: CALL(q4hx8, 0) break;                                                                \
        case 7: CALL(iq4x8, IQ4_SUMS) break;                                                         \
        case 8: CALL(q5mx8, 0) break;                                                                \
        case 9: CALL(mx4x8, IQ4_SUMS) break;                                                         \
        case 10: CALL(f16, 0) break;                                                                 \
        case 11: CALL(bf16, 0) break;                                                                \
        default: CALL(q6kx8, 0) break; /* 5 */                                                       \
    }

// One row through the linear l, by every thread of a team: each quantizes x into its own scratch
// (xq, sums) and computes its share of y (bias added), the closing barrier making y whole.
static void linear_team(const qlinear* l, const float* x, block_x8* xq, int32_t* sums, float* y) {
    const float* bias = l->has_bias ? l->bias : NULL;
#define LINEAR_OF(STEM, SUMS) kvgen_linear_##STEM##_team((const block_##STEM*)l->blocks, x, xq, sums, y, l->n, l->k, bias);
    FOR_KIND(l->kind, LINEAR_OF)
#undef LINEAR_OF
}

// One row through l by the calling thread alone (no bias), the bits linear_team gives it.
static void linear_serial(const qlinear* l, const float* x, block_x8* xq, int32_t* sums, float* y) {
#define SERIAL_OF(STEM, SUMS) kvgen_linear_##STEM##_serial((const block_##STEM*)l->blocks, x, xq, sums, y, l->n, l->k);
    FOR_KIND(l->kind, SERIAL_OF)
#undef SERIAL_OF
}

#include "lora_delta.c"

// RoPE over a head's first `rotary` channels (all of them, or fewer: partial rotary), channel i
// turned with channel i + rotary / 2; cos and sin hold the angles of those channels.
static void rotate_half(float* x, const float* cos, const float* sin, int64_t rotary) {
    const int64_t half = rotary / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

// The batch-1 step runs inside one OpenMP parallel region (a team) per call, not one per matmul and
// attention: a fork and join cost ~1.2 us on two Zen 4 cores and a barrier ~0.45 us, and the step
// had five forks per layer. Each thread keeps its own copy of the residual stream h and of each
// linear's input (normed h, the MLP's activations), computed by every thread from the same shared
// values in the same order, so the copies hold the same bits and a linear needs no barrier before
// it: only its outputs (shared, each output computed by one thread) are waited for. Thread 0's copy
// of h is the caller's h itself. Outside any region (one thread) the same code runs serially.
typedef struct {
    float* h;        // [hidden]: this thread's residual stream
    float* x;        // [widest]: a linear's input
    float* y;        // [hidden]: a normed sublayer output (Gemma); a mixture's sum of its experts
    block_x8* xq;    // [widest / 32]: x as activation blocks
    int32_t* sums;   // [widest / 32]: their code sums
    float* act;      // [widest]: an expert's activation (x keeps the mixture's input)
    float* own;      // what this thread allocated
} thread_scratch;

static int64_t block_widest(const block_t* b) {
    const int64_t attn = b->num_heads * b->head_dim, wide = b->hidden > attn ? b->hidden : attn;
    const int64_t mlp = b->intermediate > b->shared_intermediate ? b->intermediate : b->shared_intermediate;
    return wide > mlp ? wide : mlp;
}

// This thread's scratch for `blocks`; h: the caller's residual stream (thread 0 works in it).
static thread_scratch thread_scratch_new(const block_t* blocks, int64_t num_layers, float* h) {
    int64_t hidden = 0, widest = 0;
    for (int64_t l = 0; l < num_layers; l++) {
        hidden = blocks[l].hidden > hidden ? blocks[l].hidden : hidden;
        widest = block_widest(&blocks[l]) > widest ? block_widest(&blocks[l]) : widest;
    }
    const int64_t nb = widest / QK + 1;
    float* own = malloc(sizeof(float) * (size_t)(2 * hidden + 2 * widest) + (sizeof(block_x8) + sizeof(int32_t)) * (size_t)nb);
    thread_scratch t = {own, own + hidden, own + hidden + widest, (block_x8*)(own + 2 * hidden + 2 * widest), NULL,
                        own + 2 * hidden + widest, own};
    t.sums = (int32_t*)(t.xq + nb);
    if (omp_get_thread_num() == 0) {
        t.h = h;
    } else {
        memcpy(t.h, h, (size_t)blocks[0].hidden * sizeof(float));  // before thread 0's first write: behind a barrier
    }
    return t;
}

// The widest LoRA delta of `count` linears (A x's scratch per row), 0: none.
static int64_t lora_width(const lora_linear* lora, int64_t count) {
    int64_t width = 0;
    for (int64_t i = 0; lora != NULL && i < count; i++)
        if (lora[i].a != NULL && lora[i].width > width) width = lora[i].width;
    return width;
}

// The delta of linear l for `rows` rows of inputs x (the batch-1 step: one, the thread's copy of
// its input), by the team; slots: each row's adapter slot; xa: the team's shared scratch, rows x
// lora_width floats.
static void lora_team(const lora_linear* lora, int which, const qlinear* l, const float* x, float* y, int64_t rows,
                      const int64_t* slots, float* xa) {
    if (lora != NULL && lora_applies(&lora[which], rows, slots))
        lora_delta_team(&lora[which], l->k, l->n, x, y, rows, slots, xa);
}

// Latent attention (DeepSeek-V2). Head h's query from the raw projection: its RoPE part, then
// W_UK[h]^T q_nope (the latent the keys hold); q: [rope + rank].
static void mla_query(const block_t* b, const float* raw, int64_t h, float* q) {
    const int64_t nope = b->mla_nope, rope = b->mla_rope, rank = b->mla_rank;
    const float* head = raw + h * (nope + rope);
    const float* w = b->w_uk + h * nope * rank;
    float* latent = q + rope;
    memcpy(q, head + nope, (size_t)rope * sizeof(float));
    if (b->mla_uk != NULL) {  // quantized weights: the head's nope values as int8 blocks
        block_x8 xq[nope / QK];
        int32_t sums[nope / QK];
        linear_serial(&b->mla_uk[h], head, xq, sums, latent);
        return;
    }
    for (int64_t r = 0; r < rank; r++) latent[r] = 0.0f;
    for (int64_t n = 0; n < nope; n++) {
        const float a = head[n];
        const float* row = w + n * rank;
        for (int64_t r = 0; r < rank; r++) latent[r] += a * row[r];
    }
}

// The token's key (and value) from the raw projection: [RoPE key, norm(latent)]; k: [rope + rank].
static void mla_key(const block_t* b, const float* raw, float* k) {
    const float* kv = raw + b->num_heads * (b->mla_nope + b->mla_rope);
    memcpy(k, kv + b->mla_rank, (size_t)b->mla_rope * sizeof(float));
    rms_norm(kv, b->mla_kv_norm, b->eps, b->mla_rank, k + b->mla_rope);
}

// Head h's v output values, W_UV[h] . (the latent part of its attention output), into out + h * v.
static void mla_value(const block_t* b, const float* attn, int64_t h, float* out) {
    const int64_t v = b->mla_v, rank = b->mla_rank;
    const float* latent = attn + h * b->head_dim + b->mla_rope;
    if (b->mla_uv != NULL) {  // quantized weights: the latent output as int8 blocks
        block_x8 xq[rank / QK];
        int32_t sums[rank / QK];
        linear_serial(&b->mla_uv[h], latent, xq, sums, out + h * v);
        return;
    }
    for (int64_t j = 0; j < v; j++) out[h * v + j] = dot(b->w_uv + (h * v + j) * rank, latent, rank);
}

// block_pre_team for latent attention: queries over the latent, the new key (and value) into
// k_out / v_out, q in b->qkv_out for every thread.
static void mla_pre_team(const block_t* b, const thread_scratch* t, const float* cos, const float* sin, float* k_out,
                         float* v_out) {
    const int64_t d = b->head_dim;
    rms_norm(t->h, b->input_norm, b->eps, b->hidden, t->x);
    linear_team(&b->qkv, t->x, t->xq, t->sums, b->mla_raw);
#pragma omp for schedule(static)
    for (int64_t h = 0; h < b->num_heads; h++) {
        mla_query(b, b->mla_raw, h, b->qkv_out + h * d);
        rotate_half(b->qkv_out + h * d, cos, sin, b->rotary_dim);
    }
#pragma omp single
    {
        float* k = b->qkv_out + b->num_heads * d;
        mla_key(b, b->mla_raw, k);
        rotate_half(k, cos, sin, b->rotary_dim);
        memcpy(k_out, k, (size_t)d * sizeof(float));
        memcpy(v_out, k, (size_t)d * sizeof(float));  // the value is the key (only its latent part is read)
    }
}

// The QK-norm of `heads` heads' values x in place: each head's over its channels (Qwen3, Gemma 3),
// or one over all of them (OLMo 2: qk_norm_full); nothing without a weight.
static void qk_norm(const block_t* b, float* x, const float* w, int64_t heads) {
    if (!w) return;
    const int64_t d = b->head_dim;
    if (b->qk_norm_full) {
        rms_norm(x, w, b->eps, heads * d, x);
        return;
    }
    for (int64_t head = 0; head < heads; head++) rms_norm(x + head * d, w, b->eps, d, x + head * d);
}

// norm(h) -> q, k, v; QK-norm and RoPE; the new key and value of each kv head written to k_out/v_out
// + head * out_head_stride. By every thread of a team (t: its scratch); returns after a barrier,
// with q in b->qkv_out for every thread. lora: this layer's LORA_LINEARS deltas, or NULL; slot: the
// token's adapter slot (-1: none); xa: see lora_team.
static void block_pre_team(const block_t* b, const thread_scratch* t, const float* cos, const float* sin, float* k_out,
                           float* v_out, int64_t out_head_stride, const lora_linear* lora, const int64_t* slot,
                           float* xa) {
    if (b->mla_rank > 0) {  // no adapters: the LoRA registry refuses latent attention
        mla_pre_team(b, t, cos, sin, k_out, v_out);
        return;
    }
    const int64_t d = b->head_dim, nq = b->num_heads * d, nkv = b->num_kv_heads * d;
    norm_input(t->h, b->input_norm, b->eps, b->hidden, t->x);
    linear_team(&b->qkv, t->x, t->xq, t->sums, b->qkv_out);
    lora_team(lora, LORA_QKV, &b->qkv, t->x, b->qkv_out, 1, slot, xa);
#pragma omp single  // its closing barrier: q and the cache's new key/value ready for every thread
    {
        float* q = b->qkv_out;
        float* k = b->qkv_out + nq;
        const float* v = b->qkv_out + nq + nkv;
        qk_norm(b, q, b->q_norm, b->num_heads);
        qk_norm(b, k, b->k_norm, b->num_kv_heads);
        for (int64_t head = 0; head < b->num_heads; head++) rotate_half(q + head * d, cos, sin, b->rotary_dim);
        for (int64_t head = 0; head < b->num_kv_heads; head++) {
            rotate_half(k + head * d, cos, sin, b->rotary_dim);
            memcpy(k_out + head * out_head_stride, k + head * d, (size_t)d * sizeof(float));
            memcpy(v_out + head * out_head_stride, v + head * d, (size_t)d * sizeof(float));
        }
    }
}

// k_out, v_out: each kv head's head_dim values `out_head_stride` floats apart (head_dim: contiguous,
// handed to cache.update by the caller; a cache's own head stride: written in place). lora: the
// layer's deltas or NULL, applied for adapter slot `slot` (-1: none).
void kvgen_block_pre_into(const block_t* b, const float* h, const float* cos, const float* sin, float* k_out, float* v_out,
                          int64_t out_head_stride, const lora_linear* lora, int64_t slot) {
    float* xa = malloc(sizeof(float) * (size_t)(lora_width(lora, LORA_LINEARS) + 1));
#pragma omp parallel
    {
        const thread_scratch t = thread_scratch_new(b, 1, (float*)h);  // h is only read here
        block_pre_team(b, &t, cos, sin, k_out, v_out, out_head_stride, lora, &slot, xa);
        free(t.own);
    }
    free(xa);
}

void kvgen_block_pre(const block_t* b, const float* h, const float* cos, const float* sin, float* k_out, float* v_out,
                     const lora_linear* lora, int64_t slot) {
    kvgen_block_pre_into(b, h, cos, sin, k_out, v_out, b->head_dim, lora, slot);
}

// Where a cache keeps one layer's keys or values (see KVLayout in kv/interface.py): one strided
// buffer (table == NULL) or blocks of `block_size` positions listed by a block table.
// A row of a token tree (kvgen_decode_tree) reads the cache up to tail_start, then its own path:
// position p >= tail_start at element offset tail[p - tail_start] (tail == NULL: no path).
typedef struct {
    const float* base;
    int64_t head_stride, pos_stride, block_stride, block_size;
    const int64_t* table;
    const int64_t* tail;
    int64_t tail_start;
} kv_layout;

static inline const float* kv_at(const kv_layout* l, int64_t head, int64_t pos) {
    if (l->tail != NULL && pos >= l->tail_start) return l->base + l->tail[pos - l->tail_start] + head * l->head_stride;
    if (l->table == NULL) return l->base + head * l->head_stride + pos * l->pos_stride;
    return l->base + l->table[pos / l->block_size] * l->block_stride + head * l->head_stride +
           (pos % l->block_size) * l->pos_stride;
}

// rows[i] = kv_at(l, head, first + i) for i < n, one division for the run instead of two per
// position (the divisions were a fifth of a prompt's attention time).
static inline void kv_rows(const kv_layout* l, int64_t head, int64_t first, int64_t n, const float** rows) {
    if (l->tail != NULL && first + n > l->tail_start) {  // the run reaches a tree row's own path
        const int64_t cached = first < l->tail_start ? l->tail_start - first : 0;
        kv_layout cache = *l;
        cache.tail = NULL;
        kv_rows(&cache, head, first, cached, rows);
        for (int64_t i = cached; i < n; i++) rows[i] = l->base + l->tail[first + i - l->tail_start] + head * l->head_stride;
        return;
    }
    if (l->table == NULL) {
        const float* p = l->base + head * l->head_stride + first * l->pos_stride;
        for (int64_t i = 0; i < n; i++) rows[i] = p + i * l->pos_stride;
        return;
    }
    int64_t block = first / l->block_size, offset = first % l->block_size;
    for (int64_t i = 0; i < n;) {
        const float* p = l->base + l->table[block] * l->block_stride + head * l->head_stride;
        for (; offset < l->block_size && i < n; offset++, i++) rows[i] = p + offset * l->pos_stride;
        block++, offset = 0;
    }
}

#include "attention_tiles.c"

// Query heads that share one kv head (q, out: [count, d], count <= MAX_HEAD_RUN) over keys[start,
// end), in tiles of 32 positions. The tile loop runs outside the head loop, so a tile's keys and
// values come from memory once for all the heads (Gemma 3 270M: 4 query heads per kv head) where
// one head at a time read them once per head; each head's sums are the lone head's, op for op.
// attend_begin and attend_end open and close the heads' sums; the rows step's blocks of rows
// (decode_rows.c, attend_row_block) take the tiles between them row by row in turn.
#define MAX_HEAD_RUN MAX_HEAD_TILE
// sinks: the heads' sink logits (NULL: none; softmax_start).
static void attend_begin(float* out, int64_t count, int64_t d, float cap, const float* sinks, softmax_state* st) {
    for (int64_t h = 0; h < count; h++) {
        st[h] = softmax_start(cap, sinks ? sinks + h : NULL);
        for (int64_t j = 0; j < d; j++) out[h * d + j] = 0.0f;
    }
}

static void attend_end(float* out, int64_t count, int64_t d, const softmax_state* st) {
    for (int64_t h = 0; h < count; h++) {
        const float inv = 1.0f / st[h].sum;
        for (int64_t j = 0; j < d; j++) out[h * d + j] *= inv;
    }
}

// One tile's key and value row addresses (kv_rows), kept for the next rows of a block that read
// the same positions (decode_rows.c, attend_row_block): listing them anew for every row had cost a
// twentieth of a 2,048-token prompt.
typedef struct {
    int64_t first, keys_listed, values_listed;  // keys [first, first + keys_listed) are listed, values likewise
    kv_layout keys, values;                     // whose positions they are
    const float *key_rows[64], *value_rows[32];
    float* kt;          // room for a tile's keys as columns (transposed_scores.c), or NULL: keys by rows
    int64_t kt_keys;    // keys [first, first + kt_keys) are in kt
} tile_rows;

// Whether layouts a and b (one step's, so one store and one set of strides) keep positions
// [first, last) in the same places.
static int same_positions(const kv_layout* a, const kv_layout* b, int64_t first, int64_t last) {
    if (a->tail != NULL || b->tail != NULL || a->base != b->base) return 0;
    if (a->table == b->table) return 1;
    if (a->table == NULL || b->table == NULL) return 0;
    for (int64_t block = first / a->block_size; block <= (last - 1) / a->block_size; block++)
        if (a->table[block] != b->table[block]) return 0;
    return 1;
}

// The rows of one tile for a row reading keys [first, first + reach) and values [first, first + n)
// through kl / vl: the listed ones, extended where it reads further (returns 1), or listed anew (0).
static int list_tile_rows(tile_rows* t, const kv_layout* kl, const kv_layout* vl, int64_t kv_head, int64_t first,
                           int64_t reach, int64_t n) {
    const int64_t keys_end = first + (reach > t->keys_listed ? reach : t->keys_listed);
    const int64_t values_end = first + (n > t->values_listed ? n : t->values_listed);
    int kept = 1;
    if (t->first != first || t->keys_listed == 0 || !same_positions(&t->keys, kl, first, keys_end) ||
        !same_positions(&t->values, vl, first, values_end)) {
        t->first = first, t->keys_listed = t->values_listed = t->kt_keys = 0, t->keys = *kl, t->values = *vl;
        kept = 0;
    }
    if (reach > t->keys_listed) {
        kv_rows(&t->keys, kv_head, first + t->keys_listed, reach - t->keys_listed, t->key_rows + t->keys_listed);
        t->keys_listed = reach;
    }
    if (n > t->values_listed) {
        kv_rows(&t->values, kv_head, first + t->values_listed, n - t->values_listed, t->value_rows + t->values_listed);
        t->values_listed = n;
    }
    return kept;
}

// The tile of positions [first, min(first + 32, end)) into the heads' running sums: its addresses
// listed (or the ones `listed` holds), then attend_tile_heads; streamed keys (not `cached`) reach
// into the next tile, which is asked for ahead.
static void attend_listed_tile(tile_rows* listed, const float* q, float* out, int64_t count, const kv_layout* keys,
                               const kv_layout* values, int64_t kv_head, int64_t first, int64_t end, float scale,
                               int64_t d, int cached, softmax_state* st) {
    const int64_t n = end - first < 32 ? end - first : 32;
    const int64_t reach = cached ? n : (end - first < 64 ? end - first : 64);
    const int kept = list_tile_rows(listed, keys, values, kv_head, first, reach, n);
    (void)kept;  // read only where the scores can be transposed
#ifdef TRANSPOSED_SCORES
    // Transposed once a second row reads the tile: rows whose tiles all differ (a sliding window
    // moves each row's tiles by a position) would pay a transposition per row.
    if (listed->kt != NULL && cached && kept && d % 32 == 0 && d <= MAX_KT_DIM) {  // kt_keys > 0 only if kept
        if (listed->kt_keys < n) transpose_keys(listed->key_rows, listed->kt_keys, n, d, listed->kt);
        listed->kt_keys = listed->kt_keys > n ? listed->kt_keys : n;
        attend_transposed_tile(q, count, listed->kt, listed->value_rows, n, d, scale, st, out);
        return;
    }
#endif
    attend_tile_heads(q, count, listed->key_rows, listed->value_rows, n, reach, d, scale, st, out, cached);
}

static void attend_heads(const float* q, float* out, int64_t count, const kv_layout* keys, const kv_layout* values,
                         int64_t kv_head, int64_t start, int64_t end, float scale, int64_t d, int cached) {
    softmax_state st[MAX_HEAD_RUN];
    tile_rows listed = {.first = -1};
    attend_begin(out, count, d, 0.0f, NULL, st);  // the torch path's paged kernel: soft-capping and sinks run in torch
    for (int64_t first = start; first < end; first += 32)
        attend_listed_tile(&listed, q, out, count, keys, values, kv_head, first, end, scale, d, cached, st);
    attend_end(out, count, d, st);
}

// Attention's work units for `rows` one-token rows: unit u is a run of query heads of one kv head
// of one row. A whole group per unit where rows and kv heads give the threads enough units, else
// half groups (one row of Gemma 3: 2 units of 2 heads, one per thread; a unit of all 4 heads left
// a thread idle: Gemma 3 at 4,096 tokens decoded 52 tok/s against 59).
typedef struct { int64_t group, per, parts, kv_heads; } head_units;

static head_units attention_units(int64_t rows, int64_t heads, int64_t kv_heads) {
    const int64_t group = heads / kv_heads;
    int64_t per = rows * kv_heads >= 4 ? group : (group + 1) / 2;
    per = per < MAX_HEAD_RUN ? per : MAX_HEAD_RUN;
    return (head_units){group, per, (group + per - 1) / per, kv_heads};
}

// Unit u -> its row, its first head (within the row) and its head count.
static inline int64_t unit_heads(const head_units* h, int64_t u, int64_t* row, int64_t* first) {
    const int64_t part = u % h->parts, kv = (u / h->parts) % h->kv_heads;
    *row = u / (h->parts * h->kv_heads);
    *first = kv * h->group + part * h->per;
    return h->group - part * h->per < h->per ? h->group - part * h->per : h->per;
}

// Attention of one query per head (q, out: [heads, d]) over keys[start, end), in three
// passes split so that each thread reads its own share of the keys and values: the scores by tiles
// of positions, each head's running softmax by heads, the weighted sums of values by (kv head,
// 32-column slice) units. Head units had every thread stream the keys and values of a kv head it shares with the
// other (Gemma 3: 4 query heads over 1 kv head), at one core's bandwidth: ~27 us of a layer at 200
// positions. Each value is computed as attend_heads computes it (the same tiles of 32 positions,
// the same rescale before a tile's sums, each column's sum its own, weighted_sums_columns), so a
// token's bits are those of the head units the rows step runs. Over a block table (the engine's
// pool) the next keys and the next tile's values are asked for ahead (prefetch_rows): one decode
// at 4,000 positions ran 1.20-1.31x as fast. Asked for a few rows at a time, in step with the work
// (keys two positions at a time, values four, with each run of sums), instead of eight keys and a
// whole tile's values in one burst: 1.37x as fast again (96.5 -> 132.4 tok/s in the engine, about
// the contiguous cache's speed). By every thread of a team, which shares `work`
// (attention_work floats); returns after a barrier, with out whole for every thread.
static void attend_split_team(const float* q, float* attn, int64_t heads, int64_t kv_heads, int64_t d, float scale,
                              float cap, const float* sinks, const kv_layout* keys, const kv_layout* values,
                              int64_t start, int64_t end, float* work) {
    const int64_t group = heads / kv_heads;
    const int64_t len = end - start, tiles = (len + 31) / 32;
    float* p = work;  // scores, then weights: [heads, len]
    float* rescale = p + heads * len;  // [heads, tiles]: the factor applied before tile t's sums, -1: none
    float* sums = rescale + heads * tiles;  // [heads]: the softmax denominators
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t first = start + 32 * t, n = end - first < 32 ? end - first : 32;
        const float* key_rows[40];  // kv head 0's (over a block table also the next tile's first 8); kv head g's are g head strides on
        const int64_t reach = keys->table != NULL ? 40 : 32, ahead = end - first < reach ? end - first : reach;
        kv_rows(keys, 0, first, ahead, key_rows);
        for (int64_t i = 0; i < n; i++) {  // position by position, every head: the kv heads stream together
            if (keys->table != NULL && i % 2 == 0)  // a block table's: positions 8 on asked for, two at a time
                for (int64_t g = 0; g < kv_heads; g++)
                    prefetch_rows(key_rows + i + 8, ahead - i - 8, 2, d, g * keys->head_stride);
            for (int64_t h = 0; h < heads; h++)
                p[h * len + 32 * t + i] = dot(q + h * d, key_rows[i] + h / group * keys->head_stride, d) * scale;
        }
    }
#pragma omp for schedule(static)
    for (int64_t h = 0; h < heads; h++) {  // attend_tile_heads' softmax, tile by tile
        softmax_state st = softmax_start(cap, sinks ? sinks + h : NULL);
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n = len - 32 * t < 32 ? len - 32 * t : 32;
            rescale[h * tiles + t] = softmax_tile(p + h * len + 32 * t, n, &st);
        }
        sums[h] = st.sum;
    }
    // This thread's share of the (kv head, 32-column slice) units, taken in order, so that it reads
    // whole value rows where it can (the columns past the last whole slice go with that slice).
    // Half of every row to each thread (SmolLM2: 128 of 256 bytes) streamed a layer's values at
    // ~21 GB/s; whole rows of kv heads 0 and 2 and halves of kv head 1 decoded at 8,192 positions
    // 1.2-1.26x as fast, in in-process turns.
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t slices = d >= 32 ? d / 32 : 1, units = kv_heads * slices;
    const int64_t u0 = units * me / threads, u1 = units * (me + 1) / threads;
    const float* value_rows[64];
    for (int64_t kv = u0 / slices; kv < kv_heads && kv * slices < u1; kv++) {
        const int64_t h0 = kv * group, s0 = u0 > kv * slices ? u0 - kv * slices : 0;
        const int64_t s1 = u1 < (kv + 1) * slices ? u1 - kv * slices : slices;
        const int64_t first_col = 32 * s0, last_col = s1 == slices ? d : 32 * s1;
        float* out = attn + h0 * d;
        for (int64_t h = 0; h < group; h++)
            for (int64_t j = first_col; j < last_col; j++) out[h * d + j] = 0.0f;
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t first = start + 32 * t, n = end - first < 32 ? end - first : 32;
            const int64_t reach = values->table != NULL ? 64 : 32, ahead = end - first < reach ? end - first : reach;
            kv_rows(values, h0 / group, first, ahead, value_rows);  // over a block table also the next tile's
            for (int64_t h = 0; h < group; h++) {
                const float correction = rescale[(h0 + h) * tiles + t];
                if (correction >= 0.0f)
                    for (int64_t j = first_col; j < last_col; j++) out[h * d + j] *= correction;
            }
            weighted_sums_streamed(p + h0 * len + 32 * t, len, value_rows, n, d, first_col, last_col, out, group,
                                   value_rows + 32, values->table != NULL ? ahead - 32 : 0);  // the next tile's columns
        }
        for (int64_t h = 0; h < group; h++) {
            const float inv = 1.0f / sums[h0 + h];
            for (int64_t j = first_col; j < last_col; j++) out[h * d + j] *= inv;
        }
    }
#pragma omp barrier
}

// attend_split_team's shared scratch for `heads` over at most `len` positions, in floats.
static int64_t attention_work(int64_t heads, int64_t len) { return heads * (len + (len + 31) / 32 + 1); }

// The one-token attention over one strided fp32 K/V buffer (k_base, v_base: [kv_heads, positions,
// d] addressed by head_stride, pos_stride): q, out [heads, d]. For tests: the bits of the C step's.
void kvgen_decode_attention(const float* q, float* out, const float* k_base, const float* v_base, int64_t heads,
                            int64_t kv_heads, int64_t d, float scale, int64_t head_stride, int64_t pos_stride,
                            int64_t start, int64_t end) {
    const kv_layout k = {k_base, head_stride, pos_stride, 0, 1, NULL};
    const kv_layout v = {v_base, head_stride, pos_stride, 0, 1, NULL};
    float* work = malloc(sizeof(float) * (size_t)attention_work(heads, end - start));
#pragma omp parallel
    attend_split_team(q, out, heads, kv_heads, d, scale, 0.0f, NULL, &k, &v, start, end, work);
    free(work);
}

// A batch of one-token rows, each over its own blocks of one paged store, read in place (no
// gather, no padding): q, out [rows, heads, d]; row r sees positions [starts[r], ends[r]) through
// tables[r * table_width ..]. The store's layer holds [blocks, kv_heads, block_size, d].
void kvgen_paged_decode_attention(const float* q, float* out, const float* k_base, const float* v_base,
                                  int64_t rows, int64_t heads, int64_t kv_heads, int64_t d, float scale,
                                  int64_t head_stride, int64_t pos_stride, int64_t block_stride, int64_t block_size,
                                  const int64_t* tables, int64_t table_width, const int64_t* starts, const int64_t* ends) {
    const head_units units = attention_units(rows, heads, kv_heads);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t u = 0; u < rows * units.kv_heads * units.parts; u++) {
        int64_t r, head;
        const int64_t count = unit_heads(&units, u, &r, &head);
        const kv_layout k = {k_base, head_stride, pos_stride, block_stride, block_size, tables + r * table_width};
        const kv_layout v = {v_base, head_stride, pos_stride, block_stride, block_size, tables + r * table_width};
        attend_heads(q + (r * heads + head) * d, out + (r * heads + head) * d, count, &k, &v, head / units.group,
                     starts[r], ends[r], scale, d, 0);
    }
}

// tanh-GELU as a sigmoid: 0.5 x (1 + tanh(u)) = x / (1 + e^(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3),
// so GeGLU takes SwiGLU's vectorised exp (tanhf one lane at a time cost Gemma 3 270M ~0.5 ms a
// token, 26 us per layer's 2,048 values on one core while the other thread waited).
static inline float gelu_tanh(float x) {
    return x / (1.0f + expf(-1.5957691216057308f * (x + 0.044715f * x * x * x)));
}

// out = act(gate) * up over n values, act as block b says (b->act); gpt-oss's clamped SwiGLU (act
// 2) is (clamp(up, -limit, limit) + 1) g / (1 + e^(-alpha g)) with g = min(gate, limit). Act 3 has
// no gate: out = relu(gate)² of the up projection's n values in `gate` (`up` unread); one rounding,
// so the bits of torch's relu(x).square().
static void gated_activation(const float* gate, const float* up, float* out, int64_t n, const block_t* b) {
    const int act = b->act;
    if (act == 3) {
        for (int64_t i = 0; i < n; i++) {
            const float g = gate[i] > 0.0f ? gate[i] : 0.0f;
            out[i] = g * g;
        }
        return;
    }
    const float alpha = b->swiglu_alpha, limit = b->swiglu_limit;
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i), u = _mm256_loadu_ps(up + i);
        if (act == 2) {  // clamped: g = min(gate, limit), u = clamp(up, -limit, limit) + 1
            g = _mm256_min_ps(g, _mm256_set1_ps(limit));
            u = _mm256_add_ps(_mm256_min_ps(_mm256_max_ps(u, _mm256_set1_ps(-limit)), _mm256_set1_ps(limit)), one);
        }
        // SiLU: g / (1 + e^-g); tanh-GELU: g / (1 + e^(-2u)) with -2u = c g (1 + 0.044715 g^2); clamped: e^(-alpha g)
        const __m256 z = act == 1 ? _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(-1.5957691216057308f), g),
                                                  _mm256_fmadd_ps(_mm256_mul_ps(g, g), _mm256_set1_ps(0.044715f), one))
                         : act == 2 ? _mm256_mul_ps(_mm256_set1_ps(-alpha), g)
                                    : _mm256_sub_ps(_mm256_setzero_ps(), g);
        const __m256 activated = _mm256_div_ps(g, _mm256_add_ps(one, exp8(z)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(activated, u));
    }
#else
    for (; i + 8 <= n; i += 8)  // exp8's lanes one at a time, z as above: the AVX2 build's bits
        for (int64_t l = i; l < i + 8; l++) {
            const float g = act == 2 ? fminf(gate[l], limit) : gate[l];
            const float u = act == 2 ? fminf(fmaxf(up[l], -limit), limit) + 1.0f : up[l];
            const float z = act == 1 ? (-1.5957691216057308f * g) * fmaf(g * g, 0.044715f, 1.0f) : act == 2 ? -alpha * g : 0.0f - g;
            out[l] = g / (1.0f + exp_lane(z)) * u;
        }
#endif
    for (; i < n; i++) {
        const float g = act == 2 ? fminf(gate[i], limit) : gate[i];
        const float u = act == 2 ? fminf(fmaxf(up[i], -limit), limit) + 1.0f : up[i];
        out[i] = (act == 1 ? gelu_tanh(g) : g / (1.0f + expf(act == 2 ? -alpha * g : -g))) * u;
    }
}

// h += y, scaled (Granite: y * scale, as transformers multiplies before adding; 0: unscaled).
static inline void residual_add(float* h, const float* y, float scale, int64_t hidden) {
    if (scale != 0.0f) {
        for (int64_t i = 0; i < hidden; i++) h[i] += y[i] * scale;
    } else {
        for (int64_t i = 0; i < hidden; i++) h[i] += y[i];
    }
}

// h += norm(y) (Gemma's post-sublayer norm, when given) or h += y: block b's residual add.
static void add_residual(const block_t* b, float* h, float* y, const float* norm, int64_t hidden) {
    if (norm) rms_norm(y, norm, b->eps, hidden, y);
    residual_add(h, y, b->residual_scale, hidden);
}

// add_residual into this thread's h from the team's shared y, norm(y) going to its own t->y.
static void add_residual_team(const block_t* b, const thread_scratch* t, const float* y, const float* norm) {
    if (norm) {
        rms_norm(y, norm, b->eps, b->hidden, t->y);
        y = t->y;
    }
    residual_add(t->h, y, b->residual_scale, b->hidden);
}

// Expert e's router score for input x (normed h), its bias added where the router has one.
static inline float router_score(const block_t* b, int64_t e, const float* x) {
    const float score = dot(b->router + e * b->hidden, x, b->hidden);
    return b->router_bias ? score + b->router_bias[e] : score;
}

// The weight of the shared expert's output for input x: sigmoid(shared_gate . x) (Qwen2-MoE), 1
// where it has no gate.
static inline float shared_expert_gate(const block_t* b, const float* x) {
    return b->shared_gate ? 1.0f / (1.0f + expf(-dot(b->shared_gate, x, b->hidden))) : 1.0f;
}

// The best of `n` scores not yet in order[0..j) (ties: the lower index).
static int64_t best_remaining(const float* scores, int64_t n, const int64_t* order, int64_t j) {
    int64_t best = -1;
    for (int64_t e = 0; e < n; e++) {
        int taken = 0;
        for (int64_t i = 0; i < j; i++) taken |= order[i] == e;
        if (!taken && (best < 0 || scores[e] > scores[best])) best = e;
    }
    return best;
}

// choice [num_experts] set to -inf outside the expert_groups_used best groups (models/moe.py's
// eligible): a group scores its best choice (softmax) or its best two's sum (sigmoid, DeepSeek-V3).
static void keep_best_groups(const block_t* b, float* choice) {
    const int64_t groups = b->expert_groups, size = b->num_experts / groups;
    float group_scores[groups];
    int64_t kept[groups];
    for (int64_t g = 0; g < groups; g++) {
        float first = -INFINITY, second = -INFINITY;
        for (int64_t e = g * size; e < (g + 1) * size; e++) {
            if (choice[e] > first) {
                second = first;
                first = choice[e];
            } else if (choice[e] > second) {
                second = choice[e];
            }
        }
        group_scores[g] = b->expert_sigmoid ? first + second : first;
    }
    for (int64_t j = 0; j < b->expert_groups_used; j++) kept[j] = best_remaining(group_scores, groups, kept, j);
    for (int64_t g = 0; g < groups; g++) {
        int keep = 0;
        for (int64_t j = 0; j < b->expert_groups_used; j++) keep |= kept[j] == g;
        if (!keep)
            for (int64_t e = g * size; e < (g + 1) * size; e++) choice[e] = -INFINITY;
    }
}

// A token's experts from its router scores [num_experts]: the top_k by softmax probability (ties:
// the lower index), returned in ascending expert order (the order their outputs are summed in,
// here, in the rows step and in models/moe.py), with their weights: the probabilities, divided by
// their sum (taken from the most probable down, as torch sums topk's output) when normalize, times
// routed_scale (DeepSeek). DeepSeek-V3 (expert_sigmoid, choice_bias, expert_groups): the top_k by
// sigmoid(score) + bias among the eligible groups, weighed by sigmoid(score), summed in that order.
static void route_experts(const block_t* b, const float* scores, int64_t* ids, float* weights) {
    const int64_t n = b->num_experts, k = b->top_k;
    float top = scores[0], total = 0.0f;
    float prob[n], choice[n];
    if (b->expert_sigmoid) {
        for (int64_t e = 0; e < n; e++) prob[e] = 1.0f / (1.0f + expf(-scores[e]));
    } else {
        for (int64_t e = 1; e < n; e++) top = scores[e] > top ? scores[e] : top;
        for (int64_t e = 0; e < n; e++) total += expf(scores[e] - top);
        for (int64_t e = 0; e < n; e++) prob[e] = expf(scores[e] - top) / total;
    }
    // Without a bias or groups softmax chooses by the scores themselves (the same order as the
    // probabilities', whose rounding could tie two of them).
    const int plain = !b->expert_sigmoid && !b->choice_bias && b->expert_groups <= 1;
    for (int64_t e = 0; e < n; e++) choice[e] = plain ? scores[e] : prob[e] + (b->choice_bias ? b->choice_bias[e] : 0.0f);
    if (b->expert_groups > 1) keep_best_groups(b, choice);
    int64_t order[k];
    for (int64_t j = 0; j < k; j++) order[j] = best_remaining(choice, n, order, j);
    float p[k], chosen = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        p[j] = prob[order[j]];
        chosen += p[j];
    }
    for (int64_t j = 0; j < k; j++) {  // ascending expert order for the sum
        int64_t at = 0;
        for (int64_t i = 0; i < k; i++) at += order[i] < order[j];
        ids[at] = order[j];
        weights[at] = (b->normalize ? p[j] / chosen : p[j]) * (b->routed_scale > 0.0f ? b->routed_scale : 1.0f);
    }
}

// The mixture for one token, by every thread of a team: x (each thread's copy) holds the normed
// input; the sum of weight * expert(x) over its experts, in ascending expert order, goes to t->y.
static void experts_team(const block_t* b, const thread_scratch* t) {
#pragma omp for schedule(static)
    for (int64_t e = 0; e < b->num_experts; e++) b->router_out[e] = router_score(b, e, t->x);
    int64_t ids[b->top_k];
    float weights[b->top_k];
    route_experts(b, b->router_out, ids, weights);
    const int64_t n = b->intermediate;
    for (int64_t i = 0; i < b->hidden; i++) t->y[i] = 0.0f;
    for (int64_t j = 0; j < b->top_k; j++) {
        // b->mlp and b->x are shared: every thread reads them before the next linear's closing
        // barrier, after which the next expert writes them.
        linear_team(&b->expert_gate_up[ids[j]], t->x, t->xq, t->sums, b->mlp);
        gated_activation(b->mlp, b->mlp + n, t->act, n, b);
        linear_team(&b->expert_down[ids[j]], t->act, t->xq, t->sums, b->x);
        for (int64_t i = 0; i < b->hidden; i++) t->y[i] += weights[j] * b->x[i];
    }
    if (b->shared_intermediate > 0) {
        const int64_t m = b->shared_intermediate;
        const float gate = shared_expert_gate(b, t->x);
        linear_team(&b->shared_gate_up, t->x, t->xq, t->sums, b->mlp);
        gated_activation(b->mlp, b->mlp + m, t->act, m, b);
        linear_team(&b->shared_down, t->act, t->xq, t->sums, b->x);
        for (int64_t i = 0; i < b->hidden; i++) t->y[i] += gate * b->x[i];
    }
}

static void mlp_team(const block_t* b, const thread_scratch* t, const lora_linear* lora, const int64_t* slot, float* xa);

// Everything after attention (b->attn holds its output): o-proj, residual, MLP, residual, into each
// thread's h. By every thread of a team; returns after a barrier (b->x, the sublayers' outputs, is
// read by every thread before the next linear writes it: the barrier that closes gate_up).
static void block_finish_team(const block_t* b, const thread_scratch* t, const lora_linear* lora, const int64_t* slot,
                              float* xa) {
    const float* o_in = b->attn;
    if (b->mla_rank > 0) {  // each head's latent output expanded to its values
#pragma omp for schedule(static)
        for (int64_t h = 0; h < b->num_heads; h++) mla_value(b, b->attn, h, b->mla_out);
        o_in = b->mla_out;
    }
    linear_team(&b->o, o_in, t->xq, t->sums, b->x);
    lora_team(lora, LORA_O, &b->o, o_in, b->x, 1, slot, xa);
    add_residual_team(b, t, b->x, b->attn_out_norm);
    mlp_team(b, t, lora, slot, xa);
}

// Whether block b has an MLP sublayer (Nemotron-H's attention layers are attention alone).
static inline int has_mlp(const block_t* b) { return b->intermediate > 0 || b->num_experts > 0; }

// The block's MLP sublayer: norm, gated MLP or mixture, residual, into each thread's h (by every
// thread of a team; returns after a barrier).
static void mlp_team(const block_t* b, const thread_scratch* t, const lora_linear* lora, const int64_t* slot, float* xa) {
    if (!has_mlp(b)) {
#pragma omp barrier
        return;
    }
    norm_input(t->h, b->mlp_in_norm, b->eps, b->hidden, t->x);
    if (b->num_experts > 0) {  // no adapters on experts (the LoRA registry refuses them; attention's apply above)
        experts_team(b, t);
        add_residual_team(b, t, t->y, b->mlp_out_norm);
        return;
    }
    linear_team(&b->gate_up, t->x, t->xq, t->sums, b->mlp);
    lora_team(lora, LORA_GATE_UP, &b->gate_up, t->x, b->mlp, 1, slot, xa);
    const int64_t n = b->intermediate;
    gated_activation(b->mlp, b->mlp + n, t->x, n, b);
    linear_team(&b->down, t->x, t->xq, t->sums, b->x);
    lora_team(lora, LORA_DOWN, &b->down, t->x, b->x, 1, slot, xa);
    add_residual_team(b, t, b->x, b->mlp_out_norm);
}

// The MLP sublayer alone for one token (a hybrid's Mamba layers: their mixer runs in mamba_step.c):
// h += residual_scale * mlp(norm(h)), b's attention fields unused. lora: this layer's LORA_LINEARS
// deltas or NULL, for adapter slot `slot` (-1: none).
void kvgen_block_mlp(const block_t* b, float* h, const lora_linear* lora, int64_t slot) {
    float* xa = lora ? malloc(sizeof(float) * (size_t)(lora_width(lora, LORA_LINEARS) + 1)) : NULL;  // no adapter: no scratch
#pragma omp parallel
    {
        const thread_scratch t = thread_scratch_new(b, 1, h);
        mlp_team(b, &t, lora, &slot, xa);
        free(t.own);
    }
    free(xa);
}

// keys/values: the [1, kv_heads, L, head_dim] views cache.update() returned.
void kvgen_block_post(const block_t* b, float* h, const float* keys, int64_t k_head_stride, int64_t k_pos_stride,
                      const float* values, int64_t v_head_stride, int64_t v_pos_stride, int64_t start, int64_t end,
                      const lora_linear* lora, int64_t slot) {
    const kv_layout k = {keys, k_head_stride, k_pos_stride, 0, 1, NULL};
    const kv_layout v = {values, v_head_stride, v_pos_stride, 0, 1, NULL};
    float* work = malloc(sizeof(float) * (size_t)(attention_work(b->num_heads, end - start) + lora_width(lora, LORA_LINEARS)));
#pragma omp parallel
    {
        const thread_scratch t = thread_scratch_new(b, 1, h);
        attend_split_team(b->qkv_out, b->attn, b->num_heads, b->num_kv_heads, b->head_dim, b->scale, b->softcap, b->sinks,
                          &k, &v, start, end, work);
        block_finish_team(b, &t, lora, &slot, work + attention_work(b->num_heads, end - start));
        free(t.own);
    }
    free(work);
}

// Every block for one token, reading and appending K/V in the cache's own storage (KVLayout):
// the new key/value is written at `position`, attention reads positions [start, position].
// rope: [kinds, 2, head_dim] (cos, sin); rope_kind, window: per layer (window 0 = full attention).
// lora: [num_layers, LORA_LINEARS] adapter deltas or NULL, applied for adapter slot `slot` (-1: none).
// One parallel region for all the layers (see thread_scratch).
void kvgen_decode_layers(const block_t* blocks, int64_t num_layers, float* h, const float* rope,
                         const int64_t* rope_kind, const int64_t* window, float* k_base, float* v_base,
                         int64_t layer_stride, int64_t head_stride, int64_t pos_stride, int64_t block_stride,
                         int64_t block_size, const int64_t* table, int64_t position, const lora_linear* lora,
                         int64_t slot) {
    int64_t heads = 0;
    for (int64_t layer = 0; layer < num_layers; layer++) heads = blocks[layer].num_heads > heads ? blocks[layer].num_heads : heads;
    const int64_t attention_floats = attention_work(heads, position + 1);
    float* work = malloc(sizeof(float) * (size_t)(attention_floats + lora_width(lora, num_layers * LORA_LINEARS)));
#pragma omp parallel
    {
        const thread_scratch t = thread_scratch_new(blocks, num_layers, h);
        for (int64_t layer = 0; layer < num_layers; layer++) {
            const block_t* b = &blocks[layer];
            const lora_linear* layer_lora = lora ? lora + layer * LORA_LINEARS : NULL;
            const int64_t d = b->head_dim;
            const float* cos = rope + rope_kind[layer] * 2 * d;
            const kv_layout k = {k_base + layer * layer_stride, head_stride, pos_stride, block_stride, block_size, table};
            const kv_layout v = {v_base + layer * layer_stride, head_stride, pos_stride, block_stride, block_size, table};
            block_pre_team(b, &t, cos, cos + d, (float*)kv_at(&k, 0, position), (float*)kv_at(&v, 0, position),
                           head_stride, layer_lora, &slot, work + attention_floats);
            const int64_t start = window[layer] > 0 && position + 1 > window[layer] ? position + 1 - window[layer] : 0;
            attend_split_team(b->qkv_out, b->attn, b->num_heads, b->num_kv_heads, d, b->scale, b->softcap, b->sinks,
                              &k, &v, start, position + 1, work);
            block_finish_team(b, &t, layer_lora, &slot, work + attention_floats);
        }
        free(t.own);
    }
    free(work);
}

#include "quantized_attention.c"
#include "paged_codes_attention.c"

#include "decode_rows.c"
