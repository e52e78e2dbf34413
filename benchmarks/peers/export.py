"""Export kvgen's models for the peer engines, once: the GGUF -> an HF folder (fp32, via transformers)
-> CTranslate2 int8, OpenVINO int4 (group 64, every layer) and ONNX Runtime GenAI int4 (its builder
through ortgenai_builder.py).

The peers quantize the dequantized fp32 weights themselves, each in its own format: they run the same
model as kvgen, not the same bytes. Each export is written to a temporary folder and renamed when
complete, so an interrupted run leaves nothing half-written; a finished export is never redone. An
engine that cannot export a model (its converter lacks the architecture) leaves `<export>.failed`
with the reason, which the benchmark prints when it skips that engine.

    python benchmarks/peers/export.py --models smollm2,gemma3-270m --optimum-cli PATH
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).parents[1]))
from peers.paths import EXPORTS, export_dir, peers_root  # noqa: E402


def export_hf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized already: the saved folder must not claim to be GGUF-quantized, or
    # every converter refuses it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def converter_commands(engine: str, hf: Path, out: Path, optimum_cli: Path) -> list[list[str]]:
    """The one documented command line of each engine's own converter."""
    if engine == "ctranslate2":
        bin_dir = Path(sys.executable).parent
        return [[str(bin_dir / "ct2-transformers-converter"), "--model", str(hf), "--output_dir", str(out), "--quantization", "int8"]]
    if engine == "openvino":
        # group 64: SmolLM2's hidden size 576 is not a multiple of the default 128; ratio 1.0: every layer int4.
        return [[str(optimum_cli), "export", "openvino", "--model", str(hf), "--task", "text-generation-with-past",
                 "--weight-format", "int4", "--group-size", "64", "--ratio", "1.0", str(out)]]  # fmt: skip
    if engine == "onnxruntime-genai":
        cache = out.parent / f"{out.name}.cache"
        # The builder's own command line, through a wrapper that hands it Gemma 3's RoPE settings in
        # the form it reads (ortgenai_builder.py).
        command = [sys.executable, str(Path(__file__).with_name("ortgenai_builder.py")), "-i", str(hf), "-o", str(out),
                   "-p", "int4", "-e", "cpu", "-c", str(cache)]  # fmt: skip
        if json.loads((hf / "config.json").read_text()).get("model_type") == "gemma3_text":
            # Gemma 3's int4 head shared as its embedding table gives garbage from the first token
            # (the builder's default for tied embeddings); unshared, the head is int4 and the
            # embedding table stays fp32, of which a decode step reads one row.
            command += ["--extra_options", "shared_embeddings=false"]
        return [command]
    raise ValueError(f"unknown engine {engine!r}")


def run_export(engine: str, out: Path, work: Callable[[Path], None]) -> str:
    """Run one export into `out` (skipped when done); returns a one-line outcome."""
    failed = out.parent / f"{out.name}.failed"
    if out.is_dir():
        return "done before"
    tmp = out.parent / f"{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    failed.unlink(missing_ok=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        work(tmp)
    except Exception as error:  # noqa: BLE001 - any converter failure is reported, the others still run
        lines = str(error).strip().splitlines()
        reason = lines[-1] if lines else type(error).__name__  # a converter's traceback ends with its reason
        failed.write_text(f"{engine} export failed: {reason}\n\n{error}\n")  # first line: the reason
        shutil.rmtree(tmp, ignore_errors=True)
        return f"FAILED ({reason})"
    tmp.rename(out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e6
    return f"exported in {time.perf_counter() - started:.0f} s, {size:.0f} MB"


def run_command(command: list[str], log: Path) -> None:
    with log.open("w") as stream:
        result = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        tail = log.read_text().strip().splitlines()[-15:]
        raise RuntimeError(f"{Path(command[0]).name} exited {result.returncode} (log {log}):\n" + "\n".join(tail))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,gemma3-270m", help="comma-separated kvgen model names")
    parser.add_argument("--engines", default="ctranslate2,openvino,onnxruntime-genai", help="comma-separated")
    parser.add_argument("--optimum-cli", type=Path, default=peers_root() / "openvino-export" / "bin" / "optimum-cli",
                        help="optimum-cli of the separate venv optimum-intel needs (it pins an older transformers)")  # fmt: skip
    parser.add_argument("--root", type=Path, default=peers_root(), help="exports go to ROOT/<model>/<engine>")
    args = parser.parse_args()
    from kvgen.loading.registry import resolve_model_path

    engines = [e for e in args.engines.split(",") if e]
    unknown = [e for e in engines if e not in EXPORTS or e == "hf"]
    if unknown:
        parser.error(f"unknown engines {unknown}; choose from {[e for e in EXPORTS if e != 'hf']}")
    for model in [m for m in args.models.split(",") if m]:
        gguf = resolve_model_path(model)
        hf = export_dir(model, "hf", args.root)
        print(f"{model}: hf {run_export('hf', hf, lambda out: export_hf(gguf, out))}", flush=True)
        if not hf.is_dir():
            continue
        for engine in engines:
            out = export_dir(model, engine, args.root)

            def work(tmp: Path, engine: str = engine) -> None:
                try:
                    for command in converter_commands(engine, hf, tmp, args.optimum_cli):
                        run_command(command, tmp.parent / f"{tmp.name.removesuffix('.tmp')}.log")
                finally:
                    shutil.rmtree(tmp.parent / f"{tmp.name}.cache", ignore_errors=True)  # the ORT builder's cache

            print(f"{model}: {engine} {run_export(engine, out, work)}", flush=True)


if __name__ == "__main__":
    main()
