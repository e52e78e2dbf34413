"""What each K/V storage choice does to the model: perplexity on Shakespeare, change vs the exact
cache, KL divergence and top-1 agreement against it, and bytes per token of the packed storage.

Weights stay fp32 so only the cache's rounding is measured; the text is fed 16 tokens at a time
(the recent full-precision window is 32 tokens plus the unfilled block of 32, so most positions
are read back from the packed blocks). kvquant3 is calibrated on a different text (kv/kvquant.py).

    python benchmarks/kv_quality.py --tokens 512
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from common import compared, print_table, quality_arguments, write_results  # noqa: E402

from kvgen import LLM  # noqa: E402
from kvgen.kv_check import quantized_cache  # noqa: E402
from kvgen.quality import score  # noqa: E402
from tests.support.shakespeare import play_text  # noqa: E402

PAIRS = [("fp32", "fp32"), ("fp16", "fp16"), ("bf16", "bf16"), ("fp8", "fp8"), ("int8", "int8"),
         ("int4", "int4"), ("int8", "int4"), ("int3", "int3"), ("kvquant3", "kvquant3"), ("kvquant3", "int4")]  # fmt: skip


def main() -> None:
    args = quality_arguments(__doc__)

    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        llm = LLM.load(name, progress=False, weights="fp32")
        ids = llm.tokenizer.encode(play_text(args.play))[: args.tokens + 1]
        exact = None
        for k, v in PAIRS:
            factory = quantized_cache(llm.model, llm.tokenizer, k, v, residual=32)
            scores = score(llm.model, factory, ids, chunk_size=16, keep_distributions=True)
            exact = exact or scores  # the first pair is fp32/fp32
            # Bytes of the packed tensors per stored position (sink and recent fp32 window excluded).
            rows.append({"model": name, "k": k, "v": v, **compared(exact, scores),
                         "bytes_per_token": factory(1).stored_bytes_per_token})  # fmt: skip
            print(rows[-1], flush=True)  # a long run shows (and keeps) its progress
        write_results(args.name or "kv_quality", {"config": vars(args), "rows": rows})
    print(f"\n{args.play}, {args.tokens} tokens, fp32 weights, 16-token chunks, 32-token full-precision window")
    print_table(rows, ["model", "k", "v", "perplexity", "delta_ppl_pct", "kld", "top1_agreement", "bytes_per_token"])
    path = write_results(args.name or "kv_quality", {"config": vars(args), "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
