"""Train the EAGLE draft head on a target model's own features over Shakespeare (CPU, minutes).

    python scripts/train_eagle.py --model smollm2 --out src/kvgen/speculative/weights/eagle_smollm2.safetensors

1. Run the target (fp32) over a few plays in chunks; keep its last-layer features f_t and its greedy
   next token after every position.
2. Train the head to map (f_t, embedding of x_{t+1}) to f_{t+1}, unrolled over two steps so it also
   learns from its own predictions, with a feature loss (on the normalised features the LM head reads)
   and a cross-entropy on the target's greedy token over the tokens seen in the data.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvgen import LLM  # noqa: E402
from kvgen.kv.contiguous import ContiguousCache  # noqa: E402
from kvgen.kv.interface import CacheSpec  # noqa: E402
from kvgen.speculative.eagle import SHIPPED_WEIGHTS, EagleHead, save_eagle_head  # noqa: E402

PLAYS = ("hamlet", "macbeth", "othello", "romeo_and_juliet", "king_lear", "julius_caesar")


def shakespeare_text(base: Path, max_chars: int) -> str:
    parts = []
    for play in PLAYS:
        found = sorted(base.glob(f"**/shksprdata/texts/{play}_gut.txt"))
        if found:
            text = found[0].read_text(encoding="utf-8", errors="replace")
            parts.append(text[text.find("ACT I") :])
    if not parts:
        raise SystemExit(f"no Shakespeare texts under {base}: run `make data`")
    return "\n\n".join(parts)[:max_chars]


@torch.inference_mode()
def extract(llm: LLM, ids: list[int], chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> features [N, H], token ids [N], target greedy next token [N], per chunk concatenated (pairs
    never cross a chunk boundary: the last position of each chunk is dropped by the caller's mask)."""
    model = llm.model
    feats, tokens, greedy, valid = [], [], [], []
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start : start + chunk]
        cache = ContiguousCache(CacheSpec.for_model(model.config, model.dtype), len(piece))
        h = model.hidden_states(torch.tensor([piece]), cache)[0]  # [S, H]
        feats.append(h)
        tokens.append(torch.tensor(piece))
        greedy.append(model.logits_from_hidden(h).argmax(-1))
        mask = torch.ones(len(piece), dtype=torch.bool)
        mask[-2:] = False  # a two-step pair needs positions t, t+1, t+2 in the same chunk
        valid.append(mask)
        print(f"  features {start + len(piece)}/{len(ids)}", file=sys.stderr, end="\r")
    print(file=sys.stderr)
    return torch.cat(feats), torch.cat(tokens), torch.cat(greedy), torch.cat(valid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=24000, help="training tokens of Shakespeare")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--inner", type=int, default=1024, help="the head's inner width")
    parser.add_argument("--out", type=Path, default=SHIPPED_WEIGHTS)
    parser.add_argument("--features", type=Path, default=None, help="cache the extracted features in this file")
    parser.add_argument("--data", type=Path, default=Path(os.environ.get("KVGEN_SHAKESPEARE", ROOT / ".venv/data/shakespeare")))
    args = parser.parse_args()
    torch.manual_seed(0)

    started = time.perf_counter()
    llm = LLM.load(args.model, progress=False, weights="fp32")
    model = llm.model
    ids = llm.tokenizer.encode(shakespeare_text(args.data, args.tokens * 6), add_special_tokens=False)[: args.tokens]
    if args.features is not None and args.features.exists():
        feats, tokens, greedy, valid = torch.load(args.features)
    else:
        feats, tokens, greedy, valid = extract(llm, ids, chunk=512)
        if args.features is not None:
            torch.save((feats, tokens, greedy, valid), args.features)
    print(f"extracted {len(ids)} positions in {time.perf_counter() - started:.0f}s", file=sys.stderr)

    # Cross-entropy over the tokens the target actually predicts here (a full-vocabulary softmax per
    # step is 49k x 576 x batch: too slow for a few CPU minutes; the feature loss covers the rest).
    vocab = torch.unique(greedy)
    to_sub = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    to_sub[vocab] = torch.arange(len(vocab))
    head_weight = model.lm_head.weight[vocab]  # [V', H]
    embeddings = model.embed_tokens

    head = EagleHead(model.config.hidden_size, args.inner)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=args.steps, pct_start=0.05)
    positions = valid.nonzero()[:, 0]
    holdout, train = positions[:1024], positions[1024:]

    def loss_on(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = feats[t]
        loss, correct = torch.zeros(()), torch.zeros(())
        for step in (1, 2):  # the second step reads the head's own prediction, as drafting does
            f = head(f, embeddings[tokens[t + step]])
            target = F.normalize(feats[t + step], dim=-1)
            loss = loss + F.smooth_l1_loss(F.normalize(f, dim=-1) * target.shape[-1] ** 0.5,
                                           target * target.shape[-1] ** 0.5)  # fmt: skip
            logits = F.linear(model.norm(f), head_weight)
            labels = to_sub[greedy[t + step]]
            loss = loss + 0.1 * F.cross_entropy(logits, labels)
            if step == 1:
                correct = (logits.argmax(-1) == labels).float().mean()
        return loss, correct

    for step in range(args.steps):
        batch = train[torch.randint(len(train), (args.batch,))]
        loss, _ = loss_on(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == args.steps - 1:
            with torch.no_grad():
                held_loss, held_acc = loss_on(holdout)
            print(f"step {step}: loss {loss.item():.3f}, held-out loss {held_loss.item():.3f}, "
                  f"held-out top-1 agreement with the target {held_acc.item():.3f}", file=sys.stderr)  # fmt: skip
    save_eagle_head(head, args.out, args.model)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
