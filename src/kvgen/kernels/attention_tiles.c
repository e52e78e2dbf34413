// Softmax attention of one query head over tiles of positions: scores for a whole tile, one
// rescale of the running sums per tile, a vectorised exp, and a weighted sum of the tile's values
// kept in registers. Used by decode.c's attention over fp32 storage and by quantized_attention.c.
// Every sum runs in one order with AVX-512, AVX2 or none (key dots as decode.c's dot, exp sums in
// 8 lanes reduced as hsum8, one fma per value), so the builds give the same bits.
// This file is #included by decode.c.
#define MAX_TILE 64  // positions per tile
#define MAX_HEAD_TILE 8  // query heads per attend_tile_heads call

// e^x in each lane: 2^n * e^r with n = round(x / ln 2) and |r| <= ln 2 / 2, e^r by its Taylor
// series to r^7 (relative error ~2e-8 before rounding); x is clamped to [-87, 88] (no inf/denormals).
// P: the intrinsics' prefix, so that 8 lanes (exp8) and 16 (exp16) run the same operations per lane.
#define EXP_LANES(P, VEC, IVEC, ROUND, AS_FLOAT)                                                       \
    x = P##_min_ps(P##_max_ps(x, P##_set1_ps(-87.0f)), P##_set1_ps(88.0f));                          \
    const VEC n = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); \
    VEC r = P##_fnmadd_ps(n, P##_set1_ps(0.693145751953125f), x); /* ln 2 in two parts: exact n * hi */ \
    r = P##_fnmadd_ps(n, P##_set1_ps(1.428606765330187045e-06f), r);                                 \
    VEC p = P##_set1_ps(1.0f / 5040.0f);                                                             \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f / 720.0f));                                              \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f / 120.0f));                                              \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f / 24.0f));                                               \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f / 6.0f));                                                \
    p = P##_fmadd_ps(p, r, P##_set1_ps(0.5f));                                                       \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f));                                                       \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f));                                                       \
    const IVEC scale = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23);   \
    return P##_mul_ps(p, AS_FLOAT(scale));
#ifdef __AVX2__
static inline __m256 exp8(__m256 x) { EXP_LANES(_mm256, __m256, __m256i, _mm256_round_ps, _mm256_castsi256_ps) }
#endif
#ifdef __AVX512F__
static inline __m512 exp16(__m512 x) { EXP_LANES(_mm512, __m512, __m512i, _mm512_roundscale_ps, _mm512_castsi512_ps) }
#endif

