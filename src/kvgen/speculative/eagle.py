"""EAGLE-style drafting: a head predicts the target's next last-layer feature, the target's own
norm and output rows turn it into a draft token.

The head (eagle_head.py: one decoder layer over the reply's features) maps the target's last block
output f_t and the embedding of the token x_{t+1} chosen after it to f_{t+1}; the target's final norm
and the rows of its LM head for a **draft vocabulary** (the few thousand tokens the target emits most
often, as in EAGLE-3) turn that into draft logits; drafting k tokens chains the head on its own
predicted features (EAGLE, Li et al. 2024). A draft token costs the head's layer and a small matrix
product instead of the target; verification still scores the full vocabulary, so output is exact
whatever the head drafts. `scripts/train_eagle.py` trains it on SmolLM2's own greedy chat replies.
"""

from __future__ import annotations

import time
import weakref
from pathlib import Path

import torch
from torch import nn

from kvgen.kernels.formats import QuantizedWeight, requantize
from kvgen.models.base import DecoderLM
from kvgen.models.half_linear import C_STEP_LINEARS
from kvgen.models.quantized_linear import QuantizedLinear
from kvgen.sampling.grammar import TokenConstraint
from kvgen.sampling.sampler import argmax
from kvgen.speculative.eagle_fast import FastDraftLogits, FastHeadCache, FastHeadWeights
from kvgen.speculative.eagle_head import SHAPE, EagleHead, HeadCache
from kvgen.speculative.proposer import Draft, DraftedPath, DraftPolicy, Proposer, can_extend, mask_logits

SHIPPED_WEIGHTS = Path(__file__).parent / "weights" / "eagle_smollm2.safetensors"


def draft_head_rows(model: DecoderLM, vocab: torch.Tensor) -> torch.Tensor:
    """The target's LM head rows for `vocab`, [N, H] fp32 (a quantized or 16-bit head widened once)."""
    head = model.lm_head
    weight = head.dequantized() if isinstance(head, C_STEP_LINEARS) else head.weight
    return weight[vocab].float().contiguous()


def draft_projection_weight(model: DecoderLM, vocab: torch.Tensor) -> QuantizedWeight | torch.Tensor:
    """The LM head restricted to `vocab`: for a quantized or 16-bit target head (whose decode steps
    run in C) its rows requantized to 8 bits (exact for Q8_0 rows), for the same C kernel, a twelfth
    of the full head's bytes at 4,096 rows; an fp32 head's rows as they are. Drafts only propose:
    the target's verify keeps the output exact either way."""
    rows = draft_head_rows(model, vocab)
    return requantize(rows, "q8s") if _c_target(model) else rows


def _c_target(model: DecoderLM) -> bool:
    """Whether the target's head is quantized or 16-bit: its steps run in C, and so does the head's."""
    return isinstance(model.lm_head, C_STEP_LINEARS)


def draft_projection(weight: QuantizedWeight | torch.Tensor) -> nn.Module:
    if isinstance(weight, QuantizedWeight):
        return QuantizedLinear(weight)  # its own scratch buffer: proposers may run in several threads
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight
    return linear.requires_grad_(False)


# Per model and weight file: the loaded head, its draft rows and, for a quantized target, the head's
# 8-bit linears for the C step. Building them dequantizes the whole output head (~0.3 s on 2 cores);
# a request must not pay that (shared read-only; keyed on the file's modification time, so a
# retrained head is read again).
_Loaded = tuple[EagleHead, QuantizedWeight | torch.Tensor, FastHeadWeights | None]
_loaded: "weakref.WeakKeyDictionary[DecoderLM, dict[tuple[str, int], _Loaded]]" = weakref.WeakKeyDictionary()


def eagle_proposer(model: DecoderLM, path: str | Path | None) -> "EagleProposer":
    """A fresh proposer (its own feature state) over the head at `path` (None: the shipped one)."""
    path = Path(path) if path is not None else SHIPPED_WEIGHTS
    key = (str(path.resolve()), path.stat().st_mtime_ns if path.exists() else -1)
    per_model = _loaded.setdefault(model, {})
    if key not in per_model:
        head = load_eagle_head(path, model)
        # On a quantized target the head's layer runs the C decode step over 8-bit linears: a
        # draft token then reads ~4 MB of head weights instead of ~17 MB in fp32.
        fast = FastHeadWeights(head) if _c_target(model) else None
        per_model[key] = head, draft_projection_weight(model, head.draft_vocab), fast
    head, weight, fast = per_model[key]
    return EagleProposer(model, head, weight, fast)


def save_eagle_head(head: EagleHead, path: Path, model_name: str) -> None:
    from safetensors.torch import save_file

    tensors = {name: t.detach().half().contiguous() for name, t in head.state_dict().items() if name != "draft_vocab"}
    tensors["draft_vocab"] = head.draft_vocab.int().contiguous()
    metadata = {name: str(value) for name, value in head.shape().items()} | {"model": model_name}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)


