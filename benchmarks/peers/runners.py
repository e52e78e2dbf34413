"""One runner per peer engine, for benchmarks/decode.py: each loads its export of the model once and
returns generate(n) -> the n new token ids, greedy, from the very token ids kvgen gets, EOS ignored,
on `threads` threads. An engine whose package or export is missing raises PeerUnavailable, with the
reason, so the benchmark skips it and says why."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
from pathlib import Path
from typing import Callable

from peers.paths import export_dir

Generate = Callable[[int], list[int]]


class PeerUnavailable(Exception):
    """The engine cannot run here: its package is not installed or the model was not exported for it."""


def _require(package: str, engine: str, model: str, root: Path | None) -> Path:
    if importlib.util.find_spec(package) is None:
        raise PeerUnavailable(f"{package} is not installed (make .venv/.peer-deps)")
    path = export_dir(model, engine, root)
    failed = path.parent / f"{path.name}.failed"
    if failed.is_file():
        raise PeerUnavailable(failed.read_text().strip().splitlines()[0])
    if not path.is_dir():
        raise PeerUnavailable(f"no export at {path} (make .venv/.peer-models)")
    return path


def _serve(connection, model: str, ids: list[int], threads: int, root: Path | None) -> None:
    """The child side of ctranslate2_runner: load the engine, then answer generate(n) calls."""
    try:
        generate = _ctranslate2_in_process(model, ids, threads, root)
    except PeerUnavailable as error:
        connection.send(error)
        return
    connection.send(None)
    try:
        while (n := connection.recv()) is not None:
            connection.send(generate(n))
    except EOFError:  # the benchmark ended without saying goodbye
        pass


def ctranslate2_runner(model: str, ids: list[int], threads: int, root: Path | None = None) -> Generate:
    """CTranslate2 in a process of its own: once it has generated in a process, kvgen's and llama.cpp's
    OpenMP steps in that process run about half as fast (its bundled OpenMP runtime beside theirs;
    measured on SmolLM2: kvgen 218 -> 94 tok/s after one CTranslate2 call). The pipe adds well under a
    millisecond per call."""
    _require("ctranslate2", "ctranslate2", model, root)
    parent, child = multiprocessing.get_context("spawn").Pipe()
    process = multiprocessing.get_context("spawn").Process(target=_serve, args=(child, model, ids, threads, root), daemon=True)
    process.start()
    if (error := parent.recv()) is not None:
        raise error

    def generate(n: int) -> list[int]:
        parent.send(n)
        return parent.recv()

    return generate


def _ctranslate2_in_process(model: str, ids: list[int], threads: int, root: Path | None) -> Generate:
    path = _require("ctranslate2", "ctranslate2", model, root)
    import ctranslate2

    generator = ctranslate2.Generator(str(path), device="cpu", compute_type="int8", intra_threads=threads, inter_threads=1)
    # CTranslate2 takes tokens as strings: its vocabulary is the tokenizer's, in id order.
    vocabulary = json.loads((path / "vocabulary.json").read_text())
    tokens = [vocabulary[i] for i in ids]

    def generate(n: int) -> list[int]:
        # The prompt goes through the decoder at once (not token by token); end_token=[] and
        # min_length=n: no token ends the generation before n.
        result = generator.generate_batch([tokens], max_length=n, min_length=n, sampling_topk=1, end_token=[],
                                          include_prompt_in_result=False)[0]  # fmt: skip
        out = result.sequences_ids[0]
        assert len(out) == n, (len(out), n)
        return out

    return generate


def openvino_runner(model: str, ids: list[int], threads: int, root: Path | None = None) -> Generate:
    path = _require("openvino_genai", "openvino", model, root)
    import numpy as np
    import openvino as ov
    import openvino_genai

    # No prefix caching: a repeated prompt would skip its prefill and time nothing.
    scheduler = openvino_genai.SchedulerConfig()
    scheduler.enable_prefix_caching = False
    pipeline = openvino_genai.LLMPipeline(str(path), "CPU", scheduler_config=scheduler, INFERENCE_NUM_THREADS=threads)
    prompt = openvino_genai.TokenizedInputs(ov.Tensor(np.array([ids], dtype=np.int64)), ov.Tensor(np.ones((1, len(ids)), dtype=np.int64)))

    def generate(n: int) -> list[int]:
        config = openvino_genai.GenerationConfig(max_new_tokens=n, min_new_tokens=n, ignore_eos=True, do_sample=False)
        config.apply_chat_template = False
        out = list(pipeline.generate(prompt, config).tokens[0])
        assert len(out) == n, (len(out), n)
        return out

    return generate


def onnxruntime_genai_runner(model: str, ids: list[int], threads: int, root: Path | None = None) -> Generate:
    path = _require("onnxruntime_genai", "onnxruntime-genai", model, root)
    import onnxruntime_genai as og

    config = og.Config(str(path))
    # The thread count belongs to the session options of genai_config.json: overlaid here, not edited there.
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    engine = og.Model(config)
    # Its sliding-window layers (Gemma 3) refuse a KV cache shorter than the window: the cache is
    # sized to the window then, and generation still stops after n tokens (min_length keeps EOS out).
    window = json.loads((path / "genai_config.json").read_text())["model"]["decoder"].get("sliding_window", {})
    window_size = int(window.get("window_size", 0))

    def generate(n: int) -> list[int]:
        params = og.GeneratorParams(engine)
        params.set_search_options(do_sample=False, max_length=max(len(ids) + n, window_size), min_length=len(ids) + n)
        generator = og.Generator(engine, params)
        generator.append_tokens(ids)  # the prefill: the prompt's forward pass
        out: list[int] = []
        while len(out) < n:
            generator.generate_next_token()  # picks from the last logits, runs the forward of the last pick first
            out.append(int(generator.get_next_tokens()[0]))
        return out

    return generate


PEER_RUNNERS: dict[str, Callable[[str, list[int], int], Generate]] = {
    "ctranslate2": ctranslate2_runner,
    "openvino": openvino_runner,
    "onnxruntime-genai": onnxruntime_genai_runner,
}