#ifdef __AVX2__
// Eight hsum8s at once: lane k of the result is hsum8(v[slot(k)]), in hsum8's order
// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), with slot(k) = 2k for k < 4, 2(k - 4) + 1
// after: a butterfly of 128-bit swaps and in-lane shuffles, 21 instructions where eight
// horizontal sums take ~48 in one dependency chain each.
static inline __m256 hsum8_each(const __m256 v[8]) {
    __m256 pairs[4];  // [v(2i) lanes 0-3 + 4-7 | v(2i+1) the same]
    for (int i = 0; i < 4; i++)
        pairs[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                                 _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
    __m256 halves[2];  // per 128-bit lane: [x, y] of two vectors, x = w0 + w2, y = w1 + w3
    for (int i = 0; i < 2; i++)
        halves[i] = _mm256_add_ps(_mm256_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm256_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_shuffle_ps(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// The largest of 8 lanes, by shuffles (a maximum is the same in any order).
static inline float max8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_permute2f128_ps(x, x, 1));
    x = _mm256_max_ps(x, _mm256_shuffle_ps(x, x, 0x4E));
    x = _mm256_max_ps(x, _mm256_shuffle_ps(x, x, 0xB1));
    return _mm256_cvtss_f32(x);
}

// dot()'s 8 lane sums before hsum8 (its four accumulators added pairwise) for a 64-channel head,
// the query in registers: one load per fma (the key's), where reloading the query too made two,
// more than the load ports feed two fmas a cycle.
static inline __m256 dot_lanes64(const __m256 q[8], const float* k) {
    __m256 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm256_fmadd_ps(q[r], _mm256_loadu_ps(k + 8 * r), _mm256_setzero_ps());
    for (int r = 0; r < 4; r++) acc[r] = _mm256_fmadd_ps(q[4 + r], _mm256_loadu_ps(k + 32 + 8 * r), acc[r]);
    return _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
}
#endif

#include "transposed_scores.c"

// Asks for rows k[0 .. min(m, most)) of keys or values (m: the rows there are), d floats each from
// `offset` on: a block table's positions lie in blocks of a few each, which the hardware
// prefetchers do not follow from one to the next.
static inline void prefetch_rows(const float* const* k, int64_t m, int64_t most, int64_t d, int64_t offset) {
    for (int64_t i = 0; i < (m < most ? m : most); i++)
        for (int64_t c = 0; c < d; c += 16) __builtin_prefetch(k[i] + offset + c);
}

// scores[h * stride + i] = dot(q + h * d, keys[i], d) * scale for `count` heads over n keys, each
// the bits of dot(). `cached`: the keys are read by many rows (a prompt's), so they sit in cache:
// then, for 64-channel heads, eight keys at a time, their lane sums reduced together (hsum8_each),
// one head after another (a 512-token prompt's attention 0.67x the time, SmolLM2's heads; reloading
// a wider head's query per key gained nothing on Gemma 3's 256 channels). Keys streamed from memory for
// a few rows (a verify, a decode batch) go one at a time through every head instead: a head's pass
// over keys that the next heads read from L1 left memory idle for two thirds of the time (30
// layers of a 3-row verify at 1,024 positions took 1.11x as long that way). They are asked for
// eight keys ahead, into the next tile where keys[n .. reach) are given, and with the keys the
// tile's values at the same positions (`values`, or NULL), which the sums read next: a
// tile's first keys and its values had come from memory unasked, and the hardware prefetchers do
// not follow a block table from one block to the next (16 decode rows over the engine's paged
// blocks: attention 1.2x as fast with the keys asked for within a tile, 1.33-1.47x more with both).
// Two keys and two values at a time, in step with the dots, not eight of each in one burst: 16
// engine requests at 1,000 positions 1.16x as fast again.
static void tile_scores(const float* q, int64_t count, const float* const* keys, const float* const* values, int64_t n,
                        int64_t reach, int64_t d, float scale, float* scores, int64_t stride, int cached) {
#ifdef __AVX2__
    if (cached && d == 64) {
        const __m256 factor = _mm256_set1_ps(scale);
        for (int64_t h = 0; h < count; h++) {
            __m256 qh[8];
            for (int c = 0; c < 8; c++) qh[c] = _mm256_loadu_ps(q + h * d + 8 * c);
            for (int64_t i0 = 0; i0 < n; i0 += 8) {
                const int64_t m = n - i0 < 8 ? n - i0 : 8;
                const float* const* k = keys + i0;
                const __m256 lanes[8] = {  // in hsum8_each's slots; keys past n repeat the first (dropped)
                    dot_lanes64(qh, k[0]), dot_lanes64(qh, k[m > 4 ? 4 : 0]), dot_lanes64(qh, k[m > 1 ? 1 : 0]),
                    dot_lanes64(qh, k[m > 5 ? 5 : 0]), dot_lanes64(qh, k[m > 2 ? 2 : 0]), dot_lanes64(qh, k[m > 6 ? 6 : 0]),
                    dot_lanes64(qh, k[m > 3 ? 3 : 0]), dot_lanes64(qh, k[m > 7 ? 7 : 0]),
                };
                const __m256 x = _mm256_mul_ps(hsum8_each(lanes), factor);
                if (m == 8) {
                    _mm256_storeu_ps(scores + h * stride + i0, x);
                } else {
                    float out[8];
                    _mm256_storeu_ps(out, x);
                    memcpy(scores + h * stride + i0, out, (size_t)m * sizeof(float));
                }
            }
        }
        return;
    }
#endif
    for (int64_t i0 = 0; i0 < n; i0 += 2) {
        if (!cached) {
            prefetch_rows(keys + i0 + 8, reach - i0 - 8, 2, d, 0);
            if (values != NULL) prefetch_rows(values + i0, n - i0, 2, d, 0);
        }
        for (int64_t i = i0; i < n && i < i0 + 2; i++)
            for (int64_t h = 0; h < count; h++) scores[h * stride + i] = dot(q + h * d, keys[i], d) * scale;
    }
}

// Heads [0, H) of one group (p: their weights, rows p_stride apart; out: their sums, rows d apart),
// columns [j, last) in runs of WIDTH: each value load feeds every head of the group, H * WIDTH /
// LANES fma chains in registers, one fma per column and position, in position order.
#define HEAD_GROUP_RUNS(H, WIDTH, VEC, LANES, LOADU, STOREU, SET1, FMADD)                               \
    for (; j + (WIDTH) <= last; j += (WIDTH)) {                                                      \
        VEC a[H][(WIDTH) / (LANES)];                                                                 \
        for (int g = 0; g < (H); g++)                                                                \
            for (int c = 0; c < (WIDTH) / (LANES); c++) a[g][c] = LOADU(out + g * d + j + (LANES) * c); \
        for (int64_t i = 0; i < n; i++) {                                                            \
            VEC w[H];                                                                                \
            for (int g = 0; g < (H); g++) w[g] = SET1(p[g * p_stride + i]);                          \
            const float* v = values[i] + j;                                                          \
            for (int c = 0; c < (WIDTH) / (LANES); c++) {                                            \
                const VEC vc = LOADU(v + (LANES) * c);                                               \
                for (int g = 0; g < (H); g++) a[g][c] = FMADD(w[g], vc, a[g][c]);                    \
            }                                                                                        \
        }                                                                                            \
        for (int g = 0; g < (H); g++)                                                                \
            for (int c = 0; c < (WIDTH) / (LANES); c++) STOREU(out + g * d + j + (LANES) * c, a[g][c]); \
    }

// HEAD_GROUP_RUNS' widths for a group of H heads: enough chains in flight (8 or more where the
// columns allow) with the registers the ISA has.
#ifdef __AVX512F__
#define HEAD_GROUP_512(H, WIDTH) HEAD_GROUP_RUNS(H, WIDTH, __m512, 16, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_set1_ps, _mm512_fmadd_ps)
#else
#define HEAD_GROUP_512(H, WIDTH)
#endif
#ifdef __AVX2__
#define HEAD_GROUP_256(H, WIDTH) HEAD_GROUP_RUNS(H, WIDTH, __m256, 8, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_set1_ps, _mm256_fmadd_ps)
#else
#define HEAD_GROUP_256(H, WIDTH)
#endif

// One group of H (1-4; 4 only with AVX-512) heads over columns [first, last): vector runs, then one
// lane at a time.
static inline void head_group_sums(const float* p, int64_t p_stride, const float* const* values, int64_t n,
                                   int64_t d, int64_t first, int64_t last, float* out, int64_t H) {
    int64_t j = first;  // the first column left
    if (H == 4) {  // 4 x 4 chains (AVX-512's 32 registers): Gemma 3's four heads, 1.22x a pair's speed
        HEAD_GROUP_512(4, 64)
        HEAD_GROUP_256(4, 32)
    } else if (H == 3) {  // 3 x 4 chains: SmolLM2's three heads per kv head, where a pair and a lone head left
        HEAD_GROUP_512(3, 64)  // the lone head's 4 chains waiting on the fma latency
        HEAD_GROUP_256(3, 32)
    } else if (H == 2) {
        HEAD_GROUP_512(2, 64)
        HEAD_GROUP_256(2, 32)
    } else {  // a lone head: runs twice as wide keep 8 fma chains in flight, not 4
        HEAD_GROUP_512(1, 128)
        HEAD_GROUP_512(1, 64)
        HEAD_GROUP_256(1, 64)
        HEAD_GROUP_256(1, 32)
    }
    for (int64_t h = 0; h < H; h++)
        for (int64_t i = 0; i < n; i++)  // one fma per position, as the vector lanes do
            for (int64_t c = j; c < last; c++) out[h * d + c] = fmaf(p[h * p_stride + i], values[i][c], out[h * d + c]);
}

// The size of the next group of heads, `left` heads to go: fours where AVX-512's registers hold
// them, a three where the count is odd, pairs.
static inline int64_t next_head_group(int64_t left) {
#ifdef __AVX512F__
    if (left >= 4 && left != 5) return 4;  // 5: a three and a pair, not a four and a lone head
#endif
    return left == 1 ? 1 : left % 2 == 1 ? 3 : 2;
}

// out[h][j] += sum_i p[h][i] * values[i][j] for `count` heads (p, out: [count][..]) and the columns
// j in [first, last), the sums kept in registers over the tile's positions. Columns outside, heads
// inside: a slice of the tile's values comes from L2 once and from L1 for the other heads, and each
// value load feeds a group of heads (next_head_group). Each column's sum is its
// own (one fma per position, in order, in any group or run), so a range that starts at a multiple of
// 32 gives the columns the bits of the whole row's call. AVX-512 takes 64 columns of a group in
// 16-lane registers: the same fma per column and position, half the instructions (with
// exp_shifted's 16 lanes: a 2,048-token SmolLM2 prompt 1.1x as fast on a 2-core Intel Xeon, once the
// rows step's blocks of rows keep the tiles in L1).
static void weighted_sums_columns(const float* p, int64_t p_stride, const float* const* values, int64_t n, int64_t d,
                                  int64_t first, int64_t last, float* out, int64_t count) {
    for (int64_t h = 0; h < count;) {
        const int64_t group = next_head_group(count - h);
        head_group_sums(p + h * p_stride, p_stride, values, n, d, first, last, out + h * d, group);
        h += group;
    }
}

static void weighted_sums(const float* p, int64_t p_stride, const float* const* values, int64_t n, int64_t d,
                          float* out, int64_t count) {
    weighted_sums_columns(p, p_stride, values, n, d, 0, d, out, count);
}

// weighted_sums_columns over values read from memory, in runs of STREAM_RUN positions: every column
// slice and head of a few rows before the next rows, so the rows are read in order. A tile's 32
// rows taken slice by slice read each row's lines apart, and the batch-1 step summed SmolLM2's
// values at ~25 GB/s; in runs of 4 its attention over 8,192 positions took 0.85x the time (runs of
// 2: 0.97x, 8: 0.92x, 16: 0.99x). Each column's sum is still one fma per position in order: the
// same bits. (The rows step's head units over the engine's 16-position blocks ran 1.18x slower in
// runs of 4: they keep whole tiles.) next: rows[0 .. next_n) of the next tile (over a block table,
// which the hardware prefetchers do not follow), asked for STREAM_RUN rows per run, in step with
// the sums (columns [first, last)); NULL: none.
#define STREAM_RUN 4
static void weighted_sums_streamed(const float* p, int64_t p_stride, const float* const* values, int64_t n, int64_t d,
                                   int64_t first, int64_t last, float* out, int64_t count, const float* const* next,
                                   int64_t next_n) {
    for (int64_t i = 0; i < n; i += STREAM_RUN) {
        if (next != NULL && i < next_n)
            prefetch_rows(next + i, next_n - i, STREAM_RUN, last - first, first);
        weighted_sums_columns(p + i, p_stride, values + i, n - i < STREAM_RUN ? n - i : STREAM_RUN, d, first, last, out,
                              count);
    }
}

// p[i] = exp(s[i] - max) for n scores; returns their sum.
static float exp_shifted(float* s, int64_t n, float max) {
    int64_t i = 0;
    float sum = 0.0f;
#ifdef __AVX2__
    __m256 total = _mm256_setzero_ps();
    const __m256 m = _mm256_set1_ps(max);
#ifdef __AVX512F__
    const __m512 m16 = _mm512_set1_ps(max);
    for (; i + 16 <= n; i += 16) {  // 16 exps at once, added to the 8 lane sums as two runs of 8
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), m16));
        _mm512_storeu_ps(s + i, e);
        total = _mm256_add_ps(total, _mm512_castps512_ps256(e));
        total = _mm256_add_ps(total, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
#endif
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

// Softmax-weighted sums of one query head over some tiles: out = sum p_i v_i, with max m and sum l;
// cap > 0 soft-caps the scores first (Gemma 2: s -> cap tanh(s / cap)), 0 leaves them.
typedef struct { float max, sum, cap; } softmax_state;

// A head's running softmax before its first tile; sink: its sink logit (gpt-oss), folded in first as
// a position of weight e^(sink - max) and no value, or NULL.
static inline softmax_state softmax_start(float cap, const float* sink) {
    return sink ? (softmax_state){*sink, 1.0f, cap} : (softmax_state){-INFINITY, 0.0f, cap};
}

// s[i] = cap tanh(s[i] / cap) for i < n, as cap (e - 1) / (e + 1) with e = e^(2 s / cap): exp8's
// lanes, or exp_lane one at a time (the same operations), so every build and tile position gives
// a score the same bits. tanhf one score at a time would cost Gemma 2 2B ~30 ms a token at 8,192
// positions.
static void soft_cap(float* s, int64_t n, float cap) {
    const float twice = 2.0f / cap;
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 one = _mm256_set1_ps(1.0f), c = _mm256_set1_ps(cap), t = _mm256_set1_ps(twice);
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_mul_ps(_mm256_loadu_ps(s + i), t));
        _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_div_ps(_mm256_sub_ps(e, one), _mm256_add_ps(e, one)), c));
    }
