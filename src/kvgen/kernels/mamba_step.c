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
//
// The rows are independent sequences, or a chain: one sequence's next tokens, where row r's *_in
// state is row r-1's *_out (a speculative verify: models/recurrent.py, `_steps_in_c`). The conv and the scan run
// each channel's rows in order on one thread, so a chain's row reads the state the row before wrote,
// and every row gets the bits of a one-token step.

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

// SiLU with exp_lane (exp8's lanes one at a time), so the prompt kernels' 8-lane form (silu8)
// gives the decode step's bits.
static inline float silu(float x) { return x / (1.0f + exp_lane(-x)); }
#ifdef __AVX2__
static inline __m256 silu8(__m256 x) {
    const __m256 negated = _mm256_xor_ps(x, _mm256_set1_ps(-0.0f));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(negated)));
}
#endif

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

#ifdef __AVX2__
// scan_channel for four channels of one Mamba-2 head (one decay, one B and C), each state updated
// in place: every channel's bits are scan_channel's, its dot product in 8 lanes summed by hsum8,
// but the four channels' chains of FMAs interleave instead of each waiting on its own.
static void scan_four_channels(float step, float decay, const float* u, const float* B, const float* C, float* s,
                               int64_t n, float* acc) {
    __m256 sum[4], drive[4];
    const __m256 same = _mm256_set1_ps(decay);
    for (int c = 0; c < 4; c++) sum[c] = _mm256_setzero_ps(), drive[c] = _mm256_set1_ps(step * u[c]);
    for (int64_t j = 0; j < n; j += 8) {
        const __m256 b = _mm256_loadu_ps(B + j), cj = _mm256_loadu_ps(C + j);
        for (int c = 0; c < 4; c++) {
            const __m256 v = _mm256_fmadd_ps(same, _mm256_loadu_ps(s + c * n + j), _mm256_mul_ps(drive[c], b));
            _mm256_storeu_ps(s + c * n + j, v);
            sum[c] = _mm256_fmadd_ps(v, cj, sum[c]);
        }
    }
    for (int c = 0; c < 4; c++) acc[c] = hsum8(sum[c]);
}
#endif

// Mamba-2's scan over t_len positions of one sequence, one step at a time as kvgen_mamba2_step_from
// takes it (the same decay e^(dt A[h]) and update per position, so the same bits), channels
// (head, p) in parallel, four of a head at a time where head_dim and n allow. u is
// [t_len, heads * head_dim], B and C [t_len, groups * n], each row `stride` floats apart (views of
// the conv's output); dt [t_len, heads] after softplus, or with `dt_bias` [heads] (not NULL) before
// it: softplus(dt + dt_bias) then, as the decode step computes it, so a position's step has the
// decode's bits whatever the prompt's length; A, D [heads]; state [heads * head_dim, n],
// read and left as the state after the last position; y [t_len, heads * head_dim] = C . s + D u,
// not yet gated. capture: num_capture ascending positions whose states go to captured
// [num_capture, heads * head_dim, n].
void kvgen_ssd_scan(const float* u, const float* dt_in, const float* dt_bias, const float* A, const float* B, const float* C,
                    const float* D, int64_t stride, float* state, float* y, int64_t t_len, int64_t heads, int64_t head_dim,
                    int64_t groups, int64_t n, const int64_t* capture, int64_t num_capture, float* captured) {
    const int64_t inner = heads * head_dim, per_group = heads / groups;
    float* stepped = dt_bias ? malloc(sizeof(float) * (size_t)(t_len * heads + 1)) : NULL;
    const float* dt = dt_bias ? stepped : dt_in;
#ifdef __AVX2__
    const int64_t width = head_dim % 4 == 0 && n % 8 == 0 ? 4 : 1;
#else
    const int64_t width = 1;
#endif
#pragma omp parallel
    {
        if (dt_bias) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < t_len * heads; i++) stepped[i] = softplus(dt_in[i] + dt_bias[i % heads]);
        }
        float* s = malloc(sizeof(float) * (size_t)(2 * n * width));
