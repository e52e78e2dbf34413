// LoRA deltas inside the C decode steps: after a linear's base output y [rows, out] for inputs
// x [rows, in], each row r with an adapter slot s = slots[r] >= 0 gets y_r += B_s (A_s x_r), in
// fp32 (the scaling is folded into B). Rows with slot -1 are not touched, so they keep the exact
// bits of the base-only step.
//
// Every loaded adapter is one slot of a stack per (layer, fused linear), as models/lora.py builds it
// (Punica / S-LoRA's gathered layout: a row gathers its own slot by index). A fused linear (q|k|v,
// gate|up) holds its parts' ranks side by side: part p of slot s owns ranks[s * parts + p] rank rows,
// after the earlier parts' ones, and writes output columns [part_out[p], part_out[p + 1]).
//
// Batch invariance: each output of a row is summed in one fixed order (the rank rows in turn, each
// x A-row dot product in 32 lanes then a fixed tree), whatever the other rows, the row count or
// the split across threads, and with or without AVX2 (both use fused multiply-adds in the same
// order).
#include <stdlib.h>

typedef struct {
    const float* a;        // [slots, width, in]; NULL: no adapter touches this linear
    const float* b;        // [slots, width, out]
    const int32_t* ranks;  // [slots, parts]
    int64_t slots, width, parts;
    int64_t part_out[4];   // parts + 1 output offsets
} lora_linear;

// one layer's lora_linears; a hybrid's state layer adds its mixer's in_proj and out_proj (mamba_step.c)
enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORA_MIXER_IN, LORA_MIXER_OUT, LORA_LINEARS };

// a . x: lane i % 32 accumulates with FMAs, then a fixed tree; the tail (n % 32) in order.
static float lora_dot(const float* a, const float* x, int64_t n) {
    float lanes[32] = {0};
    int64_t i = 0;
#ifdef __AVX2__
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; i + 32 <= n; i += 32)
        for (int q = 0; q < 4; q++)
            acc[q] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * q), _mm256_loadu_ps(x + i + 8 * q), acc[q]);
    for (int q = 0; q < 4; q++) _mm256_storeu_ps(lanes + 8 * q, acc[q]);
#else
    for (; i + 32 <= n; i += 32)
        for (int l = 0; l < 32; l++) lanes[l] = fmaf(a[i + l], x[i + l], lanes[l]);
#endif
    float eight[8];
    for (int l = 0; l < 8; l++) eight[l] = (lanes[l] + lanes[8 + l]) + (lanes[16 + l] + lanes[24 + l]);
    float s = ((eight[0] + eight[4]) + (eight[2] + eight[6])) + ((eight[1] + eight[5]) + (eight[3] + eight[7]));
    for (; i < n; i++) s = fmaf(a[i], x[i], s);
    return s;
}

// y[lo, hi) += sum over rank rows j of xa[j] * b[j][.] (j in order, one FMA chain per output).
static void lora_expand(const float* xa, const float* b, int64_t rank, int64_t out, float* y, int64_t lo, int64_t hi) {
    int64_t o = lo;
#ifdef __AVX2__
    for (; o + 8 <= hi; o += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < rank; j++) acc = _mm256_fmadd_ps(_mm256_set1_ps(xa[j]), _mm256_loadu_ps(b + j * out + o), acc);
        _mm256_storeu_ps(y + o, _mm256_add_ps(_mm256_loadu_ps(y + o), acc));
    }
#endif
    for (; o < hi; o++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < rank; j++) acc = fmaf(xa[j], b[j * out + o], acc);
        y[o] += acc;
    }
}

static int64_t lora_rank_total(const lora_linear* L, int64_t slot) {
    int64_t total = 0;
    for (int64_t p = 0; p < L->parts; p++) total += L->ranks[slot * L->parts + p];
    return total;
}

#define LORA_COLUMNS 128  // output columns per task of the expand step

// The delta of every row with a slot, added to y [rows, out]; x [rows, in]. Called by every
// thread of a team (or by one thread outside any); xa: [rows, L->width] scratch shared by the team.
// The closing barriers of both `omp for` loops order A x before B (A x) and make y whole.
static void lora_delta_team(const lora_linear* L, int64_t in, int64_t out, const float* x, float* y, int64_t rows,
                            const int64_t* slots, float* xa) {
    const int64_t width = L->width;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * width; i++) {
        const int64_t r = i / width, j = i % width, s = slots[r];
        if (s >= 0 && j < lora_rank_total(L, s)) xa[i] = lora_dot(L->a + (s * width + j) * in, x + r * in, in);
    }
    const int64_t chunks = (out + LORA_COLUMNS - 1) / LORA_COLUMNS;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < rows * chunks; t++) {
        const int64_t r = t / chunks, s = slots[r];
        if (s < 0) continue;
        const int64_t c0 = (t % chunks) * LORA_COLUMNS, c1 = c0 + LORA_COLUMNS < out ? c0 + LORA_COLUMNS : out;
        int64_t rank_at = 0;
        for (int64_t p = 0; p < L->parts; p++) {
            const int64_t rank = L->ranks[s * L->parts + p];
            const int64_t lo = c0 > L->part_out[p] ? c0 : L->part_out[p];
            const int64_t hi = c1 < L->part_out[p + 1] ? c1 : L->part_out[p + 1];
            if (rank > 0 && lo < hi)
                lora_expand(xa + r * width + rank_at, L->b + (s * width + rank_at) * out, rank, out, y + r * out, lo, hi);
            rank_at += rank;
        }
    }
}

// Whether any row has an adapter delta to add (L == NULL or L->a == NULL: none).
static int lora_applies(const lora_linear* L, int64_t rows, const int64_t* slots) {
    if (L == NULL || L->a == NULL || slots == NULL) return 0;
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] >= 0) return 1;
    return 0;
}

// lora_delta_team run by a team of its own. Exported for the tests, which compare it with the torch path.
void kvgen_lora_delta(const lora_linear* L, int64_t in, int64_t out, const float* x, float* y, int64_t rows,
                      const int64_t* slots) {
    if (!lora_applies(L, rows, slots)) return;
    float* xa = malloc(sizeof(float) * (size_t)(rows * L->width));  // [rows, width]: A x of each row
#pragma omp parallel
    lora_delta_team(L, in, out, x, y, rows, slots, xa);
    free(xa);
}

