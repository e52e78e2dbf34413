"""Structured output: token masks from a grammar, computed by llguidance.

`StructuredOutput` says what the text must be (a JSON schema, any JSON object, a regex, a Lark or GBNF
grammar). It is compiled and checked when built, without a tokenizer, so a schema feature llguidance
cannot enforce is a ValueError naming the feature before any generation starts.

`TokenConstraint` is the interface the decode loop (and speculative decoding) uses:

    mask = constraint.allowed_mask(vocab_size)   # bool [V]: which tokens may come next
    ok = constraint.advance(token)                # consume a sampled token (False: it was not allowed)
    constraint.rollback(n)                        # undo the last n advances (rejected draft tokens)
    constraint.is_finished()                      # the grammar can take nothing more: stop
    constraint.fork()                             # an independent copy (n samples per prompt)

`GrammarConstraint` implements it over an `llguidance.LLMatcher`. The mask for the next step can be
computed on a worker thread while the model's forward pass runs (`prefetch()`); llguidance releases
the GIL while it computes, so the two overlap.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Protocol
from weakref import WeakKeyDictionary

import llguidance
import torch

from kvgen.loading.tokenizer import Tokenizer

StructuredKind = Literal["json_schema", "json_object", "regex", "lark", "gbnf"]
STRUCTURED_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "lark", "gbnf")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text. `spec` is a schema (dict or JSON text) for json_schema, a
    pattern for regex, grammar text for lark / gbnf, and unused for json_object."""

    kind: StructuredKind
    spec: Any = None

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind {self.kind!r} is unknown; choose one of {', '.join(STRUCTURED_KINDS)}")
        object.__setattr__(self, "_grammar", self._compile())

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> "StructuredOutput":
        return cls("json_schema", schema)

    @classmethod
    def json_object(cls) -> "StructuredOutput":
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "StructuredOutput":
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> "StructuredOutput":
        return cls("lark", grammar)

    @classmethod
    def gbnf(cls, grammar: str) -> "StructuredOutput":
        return cls("gbnf", grammar)

    @property
    def grammar(self) -> str:
        """The llguidance grammar (JSON text) this compiles to."""
        return self._grammar  # type: ignore[attr-defined]

    def _compile(self) -> str:
        if self.kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        elif self.kind == "json_schema":
            grammar = self._compile_schema()
        else:
            if not isinstance(self.spec, str) or not self.spec.strip():
                raise ValueError(f"structured output {self.kind}: give the {self.kind} text as a non-empty string")
            # grammar_from converts GBNF (llama.cpp grammars) to Lark itself.
            grammar = llguidance.grammar_from("gbnf" if self.kind == "gbnf" else self.kind, self.spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            raise ValueError(f"structured output {self.kind} cannot be enforced: {messages[0]}")
        return grammar

    def _compile_schema(self) -> str:
        schema = self.spec
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"structured output json_schema: the schema is not valid JSON ({error})") from error
        if not isinstance(schema, dict):
            raise ValueError(f"structured output json_schema: the schema must be a JSON object, got {type(schema).__name__}")
        # Compact separators: the model writes {"a":1}, no free whitespace it could loop on.
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


class TokenConstraint(Protocol):
    """Which tokens may come next; see the module docstring."""

    def allowed_mask(self, vocab_size: int) -> torch.Tensor: ...
    def advance(self, token_id: int) -> bool: ...
    def rollback(self, num_tokens: int) -> None: ...
    def is_finished(self) -> bool: ...
    def fork(self) -> "TokenConstraint": ...


_llg_tokenizers: "WeakKeyDictionary[Tokenizer, llguidance.LLTokenizer]" = WeakKeyDictionary()
_llg_lock = threading.Lock()
# Mask computation overlaps the forward pass; a few workers so concurrent sessions do not queue.
# Off by default: measured on a 2-core machine, a mask thread running beside the forward pass slowed
# the OpenMP decode kernels far more than the mask costs (benchmarks/structured.py --overlap).
OVERLAP_MASK = False
_mask_workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvgen-grammar-mask")


def llg_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of a kvgen tokenizer (built once per tokenizer, ~0.2 s)."""
    with _llg_lock:
        if tokenizer not in _llg_tokenizers:
            _llg_tokenizers[tokenizer] = llguidance.LLTokenizer(
                tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=list(tokenizer.eos_token_ids)
            )
        return _llg_tokenizers[tokenizer]


class GrammarConstraint:
    """A TokenConstraint over an llguidance matcher (one per request). Not shared between threads;
    its own worker thread and the caller take turns on the matcher (`_settle`)."""

    def __init__(self, matcher: llguidance.LLMatcher, num_words: int):
        self.matcher = matcher
        self.num_words = num_words  # 32-bit words in the bitmask
        self._bitmask = torch.zeros(num_words, dtype=torch.int32)
        self._bit_positions = torch.arange(32, dtype=torch.int32)
        self._pending: Future[None] | None = None
        self._mask_ready = False  # the bitmask is for the matcher's current state

    @classmethod
    def create(cls, output: StructuredOutput, tokenizer: Tokenizer) -> "GrammarConstraint":
        ll_tokenizer = llg_tokenizer(tokenizer)
        matcher = llguidance.LLMatcher(ll_tokenizer, output.grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured output {output.kind} cannot be enforced: {matcher.get_error()}")
        return cls(matcher, (ll_tokenizer.vocab_size + 31) // 32)

    def prefetch(self) -> None:
        """Start computing the next mask on a worker thread (call right after advance)."""
        if OVERLAP_MASK and not self._mask_ready and self._pending is None:
            self._pending = _mask_workers.submit(self._fill_bitmask)

    def _fill_bitmask(self) -> None:
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.data_ptr(), self.num_words * 4)

    def _settle(self) -> None:
        """Wait for a mask being computed: the matcher may be used by one thread at a time."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
            self._mask_ready = True

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        """bool [vocab_size]: True where the grammar allows the token (ids past the tokenizer's
        vocabulary, such as padding rows of the embedding, are never allowed)."""
        self._settle()
        if not self._mask_ready:
            self._fill_bitmask()
            self._mask_ready = True
        bits = (self._bitmask.unsqueeze(-1) >> self._bit_positions) & 1  # [W, 32]
        allowed = bits.view(-1).bool()
        if allowed.numel() >= vocab_size:
            return allowed[:vocab_size]
        return torch.cat([allowed, torch.zeros(vocab_size - allowed.numel(), dtype=torch.bool)])

    def advance(self, token_id: int) -> bool:
        self._leave_state()
        return self.matcher.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self._leave_state()
        if not self.matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll the grammar back by {num_tokens} tokens: {self.matcher.get_error()}")

    def is_finished(self) -> bool:
        self._settle()
        return self.matcher.is_stopped()

    def is_accepting(self) -> bool:
        self._settle()
        return self.matcher.is_accepting()

    def error(self) -> str:
        self._settle()
        return self.matcher.get_error()

    def fork(self) -> "GrammarConstraint":
        self._settle()
        return GrammarConstraint(self.matcher.deep_copy(), self.num_words)

    def _leave_state(self) -> None:
        self._settle()
        self._mask_ready = False