#endif
    for (; i < n; i++) {
        const float e = exp_lane(s[i] * twice);
        s[i] = (e - 1.0f) / (e + 1.0f) * cap;
    }
}

// The largest of n scores (-inf for none): a maximum is the same in any order.
static inline float tile_maximum(const float* s, int64_t n) {
    float tile_max = -INFINITY;
    int64_t i = 0;
#ifdef __AVX2__
    if (n >= 8) {
        __m256 m8 = _mm256_loadu_ps(s);
        for (i = 8; i + 8 <= n; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + i));
        tile_max = max8(m8);
    }
#endif
    for (; i < n; i++) tile_max = s[i] > tile_max ? s[i] : tile_max;
    return tile_max;
}

// Folds a tile's n scores into one head's running softmax (s becomes e^(s - max)); returns the
// factor for what was accumulated under the old maximum, or -1 when the maximum held (an exp is
// never negative).
static inline float softmax_tile(float* s, int64_t n, softmax_state* st) {
    if (st->cap > 0.0f) soft_cap(s, n, st->cap);
    const float tile_max = tile_maximum(s, n);
    float correction = -1.0f;
    if (tile_max > st->max) {
        correction = expf(st->max - tile_max);
        st->sum *= correction;
        st->max = tile_max;
    }
    st->sum += exp_shifted(s, n, st->max);
    return correction;
}