#pragma omp for schedule(static)
        for (int64_t first = 0; first < inner; first += width) {
            const int64_t head = first / head_dim, g = head / per_group, bytes = n * width * (int64_t)sizeof(float);
            float *s0 = s, *s1 = s + n * width;
            memcpy(s0, state + first * n, (size_t)bytes);
            for (int64_t t = 0, c = 0; t < t_len; t++) {
                const float step = dt[t * heads + head], decay = exp_lane(step * A[head]);
                const float *x = u + t * stride + first, *Bt = B + t * stride + g * n, *Ct = C + t * stride + g * n;
                float acc[4];
#ifdef __AVX2__
                if (width == 4) {
                    scan_four_channels(step, decay, x, Bt, Ct, s0, n, acc);
                } else
#endif
                {
                    acc[0] = scan_channel(NULL, step, decay, x[0], Bt, Ct, s0, s1, n);
                    float* swap = s0;
                    s0 = s1;
                    s1 = swap;
                }
                for (int64_t k = 0; k < width; k++) y[t * inner + first + k] = acc[k] + x[k] * D[head];
                if (c < num_capture && capture[c] == t) memcpy(captured + (c++ * inner + first) * n, s0, (size_t)bytes);
            }
            memcpy(state + first * n, s0, (size_t)bytes);
        }
        free(s);
    }
    free(stepped);
}

// The conv step of one channel: the held window [kernel] shifted by the new input, w . window + b.
static inline float conv_window(const float* held, float input, const float* w, float bias, float* window, int64_t k) {
    for (int64_t j = 0; j + 1 < k; j++) window[j] = held[j + 1];
    window[k - 1] = input;
    float acc = 0.0f;
    for (int64_t j = 0; j < k; j++) acc += window[j] * w[j];
    return acc + bias;
}

// Mamba's and Mamba-2's conv step: SiLU after the window.
static inline float conv_channel(const float* held, float input, const float* w, float bias, float* window, int64_t k) {
    return silu(conv_window(held, input, w, bias, window, k));
}

// A prompt's causal depthwise conv, each position as the decode step computes it (conv_window, and
// conv_channel's SiLU where `silu_after`), so a prompt's conv outputs, and the states the scan takes
// from them, have the bits decoding its tokens one by one gives. extended [rows, channels, k-1+len]:
// each channel's held inputs (its last k-1) then the new ones; w [channels, k]; bias [channels] or
// NULL -> out [rows, channels, len].
void kvgen_causal_conv(const float* extended, const float* w, const float* bias, int64_t rows, int64_t channels, int64_t k,
                       int64_t len, int32_t silu_after, float* out) {
    const int64_t width = k - 1 + len;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < channels; c++) {
            const float* held = extended + (r * channels + c) * width;
            float* y = out + (r * channels + c) * len;
            const float shift = bias ? bias[c] : 0.0f;
            int64_t t = 0;
#ifdef __AVX2__
            for (; t + 8 <= len; t += 8) {  // 8 positions at once, each with the scalar loop's operations in order
                __m256 acc = _mm256_setzero_ps();
                for (int64_t j = 0; j < k; j++)
                    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(held + t + j), _mm256_set1_ps(w[c * k + j])));
                acc = _mm256_add_ps(acc, _mm256_set1_ps(shift));
                _mm256_storeu_ps(y + t, silu_after ? silu8(acc) : acc);
            }
#endif
            for (; t < len; t++) {
                float acc = 0.0f;
                for (int64_t j = 0; j < k; j++) acc += held[t + j] * w[c * k + j];
                acc = acc + shift;
                y[t] = silu_after ? silu(acc) : acc;
            }
        }
    }
}

