// Interleaved weights (q4x8, q4hx8, q5x8, q8x8, q8sx8; q4kx8 in k_quants.c) times int8 activation rows
// in AMX tiles, 16 rows by 16 outputs a tile, where the CPU has AMX (Intel Sapphire Rapids and
// later). #included by interleaved.c after interleaved_pairs.c, whose pair kernels take the rows
// left over and every build without AMX.
//
// Numerics: the vector kernels' exactly. One tile multiply per 32-element block (TDPBSUD, the
// activations the signed side and 4-bit weights the unsigned one; TDPBSSD for 8-bit weights and
// for q5's, unpacked as the signed u - 16; K = 32, so blocks never mix) gives each (row, output) the
// block's exact integer dot (q5's vector kernel takes 16 x the activations' sum from the unsigned
// dot: the same integer), then the same acc = fma(float(idot), d_w * d_x, acc)
// (and acc = fma(m_w, s_x, acc) where the format has offsets) per block, in order, in 512-bit
// registers. A row's outputs are the same bits with AMX or without, alone or among many rows.
//
// Layout: a pair's block is nearly the B tile as it stands. TDPBSUD's B holds, per K-row i
// (elements 4i..4i+3), four bytes per output: q4x8's load i (i < 4) is exactly that for 8 outputs,
// as low nibbles for elements 4i + e and high nibbles for 16 + 4i + e, and q8sx8's load i (i < 8) as
// bytes. So B row i of a pair is the two groups' (unpacked) load i side by side, unpacked once per
// pair and call for every row tile. The A tile is read in place: 16 activation blocks' 32 codes,
// a row apart.
//
// The kernels ask Linux for the tile data state once (arch_prctl); where that is refused, or
// kvgen_amx_set(0) turns them off, the pair kernels run.

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <sys/syscall.h>
long syscall(long number, ...);  // unistd.h declares it only outside strict C11

#define AMX_ROWS 16        // activation rows a tile
// Rows a call needs before the tiles pay (MIN_ROWS below), against the 512-bit pair kernels on one
// tile of 16 rows (its weights unpacked for it alone), 2 threads: q4h 1.00x, q5 1.01x (24 rows
// 0.95x), q4k 1.07x, q8s 1.42x. So 32 for q4 and q5, 16 for q4k and the 8-bit formats.
#define AMX_SPAN_BLOCKS 64  // blocks unpacked at once: 32 KiB of B tiles on the stack
// Tile registers: a block's dots, its activation codes, its weights. (Two or three sets of them in
// turn, so that one block's store never waited on the multiply just issued, were no faster: on an
// Intel Xeon with AMX the tile instructions and the 512-bit arithmetic around them did not overlap.)
#define AMX_C 0
#define AMX_A 1
#define AMX_B 2
// A second set for formats whose 16-element halves carry their own scales (Q6_K: a multiply each).
#define AMX_C2 3
#define AMX_A2 4
#define AMX_B2 5

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_config;

static int amx_enabled = -1;  // -1: not asked yet; 0: off or refused; 1: on

// Asks for the tile data state once (XFEATURE_XTILEDATA, 18, by ARCH_REQ_XCOMP_PERM, 0x1023).
static int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return permitted;
}

static inline int amx_on(void) {
    if (amx_enabled < 0) amx_enabled = amx_permitted();
    return amx_enabled;
}

// Turns the AMX tiles on (on > 0, where the CPU and Linux allow them) or off (on == 0), or leaves
// them as they are (on < 0: on by default); returns whether they are on. The bits of every output
// are the same either way.
int kvgen_amx_set(int on) {
    if (on >= 0) amx_enabled = on && amx_permitted();
    return amx_on();
}

