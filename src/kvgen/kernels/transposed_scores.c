// Scores of a prompt's tile from its keys laid out as columns (kt[c * KT_WIDTH + i] = key i's
// channel c), 16 keys to a 512-bit register. The rows of a block (decode_rows.c) share a tile's
// keys, so it is transposed once for all their heads. Each key's score keeps dot()'s order: lane
// class l (channels j + 8r + l) summed over j in one fma chain per r from zero, the four chains
// added pairwise, then the eight classes as hsum8 adds its lanes; here a class is a register of
// 16 keys, so a key's reduction costs one add per class instead of a horizontal sum, and a tile's
// key loads feed 16 keys each (tile_scores loads one key per fma). The same bits as tile_scores.
// This file is #included by attention_tiles.c. Builds for AMD CPUs leave it out (NO_TRANSPOSED_SCORES,
// kernels/build.py: slower on Zen 4).
#if defined(__AVX512F__) && !defined(NO_TRANSPOSED_SCORES)
#define TRANSPOSED_SCORES 1
#define KT_WIDTH 32     // keys per transposed tile (attend_listed_tile's tiles)
#define MAX_KT_DIM 256  // the widest head transposed

// Keys [from, to) of a tile into kt's columns, and zeros in the columns after `to` (the scores
// compute all KT_WIDTH lanes; zeros keep the unused ones finite and normal).
static void transpose_keys(const float* const* keys, int64_t from, int64_t to, int64_t d, float* kt) {
    int64_t i0 = from - from % 8;  // whole runs of 8 (columns before `from` are rewritten with the same values)
    for (; i0 + 8 <= to; i0 += 8)
        for (int64_t c0 = 0; c0 < d; c0 += 8) {  // an 8 x 8 block through in-lane unpacks and shuffles
            __m256 r[8], t[8], u[8];
            for (int k = 0; k < 8; k++) r[k] = _mm256_loadu_ps(keys[i0 + k] + c0);
            for (int k = 0; k < 4; k++)
                t[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]), t[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
            for (int k = 0; k < 2; k++) {
                u[4 * k] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
                u[4 * k + 1] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0xEE);
                u[4 * k + 2] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
                u[4 * k + 3] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xEE);
            }
            for (int k = 0; k < 4; k++) {
                _mm256_storeu_ps(kt + (c0 + k) * KT_WIDTH + i0, _mm256_permute2f128_ps(u[k], u[4 + k], 0x20));
                _mm256_storeu_ps(kt + (c0 + 4 + k) * KT_WIDTH + i0, _mm256_permute2f128_ps(u[k], u[4 + k], 0x31));
            }
        }
    for (int64_t c = 0; c < d; c++)
        for (int64_t i = i0; i < KT_WIDTH; i++) kt[c * KT_WIDTH + i] = i < to ? keys[i][c] : 0.0f;
}

// Lane class l of one head's dots for 32 keys (kt: their first column; lo: keys 0-15, hi: 16-31),
// as dot() forms it: four fma chains over the channels j + 8r + l from zero, added pairwise. Each
// broadcast query channel feeds both registers of keys. (Named registers, not arrays: gcc kept
// arrays of them on the stack.)
typedef struct { __m512 lo, hi; } key_pair;

#define ALWAYS_INLINE static inline __attribute__((always_inline))
ALWAYS_INLINE key_pair add_pairs(key_pair a, key_pair b) {
    return (key_pair){_mm512_add_ps(a.lo, b.lo), _mm512_add_ps(a.hi, b.hi)};
}

ALWAYS_INLINE key_pair class_lanes(const float* q, const float* kt, int64_t d, int l) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t j = 0; j < d; j += 32) {
        const float* k = kt + (j + l) * KT_WIDTH;
        __m512 x = _mm512_set1_ps(q[j + l]);
        a0 = _mm512_fmadd_ps(x, _mm512_loadu_ps(k), a0), b0 = _mm512_fmadd_ps(x, _mm512_loadu_ps(k + 16), b0);
        x = _mm512_set1_ps(q[j + 8 + l]);
        a1 = _mm512_fmadd_ps(x, _mm512_loadu_ps(k + 8 * KT_WIDTH), a1);
        b1 = _mm512_fmadd_ps(x, _mm512_loadu_ps(k + 8 * KT_WIDTH + 16), b1);
        x = _mm512_set1_ps(q[j + 16 + l]);
        a2 = _mm512_fmadd_ps(x, _mm512_loadu_ps(k + 16 * KT_WIDTH), a2);
        b2 = _mm512_fmadd_ps(x, _mm512_loadu_ps(k + 16 * KT_WIDTH + 16), b2);
        x = _mm512_set1_ps(q[j + 24 + l]);
        a3 = _mm512_fmadd_ps(x, _mm512_loadu_ps(k + 24 * KT_WIDTH), a3);
        b3 = _mm512_fmadd_ps(x, _mm512_loadu_ps(k + 24 * KT_WIDTH + 16), b3);
    }
    return (key_pair){_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                      _mm512_add_ps(_mm512_add_ps(b0, b1), _mm512_add_ps(b2, b3))};
}

