// One decode step (one token, batch 1) of every Mamba block in one call, for models whose
// projections are quantized (models/mamba_decode.py). Per block, as models/mamba.py computes it:
//
//   x = rms_norm(h); [u, z] = in_proj(x); u = SiLU(causal depthwise conv over the held inputs and u);
//   [dt, B, C] = x_proj(u) (Falcon-Mamba: each RMS-normed, no weight); dt = softplus(dt_proj(dt) + b);
//   s = exp(dt A) s + dt B u (per channel, over the state); y = (C . s + D u) SiLU(z); h += out_proj(y)
//
// The states are read from *_in and written to *_out (never in place): the cache keeps earlier
// states as checkpoints, and a step that fails leaves them as they were. #included by qgemm.c after
// decode.c (qlinear, linear_team, dot, rms_norm).

typedef struct {
    int64_t hidden, inner, state, kernel, rank;
    float eps;           // the block's RMS norm
    float dt_b_c_eps;    // Falcon-Mamba's norms over dt, B and C; 0: none (Mamba)
    const float* norm;   // [hidden]
    qlinear in_proj;     // [2 inner, hidden]: u's rows, then the gate's
    const float* conv_w; // [inner, kernel]
    const float* conv_b; // [inner] or NULL
    qlinear x_proj;      // [rank + 2 state, inner]
    qlinear dt_proj;     // [inner, rank] when rank is whole blocks (dt_quantized); else dt_w
    const float* dt_w;   // [inner, rank] fp32
    const float* dt_b;   // [inner]
    const float* A;      // [inner, state]: -exp(A_log)
    const float* D;      // [inner]
    qlinear out_proj;    // [hidden, inner]
    int32_t dt_quantized;
    int32_t pad;
} mamba_block_t;

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }  // torch's threshold

// One channel's state update over the state's n values and its output C . s_new:
// s_new = d s + (step u) B, where d = e^(step a[j]) (Mamba: a decay per state value, exp as exp8 /
// exp_lane, the same bits in every build) or, with a NULL, `decay` (Mamba-2: one per head); the dot
// in 8 lanes summed in hsum8's order where n is a multiple of 8.
static float scan_channel(const float* a, float step, float decay, float u, const float* B, const float* C,
                          const float* s0, float* s1, int64_t n) {
    const float drive = step * u;
    if (n % 8 == 0) {
#ifdef __AVX2__
        __m256 sum = _mm256_setzero_ps();
        const __m256 st = _mm256_set1_ps(step), dr = _mm256_set1_ps(drive), same = _mm256_set1_ps(decay);
        for (int64_t j = 0; j < n; j += 8) {
            const __m256 d = a ? exp8(_mm256_mul_ps(_mm256_loadu_ps(a + j), st)) : same;
            const __m256 s = _mm256_fmadd_ps(d, _mm256_loadu_ps(s0 + j), _mm256_mul_ps(dr, _mm256_loadu_ps(B + j)));
            _mm256_storeu_ps(s1 + j, s);
            sum = _mm256_fmadd_ps(s, _mm256_loadu_ps(C + j), sum);
        }
        return hsum8(sum);
#else
        float lanes[8] = {0.0f};
        for (int64_t j = 0; j < n; j++) {
            s1[j] = fmaf(a ? exp_lane(a[j] * step) : decay, s0[j], drive * B[j]);
            lanes[j % 8] = fmaf(s1[j], C[j], lanes[j % 8]);
        }
        return sum_lanes(lanes);
#endif
    }
    float acc = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        s1[j] = fmaf(a ? exp_lane(a[j] * step) : decay, s0[j], drive * B[j]);
        acc += s1[j] * C[j];
    }
    return acc;
}

// Mamba's selective scan over t_len positions of one sequence, channels in parallel. u, dt (after
// softplus), z (the gate), y: [t_len, inner]; B, C: [t_len, n]; A: [inner, n]; state: [inner, n],
// read and left as the state after the last position. y = (C . s + D u) SiLU(z). capture:
// num_capture ascending positions whose states go to captured [num_capture, inner, n].
void kvgen_selective_scan(const float* u, const float* dt, const float* z, const float* A, const float* B,
                          const float* C, const float* D, float* state, float* y, int64_t t_len, int64_t inner,
                          int64_t n, const int64_t* capture, int64_t num_capture, float* captured) {
#pragma omp parallel
    {
        float* s = malloc(sizeof(float) * (size_t)(2 * n));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < inner; i++) {
            float *s0 = s, *s1 = s + n;
            memcpy(s0, state + i * n, (size_t)n * sizeof(float));
            for (int64_t t = 0, c = 0; t < t_len; t++) {
                const int64_t at = t * inner + i;
                const float acc = scan_channel(A + i * n, dt[at], 0.0f, u[at], B + t * n, C + t * n, s0, s1, n);
                y[at] = (acc + u[at] * D[i]) * silu(z[at]);
                float* swap = s0;
                s0 = s1;
                s1 = swap;
                if (c < num_capture && capture[c] == t) memcpy(captured + (c++ * inner + i) * n, s0, (size_t)n * sizeof(float));
            }
            memcpy(state + i * n, s0, (size_t)n * sizeof(float));
        }
        free(s);
    }
}

