"""Train the EAGLE draft head on the target's own greedy chat replies (self-distillation, CPU).

    python scripts/train_eagle.py --model smollm2 --out src/kvgen/speculative/weights/eagle_smollm2.safetensors

1. Chat requests (scripts/eagle_prompts.py) through the target's chat template; the target (the
   default 4-bit weights, the ones it drafts for) answers each greedily (batched decoding).
2. One forward over every prompt + reply gives the features the proposer reads at inference (the
   last block's output before the final norm, from the same C rows step that verifies drafts) and
   the target's greedy next token at every position.
3. The draft vocabulary: the `--draft-vocab` tokens the target emits most often in its replies.
4. Train the head (one decoder layer, kvgen/speculative/eagle_head.py) over whole replies: at reply
   position j it reads (f_j, embedding of x_{j+1}) and the earlier positions, and predicts f_{j+1};
   from there each position's chain runs `--depth - 1` more steps on the head's own predicted
   features, as the proposer drafts (EAGLE-3's training-time test). The loss is a cross-entropy on
   the target's greedy token over the draft vocabulary at every chain step (step t weighted
   `--chain-weight` ** t) plus a feature loss on the first (on the normalised features the LM head
   reads). A few requests are held out: they report the head's top-1 agreement with the target per
   chain step, and at the end chains of drafts as the proposer runs them.
   With `--soft`, part of each cross-entropy is against the target's whole distribution over the
   draft vocabulary (its logits from the stored features), not only its greedy token.

The replies and features can be prepared in slices and trained on together (each slice one file):

    python scripts/train_eagle.py --first-request 0 --requests 1944 --data a.pt --prepare-only
    python scripts/train_eagle.py --first-request 1944 --requests 1944 --data b.pt --prepare-only
    python scripts/train_eagle.py --data a.pt --data b.pt --out head.safetensors

`--start-from` goes on training a saved head; with `--steps 0` it reports that head's agreement on
the held-out replies (the last `--holdout` of the files given).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

from eagle_prompts import chat_requests  # noqa: E402

from kvgen import LLM, SamplingParams  # noqa: E402
from kvgen.kv.contiguous import ContiguousCache  # noqa: E402
from kvgen.kv.interface import CacheSpec  # noqa: E402
from kvgen.speculative.eagle import (  # noqa: E402
    SHIPPED_WEIGHTS, EagleProposer, draft_head_rows, load_eagle_head, save_eagle_head,
)
from kvgen.speculative.eagle_head import EagleHead  # noqa: E402
from kvgen.speculative.proposer import DraftPolicy  # noqa: E402


def replies(llm: LLM, requests: list[str], new_tokens: int, batch: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the target's greedy reply ids) per request, through the chat template."""
    prompts = [
        llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": r}], add_generation_prompt=True),
                             add_special_tokens=False)  # fmt: skip
        for r in requests
    ]
    params = SamplingParams(max_new_tokens=new_tokens)
    out = []
    for first in range(0, len(prompts), batch):
        chunk = prompts[first : first + batch]
        out += [(p, r.token_ids) for p, r in zip(chunk, llm.generate_batch(chunk, params))]
        print(f"  replies {len(out)}/{len(prompts)}", file=sys.stderr, end="\r")
    print(file=sys.stderr)
    return out


@torch.inference_mode()
def extract(llm: LLM, pairs: list[tuple[list[int], list[int]]]):
    """-> features [N, H], ids [N], the target's greedy next ids [N] over every prompt + reply, and
    each reply's span (its first token's index, the sequence's end) in those rows."""
    model = llm.model
    feats, tokens, greedy, spans = [], [], [], []
    offset = 0
    for prompt, reply in pairs:
        ids = prompt + reply
        cache = ContiguousCache(CacheSpec.for_model(model.config, model.dtype), len(ids))
        h = model.hidden_states(torch.tensor([ids]), cache)[0]  # [S, H]
        feats.append(h.clone())
        tokens.append(torch.tensor(ids))
        greedy.append(model.logits_from_hidden(h).argmax(-1))
        spans.append((offset + len(prompt), offset + len(ids)))
        offset += len(ids)
    return torch.cat(feats), torch.cat(tokens), torch.cat(greedy), spans


