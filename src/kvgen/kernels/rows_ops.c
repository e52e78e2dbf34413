// The torch blocks' per-row operations over many rows (prefill, the batched torch path), in C: the
// decode step's own RMSNorm and gated activations (decode.c) on each row, rows split over threads. One pass
// where torch makes several over the rows and their temporaries, and a row gets the bits the C
// decode step computes for it, at any row count. #included by qgemm.c after decode.c.

// out[r] = x[r] / rms(x[r]) * w for rows x n values (out may be x).
void kvgen_rms_norm_rows(const float* x, const float* w, float eps, int64_t rows, int64_t n, float* out) {
#pragma omp parallel for schedule(static) if (rows * n > 32768)
    for (int64_t r = 0; r < rows; r++) rms_norm(x + r * n, w, eps, n, out + r * n);
}

// out[r] = act(gate_up[r, :n]) * gate_up[r, n:], rows x n values; act 0: SiLU, 1: tanh-GELU (the
// C decode step's, gated_activation).
void kvgen_gated_rows(const float* gate_up, int64_t rows, int64_t n, int32_t act, float* out) {
    const block_t gated = {.act = act};
#pragma omp parallel for schedule(static) if (rows * n > 32768)
    for (int64_t r = 0; r < rows; r++) gated_activation(gate_up + r * 2 * n, gate_up + r * 2 * n + n, out + r * n, n, &gated);
}

// RoPE over x [batch, heads, seq, d] (strides sb, sh, ss in floats; d contiguous) into out, contiguous:
// out = x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1), the product and sum rounded as
// torch rounds them (no fused multiply-add: qgemm.c is built as ISO C, which contracts nothing), so
// the bits are the torch expression's. cos, sin: [batch or 1, 1, seq, d] contiguous; cos_sb: their
// batch stride (0: one row of angles for every batch row).
void kvgen_rope(const float* x, int64_t batch, int64_t heads, int64_t seq, int64_t d, int64_t sb, int64_t sh,
                int64_t ss, const float* cos, const float* sin, int64_t cos_sb, float* out) {
    const int64_t half = d / 2, rows = batch * heads * seq;
#pragma omp parallel for schedule(static) if (rows * d > 32768)
    for (int64_t row = 0; row < rows; row++) {
        const int64_t b = row / (heads * seq), h = (row / seq) % heads, s = row % seq;
        const float* xr = x + b * sb + h * sh + s * ss;
        const float* c = cos + b * cos_sb + s * d;
        const float* sn = sin + b * cos_sb + s * d;
        float* o = out + row * d;
        for (int64_t i = 0; i < half; i++) {
            const float a = xr[i], e = xr[i + half];
            o[i] = a * c[i] + (-e) * sn[i];
            o[i + half] = e * c[i + half] + a * sn[i + half];
        }
    }
}

// torch.argmax of x [n]: the first NaN if any, else the first maximum (-0.0 and 0.0 tie). Greedy
// decoding's choice over a vocabulary of logits: the maximum in one vector pass, then a scan to its
// first index, where torch's argmax takes one scalar pass (0.2 ms over Gemma 3's 262,144 logits, 2%
// of a decode step).
int64_t kvgen_argmax_f32(const float* x, int64_t n) {
    float best = -INFINITY;
    int64_t i = 0;
    int nan = 0;
#ifdef __AVX2__
    __m256 lanes = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        lanes = _mm256_max_ps(lanes, v);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float l[8];
    _mm256_storeu_ps(l, lanes);
    for (int j = 0; j < 8; j++) best = l[j] > best ? l[j] : best;
    nan = _mm256_movemask_ps(unordered) != 0;
#endif
    for (; i < n; i++) {
        if (x[i] != x[i]) nan = 1;
        else if (x[i] > best) best = x[i];
    }
    for (i = 0; i < n; i++) {
        if (nan ? x[i] != x[i] : x[i] == best) return i;
    }
    return 0;  // n == 0
}
