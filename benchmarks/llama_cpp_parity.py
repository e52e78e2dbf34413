"""kvgen, transformers and llama.cpp on the same all-F32 GGUF of a random tiny model that
transformers builds (tests/support/tiny_hf.py; the file with llama.cpp's converter's names and
metadata, tests/support/tiny_gguf.py): with no weight or activation rounded, the three engines'
last logits should agree, which checks the file conventions kvgen reads (row orders, scalars,
which layers go without RoPE) against llama.cpp's own reading, not only against the test writer.

    python benchmarks/llama_cpp_parity.py --families granite smollm3 mamba falcon-mamba mamba2 granite-hybrid

`mamba`, `falcon-mamba` and `mamba2` are transformers' MambaForCausalLM, FalconMambaForCausalLM
(llama.cpp's `mamba` architecture; Falcon-Mamba's file says ssm.dt_b_c_rms) and Mamba2ForCausalLM;
`granite-hybrid` (`-dense`: without experts) its GraniteMoeHybridForCausalLM (Granite 4.0-H,
llama.cpp's `granitehybrid`); `lfm2` its Lfm2ForCausalLM (Liquid's LFM2, llama.cpp's `lfm2`) and
`lfm2-moe` its Lfm2MoeForCausalLM (`lfm2moe`); `nemotron-h` its NemotronHForCausalLM (NVIDIA's
Nemotron-H, `nemotron_h`) and `nemotron-h-moe` the same with mixtures (Nemotron 3 Nano's kind, `nemotron_h_moe`);
`falcon-h1` its FalconH1ForCausalLM (TII's Falcon-H1, `falcon-h1`: the µP multipliers folded into the file's tensors;
`-norm`: with the mixer's gated norm).
`--name` names the results file (results/<name>.json), so a run of some families does not replace
another's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", required=True,
                        help="tests/support/tiny_hf.py FAMILIES names, mamba, falcon-mamba, mamba2, granite-hybrid(-dense), lfm2(-moe), "
                             "nemotron-h(-moe), falcon-h1(-norm)")
    parser.add_argument("--name", default="llama-cpp-parity", help="results file: results/<name>.json")
    args = parser.parse_args()
    from llama_cpp import Llama

    from kvgen import LLM
    from tests.support.models import PROMPTS, model_path
    from tests.support.tiny_gguf import write_gguf_from_hf, write_granite_hybrid_gguf, write_lfm2_gguf, write_mamba_gguf, write_nemotron_h_gguf
    from tests.support.tiny_gguf import write_falcon_h1_gguf
    from tests.support.tiny_hf import (save_tiny_decoder, save_tiny_granite_hybrid, save_tiny_lfm2, save_tiny_lfm2_moe, save_tiny_mamba, save_tiny_mamba2,
                                       save_tiny_nemotron_h, tokenizer_folder)  # fmt: skip
    from tests.support.tiny_hf import save_tiny_falcon_h1

    folder = Path(tempfile.mkdtemp())
    tokenizer = tokenizer_folder(folder / "tokenizer")
    rows = {}
    for name in args.families:
        if name in ("granite-hybrid", "granite-hybrid-dense"):
            model = save_tiny_granite_hybrid(folder / name, tokenizer, experts=0 if name.endswith("dense") else 4)
            path = write_granite_hybrid_gguf(folder / f"{name}.gguf", model, model_path("smollm2"))
        elif name == "lfm2":
            model = save_tiny_lfm2(folder / name, tokenizer, conv_bias=False)  # llama.cpp reads no conv biases
            path = write_lfm2_gguf(folder / f"{name}.gguf", model, model_path("smollm2"))
        elif name == "lfm2-moe":
            model = save_tiny_lfm2_moe(folder / name, tokenizer, scale=1.0)  # Liquid's; llama.cpp's lfm2moe reads no scale
            path = write_lfm2_gguf(folder / f"{name}.gguf", model, model_path("smollm2"))
        elif name in ("nemotron-h", "nemotron-h-moe"):
            model = save_tiny_nemotron_h(folder / name, tokenizer, experts=4 if name.endswith("moe") else 0)
            path = write_nemotron_h_gguf(folder / f"{name}.gguf", model, model_path("smollm2"))
        elif name in ("falcon-h1", "falcon-h1-norm"):
            model = save_tiny_falcon_h1(folder / name, tokenizer, rms_norm=name.endswith("norm"))
            path = write_falcon_h1_gguf(folder / f"{name}.gguf", model, model_path("smollm2"))
        elif name in ("mamba", "falcon-mamba", "mamba2"):
            if name == "mamba2":
                model = save_tiny_mamba2(folder / name, tokenizer)
            else:
                model = save_tiny_mamba(folder / name, tokenizer, falcon=name == "falcon-mamba")
            path = write_mamba_gguf(folder / f"{name}.gguf", model, model_path("smollm2"))
        else:
            model = save_tiny_decoder(name, folder / name, tokenizer)
            path = write_gguf_from_hf(folder / f"{name}.gguf", model, model_path("smollm2"))
        peer = Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False, logits_all=True)
        ids = peer.tokenize(PROMPTS[2].encode(), add_bos=False)
        peer.reset()
        peer.eval(ids)
        llama_cpp = np.array(peer.scores[len(ids) - 1])
        llm = LLM.load(path, progress=False, weights="fp32")
        with torch.inference_mode():
            reference = model(torch.tensor([ids])).logits[0, -1].numpy()
            kvgen = llm.model(torch.tensor([ids]), llm.generator.new_cache(len(ids)))[0, -1].numpy()
        rows[name] = {
            "prompt_tokens": len(ids), "logit_std": float(reference.std()),
            "kvgen_vs_transformers": float(np.abs(kvgen - reference).max()),
            "llama_cpp_vs_transformers": float(np.abs(llama_cpp - reference).max()),
        }  # fmt: skip
        print(name, {k: round(v, 7) for k, v in rows[name].items()})
    print(write_results(args.name, {"families": rows}))


if __name__ == "__main__":
    main()