// Tiles for blocks of `depth` elements (K): dots 16 x 16 int32, activations 16 rows x K codes,
// weights K / 4 rows of 16 outputs x 4 codes; `sets` of them (1, or 2 for half blocks).
static void amx_configure_depth(int depth, int sets) {
    amx_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int set = 0; set < sets; set++) {
        const int c = set ? AMX_C2 : AMX_C, a = set ? AMX_A2 : AMX_A, b = set ? AMX_B2 : AMX_B;
        config.rows[c] = AMX_ROWS, config.colsb[c] = 16 * sizeof(int32_t);
        config.rows[a] = AMX_ROWS, config.colsb[a] = (uint16_t)depth;
        config.rows[b] = (uint8_t)(depth / 4), config.colsb[b] = 64;
    }
    _tile_loadconfig(&config);
}

static void amx_configure(void) { amx_configure_depth(QK, 1); }
static void amx_configure_halves(void) { amx_configure_depth(QK / 2, 2); }

// A pair's 4-bit block as a B tile: load i's low nibbles are K-row i, its high ones K-row 4 + i.
// planes0 / planes1: q5x8's fifth bits of the two groups (NULL: 4-bit weights).
static inline void amx_unpack_nibbles(const uint8_t* qs0, const uint8_t* qs1, const uint8_t* planes0,
                                      const uint8_t* planes1, uint8_t* tile) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    const __m512i planes = planes0 != NULL ? pair_load(planes0, planes1) : _mm512_setzero_si512();
    for (int i = 0; i < 4; i++) {
        const __m512i packed = pair_load(qs0 + 32 * i, qs1 + 32 * i);
        __m512i lo = _mm512_and_si512(packed, mask), hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
        if (planes0 != NULL) {  // q5: the signed u - 16, so that the multiply gives the signed dot
            Q5_FIFTH_BITS(lo, hi, i)
            lo = _mm512_sub_epi8(lo, _mm512_set1_epi8(16)), hi = _mm512_sub_epi8(hi, _mm512_set1_epi8(16));
        }
        _mm512_storeu_si512(tile + 64 * i, lo);
        _mm512_storeu_si512(tile + 64 * (4 + i), hi);
    }
}

// A pair's 8-bit block as a B tile: load i is K-row i.
static inline void amx_unpack_bytes(const int8_t* qs0, const int8_t* qs1, uint8_t* tile) {
    for (int i = 0; i < 8; i++) _mm512_storeu_si512(tile + 64 * i, pair_load(qs0 + 32 * i, qs1 + 32 * i));
}

#define AMX_UNPACK_Q4(b, tile) amx_unpack_nibbles(w0[b].qs, w1[b].qs, NULL, NULL, tile)
#define AMX_UNPACK_Q5(b, tile) amx_unpack_nibbles(w0[b].qs, w1[b].qs, w0[b].qh, w1[b].qh, tile)
#define AMX_UNPACK_Q8(b, tile) amx_unpack_bytes(w0[b].qs, w1[b].qs, tile)

// Block b's exact integer dots (dot[t], row t of the tile, 16 outputs) by one multiply: the A tile
// read in place from the activation blocks, the B tile unpacked.
#define AMX_WHOLE_BLOCK(DP)                                                                          \
    _tile_loadd(AMX_A, x[b].qs, x_stride * (int64_t)sizeof(block_x8));                               \
    _tile_loadd(AMX_B, unpacked + (b - first) * 512, 64);                                            \
    _tile_zero(AMX_C);                                                                               \
    DP(AMX_C, AMX_A, AMX_B);                                                                         \
    _tile_stored(AMX_C, dots, 64);                                                                   \
    __m512i dot[AMX_ROWS];                                                                           \
    for (int t = 0; t < AMX_ROWS; t++) dot[t] = _mm512_load_si512(dots + 16 * t);
