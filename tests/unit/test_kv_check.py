"""kv-check: the recommendation rule, and the command on the real model."""

from __future__ import annotations

import re

from kvgen.kv.codecs import KV_DTYPES
from kvgen.kv_check import KLD_LIMIT, DtypeResult, recommend
from tests.cli.test_cli import kvgen
from tests.support.models import model_path


def row(part: str, dtype: str, bits: float, kld: float, top1: float) -> DtypeResult:
    return DtypeResult(part, dtype, bits, perplexity=10.0, delta_ppl_pct=0.0, kld=kld, top1=top1)


def test_recommends_fewest_bits_that_pass_both_thresholds() -> None:
    results = [
        row("K", "fp32", 32, 0.0, 1.0),
        row("K", "int8", 8.25, 0.0001, 0.999),
        row("K", "int4", 5, 0.002, 0.96),  # top-1 below the limit: rejected
        row("K", "int3", 4, KLD_LIMIT * 2, 0.99),  # KLD above the limit: rejected
        row("V", "fp32", 32, 0.0, 1.0),
        row("V", "int4", 5, 0.001, 0.99),
    ]
    assert recommend(results, "K").dtype == "int8"
    assert recommend(results, "V").dtype == "int4"
    assert not results[2].accepted and not results[3].accepted


def test_kv_check_command_reports_every_dtype_and_a_consistent_choice() -> None:
    model_path("smollm2")
    result = kvgen("kv-check", "smollm2", "--tokens", "128", "--weights", "fp32", "--no-progress")
    assert result.returncode == 0, result.stderr
    rows = re.findall(r"^([KV])\s+(\w+)\s+([\d.]+)\s+[\d.]+\s+[+-][\d.]+\s+([\d.]+)\s+([\d.]+)\s+(ok|REJECT)", result.stdout, re.M)
    assert len(rows) == 2 * len(KV_DTYPES)  # every dtype for K, then for V
    chosen = re.search(r"--kv-dtype-k (\w+) --kv-dtype-v (\w+)", result.stdout)
    assert chosen is not None
    for part, pick in zip("KV", chosen.groups()):
        accepted = [(float(bits), dtype) for p, dtype, bits, _, _, verdict in rows if p == part and verdict == "ok"]
        assert pick == min(accepted)[1]
        fp32 = next(r for r in rows if r[0] == part and r[1] == "fp32")
        assert float(fp32[3]) == 0.0 and fp32[5] == "ok"  # the exact cache compared with itself


def test_kv_check_rejects_a_missing_text_file() -> None:
    result = kvgen("kv-check", "smollm2", "--text", "/no/such/file.txt", "--no-progress")
    assert result.returncode == 2 and "calibration text '/no/such/file.txt' not found" in result.stderr