// A prompt's Mamba-2 gate and gated norm, each row as kvgen_mamba2_step_from computes it: y [rows,
// inner] (C . s + D x, from kvgen_ssd_scan) times SiLU(z [rows, inner]), then, where gate_w is not
// NULL, each of `groups` slices RMS-normed and times gate_w; in place in y.
void kvgen_gated_norm_rows(float* y, const float* z, const float* gate_w, int64_t rows, int64_t inner, int64_t groups, float eps) {
    const int64_t part_width = inner / groups;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float* row = y + r * inner;
        const float* gate = z + r * inner;
        int64_t c = 0;
#ifdef __AVX2__
        for (; c + 8 <= inner; c += 8) _mm256_storeu_ps(row + c, _mm256_mul_ps(_mm256_loadu_ps(row + c), silu8(_mm256_loadu_ps(gate + c))));
#endif
        for (; c < inner; c++) row[c] = row[c] * silu(gate[c]);
        for (int64_t g = 0; g < (gate_w ? groups : 0); g++) {
            float* part = row + g * part_width;
            const float inv = 1.0f / sqrtf(dot(part, part, part_width) / (float)part_width + eps);
            int64_t i = 0;
#ifdef __AVX2__
            for (; i + 8 <= part_width; i += 8)
                _mm256_storeu_ps(part + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(part + i), _mm256_set1_ps(inv)),
                                                         _mm256_loadu_ps(gate_w + g * part_width + i)));
#endif
            for (; i < part_width; i++) part[i] = part[i] * inv * gate_w[g * part_width + i];
        }
    }
}

static void weightless_rms(float* x, int64_t n, float eps) {
    const float inv = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) x[i] *= inv;
}

// y [rows, l->n] = l(x [rows, l->k]) by the team: each row's activation blocks as the one-row
// linear quantizes them, then the many-row kernel, which sums each output as it does for one row
// (interleaved.c): a row's bits do not depend on the others. Returns after the kernel's barrier.
static void linear_rows_of(const qlinear* l, const float* x, int64_t rows, block_x8* xq, int32_t* sums, float* y) {
    const float* bias = l->has_bias ? l->bias : NULL;
    if (kind_is_half(l->kind)) {  // the floats as they are
        half_rows_team((const uint16_t*)l->blocks, l->kind == 11, x, y, rows, l->n, l->k, bias);
        return;
    }
    const int64_t nb = l->k / QK;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        quantize_x8_range(x, r * nb, (r + 1) * nb, xq);
        if (kind_takes_sums(l->kind)) x8_sums_into(xq + r * nb, nb, sums + r * nb);
    }
#define ROWS_GEMM_OF(STEM, SUMS) \
    kvgen_gemm_##STEM##_team((const block_##STEM*)l->blocks, xq, (SUMS) ? sums : NULL, y, rows, l->n, l->k, bias);
    FOR_KIND(l->kind, ROWS_GEMM_OF)
#undef ROWS_GEMM_OF
}

// Scratch for `rows` rows of a step: `floats` shared floats, and activation blocks (and their sums)
// for rows rows of `widest` inputs.
typedef struct {
    float* floats;
    block_x8* xq;
    int32_t* sums;
} step_scratch;

static step_scratch step_scratch_new(int64_t floats, int64_t rows, int64_t widest) {
    const int64_t nb = rows * (widest / QK + 1);
    step_scratch s = {malloc(sizeof(float) * (size_t)floats), malloc((sizeof(block_x8) + sizeof(int32_t)) * (size_t)nb), NULL};
    s.sums = (int32_t*)(s.xq + nb);
    return s;
}

static void step_scratch_free(step_scratch s) {
    free(s.floats);
    free(s.xq);
}