// class_lanes for two heads at once (q0, q1), as (head 0 keys 0-15, 16-31, head 1 keys 0-15, 16-31):
// each key register loaded feeds both heads, so a load per fma where one head took 1.5.
typedef struct { key_pair first, second; } head_pair;

ALWAYS_INLINE head_pair add_heads(head_pair a, head_pair b) {
    return (head_pair){add_pairs(a.first, b.first), add_pairs(a.second, b.second)};
}

// The fma chain over channels j + c (j = 0, 32, ...) from zero for both heads and both key registers.
ALWAYS_INLINE head_pair channel_chains(const float* q0, const float* q1, const float* kt, int64_t d, int c) {
    __m512 a = _mm512_setzero_ps(), b = a, e = a, f = a;
    for (int64_t j = 0; j < d; j += 32) {
        const float* k = kt + (j + c) * KT_WIDTH;
        const __m512 lo = _mm512_loadu_ps(k), hi = _mm512_loadu_ps(k + 16);
        const __m512 x = _mm512_set1_ps(q0[j + c]), y = _mm512_set1_ps(q1[j + c]);
        a = _mm512_fmadd_ps(x, lo, a), b = _mm512_fmadd_ps(x, hi, b);
        e = _mm512_fmadd_ps(y, lo, e), f = _mm512_fmadd_ps(y, hi, f);
    }
    return (head_pair){{a, b}, {e, f}};
}

ALWAYS_INLINE head_pair class_lanes_heads(const float* q0, const float* q1, const float* kt, int64_t d, int l) {
    return add_heads(add_heads(channel_chains(q0, q1, kt, d, l), channel_chains(q0, q1, kt, d, 8 + l)),
                     add_heads(channel_chains(q0, q1, kt, d, 16 + l), channel_chains(q0, q1, kt, d, 24 + l)));
}

// hsum8's order over the eight classes: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
#define CLASS_TREE(ADD, s) ADD(ADD(ADD(s[0], s[4]), ADD(s[2], s[6])), ADD(ADD(s[1], s[5]), ADD(s[3], s[7])))

// One head's 32 scores (or the first n) from its classes' total, scaled.
ALWAYS_INLINE void store_scores(key_pair total, __m512 factor, int64_t n, float* scores) {
    const __mmask16 low = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    const __mmask16 high = n >= 32 ? (__mmask16)0xFFFF : n > 16 ? (__mmask16)((1u << (n - 16)) - 1) : 0;
    _mm512_mask_storeu_ps(scores, low, _mm512_mul_ps(total.lo, factor));
    _mm512_mask_storeu_ps(scores + 16, high, _mm512_mul_ps(total.hi, factor));
}

// scores[h * stride + i] = dot(q + h * d, key i, d) * scale for `count` heads over keys [0, n) of
// kt (n <= KT_WIDTH, d a multiple of 32).
ALWAYS_INLINE void transposed_scores_d(const float* q, int64_t count, const float* kt, int64_t n, int64_t d,
                                       float scale, float* scores, int64_t stride) {
    const __m512 factor = _mm512_set1_ps(scale);
    int64_t h = 0;
    for (; h + 2 <= count; h += 2) {
        head_pair s[8];  // one class at a time (unrolled, gcc interleaved all eight and spilled)
#pragma GCC unroll 1
        for (int l = 0; l < 8; l++) s[l] = class_lanes_heads(q + h * d, q + (h + 1) * d, kt, d, l);
        const head_pair total = CLASS_TREE(add_heads, s);
        store_scores(total.first, factor, n, scores + h * stride);
        store_scores(total.second, factor, n, scores + (h + 1) * stride);
    }
    if (h < count) {
        key_pair s[8];
#pragma GCC unroll 1
        for (int l = 0; l < 8; l++) s[l] = class_lanes(q + h * d, kt, d, l);
        store_scores(CLASS_TREE(add_pairs, s), factor, n, scores + h * stride);
    }
}

// transposed_scores_d, its loops unrolled for the common head widths.
static void transposed_scores(const float* q, int64_t count, const float* kt, int64_t n, int64_t d, float scale,
                              float* scores, int64_t stride) {
    if (d == 64) transposed_scores_d(q, count, kt, n, 64, scale, scores, stride);
    else if (d == 128) transposed_scores_d(q, count, kt, n, 128, scale, scores, stride);
    else transposed_scores_d(q, count, kt, n, d, scale, scores, stride);
}
#endif
