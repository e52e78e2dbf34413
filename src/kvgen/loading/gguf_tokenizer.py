"""Rebuild the tokenizer a GGUF file describes, as a `tokenizers.Tokenizer`.

A GGUF carries no tokenizer.json: only llama.cpp's vocabulary arrays (tokens, scores, token types,
maybe merges). We rebuild the same pipeline transformers builds for such a file
(transformers/integrations/gguf/gguf_tokenizer_mapping.py and the Gemma/Llama/GPT-2 tokenizer
classes it hands the vocabulary to), so token ids match the reference exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from operator import itemgetter
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from kvgen import kernels
from kvgen.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")
GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})

# llama.cpp's `tokenizer.ggml.token_type` values.
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_SPACE = "\u2581"  # sentencepiece's visible space

# Split regexes by `tokenizer.ggml.pre`, copied from transformers' GGUF_PRE_TOKENIZER_SPLITS.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
# These vocabularies were trained with every digit its own pre-token (their tokenizer.json has
# `Digits(individual_digits=True)` before ByteLevel, and llama.cpp splits on `\p{N}` for them).
# transformers' GGUF path misses this and keeps "2024" as one pre-token; we follow the original.
_INDIVIDUAL_DIGIT_PRES = frozenset({"smollm", "starcoder", "refact"})


def build_gguf_backend(metadata: Mapping[str, Any], architecture: str, tokens: list[str]) -> Backend:
    """The `tokenizers` pipeline for this file's vocabulary (`tokens`: gguf_tokens(metadata)), special
    tokens added so they match whole."""
    model = metadata.get("tokenizer.ggml.model")
    if model == "gpt2":
        backend, vocab = _byte_level_bpe(tokens, metadata)
    elif model == "llama" and architecture in GEMMA_ARCHITECTURES:
        backend, vocab = _gemma_bpe(tokens, metadata)
    elif model == "llama":
        backend, vocab = _sentencepiece_bpe(tokens, metadata)
    else:
        raise UnsupportedModelError(
            f"GGUF tokenizer.ggml.model is {model!r}, which kvgen cannot build a tokenizer for; "
            f"supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)}. Use a model with one of those tokenizers."
        )
    _add_special_tokens(backend, tokens, vocab, metadata, byte_level=model == "gpt2")
    return backend


def gguf_tokens(metadata: Mapping[str, Any]) -> list[str]:
    """The vocabulary as the file spells it; a file without one cannot be used for text."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(
            "GGUF metadata has no tokenizer.ggml.tokens, so the file carries no tokenizer; "
            "use a GGUF converted with its vocabulary (llama.cpp's convert_hf_to_gguf.py does this)."
        )
    return [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in tokens]


def token_types(metadata: Mapping[str, Any], count: int) -> list[int]:
    """llama.cpp's per-token type, all NORMAL (1) when the file omits them."""
    types = metadata.get("tokenizer.ggml.token_type")
    return [int(t) for t in types] if types else [1] * count


