// Microbenchmark: one block of 16 prompt rows over 64 tiles of 32 keys (one kv head; its query heads
// as SmolLM2's 3 x 64 channels or Gemma 3's 4 x 256), all in cache, one core, as the rows step's
// attention takes them: the direct scores (tile_scores, a key per fma), the transposed ones (each
// tile's keys transposed once for the block, transposed_scores.c; checked bit for bit against the
// direct ones), and the value sums (weighted_sums). Best of 20 rounds, ns per key and query head.
//
//   gcc -O3 -march=native -fopenmp -std=c11 -I src/kvgen/kernels benchmarks/attention_tile.c -lm -o attention_tile
//   ./attention_tile 64 3 && ./attention_tile 256 4      (head channels, query heads per kv head)
//
// Built against another commit's kernels (-I <its checkout>/src/kvgen/kernels) it times that
// commit's code; the transposed rows need a commit that has them. -march=x86-64-v3: the AVX2 build.
#include "qgemm.c"

#include <stdio.h>
#include <time.h>

#define TILES 64
#define ROWS 16

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char** argv) {
    const int d = argc > 1 ? atoi(argv[1]) : 64, heads = argc > 2 ? atoi(argv[2]) : 3;
    if (d % 32 || d > 256 || heads < 1 || heads > 8) {
        fprintf(stderr, "channels: a multiple of 32 up to 256; heads: 1-8\n");
        return 2;
    }
    float* keys = aligned_alloc(64, sizeof(float) * 32 * TILES * d);
    float* values = aligned_alloc(64, sizeof(float) * 32 * TILES * d);
    for (long i = 0; i < 32L * TILES * d; i++)
        keys[i] = (float)((i * 7919) % 1000) / 1000.0f - 0.5f, values[i] = (float)((i * 104729) % 1000) / 1000.0f;
    static float q[ROWS][8 * 256], out[ROWS][8 * 256];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < heads * d; i++) q[r][i] = (float)((r * 31 + i * 17) % 100) / 100.0f - 0.5f;
    static const float *key_rows[32 * TILES], *value_rows[32 * TILES];
    for (int i = 0; i < 32 * TILES; i++) key_rows[i] = keys + (long)i * d, value_rows[i] = values + (long)i * d;
    static float scores[8][MAX_TILE];
    double direct = 1e9, sums = 1e9, transposed = 1e9;
    for (int round = 0; round < 20; round++) {
        double t0 = now();
        for (int t = 0; t < TILES; t++)
            for (int r = 0; r < ROWS; r++)
                tile_scores(q[r], heads, key_rows + 32 * t, value_rows + 32 * t, 32, 32, d, 0.125f, scores[0], MAX_TILE, 1);
        double t1 = now();
        for (int t = 0; t < TILES; t++)
            for (int r = 0; r < ROWS; r++) weighted_sums(scores[0], MAX_TILE, value_rows + 32 * t, 32, d, out[r], heads);
        double t2 = now();
        direct = t1 - t0 < direct ? t1 - t0 : direct, sums = t2 - t1 < sums ? t2 - t1 : sums;
#ifdef TRANSPOSED_SCORES
        volatile int64_t first_key = 0;  // a value gcc cannot fold into a copy of transpose_keys
        float* kt = aligned_alloc(64, sizeof(float) * KT_WIDTH * MAX_KT_DIM);  // room as attend_row_block's
        static float other[8][MAX_TILE];
        double t3 = now();
        for (int t = 0; t < TILES; t++) {
            transpose_keys(key_rows + 32 * t, first_key, 32, d, kt);
            for (int r = 0; r < ROWS; r++) transposed_scores(q[r], heads, kt, 32, d, 0.125f, other[0], MAX_TILE);
        }
        double t4 = now();
        transposed = t4 - t3 < transposed ? t4 - t3 : transposed;
        free(kt);
        tile_scores(q[ROWS - 1], heads, key_rows + 32 * (TILES - 1), value_rows, 32, 32, d, 0.125f, scores[0], MAX_TILE, 1);
        for (int h = 0; h < heads; h++)
            if (memcmp(scores[h], other[h], 32 * sizeof(float)) != 0) {
                fprintf(stderr, "transposed scores differ from the direct ones (head %d)\n", h);
                return 1;
            }
#endif
    }
    const double per = 1e9 / ((double)TILES * ROWS * heads * 32);
    printf("%d channels, %d heads: direct scores %.3f ns, value sums %.3f ns", d, heads, direct * per, sums * per);
    if (transposed < 1e9) printf(", transposed scores %.3f ns (the same bits)", transposed * per);
    printf(" per key and head (checksum %g)\n", out[ROWS - 1][d - 1]);
    return 0;
}