#define AMX_BLOCK_SUD AMX_WHOLE_BLOCK(_tile_dpbsud)
#define AMX_BLOCK_SSD AMX_WHOLE_BLOCK(_tile_dpbssd)
// A block's two 16-element halves by a multiply each (amx_configure_halves; signed weights): dot[t]
// over elements 0-15, dot2[t] over 16-31 (UNPACK writes the halves' B tiles 256 bytes apart).
#define AMX_BLOCK_HALVES                                                                             \
    _tile_loadd(AMX_A, x[b].qs, x_stride * (int64_t)sizeof(block_x8));                               \
    _tile_loadd(AMX_A2, x[b].qs + QK / 2, x_stride * (int64_t)sizeof(block_x8));                     \
    _tile_loadd(AMX_B, unpacked + (b - first) * 512, 64);                                            \
    _tile_loadd(AMX_B2, unpacked + (b - first) * 512 + 256, 64);                                     \
    _tile_zero(AMX_C);                                                                               \
    _tile_zero(AMX_C2);                                                                              \
    _tile_dpbssd(AMX_C, AMX_A, AMX_B);                                                               \
    _tile_dpbssd(AMX_C2, AMX_A2, AMX_B2);                                                            \
    _tile_stored(AMX_C, dots, 64);                                                                   \
    _tile_stored(AMX_C2, dots + AMX_ROWS * 16, 64);                                                  \
    __m512i dot[AMX_ROWS]; /* no top-level commas: this is a macro argument */                     \
    __m512i dot2[AMX_ROWS];                                                                          \
    for (int t = 0; t < AMX_ROWS; t++) {                                                             \
        dot[t] = _mm512_load_si512(dots + 16 * t);                                                   \
        dot2[t] = _mm512_load_si512(dots + AMX_ROWS * 16 + 16 * t);                                  \
    }

// y rows [0, tiles * 16) of the pair (16 outputs each), blocks [first, first + count) added to
// what the earlier spans left (first == 0: from zero). Per block MULTIPLY gives the tile's exact
// dots, stored for the vector units to apply the block's scales (b, dot[t], b0, b1, x, acc: the
// names APPLY reads).
#define AMX_SPAN(BLOCK, MULTIPLY, APPLY)                                                             \
    for (int64_t t0 = 0; t0 < tiles * AMX_ROWS; t0 += AMX_ROWS) {                                    \
        __m512 acc[AMX_ROWS];                                                                        \
        for (int t = 0; t < AMX_ROWS; t++)                                                           \
            acc[t] = first == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(y + (t0 + t) * y_stride);   \
        const block_x8* x = activations + t0 * x_stride;                                             \
        for (int64_t b = first; b < first + count; b++) {                                            \
            MULTIPLY                                                                                 \
            const BLOCK* b0 = w0 + b; /* k-quants: unused, their APPLY reads the super-blocks */     \
            const BLOCK* b1 = w1 + b;                                                                \
            (void)b0, (void)b1;                                                                      \
            APPLY(AMX_ROWS)                                                                          \
        }                                                                                            \
        for (int t = 0; t < AMX_ROWS; t++) _mm512_storeu_ps(y + (t0 + t) * y_stride, acc[t]);       \
    }

// The pair kernels' signature for any number of rows: whole tiles of 16 in AMX, the rest (and
// every row where AMX is off) STEP rows at a time by PAIR_FN, from MIN_ROWS rows a call.
// UNPACK(b, tile) writes block b's B tile(s) (512 bytes); CONFIGURE sets the tiles MULTIPLY uses
// (AMX_BLOCK_SUD / AMX_BLOCK_SSD: one multiply a block, for the weights' sign).
#define AMX_PAIR_KERNEL(NAME, BLOCK, PAIR_FN, STEP, MIN_ROWS, UNPACK, MULTIPLY, APPLY)               \
    AMX_PAIR_KERNEL_TILES(NAME, BLOCK, PAIR_FN, STEP, MIN_ROWS, UNPACK, amx_configure, MULTIPLY, APPLY)
#define AMX_PAIR_KERNEL_TILES(NAME, BLOCK, PAIR_FN, STEP, MIN_ROWS, UNPACK, CONFIGURE, MULTIPLY, APPLY) \
    static void NAME(const BLOCK* w0, const BLOCK* w1, const block_x8* activations, const int32_t* xsum, \
                     int64_t x_stride, float* y, int64_t y_stride, int rows, int64_t nb) {           \
        const int64_t tiles = rows >= (MIN_ROWS) && amx_on() ? rows / AMX_ROWS : 0;                 \
        if (tiles > 0) {                                                                             \
            uint8_t unpacked[AMX_SPAN_BLOCKS * 512] __attribute__((aligned(64)));                    \
            int32_t dots[2 * AMX_ROWS * 16] __attribute__((aligned(64))); /* one or two tiles */      \
            CONFIGURE();                                                                             \
            for (int64_t first = 0; first < nb; first += AMX_SPAN_BLOCKS) {                          \
                const int64_t count = nb - first < AMX_SPAN_BLOCKS ? nb - first : AMX_SPAN_BLOCKS;   \
                for (int64_t b = 0; b < count; b++) UNPACK(first + b, unpacked + b * 512);           \
                AMX_SPAN(BLOCK, MULTIPLY, APPLY)                                                     \
            }                                                                                        \
            _tile_release();                                                                         \
        }                                                                                            \
        for (int64_t m0 = tiles * AMX_ROWS; m0 < rows; m0 += (STEP)) {                               \
            const int r = (int)(rows - m0 < (STEP) ? rows - m0 : (STEP));                            \
            PAIR_FN(w0, w1, activations + m0 * x_stride, xsum != NULL ? xsum + m0 * x_stride : NULL, \
                    x_stride, y + m0 * y_stride, y_stride, r, nb);                                   \
        }                                                                                            \
    }

#define AMX_KERNELS 1
AMX_PAIR_KERNEL(q4x8_amx_rows, block_q4x8, q4x8_pair_rows, PAIR_ROWS, 32, AMX_UNPACK_Q4, AMX_BLOCK_SUD,
                APPLY_PAIR_SCALES_OFFSETS)
AMX_PAIR_KERNEL(q4hx8_amx_rows, block_q4hx8, q4hx8_pair_rows, PAIR_ROWS, 32, AMX_UNPACK_Q4, AMX_BLOCK_SUD,
                APPLY_PAIR_F16_SCALES_OFFSETS)
AMX_PAIR_KERNEL(q5x8_amx_rows, block_q5x8, q5x8_pair_rows, PAIR_ROWS, 32, AMX_UNPACK_Q5, AMX_BLOCK_SSD,
                APPLY_PAIR_F16_SCALES)
AMX_PAIR_KERNEL(q8x8_amx_rows, block_q8x8, q8x8_pair_rows, PAIR_ROWS, 16, AMX_UNPACK_Q8, AMX_BLOCK_SSD,
                APPLY_PAIR_SCALES_OFFSETS)
AMX_PAIR_KERNEL(q8sx8_amx_rows, block_q8sx8, q8sx8_pair_rows, PAIR_ROWS, 16, AMX_UNPACK_Q8, AMX_BLOCK_SSD,
                APPLY_PAIR_F16_SCALES)
#define CALL_ROWS(PAIR_STEP) ROW_CHUNK  // rows a pair call takes: the whole chunk (the kernel steps itself)
#else
int kvgen_amx_set(int on) {
    (void)on;
    return 0;
}
#define q4x8_amx_rows q4x8_pair_rows
#define q4hx8_amx_rows q4hx8_pair_rows
#define q5x8_amx_rows q5x8_pair_rows
#define q8x8_amx_rows q8x8_pair_rows
#define q8sx8_amx_rows q8sx8_pair_rows
#define CALL_ROWS(PAIR_STEP) (PAIR_STEP)  // rows a pair call takes: what the pair kernel takes at once
#endif
