// Every split of a vocabulary piece into two vocabulary pieces: the merges a BPE vocabulary implies
// when its file lists none (sentencepiece GGUFs: Gemma's 262,144 tokens, Llama 2, Mistral). The
// Python loop over each piece's split points took ~1 s of Gemma 3's load; the order the merges are
// ranked in stays in Python (loading/gguf_tokenizer.py: generate_merges).
//
// Strings are UTF-8 in one buffer each, string i at [offsets[i], offsets[i + 1]). Splits are tried
// between characters only (as Python's piece[:i]; a cut inside one could match nothing anyway, valid
// UTF-8 never ending mid-character), left lengths descending or ascending per piece.

static uint64_t vocab_hash(const uint8_t* s, int64_t n) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    for (int64_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ull;
    return h;
}

// The slot of string s in the table (its index there, or -1 where it is absent).
static int32_t vocab_find(const int32_t* table, uint64_t mask, const uint8_t* text, const int64_t* offsets,
                          const uint8_t* s, int64_t n) {
    for (uint64_t slot = vocab_hash(s, n) & mask;; slot = (slot + 1) & mask) {
        int32_t i = table[slot];
        if (i < 0) return -1;
        if (offsets[i + 1] - offsets[i] == n && memcmp(text + offsets[i], s, (size_t)n) == 0) return i;
    }
}

// Writes (piece, left, right) indices for each split of each piece (pieces in order) whose halves are
// both in the vocabulary; returns how many, -1 where more than capacity, -2 where memory ran out.
int64_t kvgen_vocab_splits(const uint8_t* vocab_text, const int64_t* vocab_offsets, int64_t vocab_count,
                           const uint8_t* piece_text, const int64_t* piece_offsets, int64_t piece_count,
                           int32_t descending, int32_t* out_piece, int32_t* out_left, int32_t* out_right,
                           int64_t capacity) {
    uint64_t size = 1;
    while (size < 2 * (uint64_t)vocab_count + 1) size <<= 1;
    int32_t* table = malloc(size * sizeof *table);
    if (!table) return -2;
    memset(table, 0xff, size * sizeof *table);  // -1: empty
    const uint64_t mask = size - 1;
    for (int64_t i = 0; i < vocab_count; i++) {
        const uint8_t* s = vocab_text + vocab_offsets[i];
        uint64_t slot = vocab_hash(s, vocab_offsets[i + 1] - vocab_offsets[i]) & mask;
        while (table[slot] >= 0) slot = (slot + 1) & mask;
        table[slot] = (int32_t)i;
    }
    int64_t found = 0;
    for (int64_t p = 0; p < piece_count; p++) {
        const uint8_t* s = piece_text + piece_offsets[p];
        const int64_t n = piece_offsets[p + 1] - piece_offsets[p];
        for (int64_t k = 1; k < n; k++) {
            const int64_t cut = descending ? n - k : k;
            if ((s[cut] & 0xC0) == 0x80) continue;  // a continuation byte: inside a character
            const int32_t left = vocab_find(table, mask, vocab_text, vocab_offsets, s, cut);
            if (left < 0) continue;
            const int32_t right = vocab_find(table, mask, vocab_text, vocab_offsets, s + cut, n - cut);
            if (right < 0) continue;
            if (found == capacity) {
                free(table);
                return -1;
            }
            out_piece[found] = (int32_t)p, out_left[found] = left, out_right[found] = right;
            found++;
        }
    }
    free(table);
    return found;
}