def _byte_level_bpe(tokens: list[str], metadata: Mapping[str, Any]) -> tuple[Backend, dict[str, int]]:
    """GPT-2 style byte-level BPE, as transformers' `byte_level_tokenizer` + `set_split_regex`."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    respelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {token: index for index, token in enumerate(respelled)}
    merges = _file_merges(metadata) or generate_merges(vocab)
    backend = Backend(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = _byte_level_pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    return backend, vocab


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """How text is cut before BPE: the split the merges were learned with."""
    if pre in _INDIVIDUAL_DIGIT_PRES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = _PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )



def _byte_fallback_bpe(vocab: dict[str, int], merges: list, tokens: list[str], metadata: Mapping[str, Any]) -> Backend:
    """Sentencepiece-style BPE: unknown characters fall back to <0xNN> byte tokens."""
    bpe = BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token=_unk_token(tokens, metadata), dropout=None,
              byte_fallback=True)  # fmt: skip
    return Backend(bpe)

def _gemma_bpe(tokens: list[str], metadata: Mapping[str, Any]) -> tuple[Backend, dict[str, int]]:
    """Gemma's sentencepiece-as-BPE (transformers' `gemma_tokenizer` + `GemmaTokenizer`).

    Runs of spaces are stored as real spaces but looked up as "▁"*n, so they are respelled; the file
    has no merges, and Gemma's scores do not follow its merge order, so the merges are rebuilt with
    the token's position in the file as its score.
    """
    respelled = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(respelled)}
    positions = {token: -index for index, token in enumerate(respelled)}
    merges = _file_merges(metadata) or generate_merges(vocab, positions)
    backend = _byte_fallback_bpe(vocab, merges, tokens, metadata)
    backend.normalizer = normalizers.Replace(" ", _SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend, vocab


def _sentencepiece_bpe(tokens: list[str], metadata: Mapping[str, Any]) -> tuple[Backend, dict[str, int]]:
    """Llama 2 / Mistral sentencepiece-as-BPE (transformers' `LlamaTokenizer`, legacy=False).

    Merges come from the file or are rebuilt from the scores. A "▁" is prepended to the first
    section of text only, unless the file says `add_space_prefix` is false (as llama.cpp does).
    """
    vocab = {token: index for index, token in enumerate(tokens)}
    scores = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    merges = _file_merges(metadata) or generate_merges(vocab, dict(zip(tokens, scores)))
    backend = _byte_fallback_bpe(vocab, merges, tokens, metadata)
    add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend, vocab


def _unk_token(tokens: list[str], metadata: Mapping[str, Any]) -> str:
    """The unknown token's text, "<unk>" as sentencepiece's default when the file names none."""
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    return tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else "<unk>"


def _file_merges(metadata: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The merges the file lists ("Ġ t" -> ("Ġ", "t")), empty when it lists none."""
    merges = metadata.get("tokenizer.ggml.merges") or []
    return [tuple(merge.split(" ", 1)) for merge in merges]  # type: ignore[misc]


def generate_merges(vocab: Mapping[str, int], scores: Mapping[str, float] | None = None) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary, best first (transformers' `generate_merges`, same order).

    Every split of a token into two vocabulary pieces is a merge; with scores they rank by
    descending score, without by ascending vocabulary index; ties by piece lengths.
    """
    descending = scores is not None
    ranked = sorted((scores if scores is not None else vocab).items(), key=itemgetter(1), reverse=descending)
    pieces = [piece for piece, _ in ranked]
    # Each piece's splits come in the rank's order of left lengths (they all differ), so only the
    # merges of pieces with equal scores need sorting.
    merges, owners = _splits_in_c(pieces, vocab, descending) or _splits(pieces, vocab, descending)
    values = np.array([value for _, value in ranked], dtype=np.float64)
    starts = np.flatnonzero(np.r_[True, values[1:] != values[:-1], True])
    for group in np.flatnonzero(np.diff(starts) > 1).tolist():
        # Pieces of equal score: their merges interleave by lengths, each keeping its piece's order.
        low, high = np.searchsorted(owners, starts[group : group + 2]).tolist()
        merges[low:high] = sorted(merges[low:high], key=lambda m: (len(m[0]), len(m[1])), reverse=descending)
    return merges


Splits = tuple[list[tuple[str, str]], np.ndarray]  # merges in piece order; the piece of each


def _splits(pieces: list[str], vocab: Mapping[str, int], descending: bool) -> Splits:
    merges: list[tuple[str, str]] = []
    owners: list[int] = []
    for index, piece in enumerate(pieces):
        lengths = range(len(piece) - 1, 0, -1) if descending else range(1, len(piece))
        found = [(piece[:i], piece[i:]) for i in lengths if piece[:i] in vocab and piece[i:] in vocab]
        merges.extend(found)
        owners.extend([index] * len(found))
    return merges, np.array(owners, dtype=np.int64)


def _splits_in_c(pieces: list[str], vocab: Mapping[str, int], descending: bool) -> Splits | None:
    """_splits by the compiled kernels (kernels/vocab_splits.c; Gemma 3's 262,144 pieces: 0.06 s
    against ~1 s in Python, then ~0.2 s to make the merges' tuples); None without the kernels."""
    library = kernels.load()
    if library is None:
        return None
    piece_text, piece_offsets = _utf8(pieces)
    if vocab.keys() == set(pieces):  # the usual case: the scores rank the vocabulary itself
        keys, vocab_text, vocab_offsets = pieces, piece_text, piece_offsets
    else:
        keys = list(vocab)
        vocab_text, vocab_offsets = _utf8(keys)
    capacity = max(len(piece_text), 1)  # a piece of n bytes has fewer than n splits
    owners, lefts, rights = (np.empty(capacity, dtype=np.int32) for _ in range(3))
    count = library.kvgen_vocab_splits(vocab_text, vocab_offsets.ctypes.data, len(keys), piece_text,
                                       piece_offsets.ctypes.data, len(pieces), int(descending), owners.ctypes.data,
                                       lefts.ctypes.data, rights.ctypes.data, capacity)  # fmt: skip
    if count == -2:
        raise MemoryError("no memory for the vocabulary's hash table while building the tokenizer's merges")
    assert count >= 0, "more splits than bytes: the capacity above is a bound"
    merges = list(zip(map(keys.__getitem__, lefts[:count].tolist()), map(keys.__getitem__, rights[:count].tolist())))
    return merges, owners[:count]


def _utf8(strings: list[str]) -> tuple[bytes, np.ndarray]:
    """The strings' UTF-8 bytes end to end, and where each starts (one more offset: the end)."""
    encoded = [text.encode("utf-8") for text in strings]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)), out=offsets[1:])
    return b"".join(encoded), offsets


def _add_special_tokens(
    backend: Backend, tokens: list[str], vocab: Mapping[str, int], metadata: Mapping[str, Any], *, byte_level: bool
) -> None:
    """Make control and user-defined tokens match whole in text (transformers' `add_gguf_special_tokens`).

    Control tokens become special (skipped by decode), user-defined ones plain added tokens. A byte-level
    control token outside the byte alphabet is a llama.cpp mislabel and is left out; the bos/eos/unk/pad
    tokens are special too, as transformers' special-token map makes them.
    """
    types = token_types(metadata, len(tokens))
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    control = [
        t for t, kind in zip(tokens, types) if kind == TOKEN_TYPE_CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, kind in zip(tokens, types) if kind == TOKEN_TYPE_USER_DEFINED and t in vocab]
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    named = [_named_token(tokens, metadata, key) for key in ("bos", "eos", "unknown", "padding")]
    already = set(control) | set(user)
    extra = [t for t in dict.fromkeys(named) if t is not None and t not in already and t in vocab]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in extra])


def _named_token(tokens: Sequence[str], metadata: Mapping[str, Any], key: str) -> str | None:
    """The text of `tokenizer.ggml.<key>_token_id`, None when absent or out of range."""
    token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of every byte, which byte-level vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping
