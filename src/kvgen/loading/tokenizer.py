"""Text <-> token ids, chat templates and streaming detokenization.

One `Tokenizer` whether the model came as a GGUF (vocabulary rebuilt from metadata, see
`gguf_tokenizer`) or as a Hugging Face folder (tokenizer.json). It decides BOS/EOS itself so the two
sources behave alike, and knows every token id that should stop generation.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as Backend

from kvgen.errors import ModelLoadError
from kvgen.loading.gguf_tokenizer import TOKEN_TYPE_CONTROL, build_gguf_backend, gguf_tokens, token_types

REPLACEMENT_CHAR = "\ufffd"

# Tokens that end a turn or a document, by the names llama.cpp recognises as end-of-generation
# (llama-vocab.cpp); they stop generation when the vocabulary has them as special/control tokens.
END_OF_GENERATION_TOKENS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
)

# The harmony format (gpt-oss) ends a message with <|end|> and goes on with the next one; only
# <|return|> (the final answer) and <|call|> (a tool call) end generation, as in llama.cpp.
HARMONY_MARKERS = ("<|channel|>", "<|message|>", "<|return|>", "<|call|>")


def end_of_generation_ids(declared: list[int | None], special: Mapping[str, int]) -> list[int]:
    """The ids that end generation: those the model declares (EOS, EOT, EOM, generation_config) and
    the vocabulary's special end-of-turn tokens; a harmony vocabulary's <|end|> is not one of them."""
    ids = [i for i in declared if i is not None]
    ids += [special[name] for name in END_OF_GENERATION_TOKENS if name in special]
    if all(marker in special for marker in HARMONY_MARKERS) and "<|end|>" in special:
        ids = [i for i in ids if i != special["<|end|>"]]
    return list(dict.fromkeys(ids))


# Gemma 3's chat template, verbatim (google/gemma-3-*-it tokenizer_config.json). Gemma 3 GGUFs
# often ship without one; the system message is folded into the first user turn, as Gemma has no system role.
GEMMA_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


class Tokenizer:
    """A `tokenizers` backend plus the BOS/EOS policy and chat template of one model."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        pad_token_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
        backend_adds_special_tokens: bool = False,
    ) -> None:
        self._backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self._pad_token_id = pad_token_id
        self._add_bos = add_bos and bos_token_id is not None
        self._add_eos = add_eos and bool(self._eos_token_ids)
        self._chat_template = chat_template or None
        # True when tokenizer.json's post-processor adds BOS/EOS itself: we then let it, never twice.
        self._backend_adds_special_tokens = backend_adds_special_tokens
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], architecture: str) -> Tokenizer:
        """Build from a GGUF's metadata (key -> value as gguf-py's `contents()` gives it)."""
        tokens = gguf_tokens(metadata)
        backend = build_gguf_backend(metadata, architecture, tokens)
        types = token_types(metadata, len(tokens))
        control = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind == TOKEN_TYPE_CONTROL}
        eos_ids = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        eos_ids = end_of_generation_ids(eos_ids, control)
        template = metadata.get("tokenizer.chat_template") or None
        if template is None and "<start_of_turn>" in tokens:
            template = GEMMA_CHAT_TEMPLATE
        # Sentencepiece files that do not say otherwise want BOS (llama.cpp's and transformers' default).
        bos_default = metadata.get("tokenizer.ggml.model") == "llama"
        return cls(
            backend,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", bos_default)),
            add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=template,
        )

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        """Build from a Hugging Face model folder (tokenizer.json, tokenizer_config.json, ...)."""
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(
                f"{folder} has no tokenizer.json; kvgen needs the fast-tokenizer file. Download it with the "
                "model, or save one with transformers' `AutoTokenizer.from_pretrained(...).save_pretrained(folder)`."
            )
        try:
            backend = Backend.from_file(str(tokenizer_file))
        except Exception as error:  # the tokenizers library raises a bare Exception on a bad file
            raise ModelLoadError(
                f"{tokenizer_file} could not be read as a tokenizers file ({error}); re-download it."
            ) from error
        config = _tokenizer_config(folder)

        def token_id(name: str) -> int | None:
            text = _token_text(config.get(name))
            return backend.token_to_id(text) if text is not None else None

        eos_ids = [token_id("eos_token"), *_generation_eos_ids(folder)]
        added = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        eos_ids = end_of_generation_ids(eos_ids, added)
        explicit = "add_bos_token" in config or "add_eos_token" in config
        processor = backend.post_processor
        return cls(
            backend,
            bos_token_id=token_id("bos_token"),
            eos_token_ids=eos_ids,
            pad_token_id=token_id("pad_token"),
            add_bos=bool(config.get("add_bos_token", False)),
            add_eos=bool(config.get("add_eos_token", False)),
            chat_template=_hf_chat_template(folder, config),
            # transformers rebuilds the post-processor from explicit add_*_token flags, else keeps the file's.
            backend_adds_special_tokens=(
                not explicit and processor is not None and processor.num_special_tokens_to_add(False) > 0
            ),
        )

    # ----------------------------------------------------------------- properties

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the embedding table may be larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: EOS plus end-of-turn tokens the vocabulary marks special."""
        return self._eos_token_ids

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_token_id

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def backend(self) -> Backend:
        """The underlying `tokenizers.Tokenizer`, for callers that need offsets or batching."""
        return self._backend

    # ----------------------------------------------------------------- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; special-token strings in it ("<|im_start|>") become their single id.

        With `add_special_tokens`, BOS (and EOS) are added when the model wants them. A prompt made by
        `apply_chat_template` usually has BOS already: encode it with `add_special_tokens=False`.
        """
        if self._backend_adds_special_tokens:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self._add_bos:
            ids.insert(0, self._bos_token_id)  # type: ignore[arg-type]
        if add_special_tokens and self._add_eos:
            ids.append(self._eos_token_ids[0])
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; special tokens (BOS, <|im_end|>, ...) dropped unless asked for."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The raw vocabulary string of one id ("Ġthe", "▁the", "<0x0A>"), not its text."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            raise IndexError(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        return piece

    token_to_piece = id_to_token

    def is_special(self, token_id: int) -> bool:
        """Whether decode drops this id when skipping special tokens."""
        return token_id in self._special_ids

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A streaming decoder for one generated sequence."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------- chat

    def with_chat_template(self, source: str) -> Tokenizer:
        """The same tokenizer with another chat template (Jinja source, checked to compile)."""
        try:
            _compile_template(source)
        except jinja2.TemplateError as error:
            raise ValueError(f"the chat template does not compile: {error}") from error
        twin = copy.copy(self)
        twin._chat_template = source
        return twin

    def chat_template_reads(self, name: str) -> bool:
        """Whether the chat template names the variable `name` (so passing it can change the prompt)."""
        return self._chat_template is not None and re.search(rf"\b{re.escape(name)}\b", self._chat_template) is not None

    @property
    def chat_template_supports_tools(self) -> bool:
        """Whether the chat template renders a `tools` list (else callers describe tools themselves)."""
        return self._chat_template is not None and "tools" in self._chat_template

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False, **template_kwargs: Any,
    ) -> str:
        """The prompt text for a conversation, rendered with the model's own chat template (`tools`
        in the OpenAI/transformers form, for templates that render them). `template_kwargs` are
        further variables the template reads (`enable_thinking`, `reasoning_effort`); one the
        template never names is a ValueError, as it would change nothing.

        continue_final_message: the prompt ends inside the last message, right after its text (its
        end-of-turn cut off, as transformers does), so that generation continues it: a reply begun
        for the model ("{" for JSON, "Sure, here is"). It needs add_generation_prompt=False."""
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message continues the last message; it cannot also open a new turn "
                                 "(add_generation_prompt)")  # fmt: skip
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str) or not final.strip():
                raise ValueError("continue_final_message needs a last message with text to continue")
            text = self.apply_chat_template(messages, False, tools, **template_kwargs)
            if final.strip() not in text:
                raise ValueError("continue_final_message: the chat template does not write the last message's text "
                                 "as it is, so the prompt cannot end inside it")  # fmt: skip
            return text[: text.rindex(final.strip()) + len(final.strip())]
        unread = [name for name in template_kwargs if not self.chat_template_reads(name)]
        if unread:
            raise ValueError(f"the model's chat template does not use {', '.join(map(repr, unread))}: leave it out")
        if self._chat_template is None:
            raise ValueError(
                "this model has no chat template, so a conversation cannot be formatted for it; "
                "pass a plain text prompt instead."
            )
        try:
            return _compile_template(self._chat_template).render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=None,
                **self._special_token_texts(),
                **template_kwargs,
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"the model's chat template rejected the conversation: {error}") from error

    def _special_token_texts(self) -> dict[str, str | None]:
        """bos_token/eos_token/pad_token strings, which templates write into the prompt."""

        def text(token_id: int | None) -> str | None:
            return self._backend.id_to_token(token_id) if token_id is not None else None

        eos = self._eos_token_ids[0] if self._eos_token_ids else None
        return {"bos_token": text(self._bos_token_id), "eos_token": text(eos), "pad_token": text(self._pad_token_id)}


