"""How much quantized weights change the model: perplexity on Shakespeare, KL divergence and top-1
agreement against fp32 weights, for each weight mode, decoded one token at a time (the C decode
path) over the same tokens.

    python benchmarks/weights_quality.py --tokens 512
    python benchmarks/weights_quality.py --models <a .gguf path> --name weights_quality-<label>
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from common import compared, model_label, print_table, quality_arguments, write_results  # noqa: E402

from kvgen import LLM  # noqa: E402
from kvgen.quality import score  # noqa: E402
from tests.support.shakespeare import play_text  # noqa: E402


def main() -> None:
    args = quality_arguments(__doc__)

    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        reference = LLM.load(name, progress=False, weights="fp32")
        ids = reference.tokenizer.encode(play_text(args.play))[: args.tokens + 1]
        exact = score(reference.model, reference.generator.new_cache, ids, chunk_size=1, keep_distributions=True)
        rows.append({"model": model_label(name), "weights": "fp32", "perplexity": exact.perplexity, "delta_ppl_pct": 0.0,
                     "kld": 0.0, "top1_agreement": 1.0})  # fmt: skip
        for mode in ("int8", "q4"):
            llm = LLM.load(name, progress=False, weights=mode)
            scores = score(llm.model, llm.generator.new_cache, ids, chunk_size=1, keep_distributions=True)
            rows.append({"model": model_label(name), "weights": mode, **compared(exact, scores)})
    print(f"\n{args.play}, {args.tokens} tokens, decoded one token at a time")
    print_table(rows, ["model", "weights", "perplexity", "delta_ppl_pct", "kld", "top1_agreement"])
    path = write_results(args.name or "weights_quality", {"config": vars(args), "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
