"""EAGLE-style draft head: predicts the target's next last-layer feature from its current one.

Input: the target's last block output f_t at the last cached position and the embedding of the token
x_{t+1} chosen after it. Output: f_{t+1}, which the target's own final norm and LM head turn into draft
logits; drafting k tokens chains the head on its own predicted features (EAGLE, Li et al. 2024).
This head is a residual two-layer MLP (no attention, ~1.8M parameters, shipped in fp16) trained by
`scripts/train_eagle.py` on SmolLM2's features over Shakespeare.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kvgen.models.base import DecoderLM
from kvgen.sampling.grammar import TokenConstraint
from kvgen.speculative.proposer import Draft, DraftedPath, DraftPolicy, Proposer, can_extend

SHIPPED_WEIGHTS = Path(__file__).parent / "weights" / "eagle_smollm2.safetensors"


def rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class EagleHead(nn.Module):
    def __init__(self, hidden_size: int, inner_size: int):
        super().__init__()
        self.hidden_size, self.inner_size = hidden_size, inner_size
        self.feature_scale = nn.Parameter(torch.ones(hidden_size))
        self.token_scale = nn.Parameter(torch.ones(hidden_size))
        self.fc1 = nn.Linear(2 * hidden_size, inner_size)
        self.fc2 = nn.Linear(inner_size, hidden_size)

    def forward(self, features: torch.Tensor, token_embeddings: torch.Tensor) -> torch.Tensor:
        """features, token_embeddings [N, H] -> predicted next features [N, H]."""
        x = torch.cat([rms(features) * self.feature_scale, rms(token_embeddings) * self.token_scale], dim=-1)
        return features + self.fc2(nn.functional.silu(self.fc1(x)))


def save_eagle_head(head: EagleHead, path: Path, model_name: str) -> None:
    from safetensors.torch import save_file

    tensors = {name: t.detach().half().contiguous() for name, t in head.state_dict().items()}
    metadata = {"hidden_size": str(head.hidden_size), "inner_size": str(head.inner_size), "model": model_name}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)


def load_eagle_head(path: str | Path | None, model: DecoderLM) -> EagleHead:
    from safetensors import safe_open

    path = Path(path) if path is not None else SHIPPED_WEIGHTS
    if not path.exists():
        raise ValueError(f"no EAGLE head at {path}: train one with `make eagle` (scripts/train_eagle.py)")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        tensors = {name: f.get_tensor(name).float() for name in f.keys()}
    hidden = int(meta.get("hidden_size", 0))
    if hidden != model.config.hidden_size:
        raise ValueError(
            f"the EAGLE head at {path} was trained for hidden size {hidden} ({meta.get('model', '?')}), but the "
            f"target's is {model.config.hidden_size}: train a head for this model with scripts/train_eagle.py"
        )
    head = EagleHead(hidden, int(meta["inner_size"]))
    head.load_state_dict(tensors)
    return head.eval().requires_grad_(False)


class EagleProposer(Proposer):
    needs_target_features = True

    def __init__(self, model: DecoderLM, head: EagleHead):
        self.model, self.head = model, head
        self._features: torch.Tensor | None = None  # [H], target feature at the last cached position

    def observe_features(self, features: torch.Tensor) -> None:
        self._features = features

    @torch.inference_mode()
    def propose(self, ids: list[int], num_tokens: int, policy: DraftPolicy, constraint: TokenConstraint | None) -> Draft:
        assert self._features is not None, "EAGLE drafts from the target's features: observe_features first"
        features, token = self._features[None], ids[-1]
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        with DraftedPath(constraint) as path:
            while len(tokens) < num_tokens and can_extend(constraint):
                embedding = self.model.embed_tokens[token][None]  # [1, H]
                features = self.head(features, embedding)
                logits = self.model.logits_from_hidden(features)[0]  # [V]
                token, q = policy.pick(logits, constraint)
                tokens.append(token)
                if q is not None:
                    probs.append(q)
                if not path.advance(token):
                    break
        return Draft(tokens, torch.stack(probs) if probs else None)
