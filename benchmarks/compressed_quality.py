"""Chunk mean-pooling: how much the model changes, with and without the log(chunk) bias on pooled slots.

Perplexity, its change, KL divergence and top-1 agreement against the exact (contiguous) cache over
Shakespeare, fp32 weights, 16 tokens per forward (so most positions are read back pooled), and the
slots a layer holds at the end (a contiguous cache holds one per token).

    python benchmarks/compressed_quality.py --models smollm2 --tokens 512
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from common import compared, print_table, quality_arguments, write_results  # noqa: E402

from kvgen import LLM  # noqa: E402
from kvgen.kv import CacheSpec, ContiguousCache  # noqa: E402
from kvgen.kv.compressed import CompressedCache  # noqa: E402
from kvgen.quality import score  # noqa: E402
from tests.support.shakespeare import play_text  # noqa: E402

# (chunk, exact window, sink tokens)
SETTINGS = [(4, 64, 4), (8, 64, 4), (8, 128, 4), (16, 64, 4), (8, 64, 0)]
FORWARD_TOKENS = 16


def main() -> None:
    args = quality_arguments(__doc__)
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        llm = LLM.load(name, progress=False, weights="fp32")
        if any(llm.config.window_for(i) for i in range(llm.config.num_layers)):
            print(f"skipping {name}: the compressed cache is for full-attention models")
            continue
        spec = CacheSpec.for_model(llm.config)
        ids = llm.tokenizer.encode(play_text(args.play))[: args.tokens + 1]
        exact = score(llm.model, lambda n: ContiguousCache(spec, n), ids, FORWARD_TOKENS, keep_distributions=True)
        for chunk, window, sink in SETTINGS:
            for bias in (False, True):
                caches: list[CompressedCache] = []

                def factory(n: int) -> CompressedCache:
                    caches.append(CompressedCache(spec, chunk, window, sink, bias, capacity=n))
                    return caches[-1]

                scores = score(llm.model, factory, ids, FORWARD_TOKENS, keep_distributions=True)
                slots = caches[-1].num_slots(caches[-1].seq_len)
                rows.append({"model": name, "chunk": chunk, "window": window, "sink": sink, "log_bias": bias,
                             **compared(exact, scores), "slots": slots, "positions": caches[-1].seq_len})  # fmt: skip
    print(f"\n{args.play}, {args.tokens} tokens, fp32 weights, {FORWARD_TOKENS} tokens per forward")
    print_table(rows, ["model", "chunk", "window", "sink", "log_bias", "perplexity", "delta_ppl_pct", "kld",
                       "top1_agreement", "slots", "positions"])  # fmt: skip
    path = write_results("compressed_quality", {"config": vars(args), "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
