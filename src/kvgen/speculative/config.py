"""SpeculativeConfig: a request's opt-in to speculative decoding, validated when built."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from kvgen.config import CacheConfig
from kvgen.kv.interface import KVCache
from kvgen.models.base import DecoderLM
from kvgen.sampling.params import SamplingParams
from kvgen.speculative.adaptive import DraftLengthController

if TYPE_CHECKING:
    from kvgen.speculative.proposer import Proposer


class Generator(Protocol):
    """What a proposer is built from (generate.py's Generator, or the LLMEngine)."""

    model: DecoderLM
    tokenizer: Any
    max_context: int
    cache_config: CacheConfig

Method = Literal["lookup", "self", "draft", "eagle"]
# A verify of k drafts is k + 1 rows of the C rows step, whose linears take 8 rows per tile (4 on
# AVX2): 8 drafts made 9 rows, and the ninth took a tile of its own, unpacking every weight block
# again (~1.7 ms on SmolLM2 against ~0.6-0.8 for each row of a full tile); prompt lookup on quoted
# text ran 4% faster capped at 7 than at 8.
MAX_DRAFT_TOKENS = 7
# A tree verify of k drafts and n alternatives is k + n + 1 rows: up to 4 rows cost ~15% more than
# one on SmolLM2 q4 (2 cores, AVX-512), each further row ~10% more.
MAX_DRAFT_ALTERNATIVES = 3
METHODS = ("lookup", "self", "draft", "eagle")
# The first draft length where the request leaves it unset. EAGLE drafts one token a step: in
# in-process turns on SmolLM2 (2-core EPYC, `benchmarks/eagle_trees.py`) one-token drafts without
# alternatives beat the controller growing from four with one alternative on chat, open-ended and
# quoted text alike (the head's second draft is right ~0.35-0.58 of the time given the first, and a
# verify row beyond the second costs 0.1-0.3 of a plain step, so longer drafts roughly break even
# while their failures paused drafting).
DEFAULT_DRAFT_TOKENS = 4
EAGLE_DRAFT_TOKENS = 1


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: lookup (n-gram match in the context), self (the target's first `draft_layers` layers),
    draft (a separate model with the same tokenizer: `draft_model`, an LLM or DecoderLM), eagle (a
    small head over the target's last hidden state; `eagle_weights` or the shipped SmolLM2 head).

    `num_draft_tokens` is the first draft length; with `adaptive` it then moves within
    [min_draft_tokens, max_draft_tokens] with the rolling acceptance rate. Unset: 4, up to
    MAX_DRAFT_TOKENS (7) or num_draft_tokens if larger; for eagle with both unset, one-token drafts
    (1, up to 1), where adaptive still pauses drafting on text where they fail.

    `prediction` (lookup): the expected output, as text or token ids. Drafts come from it first
    (where the output last followed it), then from the context; the output is unchanged, and the
    more of it matches the prediction the fewer steps it takes.

    `draft_alternatives` (eagle): the head's runner-up first tokens, verified in the same forward
    as leaves beside the drafted chain (a token tree, as EAGLE-2 and SpecInfer verify); where the
    chain's first token is rejected and the target picks one of them, that step still yields two
    tokens. Greedy requests without a grammar only (rejection sampling over a tree needs
    multi-draft rules), and only where the C rows step reads an fp32 K/V layout (quantized
    weights). None or 0: the chain alone (one more verify row paid for itself in some spells of the
    2-core machine and not in others); set where it cannot apply, the request is refused."""

    method: Method = "lookup"
    num_draft_tokens: int | None = None  # None: EAGLE_DRAFT_TOKENS for eagle, else DEFAULT_DRAFT_TOKENS
    min_draft_tokens: int = 1
    max_draft_tokens: int | None = None  # None: max(MAX_DRAFT_TOKENS, num_draft_tokens); eagle's default 1
    adaptive: bool = True
    draft_model: Any = None  # kvgen LLM or DecoderLM, for method "draft"
    draft_layers: int | None = None  # for method "self"; default: half the target's layers
    max_ngram: int = 3  # for method "lookup"
    min_ngram: int = 1
    eagle_weights: str | Path | None = None  # for method "eagle"; default: the shipped head
    draft_alternatives: int | None = None  # for method "eagle"
    # For method "lookup": what the output is expected to be (text, or token ids), searched for
    # drafts before the context (OpenAI's Predicted Outputs: the file being edited).
    prediction: str | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of {', '.join(METHODS)}")
        one_token = self.method == "eagle" and self.num_draft_tokens is None and self.max_draft_tokens is None
        if self.num_draft_tokens is None:
            first = EAGLE_DRAFT_TOKENS if self.method == "eagle" else DEFAULT_DRAFT_TOKENS
            object.__setattr__(self, "num_draft_tokens", min(first, self.max_draft_tokens or first))
        if self.max_draft_tokens is None:
            longest = self.num_draft_tokens if one_token else max(MAX_DRAFT_TOKENS, self.num_draft_tokens)
            object.__setattr__(self, "max_draft_tokens", longest)
        if not 1 <= self.min_draft_tokens <= self.num_draft_tokens <= self.max_draft_tokens:
            raise ValueError(
                "need 1 <= min_draft_tokens <= num_draft_tokens <= max_draft_tokens, got "
                f"{self.min_draft_tokens}, {self.num_draft_tokens}, {self.max_draft_tokens}"
            )
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("method 'draft' needs draft_model: a kvgen LLM (or DecoderLM) sharing the target's tokenizer")
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError(f"draft_model is only used by method 'draft', not {self.method!r}")
        if self.method != "self" and self.draft_layers is not None:
            raise ValueError(f"draft_layers is only used by method 'self', not {self.method!r}")
        if self.method != "eagle" and self.eagle_weights is not None:
            raise ValueError(f"eagle_weights is only used by method 'eagle', not {self.method!r}")
        if self.prediction is not None:
            if self.method != "lookup":
                raise ValueError(f"prediction is searched for drafts by method 'lookup', not {self.method!r}: "
                                 "use method 'lookup' with a prediction")  # fmt: skip
            if not isinstance(self.prediction, str):
                ids = tuple(self.prediction)
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError("prediction must be text or a sequence of token ids (ints)")
                object.__setattr__(self, "prediction", ids)
        if self.draft_alternatives is not None:
            if self.method != "eagle":
                raise ValueError(f"draft_alternatives is only used by method 'eagle', not {self.method!r}")
            if not 0 <= self.draft_alternatives <= MAX_DRAFT_ALTERNATIVES:
                raise ValueError(f"draft_alternatives must be in [0, {MAX_DRAFT_ALTERNATIVES}], "
                                 f"got {self.draft_alternatives}")  # fmt: skip

    def alternatives_for(self, params: SamplingParams, model: DecoderLM, cache: KVCache) -> int:
        """How many alternatives a request's drafts carry: 0 unless it is greedy without a grammar
        and the target verifies trees over its cache (`DecoderLM.verifies_trees`). Raises ValueError
        where draft_alternatives was asked for a request that cannot have them."""
        if self.method != "eagle":
            return 0
        verifies_trees = model.verifies_trees(cache)
        if params.greedy and params.structured is None and verifies_trees:
            return self.draft_alternatives or 0
        if self.draft_alternatives and not verifies_trees:
            raise ValueError("draft_alternatives are verified as a token tree by the C rows step over fp32 keys and "
                             "values (quantized weights, an fp32 K/V cache), which this model or cache does not run: "
                             "leave draft_alternatives unset or at 0")  # fmt: skip
        if self.draft_alternatives:
            raise ValueError("draft_alternatives are verified for greedy requests without a grammar (temperature 0, no "
                             "response format): leave draft_alternatives unset or at 0 for this request")  # fmt: skip
        return 0

    def new_controller(self) -> DraftLengthController:
        """A fresh draft-length controller for one request, starting at num_draft_tokens."""
        return DraftLengthController(self.num_draft_tokens, self.min_draft_tokens, self.max_draft_tokens, self.adaptive)

    def check_cache(self, cache: CacheConfig) -> None:
        """Rejected drafts are rolled back with truncate: the cache must be able to rewind that far."""
        if cache.kind == "sinks":
            raise ValueError("speculative decoding needs a cache that can rewind; a sinks cache cannot once it evicts: "
                             "use the window cache with extra >= max_draft_tokens instead")  # fmt: skip
        if cache.kind in ("window", "chunked") and cache.extra < self.max_draft_tokens:
            raise ValueError(
                f"a {cache.kind} cache rewinds exactly only up to `extra` ({cache.extra}) tokens, and drafts "
                f"of up to {self.max_draft_tokens} may be rejected: set extra >= {self.max_draft_tokens} (--kv-extra)"
            )

    def check_target(self, model: Any) -> None:
        """ValueError where this method cannot draft for `model`. A model that keeps its own state
        (Mamba, Mamba-2, the hybrids) verifies a draft in one pass that keeps its state after every
        position, and rolls back to the last accepted one; prompt lookup and a separate draft model
        (one with a KV cache) need nothing more, while the layer-skip draft reads the target's own
        first layers' keys and values and EAGLE its hidden features, which these models do not give."""
        if not hasattr(model, "new_state_cache"):
            return
        if self.method in ("self", "eagle"):
            raise ValueError(f"speculative method {self.method!r} reads the target's {'KV cache' if self.method == 'self' else 'features'}, "
                             f"which a {model.config.architecture} model does not keep: use method 'lookup' or 'draft'")  # fmt: skip
        draft = getattr(self.draft_model, "model", self.draft_model)
        if self.method == "draft" and hasattr(draft, "new_state_cache"):
            raise ValueError(f"a draft model rolls its own cache back by truncate, which a {draft.config.architecture} draft "
                             "cannot: draft with a model that keeps a KV cache")  # fmt: skip

    def check_adapter(self, adapter: str | None) -> None:
        """ValueError where this method cannot draft for a request under LoRA adapter `adapter`.
        The verify runs under the adapter, so the output stays exactly the adapter's; prompt lookup
        and a separate draft model draft from the text, while the layer-skip draft and EAGLE draft
        from the base model's own layers and features, which the adapter changes."""
        if adapter is not None and self.method in ("self", "eagle"):
            raise ValueError(f"speculative method {self.method!r} drafts from the base model's own "
                             f"{'layers' if self.method == 'self' else 'features'}, not adapter {adapter!r}'s: "
                             "with a LoRA adapter use method 'lookup' or 'draft'")  # fmt: skip

    def prediction_ids(self, generator: "Generator") -> list[int]:
        """The prediction as the target's token ids (none: empty); ids out of its vocabulary are
        refused."""
        if self.prediction is None:
            return []
        if isinstance(self.prediction, str):
            return generator.tokenizer.encode(self.prediction, add_special_tokens=False)
        vocab = generator.model.config.vocab_size
        if bad := [t for t in self.prediction if not 0 <= t < vocab]:
            raise ValueError(f"prediction token id {bad[0]} is not in this model's vocabulary (0..{vocab - 1})")
        return list(self.prediction)

    def build_proposer(self, generator: "Generator") -> "Proposer":
        """A fresh proposer for one request on `generator`'s model (proposers hold per-request state)."""
        self.check_cache(generator.cache_config)
        model, max_context = generator.model, generator.max_context
        if self.method == "lookup":
            from kvgen.speculative.prompt_lookup import PromptLookupProposer

            return PromptLookupProposer(self.max_ngram, self.min_ngram, self.prediction_ids(generator))
        if self.method == "self":
            from kvgen.speculative.self_draft import SelfDraftProposer

            return SelfDraftProposer(model, self.draft_layers or model.config.num_layers // 2, max_context)
        if self.method == "draft":
            from kvgen.speculative.draft_model import DraftModelProposer, check_same_vocabulary

            draft = getattr(self.draft_model, "model", self.draft_model)  # an LLM carries .model and .tokenizer
            if draft.config.vocab_size != model.config.vocab_size:
                raise ValueError(
                    f"the draft model's vocabulary has {draft.config.vocab_size} tokens, the target's "
                    f"{model.config.vocab_size}: a draft model must share the target's tokenizer"
                )
            if hasattr(self.draft_model, "tokenizer"):
                check_same_vocabulary(generator.tokenizer, self.draft_model.tokenizer)
            return DraftModelProposer(draft, max_context)
        from kvgen.speculative.eagle import eagle_proposer

        return eagle_proposer(model, self.eagle_weights)