def load_data(paths: list[Path]):
    """Saved (features, ids, greedy ids, spans) files, concatenated in order."""
    parts = [torch.load(path) for path in paths]
    offsets = [0]
    for feats, *_ in parts[:-1]:
        offsets.append(offsets[-1] + len(feats))
    spans = [(first + offset, end + offset) for (*_, part), offset in zip(parts, offsets) for first, end in part]
    return *(torch.cat([part[i] for part in parts]) for i in range(3)), spans


class Replies:
    """Reply spans as padded training batches: at reply index j the head reads (f_j, x_{j+1}) and
    learns f_{j+1} and the target's greedy token after it; chain step t from j reads x_{j+1+t} and
    learns the target's greedy token after that."""

    def __init__(self, feats: torch.Tensor, tokens: torch.Tensor, greedy: torch.Tensor, embeddings: torch.Tensor,
                 to_draft: torch.Tensor):  # fmt: skip
        self.feats, self.tokens, self.greedy, self.embeddings, self.to_draft = feats, tokens, greedy, embeddings, to_draft

    def batch(self, spans: list[tuple[int, int]], depth: int = 1):
        """-> features, next features [B, S, H]; the embeddings of the token after each position
        [B, S + depth - 1, H]; per chain step, draft-vocabulary labels and target ids [B, S] (-100
        and -1 where the step runs past the reply)."""
        length = max(end - first - 1 for first, end in spans)
        f, f_next = (torch.zeros(len(spans), length, self.feats.shape[1]) for _ in range(2))
        x = torch.zeros(len(spans), length + depth - 1, self.embeddings.shape[1])
        labels = torch.full((depth, len(spans), length), -100, dtype=torch.long)
        target = torch.full((depth, len(spans), length), -1, dtype=torch.long)
        for b, (first, end) in enumerate(spans):
            j = torch.arange(first, end - 1)
            n = len(j)
            f[b, :n], f_next[b, :n] = self.feats[j], self.feats[j + 1]
            x[b, :n] = self.embeddings[self.tokens[j + 1]]
            for step in range(depth):
                live = j[: n - step]  # chains whose step `step` still reads a reply token
                labels[step, b, : len(live)] = self.to_draft[self.greedy[live + 1 + step]]
                target[step, b, : len(live)] = self.greedy[live + 1 + step]
        return f, x, f_next, labels, target


def teacher_features(f_next: torch.Tensor, step: int) -> torch.Tensor:
    """The target's features whose logits give chain step `step`'s label at each position [B, S, H]:
    the next features `step` positions on (zeros past the reply, where the step has no label)."""
    return F.pad(f_next[:, step:], (0, 0, 0, step))


def chain_loss(head: EagleHead, norm: nn.Module, rows: torch.Tensor, vocab: torch.Tensor, batch: tuple,
               weights: list[float], soft: float = 0.0) -> tuple[torch.Tensor, list[float]]:  # fmt: skip
    """The loss over a `Replies.batch` (its chains as deep as `weights`, step t weighted weights[t]):
    a feature loss on the first step's prediction of the next last-layer feature, and a
    cross-entropy on the target's greedy token over the draft vocabulary at each chain step; and,
    per chain step, the head's agreement with the target's greedy token. With `soft` > 0, that share
    of each step's cross-entropy is taken against the target's whole distribution over the draft
    vocabulary instead (distillation: its logits come from the stored features the step learns)."""
    f, x, f_next, labels, target = batch
    chains = head.forward_chains(f, x, len(weights))
    hidden = head.hidden_size
    scale = hidden**0.5
    real = labels[0] != -100
    raw_next, f_next = f_next, F.normalize(f_next[..., -hidden:], dim=-1)  # the last layer's, where f carries more
    loss = F.smooth_l1_loss(F.normalize(chains[0], dim=-1)[real] * scale, f_next[real] * scale)
    agree = []
    for step, predicted in enumerate(chains):
        logits = F.linear(norm(predicted), rows)
        hard = F.cross_entropy(logits.flatten(0, 1), labels[step].flatten(), ignore_index=-100)
        live = target[step] >= 0
        if soft > 0:
            with torch.no_grad():
                truth = teacher_features(raw_next, step)[live][..., -hidden:].float()
                teacher = F.softmax(F.linear(norm(truth), rows.float()), dim=-1)
            distilled = -(teacher * F.log_softmax(logits[live].float(), dim=-1)).sum(-1).mean()
            hard = (1 - soft) * hard + soft * distilled
        loss = loss + weights[step] * hard
        agree.append((vocab[logits.argmax(-1)] == target[step])[live].float().mean().item())
    return loss, agree


