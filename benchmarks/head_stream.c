// Microbenchmark: the batch-1 output-head matmul (q8sx8, Gemma 3 270M's 262,144 x 640, 178 MB: far
// more than L3, so every call streams it from DRAM) as kvgen_gemm_q8sx8 runs it, against variants
// of the same sums (checked bit for bit): software prefetch, other thread splits, 2 MB pages, and
// a plain read of the same buffer. Variants alternate within each round; only rounds in which
// other processes kept the CPUs under 5% busy count; medians and median paired ratios are printed.
//
//   gcc -O3 -march=native -fopenmp -std=c11 -I src/kvgen/kernels benchmarks/head_stream.c -lm -o head_stream
//   OMP_NUM_THREADS=2 ./head_stream ROUNDS HUGE VARIANT...     (AVX2 machines and up)
//   e.g. ./head_stream 21 1 gemm copy h:copy nta:4096 stream h:stream
//
// Measured on 2 Zen 4 cores (KVM): 4 KB -> 2 MB pages 0.71-0.76x the time (1 and 2 threads);
// software prefetch 512 B - 8 KB ahead (T0 or NTA) and interleaved thread chunks within noise or
// slower; the kernel reads faster than the plain read loop.
#define _GNU_SOURCE
#include "qgemm.c"

#include <stdio.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

// One group of 8 rows, R = 1: the ops of q8sx8_rows' TILE_LOOP(.., 1), plus a prefetch DIST bytes
// ahead of each block (HINT: _MM_HINT_T0 / _MM_HINT_NTA; DIST 0: none).
// (hint 2: the whole group DIST bytes ahead prefetched NTA, in one burst before the group's blocks.)
static inline void group_pf(const block_q8sx8* wg, const block_x8* x, float* y, int64_t nb, int dist, int hint) {
    __m256 acc = _mm256_setzero_ps();
    if (hint == 2)
        for (int64_t o = 0; o < nb * (int64_t)sizeof *wg; o += 64) _mm_prefetch((const char*)wg + dist + o, _MM_HINT_NTA);
    if (hint == 2) dist = 0;
    for (int64_t b = 0; b < nb; b++) {
        const block_q8sx8* blk = wg + b;
        if (dist > 0) {
            const char* p = (const char*)blk + dist;
            if (hint == 3) {  // each line once: those that start inside [blk + dist, blk + dist + size)
                for (uintptr_t a = ((uintptr_t)p + 63) & ~(uintptr_t)63; a < (uintptr_t)p + sizeof *blk; a += 64)
                    _mm_prefetch((const char*)a, _MM_HINT_NTA);
            } else if (hint == 0) {
                for (int o = 0; o < (int)sizeof *blk; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
            } else {
                for (int o = 0; o < (int)sizeof *blk; o += 64) _mm_prefetch(p + o, _MM_HINT_NTA);
            }
        }
        __m256i dot = _mm256_setzero_si256();
        for (int i = 0; i < 8; i++) {
            const __m256i w = _mm256_loadu_si256((const __m256i*)(blk->qs + 32 * i));
            const __m256i magnitude = _mm256_abs_epi8(w);
            const __m256i xs = _mm256_sign_epi8(broadcast4(x[b].qs + 4 * i), w);
            DOT32(dot, magnitude, xs);
        }
        const __m256 d = f16x8_to_f32(blk->d);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(x[b].d)), acc);
    }
    _mm256_storeu_ps(y, acc);
}

// split 0: contiguous halves (as omp for schedule(static)); split c > 0: chunks of c groups dealt
// round robin.
static void head_variant(const block_q8sx8* w, const block_x8* x, float* y, int64_t n, int64_t k, int dist, int hint,
                         int split) {
    const int64_t nb = k / QK, groups = n / XROWS;
#pragma omp parallel
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        if (split == 0) {
            const int64_t first = groups * id / nt, last = groups * (id + 1) / nt;
            for (int64_t g = first; g < last; g++) group_pf(w + g * nb, x, y + g * XROWS, nb, dist, hint);
        } else {
            for (int64_t c = (int64_t)id * split; c < groups; c += (int64_t)nt * split)
                for (int64_t g = c; g < c + split && g < groups; g++) group_pf(w + g * nb, x, y + g * XROWS, nb, dist, hint);
        }
    }
}