// `rows` sequences' tokens (each its own state) through every Mamba block: h [rows, hidden],
// updated in place; conv_in / conv_out: per layer and row (index layer * rows + r) [inner, kernel],
// the last `kernel` inputs, oldest first; ssm_in / ssm_out likewise [inner, state].
void kvgen_mamba_step(const mamba_block_t* blocks, int64_t num_layers, int64_t rows, float* h, const float* const* conv_in,
                      float* const* conv_out, const float* const* ssm_in, float* const* ssm_out) {
    int64_t widest = 0, hidden = blocks[0].hidden, inner = 0, projected = 0, rank = 0;
    for (int64_t l = 0; l < num_layers; l++) {
        const mamba_block_t* b = &blocks[l];
        widest = b->hidden > widest ? b->hidden : widest;
        widest = b->inner > widest ? b->inner : widest;
        inner = b->inner > inner ? b->inner : inner;
        projected = b->rank + 2 * b->state > projected ? b->rank + 2 * b->state : projected;
        rank = b->rank > rank ? b->rank : rank;
    }
    const step_scratch sc = step_scratch_new(rows * (hidden + 2 * inner + inner + projected + rank + inner + inner + hidden),
                                             rows, widest + rank);
    float *x = sc.floats, *uz = x + rows * hidden, *u = uz + rows * 2 * inner, *dbc = u + rows * inner;
    float *dt_in = dbc + rows * projected, *dt = dt_in + rows * rank, *y = dt + rows * inner, *out = y + rows * inner;
#pragma omp parallel
    for (int64_t layer = 0; layer < num_layers; layer++) {
        const mamba_block_t* b = &blocks[layer];
        const int64_t n_inner = b->inner, n_state = b->state, k = b->kernel, width = b->rank + 2 * n_state;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) rms_norm(h + r * hidden, b->norm, b->eps, b->hidden, x + r * b->hidden);
        linear_rows_of(&b->in_proj, x, rows, sc.xq, sc.sums, uz);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_inner; i++)  // rows in order within a channel: a chain's row reads the row before's state
            for (int64_t r = 0; r < rows; r++)
                u[r * n_inner + i] = conv_channel(conv_in[layer * rows + r] + i * k, uz[r * 2 * n_inner + i], b->conv_w + i * k,
                                                  b->conv_b ? b->conv_b[i] : 0.0f, conv_out[layer * rows + r] + i * k, k);
        linear_rows_of(&b->x_proj, u, rows, sc.xq, sc.sums, dbc);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            float* row = dbc + r * width;
            if (b->dt_b_c_eps > 0.0f) {  // Falcon-Mamba
                weightless_rms(row, b->rank, b->dt_b_c_eps);
                weightless_rms(row + b->rank, n_state, b->dt_b_c_eps);
                weightless_rms(row + b->rank + n_state, n_state, b->dt_b_c_eps);
            }
            memcpy(dt_in + r * b->rank, row, (size_t)b->rank * sizeof(float));  // dt_proj's rows, contiguous
        }
        if (b->dt_quantized) {
            linear_rows_of(&b->dt_proj, dt_in, rows, sc.xq, sc.sums, dt);
        } else {
#pragma omp for collapse(2) schedule(static)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t i = 0; i < n_inner; i++) dt[r * n_inner + i] = dot(b->dt_w + i * b->rank, dt_in + r * b->rank, b->rank);
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_inner; i++) {
            for (int64_t r = 0; r < rows; r++) {
                const float* B = dbc + r * width + b->rank;
                const float step = softplus(dt[r * n_inner + i] + b->dt_b[i]), ui = u[r * n_inner + i];
                const float acc = scan_channel(b->A + i * n_state, step, 0.0f, ui, B, B + n_state, ssm_in[layer * rows + r] + i * n_state,
                                               ssm_out[layer * rows + r] + i * n_state, n_state);
                y[r * n_inner + i] = (acc + ui * b->D[i]) * silu(uz[r * 2 * n_inner + n_inner + i]);
            }
        }
        linear_rows_of(&b->out_proj, y, rows, sc.xq, sc.sums, out);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < b->hidden; i++) h[r * hidden + i] += out[r * b->hidden + i];
    }
    step_scratch_free(sc);
}