class IncrementalDetokenizer:
    """Turns generated ids into text as they arrive, never splitting a character.

    Decodes only a short trailing window (vLLM's prefix/read offsets): text before `read_offset` has
    been returned, `prefix_offset..read_offset` is context so that spacing and byte merging decode as
    in the full sequence. Text ending in U+FFFD is an incomplete UTF-8 character and is held back.
    Concatenating every `add()` plus `flush()` equals `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""

    def add(self, token_id: int) -> str:
        """Take one more id; return the text that is now final (often "", never half a character)."""
        # decode() drops skipped specials before its decoders run, so dropping them here keeps the window
        # identical to the full sequence and never leaves a window that starts on invisible tokens.
        if self._skip_special_tokens and self._tokenizer.is_special(token_id):
            return ""
        self._ids.append(token_id)
        text = self._window_text()
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character decodes as U+FFFD, as decode does)."""
        if self._read_offset == len(self._ids):
            return ""
        return self._advance(self._window_text())

    def _window_text(self) -> str:
        return self._decode(self._ids[self._prefix_offset :])

    def _advance(self, text: str) -> str:
        new_text = text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return new_text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


# --------------------------------------------------------------------- HF folder helpers


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, {} when absent; a broken one is a load error naming the file."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"{path} is not valid JSON ({error}); re-download it.") from error
    return value if isinstance(value, dict) else {}


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json, with special tokens older saves kept in special_tokens_map.json filled in."""
    config = _read_json(folder / "tokenizer_config.json")
    specials = _read_json(folder / "special_tokens_map.json")
    return {**specials, **{k: v for k, v in config.items() if v is not None or k not in specials}}


def _token_text(value: Any) -> str | None:
    """A token as tokenizer_config.json writes it: a string or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _generation_eos_ids(folder: Path) -> list[int]:
    """generation_config.json's eos_token_id (an int or a list): what the model was tuned to stop on."""
    value = _read_json(folder / "generation_config.json").get("eos_token_id")
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _hf_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """The chat template: chat_template.jinja, else chat_template.json, else tokenizer_config.json."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template") or config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) and template else None


# --------------------------------------------------------------------- chat template rendering


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training): render the body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """JSON without jinja's HTML escaping, as transformers renders templates."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template the way transformers does: sandboxed, trim/lstrip blocks, same helpers."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
