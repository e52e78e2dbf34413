// Softmax attention of one query head over tiles of positions: scores for a whole tile, one
// rescale of the running sums per tile, a vectorised exp, and a weighted sum of the tile's values
// kept in registers. Used by decode.c's attention over fp32 storage and by quantized_attention.c.
// Every sum runs in one order with AVX-512, AVX2 or none (key dots as decode.c's dot, exp sums in
// 8 lanes reduced as hsum8, one fma per value), so the builds give the same bits.
// This file is #included by decode.c.
#define MAX_TILE 64  // positions per tile

// exp of 8 floats: 2^n * e^r with n = round(x / ln 2) and |r| <= ln 2 / 2, e^r by its Taylor
// series to r^7 (relative error ~2e-8 before rounding); x is clamped to [-87, 88] (no inf/denormals).
#ifdef __AVX2__
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln 2 in two parts: exact n * hi
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
#endif

// out[j] += sum_i p[i] * values[i][j], the sums kept in registers over the tile's positions.
static void weighted_sum(const float* p, const float* const* values, int64_t n, int64_t d, float* out) {
    int64_t j0 = 0;
#ifdef __AVX2__
    for (; j0 + 32 <= d; j0 += 32) {
        __m256 a0 = _mm256_loadu_ps(out + j0), a1 = _mm256_loadu_ps(out + j0 + 8);
        __m256 a2 = _mm256_loadu_ps(out + j0 + 16), a3 = _mm256_loadu_ps(out + j0 + 24);
        for (int64_t i = 0; i < n; i++) {
            const __m256 w = _mm256_set1_ps(p[i]);
            const float* v = values[i] + j0;
            a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), a3);
        }
        _mm256_storeu_ps(out + j0, a0), _mm256_storeu_ps(out + j0 + 8, a1);
        _mm256_storeu_ps(out + j0 + 16, a2), _mm256_storeu_ps(out + j0 + 24, a3);
    }
#endif
    for (int64_t i = 0; i < n; i++)  // one fma per position, as the vector lanes do
        for (int64_t j = j0; j < d; j++) out[j] = fmaf(p[i], values[i][j], out[j]);
}

// p[i] = exp(s[i] - max) for n scores; returns their sum.
static float exp_shifted(float* s, int64_t n, float max) {
    int64_t i = 0;
    float sum = 0.0f;
#ifdef __AVX2__
    __m256 total = _mm256_setzero_ps();
    const __m256 m = _mm256_set1_ps(max);
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
        _mm256_storeu_ps(s + i, e);
        total = _mm256_add_ps(total, e);
    }
    sum = hsum8(total);
#else
    float lanes[8] = {0.0f};  // exp8's lanes and hsum8's order: the AVX2 build's bits
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) s[i + l] = exp_lane(s[i + l] - max), lanes[l] += s[i + l];
    sum = sum_lanes(lanes);
#endif
    for (; i < n; i++) s[i] = expf(s[i] - max), sum += s[i];
    return sum;
}

// Softmax-weighted sums of one query head over some tiles: out = sum p_i v_i, with max m and sum l.
typedef struct { float max, sum; } softmax_state;

// One query head over a tile of n <= MAX_TILE positions (a row pointer per position), folded into
// the running softmax `st` and the unnormalised sum `out`.
static void attend_tile(const float* q, const float* const* keys, const float* const* values, int64_t n, int64_t d,
                        float scale, softmax_state* st, float* out) {
    float scores[MAX_TILE];
    float tile_max = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        scores[i] = dot(q, keys[i], d) * scale;
        if (scores[i] > tile_max) tile_max = scores[i];
    }
    if (tile_max > st->max) {  // rescale what was accumulated under the old maximum
        const float correction = expf(st->max - tile_max);
        st->sum *= correction;
        for (int64_t j = 0; j < d; j++) out[j] *= correction;
        st->max = tile_max;
    }
    st->sum += exp_shifted(scores, n, st->max);
    weighted_sum(scores, values, n, d, out);
}