// Mamba-2's block (models/mamba2.py) for one token:
//   x = rms_norm(h); [z, xBC, dt] = in_proj(x); xBC = SiLU(causal depthwise conv over the held inputs and xBC);
//   per head h (group g of B and C): dt = softplus(dt + dt_bias); s = e^(dt A) s + (dt x) B (each of
//   head_dim channels, over the state); y = C . s + D x; y = rms_norm_per_group(y SiLU(z)) w (Falcon-H1
//   without its gated norm: y = y SiLU(z), gate_w NULL); h += out_proj(y)
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
    const float* gate_w;   // [inner]: the gated norm's weight; NULL: no norm, the gate alone
    qlinear out_proj;      // [hidden, inner]
    float residual_scale;  // Granite 4.0-H's residual_multiplier on the mixer's output (0: 1)
    float pad;
} mamba2_block_t;

// Each row's and head's dt = softplus(raw dt + bias) and decay e^(dt A), once a head instead of once
// a channel (steps [rows, heads, 2]; raw: row r's raw dts at raw + r * stride). Inside a team.
static void head_steps(const mamba2_block_t* b, int64_t rows, const float* raw, int64_t stride, float* steps) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * b->heads; i++) {
        const int64_t r = i / b->heads, head = i % b->heads;
        const float dt = softplus(raw[r * stride + head] + b->dt_bias[head]);
        steps[2 * i] = dt;
        steps[2 * i + 1] = exp_lane(dt * b->A[head]);
    }
}

// As kvgen_mamba_step (rows, states per layer and row): conv states [conv_dim, kernel], recurrent
// states [heads, head_dim, state].
// x: the rows the first layer norms (h itself, or, with one layer, another copy of the residual
// stream: Falcon-H1's attention and Mamba read the same input and add into one h).
// lora: [num_layers, LORA_LINEARS] adapter deltas or NULL (in_proj's and out_proj's: LORA_MIXER_IN,
// LORA_MIXER_OUT); lora_slots[r]: row r's adapter slot (-1: none, the bits of the base-only step).
// In a chain, ssm_in[r] NULL continues from the row before's recurrent state and ssm_out[r] NULL
// keeps it only in the kernel: a verify writes one state, not one a draft (a state is megabytes,
// and writing them cost most of a verify). trace (NULL: none) then takes each row's recurrence
// inputs, layer l's [rows, conv_dim + heads] at trace + l * rows * (the widest layer's conv_dim +
// heads): the conv's output, then the raw dt, from which kvgen_mamba2_replay rebuilds the state
// after any row with the same bits.
void kvgen_mamba2_step_from(const mamba2_block_t* blocks, int64_t num_layers, int64_t rows, const float* x_in, float* h,
                            const float* const* conv_in, float* const* conv_out, const float* const* ssm_in,
                            float* const* ssm_out, const lora_linear* lora, const int64_t* lora_slots, float* trace) {
    int64_t widest = 0, projected = 0, hidden = blocks[0].hidden, inner = 0, heads = 0, traced = 0;
    for (int64_t l = 0; l < num_layers; l++) {
        const mamba2_block_t* b = &blocks[l];
        const int64_t wide = b->heads * b->head_dim, width = 2 * wide + 2 * b->groups * b->state + b->heads;
        traced = width - wide > traced ? width - wide : traced;  // conv_dim + heads
        widest = b->hidden > widest ? b->hidden : widest;
        widest = wide > widest ? wide : widest;
        inner = wide > inner ? wide : inner;
        projected = width > projected ? width : projected;
        heads = b->heads > heads ? b->heads : heads;
    }
    const step_scratch sc = step_scratch_new(rows * (hidden + 2 * projected + inner + hidden + 2 * heads), rows, widest);
    float *x = sc.floats, *proj = x + rows * hidden, *xbc = proj + rows * projected, *y = xbc + rows * projected;
    float *out = y + rows * inner, *steps = out + rows * hidden;
    float* xa = lora ? malloc(sizeof(float) * (size_t)(rows * lora_width(lora, num_layers * LORA_LINEARS) + 1)) : NULL;  // LoRA's A x
#pragma omp parallel
    for (int64_t layer = 0; layer < num_layers; layer++) {
        const mamba2_block_t* b = &blocks[layer];
        const lora_linear* layer_lora = lora ? lora + layer * LORA_LINEARS : NULL;
        const int64_t n_inner = b->heads * b->head_dim, grouped = b->groups * b->state, k = b->kernel;
        const int64_t conv_dim = n_inner + 2 * grouped, per_group = b->heads / b->groups, width = n_inner + conv_dim + b->heads;
        const float* source = layer == 0 ? x_in : h;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) rms_norm(source + r * hidden, b->norm, b->eps, b->hidden, x + r * b->hidden);
        linear_rows_of(&b->in_proj, x, rows, sc.xq, sc.sums, proj);
        lora_team(layer_lora, LORA_MIXER_IN, &b->in_proj, x, proj, rows, lora_slots, xa);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < conv_dim; i++)  // rows in order within a channel: a chain's row reads the row before's state
            for (int64_t r = 0; r < rows; r++)
                xbc[r * conv_dim + i] = conv_channel(conv_in[layer * rows + r] + i * k, proj[r * width + n_inner + i], b->conv_w + i * k,
                                                     b->conv_b ? b->conv_b[i] : 0.0f, conv_out[layer * rows + r] + i * k, k);
        if (trace) {
            float* layer_trace = trace + layer * rows * traced;
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                memcpy(layer_trace + r * (conv_dim + b->heads), xbc + r * conv_dim, sizeof(float) * (size_t)conv_dim);
                memcpy(layer_trace + r * (conv_dim + b->heads) + conv_dim, proj + r * width + n_inner + conv_dim,
                       sizeof(float) * (size_t)b->heads);
            }
        }
        head_steps(b, rows, proj + n_inner + conv_dim, width, steps);