// The conv step of one channel: the held window [kernel] shifted by the new input, SiLU(w . window + b).
static inline float conv_channel(const float* held, float input, const float* w, float bias, float* window, int64_t k) {
    for (int64_t j = 0; j + 1 < k; j++) window[j] = held[j + 1];
    window[k - 1] = input;
    float acc = 0.0f;
    for (int64_t j = 0; j < k; j++) acc += window[j] * w[j];
    return silu(acc + bias);
}

static void weightless_rms(float* x, int64_t n, float eps) {
    const float inv = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) x[i] *= inv;
}

// conv_in / conv_out: per layer [inner, kernel] (the last `kernel` inputs, oldest first);
// ssm_in / ssm_out: per layer [inner, state]. h: [hidden], the residual stream, updated in place.
void kvgen_mamba_step(const mamba_block_t* blocks, int64_t num_layers, float* h, const float* const* conv_in,
                      float* const* conv_out, const float* const* ssm_in, float* const* ssm_out) {
    int64_t widest = 0, hidden = blocks[0].hidden, inner = 0, projected = 0;
    for (int64_t l = 0; l < num_layers; l++) {
        const mamba_block_t* b = &blocks[l];
        widest = b->hidden > widest ? b->hidden : widest;
        widest = b->inner > widest ? b->inner : widest;
        inner = b->inner > inner ? b->inner : inner;
        projected = b->rank + 2 * b->state > projected ? b->rank + 2 * b->state : projected;
    }
    float* shared = malloc(sizeof(float) * (size_t)(widest + 2 * inner + inner + projected + inner + inner + hidden));
    float *x = shared, *uz = x + widest, *u = uz + 2 * inner, *dbc = u + inner, *dt = dbc + projected;
    float *y = dt + inner, *out = y + inner;
#pragma omp parallel
    {
        const int64_t nb = widest / QK + 1;
        block_x8* xq = malloc((sizeof(block_x8) + sizeof(int32_t)) * (size_t)nb);
        int32_t* sums = (int32_t*)(xq + nb);
        for (int64_t layer = 0; layer < num_layers; layer++) {
            const mamba_block_t* b = &blocks[layer];
            const int64_t n_inner = b->inner, n_state = b->state, k = b->kernel;
#pragma omp single
            rms_norm(h, b->norm, b->eps, b->hidden, x);
            linear_team(&b->in_proj, x, xq, sums, uz);
            const float* held = conv_in[layer];
            float* conv = conv_out[layer];
#pragma omp for schedule(static)
            for (int64_t i = 0; i < n_inner; i++)
                u[i] = conv_channel(held + i * k, uz[i], b->conv_w + i * k, b->conv_b ? b->conv_b[i] : 0.0f, conv + i * k, k);
            linear_team(&b->x_proj, u, xq, sums, dbc);
            float* B = dbc + b->rank;
            float* C = B + n_state;
            if (b->dt_b_c_eps > 0.0f) {
#pragma omp single
                {
                    weightless_rms(dbc, b->rank, b->dt_b_c_eps);
                    weightless_rms(B, n_state, b->dt_b_c_eps);
                    weightless_rms(C, n_state, b->dt_b_c_eps);
                }
            }
            if (b->dt_quantized) {
                linear_team(&b->dt_proj, dbc, xq, sums, dt);
            } else {
#pragma omp for schedule(static)
                for (int64_t i = 0; i < n_inner; i++) dt[i] = dot(b->dt_w + i * b->rank, dbc, b->rank);
            }
            const float* s_in = ssm_in[layer];
            float* s_out = ssm_out[layer];
#pragma omp for schedule(static)
            for (int64_t i = 0; i < n_inner; i++) {
                const float step = softplus(dt[i] + b->dt_b[i]);
                const float acc = scan_channel(b->A + i * n_state, step, 0.0f, u[i], B, C, s_in + i * n_state, s_out + i * n_state,
                                               n_state);
                y[i] = (acc + u[i] * b->D[i]) * silu(uz[n_inner + i]);
            }
            linear_team(&b->out_proj, y, xq, sums, out);
#pragma omp single
            for (int64_t i = 0; i < b->hidden; i++) h[i] += out[i];
        }
        free(xq);
    }
    free(shared);
}

