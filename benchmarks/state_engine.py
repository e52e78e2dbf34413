"""The engine serving Mamba, Granite 4.0-H and T5: several requests batched against the same
requests one by one (LLM.generate), the prefix cache of state snapshots (Mamba's, and Granite
4.0-H's with its blocks' keys), and T5's encoder runs.

No checkpoint of either installs offline, so the weights are random: transformers builds models of
mamba-130m's shape (hidden 768, 24 layers) and t5-small's (d_model 512, 6 + 6 layers, 8 heads,
d_ff 2048) with SmolLM2's 49,152-token vocabulary and saves them; kvgen loads the folders. Greedy,
EOS ignored, fp32; Mamba also with q4 weights (its decode rows in one C call), and Granite 4.0-H from
benchmarks/random_gguf.py's scaled-down H-Tiny file (q4), LFM2-350M-shaped file and scaled-down
Nemotron-H and Nemotron 3 Nano files and Falcon-H1-0.5B-shaped file where they were written (their decode rows through each layer
together in C). `--models` picks some of them and `--name` the results file. Each run reports whole wall time (prefill + decode) of N requests, and that the
batched tokens equal the one-by-one tokens. `--threads` sets torch's intra-op threads for both
sides (on a machine whose cores other jobs share, a second thread waiting for a busy core turns a
20 us attention call into milliseconds, whichever side runs).

    python benchmarks/state_engine.py --requests 8 --prompt-tokens 128 --new-tokens 32
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from common import print_table, prompt_ids, timed, write_results  # noqa: E402
from peers.paths import peers_root  # noqa: E402
from mamba_decode import save_mamba  # noqa: E402

from kvgen import LLM, SamplingParams  # noqa: E402
from kvgen.engine import EngineConfig, LLMEngine  # noqa: E402
from tests.support.tiny_hf import tokenizer_folder  # noqa: E402


_HYBRIDS = ("granite-hybrid", "lfm2", "nemotron-h", "nemotron-h-moe", "falcon-h1")


def save_t5(folder: Path):
    import transformers

    config = transformers.T5Config(vocab_size=49152, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6,
                                   num_heads=8, feed_forward_proj="relu", decoder_start_token_id=0, pad_token_id=0,
                                   eos_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(config).eval().save_pretrained(folder)
    for file in tokenizer_folder(folder / "tokenizer").iterdir():
        (folder / file.name).write_bytes(file.read_bytes())


def batched_vs_alone(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    alone: list[list[int]] = []
    seconds_alone = timed(lambda: alone.extend(llm.generate(p, params).token_ids for p in prompts))
    engine = LLMEngine(llm, EngineConfig(max_num_seqs=len(prompts), prefix_cache=False))
    batched: list = []
    seconds_batched = timed(lambda: batched.extend(engine.generate(prompts, params)))
    tokens = len(prompts) * params.max_new_tokens
    return {"requests": len(prompts), "alone_s": round(seconds_alone, 2), "batched_s": round(seconds_batched, 2),
            "alone_tok_s": round(tokens / seconds_alone, 1), "batched_tok_s": round(tokens / seconds_batched, 1),
            "speedup": round(seconds_alone / seconds_batched, 2),
            "equal": [r.output_ids for r in batched] == alone}  # fmt: skip


def prefix_hit(llm: LLM, shared: int) -> dict:
    """First token of a request whose first `shared` tokens an earlier request computed: cold vs warm."""
    engine = LLMEngine(llm, EngineConfig(block_size=64))
    base = prompt_ids(llm.tokenizer, shared + 64)
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    cold = timed(lambda: engine.generate([base[:shared] + base[shared : shared + 16]], one))
    warm_request: list = []
    warm = timed(lambda: warm_request.extend(engine.generate([base[:shared] + base[shared + 16 : shared + 32]], one)))
    fresh = llm.generate(base[:shared] + base[shared + 16 : shared + 32], one).token_ids
    return {"shared_tokens": shared, "cold_s": round(cold, 3), "warm_s": round(warm, 3), "speedup": round(cold / warm, 1),
            "cached_tokens": warm_request[0].cached_tokens, "equal_to_fresh": warm_request[0].output_ids == fresh}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--shared-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--models", nargs="+", default=["mamba", *_HYBRIDS, "t5"], choices=["mamba", *_HYBRIDS, "t5"])
    parser.add_argument("--name", default="state_engine", help="results file: results/<name>.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_mamba(Path(tmp) / "mamba", 768, 24)
        llm = LLM.load(Path(tmp) / "mamba", progress=False, weights="fp32")
        base = prompt_ids(llm.tokenizer, args.prompt_tokens + args.requests)
        prompts = [base[i : i + args.prompt_tokens] for i in range(args.requests)]  # distinct prompts
        if "mamba" in args.models:
            results["mamba"] = batched_vs_alone(llm, prompts, params)
            results["mamba_prefix"] = prefix_hit(llm, args.shared_tokens)
            del llm
            llm = LLM.load(Path(tmp) / "mamba", progress=False, weights="q4")  # decode rows: one C call for all
            results["mamba (q4)"] = batched_vs_alone(llm, prompts, params)
        del llm
        for family in (f for f in _HYBRIDS if f in args.models):  # benchmarks/random_gguf.py --family <family>
            hybrid = peers_root() / f"random-{family}" / f"random-{family}-q4_0.gguf"
            if not hybrid.exists():
                print(f"{family} skipped: {hybrid} is missing (python benchmarks/random_gguf.py --family {family})")
                continue
            llm = LLM.load(hybrid, progress=False)
            results[f"{family} (q4)"] = batched_vs_alone(llm, prompts, params)
            results[f"{family}_prefix"] = prefix_hit(llm, args.shared_tokens)
            del llm
        if "t5" in args.models:
            save_t5(Path(tmp) / "t5")
            llm = LLM.load(Path(tmp) / "t5", progress=False, weights="fp32")
            inputs = [base[: args.prompt_tokens], base[1 : args.prompt_tokens + 1]]
            before = llm.model.encoder_runs
            results["t5"] = batched_vs_alone(llm, [inputs[i % 2] for i in range(args.requests)], params)
            results["t5"]["encoder_runs"] = llm.model.encoder_runs - before  # alone + batched: one per input, cached across both
    rows = [{"model": name} | row for name, row in results.items() if not name.endswith("_prefix")]
    print_table(rows, ["model", "requests", "alone_s", "batched_s", "alone_tok_s", "batched_tok_s", "speedup", "equal"])
    if "t5" in results:
        print(f"t5 encoder runs over both passes: {results['t5']['encoder_runs']}")
    for name in (n for n in results if n.endswith("_prefix")):
        print(f"{name.removesuffix('_prefix')} prefix cache: {results[name]}")
    path = write_results(args.name, {"args": vars(args)} | results)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