#pragma omp for schedule(static)
        for (int64_t c = 0; c < n_inner; c++) {
            float held[2][b->state];  // a chain's states that are not kept
            const float* previous = NULL;
            for (int64_t r = 0; r < rows; r++) {
                const int64_t head = c / b->head_dim, g = head / per_group;
                const float* p = proj + r * width;
                const float* v = xbc + r * conv_dim;
                const float* step = steps + 2 * (r * b->heads + head);
                const float* B = v + n_inner + g * b->state;
                const float* s_in = ssm_in[layer * rows + r] ? ssm_in[layer * rows + r] + c * b->state : previous;
                float* s_out = ssm_out[layer * rows + r] ? ssm_out[layer * rows + r] + c * b->state : held[r & 1];
                const float acc = scan_channel(NULL, step[0], step[1], v[c], B, B + grouped, s_in, s_out, b->state);
                y[r * n_inner + c] = (acc + v[c] * b->D[head]) * silu(p[c]);  // gated: y SiLU(z)
                previous = s_out;
            }
        }
        const int64_t part_width = n_inner / b->groups;
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t g = 0; g < (b->gate_w ? b->groups : 0); g++) {
                float* part = y + r * n_inner + g * part_width;
                const float inv = 1.0f / sqrtf(dot(part, part, part_width) / (float)part_width + b->gate_eps);
                for (int64_t i = 0; i < part_width; i++) part[i] = part[i] * inv * b->gate_w[g * part_width + i];
            }
        }
        linear_rows_of(&b->out_proj, y, rows, sc.xq, sc.sums, out);
        lora_team(layer_lora, LORA_MIXER_OUT, &b->out_proj, y, out, rows, lora_slots, xa);
        const float scale = b->residual_scale != 0.0f ? b->residual_scale : 1.0f;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < b->hidden; i++) h[r * hidden + i] += out[r * b->hidden + i] * scale;
    }
    free(xa);
    step_scratch_free(sc);
}

