"""kv-check: measure what each K and V storage dtype does to a model, and recommend the cheapest safe one.

Users of quantized KV caches get silent corruption when a model's keys do not survive a format (keys
carry outlier channels; some models' values do too). This scores a calibration text with every K
dtype (values exact) and every V dtype (keys exact), compares each with the exact cache (KL
divergence, top-1 agreement, perplexity), and recommends per K and V the fewest bits that stay
under the thresholds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgen.kv.codecs import KV_DTYPES, key_codec, value_codec
from kvgen.kv.interface import CacheSpec
from kvgen.kv.quantized import QuantizedCache
from kvgen.models.base import DecoderLM
from kvgen.quality import Scores, kl_divergence, score, top1_agreement

KLD_LIMIT = 0.01  # nats per token
TOP1_LIMIT = 0.97
CALIBRATION_TEXT = (
    "The committee met on a grey Tuesday morning to decide what should be done about the old bridge. "
    "Some members argued that it ought to be repaired, since the town had crossed it for two hundred years "
    "and the stone was still sound; others pointed to the cracks along the northern arch and to the cost of "
    "divers, scaffolding and engineers. A farmer who had driven his cattle over it since boyhood asked to "
    "speak. \"I do not know the first thing about arches,\" he said, \"but I know that the river rose higher "
    "last spring than my father ever saw it rise, and that the water came within a hand's breadth of the road.\" "
    "Nobody answered at once. The chairwoman wrote three numbers on the board: the price of repair, the price "
    "of a new crossing, and the number of days the valley would be cut in two if nothing were done and the "
    "bridge failed in the next flood. Then she turned to the engineer, who had said nothing so far, and asked "
    "him which of the three numbers he would trust least. He smiled, took off his glasses, and said that the "
    "third one was the only number on the board that nobody in the room could change."
)


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


def _scores(model: DecoderLM, ids: list[int], k: str, v: str, chunk: int, residual: int) -> Scores:
    spec = CacheSpec.for_model(model.config, model.dtype)

    def factory(num_tokens: int) -> QuantizedCache:
        return QuantizedCache(spec, num_tokens, num_tokens, k, v, residual)

    return score(model, factory, ids, chunk_size=chunk, keep_distributions=True)


@torch.inference_mode()
def check(model: DecoderLM, ids: list[int], chunk: int = 16, residual: int = 32,
          dtypes: tuple[str, ...] = KV_DTYPES) -> tuple[Scores, list[DtypeResult]]:  # fmt: skip
    exact = _scores(model, ids, "fp32", "fp32", chunk, residual)
    results = []
    for part in ("K", "V"):
        for dtype in dtypes:
            k, v = (dtype, "fp32") if part == "K" else ("fp32", dtype)
            scores = _scores(model, ids, k, v, chunk, residual)
            codec = key_codec(dtype) if part == "K" else value_codec(dtype)
            results.append(DtypeResult(
                part, dtype, codec.bits_per_value, scores.perplexity,
                100 * (scores.perplexity / exact.perplexity - 1), kl_divergence(exact, scores),
                top1_agreement(exact, scores),
            ))  # fmt: skip
    return exact, results


def recommend(results: list[DtypeResult], part: str) -> DtypeResult:
    """The fewest bits among the accepted dtypes of `part` (fp32 is always accepted)."""
    accepted = [r for r in results if r.part == part and r.accepted]
    return min(accepted, key=lambda r: (r.bits_per_value, r.kld))


def report(results: list[DtypeResult]) -> str:
    lines = [f"{'part':4s} {'dtype':6s} {'bits':>6s} {'ppl':>9s} {'dPPL%':>7s} {'KLD':>8s} {'top-1':>6s}  verdict"]
    for r in results:
        verdict = "ok" if r.accepted else f"REJECT (KLD > {KLD_LIMIT} or top-1 < {TOP1_LIMIT})"
        lines.append(f"{r.part:4s} {r.dtype:6s} {r.bits_per_value:6.2f} {r.perplexity:9.3f} {r.delta_ppl_pct:+7.2f} "
                     f"{r.kld:8.5f} {r.top1:6.3f}  {verdict}")  # fmt: skip
    k, v = recommend(results, "K"), recommend(results, "V")
    lines.append(f"recommended: --kv-cache quantized --kv-dtype-k {k.dtype} --kv-dtype-v {v.dtype}")
    return "\n".join(lines)