// The ceiling: every byte of the buffer through the widest loads, summed (contiguous halves);
// dist > 0: with NTA prefetches that far ahead.
#ifdef __AVX512F__
typedef __m512i wide;
#define WIDE_ADD _mm512_add_epi64
#define WIDE_ZERO _mm512_setzero_si512
static inline uint64_t wide_total(wide v) { return (uint64_t)_mm512_reduce_add_epi64(v); }
#else
typedef __m256i wide;
#define WIDE_ADD _mm256_add_epi64
#define WIDE_ZERO _mm256_setzero_si256
static inline uint64_t wide_total(wide v) {
    uint64_t l[4];
    _mm256_storeu_si256((__m256i*)l, v);
    return l[0] + l[1] + l[2] + l[3];
}
#endif
static uint64_t stream_read(const void* buf, size_t bytes, int dist) {
    uint64_t total = 0;
#pragma omp parallel reduction(+ : total)
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const size_t step = 4 * sizeof(wide), lines = bytes / step;
        const wide* p = (const wide*)buf;
        wide a0 = WIDE_ZERO(), a1 = a0, a2 = a0, a3 = a0;
        for (size_t i = lines * id / nt; i < lines * (id + 1) / nt; i++) {
            if (dist > 0)
                for (size_t o = 0; o < step; o += 64) _mm_prefetch((const char*)(p + 4 * i) + dist + o, _MM_HINT_NTA);
            a0 = WIDE_ADD(a0, p[4 * i]);
            a1 = WIDE_ADD(a1, p[4 * i + 1]);
            a2 = WIDE_ADD(a2, p[4 * i + 2]);
            a3 = WIDE_ADD(a3, p[4 * i + 3]);
        }
        total += wide_total(WIDE_ADD(WIDE_ADD(a0, a1), WIDE_ADD(a2, a3)));
    }
    return total;
}

// CPU time every process spent busy so far (from /proc/stat, in seconds), to tell quiet rounds.
static double busy_seconds(void) {
    unsigned long long user = 0, nice = 0, system = 0, irq = 0, softirq = 0, steal = 0;
    FILE* f = fopen("/proc/stat", "r");
    if (f == NULL) return 0.0;
    if (fscanf(f, "cpu %llu %llu %llu %*u %*u %llu %llu %llu", &user, &nice, &system, &irq, &softirq, &steal) != 6) user = 0;
    fclose(f);
    return (double)(user + nice + system + irq + softirq + steal) / (double)sysconf(_SC_CLK_TCK);
}

