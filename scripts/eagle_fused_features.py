"""EAGLE-3's fused features, tried: a head reading the target's low, middle and last layers against
one reading the last layer alone, trained side by side on the same replies (same seed, batches and
steps, depth-3 chains as `train_eagle.py` trains them), compared on held-out agreement per chain step.

Drafted positions have no middle layers (the head predicts only the last), so there the fused head
reads zeros in their place, as EAGLE-3's head reads its own output. The replies and last-layer
features come from a file `train_eagle.py --data` wrote; the other layers' outputs are computed
once into `--layers-file`. The run in docs/speculative.md ran the two modes as two processes at
once, one thread each:

    python scripts/eagle_fused_features.py --data eagle_data_3888.pt --mode last &
    python scripts/eagle_fused_features.py --data eagle_data_3888.pt --mode fused
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_eagle import Replies, chain_loss, train_head  # noqa: E402

from kvgen import LLM  # noqa: E402
from kvgen.kv.contiguous import ContiguousCache  # noqa: E402
from kvgen.kv.interface import CacheSpec  # noqa: E402
from kvgen.speculative.eagle import draft_head_rows  # noqa: E402
from kvgen.speculative.eagle_head import EagleHead, rms  # noqa: E402


class FusedHead(EagleHead):
    """The EAGLE head with `groups` target layers (the last one last) and the token embedding mapped
    into its residual stream; its residual and feature loss are the last layer's."""

    def __init__(self, groups: int, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.groups = groups
        self.fc = nn.Linear((groups + 1) * self.hidden_size, self.hidden_size, bias=False)
        self.scales = nn.Parameter(torch.ones(groups + 1, self.hidden_size))

    def stream_input(self, features: torch.Tensor, token_embeddings: torch.Tensor) -> torch.Tensor:
        if features.shape[-1] == self.hidden_size and self.groups > 1:  # a drafted feature: the last layer's only
            features = torch.cat([features.new_zeros(*features.shape[:-1], (self.groups - 1) * self.hidden_size),
                                  features], -1)  # fmt: skip
        parts = torch.cat([features, token_embeddings], -1).unflatten(-1, (self.groups + 1, self.hidden_size))
        return (rms(parts) * self.scales).flatten(-2)

    def finish(self, features: torch.Tensor, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        return super().finish(features[..., -self.hidden_size :], x, attended)


@torch.inference_mode()
def layer_outputs(llm: LLM, tokens: torch.Tensor, spans: list[tuple[int, int]], layers: list[int]) -> torch.Tensor:
    """The outputs of blocks `layers` at every row of the data file: [N, len(layers) * H]."""
    model, hidden = llm.model, llm.model.config.hidden_size
    out = torch.zeros(len(tokens), len(layers) * hidden)
    start = 0
    for _, end in spans:  # each sequence runs from the previous one's end
        ids = tokens[start:end][None]
        for i, layer in enumerate(layers):
            cache = ContiguousCache(CacheSpec.for_model(model.config, model.dtype), ids.shape[1])
            out[start:end, i * hidden : (i + 1) * hidden] = model.hidden_states(ids, cache, num_layers=layer)[0]
        start = end
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="a file train_eagle.py --data wrote")
    parser.add_argument("--layers", default="4,15", help="the other blocks whose outputs the fused head reads")
    parser.add_argument("--layers-file", type=Path, default=None, help="their outputs (computed once; default: "
                        "next to --data)")  # fmt: skip
    parser.add_argument("--mode", choices=("last", "fused"), required=True)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    started = time.perf_counter()
    llm = LLM.load("smollm2", progress=False, weights="q4")
    model, config = llm.model, llm.model.config
    feats, tokens, greedy, spans = torch.load(args.data)
    if args.mode == "fused":
        layers = [int(layer) for layer in args.layers.split(",")]
        path = args.layers_file or args.data.with_name(f"{args.data.stem}-layers-{'-'.join(map(str, layers))}.pt")
        if not path.exists():
            torch.save(layer_outputs(llm, tokens, spans, layers), path)
        feats = torch.cat([torch.load(path), feats], 1)
    train, holdout = spans[:-32], spans[-32:]
    labelled = torch.cat([torch.arange(first + 1, end) for first, end in train])
    counts = torch.bincount(greedy[labelled], minlength=config.vocab_size)
    vocab = counts.argsort(descending=True)[:4096].sort().values
    to_draft = torch.full((config.vocab_size,), -100, dtype=torch.long)
    to_draft[vocab] = torch.arange(len(vocab))
    rows, hidden = draft_head_rows(model, vocab), config.hidden_size
    data = Replies(feats, tokens, greedy, model.embedding_table().float(), to_draft)
    head = FusedHead(feats.shape[1] // hidden, hidden, config.num_heads, config.num_kv_heads, config.head_dim, 1536, vocab)
    depth, weights = 3, [0.5**step for step in range(3)]

    def loss_on(batch: list[tuple[int, int]]) -> tuple[torch.Tensor, list[float]]:
        return chain_loss(head, model.norm, rows, vocab, data.batch(batch, depth), weights)

    train_head(head, loss_on, train, holdout, args.steps, 24, 1e-3, True, started, label=f"{args.mode} ")

if __name__ == "__main__":
    main()