// The recurrent state after the first `rows` rows of a chain that started from s_in, from its trace
// (kvgen_mamba2_step_from's): each channel's update as the step computed it, so the same bits.
void kvgen_mamba2_replay(const mamba2_block_t* b, int64_t rows, const float* trace, const float* s_in, float* s_out) {
    const int64_t n_inner = b->heads * b->head_dim, grouped = b->groups * b->state, conv_dim = n_inner + 2 * grouped;
    const int64_t per_group = b->heads / b->groups;
    float* steps = malloc(sizeof(float) * (size_t)(2 * rows * b->heads));
#pragma omp parallel
    {
        head_steps(b, rows, trace + conv_dim, conv_dim + b->heads, steps);
#pragma omp for schedule(static)
        for (int64_t c = 0; c < n_inner; c++) {
            float held[2][b->state];
            const int64_t head = c / b->head_dim, g = head / per_group;
            const float* previous = s_in + c * b->state;
            for (int64_t r = 0; r < rows; r++) {
                const float* v = trace + r * (conv_dim + b->heads);
                const float* step = steps + 2 * (r * b->heads + head);
                const float* B = v + n_inner + g * b->state;
                float* s_out_r = r == rows - 1 ? s_out + c * b->state : held[r & 1];
                scan_channel(NULL, step[0], step[1], v[c], B, B + grouped, previous, s_out_r, b->state);
                previous = s_out_r;
            }
        }
    }
    free(steps);
}

// LFM2's gated short convolution, one token for each of `rows` rows, one block a call (the hybrid
// step runs its layers one by one): x = rms_norm(h); [B, C, u] = in_proj(x); the conv window takes
// B u (no activation); h += out_proj(C . (w . window + b)). Conv states [hidden, kernel] per row,
// read from conv_in and written to conv_out (never in place, as kvgen_mamba2_step_from's).
typedef struct {
    int64_t hidden, kernel;
    float eps;             // the block's RMS norm (LFM2's operator_norm)
    float pad;
    const float* norm;     // [hidden]
    qlinear in_proj;       // [3 hidden, hidden]: B, C, u
    const float* conv_w;   // [hidden, kernel]
    const float* conv_b;   // [hidden] or NULL
    qlinear out_proj;      // [hidden, hidden]
} short_conv_block_t;

// lora: the layer's LORA_LINEARS adapter deltas or NULL; lora_slots: as kvgen_mamba2_step_from's.
void kvgen_short_conv_step(const short_conv_block_t* b, int64_t rows, float* h, const float* const* conv_in, float* const* conv_out,
                           const lora_linear* lora, const int64_t* lora_slots) {
    const int64_t hidden = b->hidden, k = b->kernel;
    const step_scratch sc = step_scratch_new(rows * 6 * hidden, rows, hidden);
    float *x = sc.floats, *proj = x + rows * hidden, *y = proj + rows * 3 * hidden, *out = y + rows * hidden;
    float* xa = lora ? malloc(sizeof(float) * (size_t)(rows * lora_width(lora, LORA_LINEARS) + 1)) : NULL;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) rms_norm(h + r * hidden, b->norm, b->eps, hidden, x + r * hidden);
        linear_rows_of(&b->in_proj, x, rows, sc.xq, sc.sums, proj);
        lora_team(lora, LORA_MIXER_IN, &b->in_proj, x, proj, rows, lora_slots, xa);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < hidden; i++) {  // rows in order within a channel: a chain's row reads the row before's state
            for (int64_t r = 0; r < rows; r++) {
                const float* p = proj + r * 3 * hidden;
                const float conv = conv_window(conv_in[r] + i * k, p[i] * p[2 * hidden + i], b->conv_w + i * k,
                                               b->conv_b ? b->conv_b[i] : 0.0f, conv_out[r] + i * k, k);
                y[r * hidden + i] = p[hidden + i] * conv;
            }
        }
        linear_rows_of(&b->out_proj, y, rows, sc.xq, sc.sums, out);
        lora_team(lora, LORA_MIXER_OUT, &b->out_proj, y, out, rows, lora_slots, xa);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < hidden; i++) h[r * hidden + i] += out[r * hidden + i];
    }
    free(xa);
    step_scratch_free(sc);
}