static double own_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static int cmp_double(const void* a, const void* b) {
    const double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

typedef struct { const char* name; int dist, hint, split, huge; } variant;  // stream: hint = prefetch distance

int main(int argc, char** argv) {
    // HEAD_ROWS: another output count (e.g. 16384, 11 MB: a weight that stays in L3 between calls).
    const int64_t n = getenv("HEAD_ROWS") ? atoll(getenv("HEAD_ROWS")) / XROWS * XROWS : 262144, k = 640, nb = k / QK;
    const int64_t groups = n / XROWS;
    const int rounds = argc > 1 ? atoi(argv[1]) : 15;
    const int huge = argc > 2 ? atoi(argv[2]) : 0;  // 1: also a copy of the weights on 2 MiB pages ("h:" variants)
    const size_t bytes = (size_t)groups * nb * sizeof(block_q8sx8);
    block_q8sx8* w = aligned_alloc(2 << 20, (bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20));
    srand(1);
    uint8_t* raw = (uint8_t*)w;
    for (size_t i = 0; i < bytes; i++) raw[i] = (uint8_t)rand();
    for (int64_t i = 0; i < groups * nb; i++)
        for (int r = 0; r < XROWS; r++) w[i].d[r] = (uint16_t)(0x1C00 + (rand() & 0x3FF));  // ~2^-8 .. 2^-7
    block_q8sx8* wh = w;
    if (huge) {
        const size_t rounded = (bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20);
        wh = aligned_alloc(2 << 20, rounded);
        if (madvise(wh, rounded, MADV_HUGEPAGE) != 0) perror("madvise");
        memcpy(wh, w, bytes);
    }
    float* xf = malloc(sizeof(float) * k);
    for (int64_t j = 0; j < k; j++) xf[j] = (float)rand() / RAND_MAX - 0.5f;
    block_x8* x = malloc(sizeof(block_x8) * nb);
    kvgen_quantize_x8(xf, 1, k, x);
    float *y0 = malloc(sizeof(float) * n), *y1 = malloc(sizeof(float) * n);

    // Variants from the command line after the two numbers: gemm | copy | t0:DIST | nta:DIST |
    // ntaline:DIST | burst:DIST | split:GROUPS | ntasplit:DIST:GROUPS | stream | streamnta:DIST
    variant variants[32];
    int count = 0;
    for (int a = 3; a < argc && count < 32; a++) {
        variant v = {argv[a], 0, 0, 0, 0};
        if (strncmp(argv[a], "h:", 2) == 0) {
            if (!huge) { fprintf(stderr, "h: variants need the second argument 1\n"); return 2; }
            v.huge = 1, argv[a] += 2;
        }
        if (strcmp(argv[a], "gemm") == 0) v.dist = -1;
        else if (strcmp(argv[a], "stream") == 0) v.dist = -2;
        else if (strncmp(argv[a], "streamnta:", 10) == 0) v.dist = -2, v.hint = atoi(argv[a] + 10);
        else if (strncmp(argv[a], "t0:", 3) == 0) v.dist = atoi(argv[a] + 3);
        else if (strncmp(argv[a], "burst:", 6) == 0) v.dist = atoi(argv[a] + 6), v.hint = 2;
        else if (strncmp(argv[a], "ntaline:", 8) == 0) v.dist = atoi(argv[a] + 8), v.hint = 3;
        else if (strncmp(argv[a], "nta:", 4) == 0) v.dist = atoi(argv[a] + 4), v.hint = 1;
        else if (strncmp(argv[a], "split:", 6) == 0) v.split = atoi(argv[a] + 6);
        else if (strncmp(argv[a], "ntasplit:", 9) == 0) v.hint = 1, v.dist = atoi(argv[a] + 9), v.split = atoi(strchr(argv[a] + 9, ':') + 1);
        else if (strcmp(argv[a], "copy") != 0) { fprintf(stderr, "unknown variant %s\n", argv[a]); return 2; }
        variants[count++] = v;
    }

    kvgen_gemm_q8sx8(w, x, y0, 1, n, k);
    for (int v = 0; v < count; v++) {
        if (variants[v].dist < 0) continue;
        memset(y1, 0, sizeof(float) * n);
        head_variant(variants[v].huge ? wh : w, x, y1, n, k, variants[v].dist, variants[v].hint, variants[v].split);
        if (memcmp(y0, y1, sizeof(float) * n) != 0) {
            fprintf(stderr, "%s: outputs differ\n", variants[v].name);
            return 1;
        }
    }
    if (huge) {  // how much of the process the kernel actually put on huge pages
        FILE* f = fopen("/proc/self/smaps_rollup", "r");
        char line[256];
        while (f != NULL && fgets(line, sizeof line, f))
            if (strncmp(line, "AnonHugePages:", 14) == 0) printf("%s", line);
        if (f != NULL) fclose(f);
    }
    double* t = calloc((size_t)count * rounds, sizeof(double));
    volatile uint64_t sink = 0;
    // A round counts only if other processes kept the CPUs under `quiet` busy (fraction of all
    // cores' time); rounds run until `rounds` quiet ones are in (or 20x as many were tried).
    const double quiet = 0.05;
    int tried = 0;
    for (int round = 0; round < rounds && tried < 20 * rounds; tried++) {
        const double busy0 = busy_seconds(), own0 = own_seconds(), wall0 = now();
        for (int i = 0; i < count; i++) {
            const int v = (i + round) % count;  // rotate the order
            const double t0 = now();
            const block_q8sx8* wv = variants[v].huge ? wh : w;
            if (variants[v].dist == -1) kvgen_gemm_q8sx8(wv, x, y0, 1, n, k);
            else if (variants[v].dist == -2) sink += stream_read(wv, bytes, variants[v].hint);
            else head_variant(wv, x, y1, n, k, variants[v].dist, variants[v].hint, variants[v].split);
            t[v * rounds + round] = now() - t0;
        }
        const double others = (busy_seconds() - busy0) - (own_seconds() - own0), wall = now() - wall0;
        if (others < quiet * wall * sysconf(_SC_NPROCESSORS_ONLN)) round++;
    }
    if (tried >= 20 * rounds) {
        fprintf(stderr, "too few quiet rounds\n");
        return 3;
    }
    printf("%.1f MB, %d threads, %d quiet rounds of %d%s\n", bytes / 1e6, omp_get_max_threads(), rounds, tried,
           huge ? ", h: on MADV_HUGEPAGE" : "");
    // Each variant's time over the first variant's in the same round (their neighbours in time),
    // then the medians: a paired ratio stands up better to load that comes and goes.
    double* ratio = malloc(sizeof(double) * (size_t)count * rounds);
    for (int v = 0; v < count; v++)
        for (int round = 0; round < rounds; round++) ratio[v * rounds + round] = t[v * rounds + round] / t[round];
    for (int v = 0; v < count; v++) {
        qsort(t + v * rounds, rounds, sizeof(double), cmp_double);
        qsort(ratio + v * rounds, rounds, sizeof(double), cmp_double);
        const double med = t[v * rounds + rounds / 2];
        printf("  %-20s median %6.2f ms  %5.1f GB/s  (min %6.2f)  time / first's: %.3f\n", variants[v].name, med * 1e3,
               bytes / med / 1e9, t[v * rounds] * 1e3, ratio[v * rounds + rounds / 2]);
    }
    return (int)(sink & 0);
}
