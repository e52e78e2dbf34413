"""Mamba decode speed: kvgen's recurrent step over its SSMStateCache against transformers'
MambaForCausalLM on the same weights, same run, taking turns.

No Mamba checkpoint installs offline, so the weights are random: transformers builds a model of
mamba-130m's shape (hidden 768, 24 layers, state 16, expand 2, SmolLM2's 49,152-token vocabulary)
and saves it; kvgen loads that folder. Greedy, EOS ignored, fp32 on both sides (kvgen's torch
projections and C scan), and kvgen's q4 weights as a third row (its one-call C decode step); decode
tok/s = (N - 1) / (time of generate(N) - time of generate(1)), best of --repeats. The state's memory
at the end of a short and a long prompt is reported too (it must not grow). Results per CPU class:
results/mamba_decode-<class>.json. Against llama.cpp on a GGUF: benchmarks/decode.py with
`random_gguf.py --family mamba`.

    python benchmarks/mamba_decode.py --prompt-tokens 128 --new-tokens 64
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from common import cpu_class, print_table, prompt_ids, timed, write_results  # noqa: E402

from kvgen import LLM, SamplingParams  # noqa: E402
from tests.support.tiny_hf import tokenizer_folder  # noqa: E402


def save_mamba(folder: Path, hidden: int, layers: int):
    import transformers

    config = transformers.MambaConfig(vocab_size=49152, hidden_size=hidden, state_size=16, num_hidden_layers=layers,
                                      conv_kernel=4, expand=2, use_mambapy=False)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(config).eval()
    model.save_pretrained(folder)
    for file in tokenizer_folder(folder / "tokenizer").iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        reference = save_mamba(Path(tmp), args.hidden, args.layers)
        llm = LLM.load(tmp, progress=False, weights="fp32")
        q4 = LLM.load(tmp, progress=False, weights="q4")
        ids = prompt_ids(llm.tokenizer, args.prompt_tokens)
        prompt = torch.tensor([ids])

        def kvgen(n: int) -> None:
            llm.generate(ids, SamplingParams(max_new_tokens=n, ignore_eos=True))

        def kvgen_q4(n: int) -> None:
            q4.generate(ids, SamplingParams(max_new_tokens=n, ignore_eos=True))

        def transformers(n: int) -> None:
            with torch.inference_mode():
                reference.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

        samples: dict[str, list[float]] = {"kvgen": [], "transformers": [], "kvgen (q4)": []}
        for _ in range(args.repeats):  # the engines take turns
            for name, run in (("kvgen", kvgen), ("transformers", transformers), ("kvgen (q4)", kvgen_q4)):
                first, full = timed(lambda: run(1)), timed(lambda: run(args.new_tokens))
                samples[name].append((args.new_tokens - 1) / max(full - first, 1e-9))
        same = llm.generate(ids, SamplingParams(max_new_tokens=16, ignore_eos=True)).token_ids == reference.generate(
            prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
        memory = {}
        for length in (128, 4096):
            cache = llm.generator.new_cache(0)
            with torch.inference_mode():
                llm.model(torch.tensor([prompt_ids(llm.tokenizer, length)]), cache)
            memory[length] = cache.memory_bytes()
    rows = [{"engine": name, "decode_tok_s": round(max(s), 1), "samples": [round(x, 1) for x in s]} for name, s in samples.items()]
    ratio = rows[0]["decode_tok_s"] / rows[1]["decode_tok_s"]
    print_table(rows, ["engine", "decode_tok_s", "samples"])
    print(f"kvgen / transformers: {ratio:.2f}x; greedy tokens equal: {same}; state bytes at 128 / 4096 tokens: {memory}")
    path = write_results(f"mamba_decode-{cpu_class()}", {"args": vars(args), "rows": rows, "ratio": round(ratio, 2),
                                          "greedy_equal": same, "state_bytes": memory})  # fmt: skip
    print(f"results: {path}")


if __name__ == "__main__":
    main()