def load_eagle_head(path: str | Path | None, model: DecoderLM) -> EagleHead:
    from safetensors import safe_open

    path = Path(path) if path is not None else SHIPPED_WEIGHTS
    if not path.exists():
        raise ValueError(f"no EAGLE head at {path}: train one with `make eagle` (scripts/train_eagle.py)")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    hidden = int(meta.get("hidden_size", 0))
    if hidden != model.config.hidden_size:
        raise ValueError(
            f"the EAGLE head at {path} was trained for hidden size {hidden} ({meta.get('model', '?')}), but the "
            f"target's is {model.config.hidden_size}: train a head for this model with scripts/train_eagle.py"
        )
    if "draft_vocab" not in tensors:
        raise ValueError(f"the EAGLE head at {path} has no draft vocabulary: retrain it with scripts/train_eagle.py")
    vocab = tensors.pop("draft_vocab").long()
    if len(vocab) == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= model.config.vocab_size:
        raise ValueError(f"the EAGLE head at {path} drafts token ids outside the target's vocabulary")
    if "fc.weight" not in tensors:
        raise ValueError(f"the EAGLE head at {path} is not a one-layer head: retrain it with scripts/train_eagle.py")
    missing = [name for name in SHAPE if name not in meta]
    if missing:
        raise ValueError(f"the EAGLE head at {path} does not record its {', '.join(missing)}: retrain it with "
                         "scripts/train_eagle.py")  # fmt: skip
    head = EagleHead(**{name: int(meta[name]) for name in SHAPE}, draft_vocab=vocab)
    head.load_state_dict({name: t.float() for name, t in tensors.items()} | {"draft_vocab": vocab})
    return head.eval().requires_grad_(False)


class EagleProposer(Proposer):
    """Drafts by chaining the head. It keeps the head's keys and values for the reply so far: the
    positions the target has committed enter with the target's own features (handed over after each
    target forward), the drafted ones with the head's predictions, dropped at the next draft."""

    needs_target_features = True

    def __init__(self, model: DecoderLM, head: EagleHead, projection: QuantizedWeight | torch.Tensor | None = None,
                 fast: FastHeadWeights | None = None):  # fmt: skip
        self.model, self.head = model, head
        self.vocab = head.draft_vocab
        weight = projection if projection is not None else draft_projection_weight(model, self.vocab)
        self.project = draft_projection(weight)  # [H] -> [N]
        # On a quantized target the final norm and the draft rows run as one C call.
        self._fast_logits = FastDraftLogits.build(model.norm, self.project)
        # committed reply positions, then this draft's
        self.cache = FastHeadCache(fast) if fast is not None else HeadCache(head)
        self._committed = 0  # positions of `cache` that hold the target's features
        self._pending: list[torch.Tensor] = []  # [n, H] committed features not run through the head yet

    def observe_features(self, features: torch.Tensor) -> None:
        self._pending.append(features)  # a reference: a paused proposer costs nothing per step

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Predicted features [1, H] -> logits over the draft vocabulary [N]."""
        if self._fast_logits is not None:
            logits = self._fast_logits(features[0])
        else:
            logits = self.project(self.model.norm(features))[0]
        cap = self.model.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def _pick(
        self, features: torch.Tensor, policy: DraftPolicy, constraint: TokenConstraint | None, runners_up: int = 0,
    ) -> tuple[int, torch.Tensor | None, list[int]] | None:  # fmt: skip
        """-> (token, its distribution or None, up to `runners_up` next-best tokens)."""
        logits = self.draft_logits(features)
        if policy.greedy and constraint is None:
            if runners_up:  # the head's next-best guesses, best first (the verify's leaves)
                best = self.vocab[logits.topk(1 + runners_up).indices].tolist()
                return best[0], None, best[1:]
            return int(self.vocab[argmax(logits)]), None, []
        # Sampling or a grammar: the full vocabulary's logits, -inf outside the draft vocabulary, so
        # q (the draft's distribution) is exactly what the token was drawn from.
        full = torch.full((self.model.config.vocab_size,), float("-inf"))
        full[self.vocab] = logits
        if not torch.isfinite(mask_logits(full, constraint)).any():
            return None  # the grammar allows no draft-vocabulary token here
        return *policy.pick(full, constraint), []

    def propose(self, ids: list[int], num_tokens: int, policy: DraftPolicy, constraint: TokenConstraint | None) -> Draft:
        assert self._pending, "EAGLE drafts from the target's features: observe_features first"
        with torch.inference_mode():
            return self._propose(ids, num_tokens, policy, constraint)

    def _propose(self, ids: list[int], num_tokens: int, policy: DraftPolicy, constraint: TokenConstraint | None) -> Draft:
        # The positions committed since the last draft enter the head with the target's features
        # (the last draft's positions go); the token after each is the id committed after it, the
        # last len(new) ids. The head's output at the last one is the first draft's feature.
        new = torch.cat(self._pending)
        self._pending = []
        self.cache.truncate(self._committed)
        after = self.model.embed_tokens[torch.tensor(ids[len(ids) - len(new) :])].float()
        started = time.perf_counter()
        features = self.cache.run(new, after)[-1:]
        self.catch_up_seconds = time.perf_counter() - started
        self._committed = self.cache.length
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        alternatives: list[int] = []
        with DraftedPath(constraint) as path:
            while len(tokens) < num_tokens and can_extend(constraint):
                if tokens:  # chain on the head's own prediction
                    embedding = self.model.embed_tokens[tokens[-1]][None].float()
                    features = self.cache.run(features, embedding)
                picked = self._pick(features, policy, constraint, 0 if tokens else policy.alternatives)
                if picked is None:
                    break
                token, q, runners_up = picked
                alternatives = alternatives or runners_up
                tokens.append(token)
                if q is not None:
                    probs.append(q)
                if not path.advance(token):
                    break
        return Draft(tokens, torch.stack(probs) if probs else None, alternatives)
