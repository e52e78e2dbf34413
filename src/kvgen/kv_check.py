"""kv-check: measure what each K and V storage dtype does to a model, and recommend the cheapest safe one.

Users of quantized KV caches get silent corruption when a model's keys do not survive a format (keys
carry outlier channels; some models' values do too). This scores a calibration text with every K
dtype (values exact) and every V dtype (keys exact), compares each with the exact cache (KL
divergence, top-1 agreement, perplexity), and recommends per K and V the fewest bits that stay
under the thresholds. kvquant3's codebooks are fit on kv/kvquant.py's CALIBRATION_TEXT, the default
text here too: pass --text with other text for a measure that is not on the fitting data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from kvgen.kv.codecs import KV_DTYPES
from kvgen.cache_factory import build_quantized_cache
from kvgen.kvquant_calibration import CALIBRATION_TEXT
from kvgen.kv.quantized import QuantizedCache
from kvgen.models.base import DecoderLM
from kvgen.quality import Scores, kl_divergence, score, top1_agreement

KLD_LIMIT = 0.01  # nats per token
TOP1_LIMIT = 0.97


@dataclass
class DtypeResult:
    part: str  # "K" or "V"
    dtype: str
    bits_per_value: float
    perplexity: float
    delta_ppl_pct: float
    kld: float
    top1: float

    @property
    def accepted(self) -> bool:
        return self.kld <= KLD_LIMIT and self.top1 >= TOP1_LIMIT


def quantized_cache(model: DecoderLM, tokenizer: Any, k: str, v: str, residual: int = 32) -> Callable[[int], QuantizedCache]:
    """A factory of empty caches of `num_tokens` positions storing K and V as `k` and `v`."""
    return lambda num_tokens: build_quantized_cache(model, tokenizer, num_tokens, num_tokens, k, v, residual)


def _scores(model: DecoderLM, tokenizer: Any, ids: list[int], k: str, v: str, chunk: int, residual: int) -> Scores:
    return score(model, quantized_cache(model, tokenizer, k, v, residual), ids, chunk_size=chunk, keep_distributions=True)


@torch.inference_mode()
def check(model: DecoderLM, tokenizer: Any, ids: list[int], chunk: int = 16, residual: int = 32,
          dtypes: tuple[str, ...] = KV_DTYPES) -> tuple[Scores, list[DtypeResult]]:  # fmt: skip
    exact = _scores(model, tokenizer, ids, "fp32", "fp32", chunk, residual)
    results = []
    for part in ("K", "V"):
        for dtype in dtypes:
            k, v = (dtype, "fp32") if part == "K" else ("fp32", dtype)
            factory = quantized_cache(model, tokenizer, k, v, residual)
            scores = score(model, factory, ids, chunk_size=chunk, keep_distributions=True)
            cache = factory(1)
            bits = (cache.key_store if part == "K" else cache.value_store).bits_per_value()
            results.append(DtypeResult(
                part, dtype, bits, scores.perplexity,
                100 * (scores.perplexity / exact.perplexity - 1), kl_divergence(exact, scores),
                top1_agreement(exact, scores),
            ))  # fmt: skip
    return exact, results


def recommend(results: list[DtypeResult], part: str) -> DtypeResult:
    """The fewest bits among the accepted dtypes of `part` (fp32 is always accepted)."""
    accepted = [r for r in results if r.part == part and r.accepted]
    return min(accepted, key=lambda r: (r.bits_per_value, r.kld))


def report(results: list[DtypeResult]) -> str:
    lines = [f"{'part':4s} {'dtype':8s} {'bits':>6s} {'ppl':>9s} {'dPPL%':>7s} {'KLD':>8s} {'top-1':>6s}  verdict"]
    for r in results:
        verdict = "ok" if r.accepted else f"REJECT (KLD > {KLD_LIMIT} or top-1 < {TOP1_LIMIT})"
        lines.append(f"{r.part:4s} {r.dtype:8s} {r.bits_per_value:6.2f} {r.perplexity:9.3f} {r.delta_ppl_pct:+7.2f} "
                     f"{r.kld:8.5f} {r.top1:6.3f}  {verdict}")  # fmt: skip
    k, v = recommend(results, "K"), recommend(results, "V")
    lines.append(f"recommended: --kv-cache quantized --kv-dtype-k {k.dtype} --kv-dtype-v {v.dtype}")
    return "\n".join(lines)