def train_head(head: nn.Module, loss_on: Callable[[list[tuple[int, int]]], tuple[torch.Tensor, list[float]]],
               train: list[tuple[int, int]], holdout: list[tuple[int, int]], steps: int, batch: int, lr: float,
               bf16: bool, started: float, label: str = "") -> None:  # fmt: skip
    """AdamW with a one-cycle schedule over random batches of `train` reply spans, reporting the
    held-out loss and agreement every 100 steps (to stderr, each line after `label`)."""
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.05)
    for step in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = loss_on([train[i] for i in torch.randint(len(train), (batch,)).tolist()])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            with torch.no_grad():
                held_loss, held_agree = loss_on(holdout)
            print(f"{label}step {step}: loss {loss.item():.3f}, held-out loss {held_loss.item():.3f}, held-out top-1 "
                  f"agreement with the target per chain step {' '.join(f'{a:.3f}' for a in held_agree)} "
                  f"({time.perf_counter() - started:.0f}s)", file=sys.stderr)  # fmt: skip


def chain_agreement(model, head: EagleHead, data: Replies, spans: list[tuple[int, int]], rows: torch.Tensor,
                    length: int = 4, every: int = 3) -> list[float]:  # fmt: skip
    """The proposer drafting `length` tokens every `every` reply positions, handed the target's
    features up to there as the decoder hands them over: the share of chains whose first 1..length
    drafts all equal the target's greedy tokens."""
    policy = DraftPolicy(SamplingParams())
    hits, chains = [0] * length, 0
    for first, end in spans:
        proposer, seen = EagleProposer(model, head, rows), first
        for j in range(first, end - length - 1, every):
            proposer.observe_features(data.feats[seen : j + 1])
            seen = j + 1
            drafted = proposer.propose(data.tokens[first : j + 2].tolist(), length, policy, None).tokens
            alive = True
            for step, token in enumerate(drafted):
                alive = alive and token == int(data.greedy[j + 1 + step])
                hits[step] += alive
            chains += 1
    return [h / max(chains, 1) for h in hits]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weights", default="q4", help="the target weights whose features the head learns")
    parser.add_argument("--requests", type=int, default=7776, help="chat requests the target answers")
    parser.add_argument("--first-request", type=int, default=0, help="skip this many requests of the list")
    parser.add_argument("--reply-batch", type=int, default=16, help="requests answered together (batched decoding)")
    parser.add_argument("--holdout", type=int, default=32, help="of those, held out for the report")
    parser.add_argument("--new-tokens", type=int, default=160, help="reply length per request")
    parser.add_argument("--draft-vocab", type=int, default=4096, help="tokens the head drafts from")
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--batch", type=int, default=24, help="replies per step")
    parser.add_argument("--depth", type=int, default=3,
                        help="chain steps trained from every position (EAGLE-3's training-time test; 1: teacher-forced only)")
    parser.add_argument("--chain-weight", type=float, default=0.5, help="loss weight of chain step t: this ** t")
    parser.add_argument("--soft", type=float, default=0.0,
                        help="share of each step's cross-entropy taken against the target's distribution (0: greedy token only)")
    parser.add_argument("--start-from", type=Path, help="go on training this saved head (its shape and draft vocabulary)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--inner", type=int, default=1536, help="the head's MLP width")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="train under bf16 autocast (CPUs with native bf16)")
    parser.add_argument("--out", type=Path, default=SHIPPED_WEIGHTS)
    parser.add_argument("--data", type=Path, action="append", default=[],
                        help="cache the replies and features in this file; given several (existing) files, train on "
                             "their requests in order, as if one run had answered them all")  # fmt: skip
    parser.add_argument("--prepare-only", action="store_true", help="write the --data file and stop")
    args = parser.parse_args()
    if args.depth < 1:
        parser.error(f"--depth must be at least 1 (the teacher-forced step), got {args.depth}")
    if not 0 <= args.soft <= 1:
        parser.error(f"--soft is a share of the cross-entropy, between 0 and 1; got {args.soft}")
    if args.steps < 0 or (args.steps == 0 and args.start_from is None):
        parser.error("--steps must be positive (0 only with --start-from, to report a saved head)")
    if args.prepare_only and not args.data:
        parser.error("--prepare-only needs --data (the file to write)")

    def given(*names: str) -> list[str]:
        return [f"--{name.replace('_', '-')}" for name in names if getattr(args, name) != parser.get_default(name)]

    reading = bool(args.data) and all(path.exists() for path in args.data)  # the replies are read, not answered
    if reading and (answering := given("requests", "first_request", "new_tokens", "reply_batch", "prepare_only")):
        parser.error(f"{', '.join(answering)} choose the replies to answer, but the --data files exist already: "
                     "remove them or leave those options out")  # fmt: skip
    if args.prepare_only and (training := given("steps", "depth", "chain_weight", "soft", "start_from", "lr", "inner",
                                                "draft_vocab", "holdout", "batch", "bf16", "out")):  # fmt: skip
        parser.error(f"{', '.join(training)} choose how the head trains, but --prepare-only stops before training")
    if args.start_from is not None and (shaped := given("inner", "draft_vocab")):
        parser.error(f"{', '.join(shaped)} shape a new head, but --start-from goes on with a saved one's")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)

    started = time.perf_counter()
    llm = LLM.load(args.model, progress=False, weights=args.weights)
    model, config = llm.model, llm.model.config
    if reading:
        feats, tokens, greedy, spans = load_data(args.data)
    else:
        if len(args.data) > 1:
            raise SystemExit(f"missing data files: {', '.join(str(p) for p in args.data if not p.exists())}")
        requests = chat_requests(args.first_request + args.requests)[args.first_request :]
        pairs = replies(llm, requests, args.new_tokens, batch=args.reply_batch)
        print(f"replies: {sum(len(r) for _, r in pairs)} tokens in {time.perf_counter() - started:.0f}s", file=sys.stderr)
        feats, tokens, greedy, spans = extract(llm, pairs)
        if args.data:
            torch.save((feats, tokens, greedy, spans), args.data[0])
    if args.prepare_only:
        print(f"wrote {args.data[0]} in {time.perf_counter() - started:.0f}s", file=sys.stderr)
        return
    train, holdout = spans[: -args.holdout], spans[-args.holdout :]
    labelled = torch.cat([torch.arange(first + 1, end) for first, end in train])  # positions whose next id is learnt
    print(f"{len(labelled)} training positions in {len(train)} replies, {time.perf_counter() - started:.0f}s", file=sys.stderr)

    if args.start_from is not None:  # go on training a saved head, with its draft vocabulary
        head = load_eagle_head(args.start_from, model).train().requires_grad_(True)
        vocab = head.draft_vocab
    else:  # the draft vocabulary: the target's most frequent next tokens over the training replies
        counts = torch.bincount(greedy[labelled], minlength=config.vocab_size)
        vocab = counts.argsort(descending=True)[: min(args.draft_vocab, int((counts > 0).sum()))].sort().values
        head = EagleHead(config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, args.inner, vocab)
    coverage = torch.isin(greedy[labelled], vocab).float().mean().item()
    print(f"draft vocabulary {len(vocab)} tokens, {coverage:.3f} of the reply tokens", file=sys.stderr)
    to_draft = torch.full((config.vocab_size,), -100, dtype=torch.long)  # -100: ignored by the loss
    to_draft[vocab] = torch.arange(len(vocab))
    rows = draft_head_rows(model, vocab)
    data = Replies(feats, tokens, greedy, model.embedding_table().float(), to_draft)

    weights = [args.chain_weight**step for step in range(args.depth)]

    def loss_on(batch: list[tuple[int, int]]) -> tuple[torch.Tensor, list[float]]:
        return chain_loss(head, model.norm, rows, vocab, data.batch(batch, args.depth), weights, args.soft)

    if args.steps > 0:  # --steps 0 with --start-from: report a saved head on the held-out replies
        train_head(head, loss_on, train, holdout, args.steps, args.batch, args.lr, args.bf16, started)
    chains = chain_agreement(model, head, data, holdout, rows)
    print(f"held-out chains whose first 1..{len(chains)} drafts all agree: {' '.join(f'{c:.3f}' for c in chains)}",
          file=sys.stderr)  # fmt: skip
    save_eagle_head(head, args.out, args.model)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