// Mamba-2's block (models/mamba2.py) for one token:
//   x = rms_norm(h); [z, xBC, dt] = in_proj(x); xBC = SiLU(causal depthwise conv over the held inputs and xBC);
//   per head h (group g of B and C): dt = softplus(dt + dt_bias); s = e^(dt A) s + (dt x) B (each of
//   head_dim channels, over the state); y = C . s + D x; y = rms_norm_per_group(y SiLU(z)) w; h += out_proj(y)
typedef struct {
    int64_t hidden, heads, head_dim, groups, state, kernel;
    float eps;             // the block's RMS norm
    float gate_eps;        // the gated norm's
    const float* norm;     // [hidden]
    qlinear in_proj;       // [inner + conv_dim + heads, hidden]: z, xBC, dt
    const float* conv_w;   // [conv_dim, kernel]
    const float* conv_b;   // [conv_dim] or NULL
    const float* dt_bias;  // [heads]
    const float* A;        // [heads]: -exp(A_log)
    const float* D;        // [heads]
    const float* gate_w;   // [inner]: the gated norm's weight
    qlinear out_proj;      // [hidden, inner]
    float residual_scale;  // Granite 4.0-H's residual_multiplier on the mixer's output (0: 1)
    float pad;
} mamba2_block_t;

// As kvgen_mamba_step: conv states per layer [conv_dim, kernel], recurrent [heads, head_dim, state].
void kvgen_mamba2_step(const mamba2_block_t* blocks, int64_t num_layers, float* h, const float* const* conv_in,
                       float* const* conv_out, const float* const* ssm_in, float* const* ssm_out) {
    int64_t widest = 0, projected = 0, hidden = blocks[0].hidden;
    for (int64_t l = 0; l < num_layers; l++) {
        const mamba2_block_t* b = &blocks[l];
        const int64_t inner = b->heads * b->head_dim, rows = 2 * inner + 2 * b->groups * b->state + b->heads;
        widest = b->hidden > widest ? b->hidden : widest;
        widest = inner > widest ? inner : widest;
        projected = rows > projected ? rows : projected;
    }
    float* shared = malloc(sizeof(float) * (size_t)(widest + 2 * projected + widest + hidden));
    float *x = shared, *proj = x + widest, *xbc = proj + projected, *y = xbc + projected, *out = y + widest;
#pragma omp parallel
    {
        const int64_t nb = widest / QK + 1;
        block_x8* xq = malloc((sizeof(block_x8) + sizeof(int32_t)) * (size_t)nb);
        int32_t* sums = (int32_t*)(xq + nb);
        for (int64_t layer = 0; layer < num_layers; layer++) {
            const mamba2_block_t* b = &blocks[layer];
            const int64_t inner = b->heads * b->head_dim, grouped = b->groups * b->state, k = b->kernel;
            const int64_t conv_dim = inner + 2 * grouped, per_group = b->heads / b->groups;
#pragma omp single
            rms_norm(h, b->norm, b->eps, b->hidden, x);
            linear_team(&b->in_proj, x, xq, sums, proj);
            const float* held = conv_in[layer];
            float* window = conv_out[layer];
#pragma omp for schedule(static)
            for (int64_t i = 0; i < conv_dim; i++)
                xbc[i] = conv_channel(held + i * k, proj[inner + i], b->conv_w + i * k, b->conv_b ? b->conv_b[i] : 0.0f,
                                      window + i * k, k);
            const float* s_in = ssm_in[layer];
            float* s_out = ssm_out[layer];
#pragma omp for schedule(static)
            for (int64_t c = 0; c < inner; c++) {
                const int64_t head = c / b->head_dim, g = head / per_group;
                const float dt = softplus(proj[inner + conv_dim + head] + b->dt_bias[head]);
                const float* B = xbc + inner + g * b->state;
                const float acc = scan_channel(NULL, dt, exp_lane(dt * b->A[head]), xbc[c], B, B + grouped, s_in + c * b->state,
                                               s_out + c * b->state, b->state);
                y[c] = (acc + xbc[c] * b->D[head]) * silu(proj[c]);  // gated: y SiLU(z)
            }
#pragma omp single
            {
                const int64_t width = inner / b->groups;
                for (int64_t g = 0; g < b->groups; g++) {
                    float* part = y + g * width;
                    const float inv = 1.0f / sqrtf(dot(part, part, width) / (float)width + b->gate_eps);
                    for (int64_t i = 0; i < width; i++) part[i] = part[i] * inv * b->gate_w[g * width + i];
                }
            }
            linear_team(&b->out_proj, y, xq, sums, out);
            const float scale = b->residual_scale != 0.0f ? b->residual_scale : 1.0f;
#pragma omp single
            for (int64_t i = 0; i < b->hidden; i++) h[i] += out[i] * scale;
        }
        free(xq);
    }
    free(shared);
}