// Folds a tile's scores (rows MAX_TILE apart) into `count` heads' running softmax (st) and
// unnormalised sums (out: [count, d]): each head's operations are a lone head's.
static void attend_scored_tile(float scores[][MAX_TILE], int64_t count, const float* const* values, int64_t n,
                               int64_t d, softmax_state* st, float* out) {
    for (int64_t h = 0; h < count; h++) {
        const float correction = softmax_tile(scores[h], n, &st[h]);
        if (correction >= 0.0f)  // rescale what was accumulated under the old maximum
            for (int64_t j = 0; j < d; j++) out[h * d + j] *= correction;
    }
    weighted_sums(scores[0], MAX_TILE, values, n, d, out, count);
}

// `count` query heads (q, out: [count, d]; st: [count]) over a tile of n <= MAX_TILE positions (a row
// pointer per position), each folded into its running softmax and unnormalised sum. Each head's
// operations are a lone head's; positions outside, heads inside, so a key comes from L2 once.
// cached: the tile is read by many rows (tile_scores); keys[n .. reach): the next tile's first keys,
// asked for ahead when not cached.
static void attend_tile_heads(const float* q, int64_t count, const float* const* keys, const float* const* values,
                              int64_t n, int64_t reach, int64_t d, float scale, softmax_state* st, float* out,
                              int cached) {
    float scores[MAX_HEAD_TILE][MAX_TILE];
    tile_scores(q, count, keys, values, n, reach, d, scale, scores[0], MAX_TILE, cached);
    attend_scored_tile(scores, count, values, n, d, st, out);
}

#ifdef TRANSPOSED_SCORES
// attend_tile_heads over a tile whose first n keys are transposed in kt (transpose_keys): the
// same bits.
static void attend_transposed_tile(const float* q, int64_t count, const float* kt, const float* const* values,
                                   int64_t n, int64_t d, float scale, softmax_state* st, float* out) {
    float scores[MAX_HEAD_TILE][MAX_TILE];
    transposed_scores(q, count, kt, n, d, scale, scores[0], MAX_TILE);
    attend_scored_tile(scores, count, values, n, d, st, out);
}
#endif

// One query head over a tile: attend_tile_heads for a single head.
static void attend_tile(const float* q, const float* const* keys, const float* const* values, int64_t n, int64_t d,
                        float scale, softmax_state* st, float* out) {
    attend_tile_heads(q, 1, keys, values, n, n, d, scale, st, out, 1);  // one head: nothing to interleave
}
