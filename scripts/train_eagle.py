"""Train the EAGLE draft head on the target's own greedy chat replies (self-distillation, CPU, minutes).

    python scripts/train_eagle.py --model smollm2 --out src/kvgen/speculative/weights/eagle_smollm2.safetensors

1. Chat requests (scripts/eagle_prompts.py) through the target's chat template; the target (the
   default 4-bit weights, the ones it drafts for) answers each greedily (batched decoding).
2. One forward over every prompt + reply gives the features the proposer reads at inference (the
   last block's output before the final norm, from the same C rows step that verifies drafts) and
   the target's greedy next token at every position.
3. The draft vocabulary: the `--draft-vocab` tokens the target emits most often in its replies.
4. Train the head to map (f_t, embedding of x_{t+1}) to f_{t+1}, unrolled over `--unroll` steps so it
   learns from its own predictions as drafting does, with a cross-entropy on the target's greedy
   token over the draft vocabulary plus a feature loss (on the normalised features the LM head
   reads). Positions are those of the replies (where drafting happens); a few requests are held out
   and report the head's top-1 agreement with the target over the full draft step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

from eagle_prompts import chat_requests  # noqa: E402

from kvgen import LLM, SamplingParams  # noqa: E402
from kvgen.kv.contiguous import ContiguousCache  # noqa: E402
from kvgen.kv.interface import CacheSpec  # noqa: E402
from kvgen.speculative.eagle import SHIPPED_WEIGHTS, EagleHead, draft_head_rows, save_eagle_head  # noqa: E402


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
def extract(llm: LLM, pairs: list[tuple[list[int], list[int]]], unroll: int):
    """-> features [N, H], input ids [N], greedy next ids [N], the positions t a training example
    starts at (a reply position with t+unroll in the same sequence), and each position's sequence."""
    model = llm.model
    feats, tokens, greedy, starts, seqs = [], [], [], [], []
    offset = 0
    for i, (prompt, reply) in enumerate(pairs):
        ids = prompt + reply
        cache = ContiguousCache(CacheSpec.for_model(model.config, model.dtype), len(ids))
        h = model.hidden_states(torch.tensor([ids]), cache)[0]  # [S, H]
        feats.append(h.clone())
        tokens.append(torch.tensor(ids))
        greedy.append(model.logits_from_hidden(h).argmax(-1))
        starts.append(torch.arange(len(prompt) - 1, len(ids) - unroll) + offset)
        seqs.append(torch.full((len(ids),), i))
        offset += len(ids)
    return torch.cat(feats), torch.cat(tokens), torch.cat(greedy), torch.cat(starts), torch.cat(seqs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weights", default="q4", help="the target weights whose features the head learns")
    parser.add_argument("--requests", type=int, default=400, help="chat requests the target answers")
    parser.add_argument("--holdout", type=int, default=16, help="of those, held out for the report")
    parser.add_argument("--new-tokens", type=int, default=128, help="reply length per request")
    parser.add_argument("--draft-vocab", type=int, default=4096, help="tokens the head drafts from")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--unroll", type=int, default=3, help="chained steps per example")
    parser.add_argument("--inner", type=int, default=1024, help="the head's inner width")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=SHIPPED_WEIGHTS)
    parser.add_argument("--data", type=Path, default=None, help="cache the replies and features in this file")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)

    started = time.perf_counter()
    llm = LLM.load(args.model, progress=False, weights=args.weights)
    model = llm.model
    if args.data is not None and args.data.exists():
        feats, tokens, greedy, starts, seqs = torch.load(args.data)
    else:
        pairs = replies(llm, chat_requests(args.requests), args.new_tokens, batch=16)
        print(f"replies: {sum(len(r) for _, r in pairs)} tokens in {time.perf_counter() - started:.0f}s", file=sys.stderr)
        feats, tokens, greedy, starts, seqs = extract(llm, pairs, args.unroll)
        if args.data is not None:
            torch.save((feats, tokens, greedy, starts, seqs), args.data)
    print(f"{len(starts)} training positions, {time.perf_counter() - started:.0f}s", file=sys.stderr)

    # The draft vocabulary: the target's most frequent tokens in its replies (the labels of the
    # training positions and the steps after them).
    reply_labels = greedy[torch.cat([starts + s for s in range(1, args.unroll + 1)]).unique()]
    counts = torch.bincount(reply_labels, minlength=model.config.vocab_size)
    vocab = counts.argsort(descending=True)[: min(args.draft_vocab, int((counts > 0).sum()))].sort().values
    coverage = counts[vocab].sum().item() / counts.sum().item()
    print(f"draft vocabulary {len(vocab)} tokens, {coverage:.3f} of the reply tokens", file=sys.stderr)
    to_sub = torch.full((model.config.vocab_size,), -100, dtype=torch.long)  # -100: ignored by the loss
    to_sub[vocab] = torch.arange(len(vocab))
    rows = draft_head_rows(model, vocab)
    embeddings = model.embed_tokens.float()
    norm = model.norm

    head = EagleHead(model.config.hidden_size, args.inner, vocab)
    optimizer = torch.optim.AdamW(head.parameters(), lr=2e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3, total_steps=args.steps, pct_start=0.05)
    num_seqs = int(seqs.max()) + 1
    held = seqs[starts] >= num_seqs - args.holdout
    holdout, train = starts[held], starts[~held]

    def loss_on(t: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        f = feats[t]
        loss, agree = torch.zeros(()), []
        alive = torch.ones(len(t), dtype=torch.bool)  # every earlier step agreed (what a chain accepts)
        for step in range(1, args.unroll + 1):  # later steps read the head's own predictions
            f = head(f, embeddings[tokens[t + step]])
            target = F.normalize(feats[t + step], dim=-1) * f.shape[-1] ** 0.5
            loss = loss + F.smooth_l1_loss(F.normalize(f, dim=-1) * f.shape[-1] ** 0.5, target)
            logits = F.linear(norm(f), rows)
            labels = to_sub[greedy[t + step]]
            loss = loss + F.cross_entropy(logits, labels, ignore_index=-100)
            alive = alive & (vocab[logits.argmax(-1)] == greedy[t + step])
            agree.append(alive.float().mean().item())
        return loss, agree

    for step in range(args.steps):
        batch = train[torch.randint(len(train), (args.batch,))]
        loss, _ = loss_on(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == args.steps - 1:
            with torch.no_grad():
                held_loss, held_agree = loss_on(holdout)
            print(f"step {step}: loss {loss.item():.3f}, held-out loss {held_loss.item():.3f}, held-out chains "
                  f"agreeing with the target for 1..{args.unroll} tokens {' '.join(f'{a:.3f}' for a in held_agree)} "
                  f"({time.perf_counter() - started:.0f}s)", file=sys.stderr)  # fmt: skip
    save_eagle_head(head, args.out, args.model)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
