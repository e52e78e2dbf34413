"""LLM: a loaded model plus its tokenizer, the entry point of the Python API.

    llm = LLM.load("smollm2")
    print(llm.generate("Once upon a time", SamplingParams(max_new_tokens=32)).text)
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from kvgen.config import CacheConfig
from kvgen.generate import ChunkCallback, GenerationStream, Generator
from kvgen.result import GenerationResult
from kvgen.loading.checkpoint import Checkpoint, resolve_dtype
from kvgen.loading.gguf import load_gguf
from kvgen.loading.gguf_file import GGUFFile
from kvgen.loading.heap import release_freed_memory
from kvgen.loading.hf import load_hf_folder
from kvgen.loading.registry import resolve_model_path
from kvgen.loading.tokenizer import Tokenizer
from kvgen.loading.weight_format import check_mode
from kvgen.lora.registry import AdapterRegistry
from kvgen.models import DecoderLM, build_model
from kvgen.models.device import check_torch_compile, default_dtype, gpu_weights_mode, move_model, resolve_device
from kvgen.sampling.params import SamplingParams
from kvgen.session import Session
from kvgen.speculative.config import SpeculativeConfig


def load_checkpoint(
    name_or_path: str | Path, dtype: str | torch.dtype = "float32", progress: bool = True, weights: str = "auto"
) -> Checkpoint:
    mode = check_mode(weights)
    torch_dtype = resolve_dtype(dtype)
    path = resolve_model_path(name_or_path)
    if path.is_dir():
        return load_hf_folder(path, torch_dtype, progress, mode)
    return load_gguf(path, torch_dtype, progress, mode)


def load_tokenizer(name_or_path: str | Path) -> Tokenizer:
    """Only the tokenizer of a model (no weights read): what a router needs to hash prompts."""
    path = resolve_model_path(name_or_path)
    if path.is_dir():
        return Tokenizer.from_hf_folder(path)
    metadata = GGUFFile(path).metadata
    return Tokenizer.from_gguf_metadata(metadata, str(metadata.get("general.architecture", "")))


class LLM:
    def __init__(
        self, model: DecoderLM, checkpoint: Checkpoint, max_context: int | None = None, cache: CacheConfig | None = None
    ):
        self.model = model
        self.tokenizer = checkpoint.tokenizer
        self.config = checkpoint.config
        self.path = checkpoint.path
        self.weights = checkpoint.weights
        self.generator = Generator(model, self.tokenizer, max_context, cache)
        self.adapters = AdapterRegistry(model)  # LoRA adapters requests may name (SamplingParams.adapter)
        self.generator.adapters = self.adapters
        self._batch = None  # BatchGenerator, built on the first generate_batch

    @classmethod
    def load(
        cls, name_or_path: str | Path, dtype: str | torch.dtype | None = None, progress: bool = True,
        max_context: int | None = None, weights: str = "auto", cache: CacheConfig | None = None,
        device: str = "cpu", torch_compile: bool = False,
    ) -> "LLM":  # fmt: skip
        """Load a short name (`kvgen models`), a .gguf file or a Hugging Face folder.

        weights: "auto" (4-bit kernels for quantized GGUF files, "16bit" for F16 / BF16 weights),
        "fp32", "16bit", "int8" or "q4"; see kvgen/loading/weight_format.py. dtype: float32 on the CPU, bfloat16 on a GPU by default.
        device: "cpu", or "cuda" for a GPU (float weights, CUDA graph decode; kvgen/models/device.py).
        torch_compile: on a GPU, compile the decode step with torch.compile before its CUDA graphs are
        captured (fused kernels; the first capture compiles); refused on the CPU.
        """
        target = resolve_device(device)
        check_torch_compile(torch_compile, target)
        if target.type != "cpu":
            weights = gpu_weights_mode(check_mode(weights))
        checkpoint = load_checkpoint(name_or_path, dtype or default_dtype(target), progress, weights)
        llm = cls(move_model(build_model(checkpoint), target), checkpoint, max_context, cache)
        llm.model.compile_cuda_graphs = torch_compile
        if torch_compile:
            llm.model.cuda_graphs()  # built now: a model whose steps run without graphs refuses at load
        del checkpoint  # its tensor dictionary and the file's map: freed before the heap is trimmed
        release_freed_memory()
        return llm

    @property
    def device(self) -> torch.device:
        return self.model.device

    def _cpu_only(self, what: str) -> None:
        if self.device.type != "cpu":
            raise ValueError(f"{what} runs on the CPU; this model is on {self.device}, where kvgen runs one "
                             "sequence at a time (generate, stream, generate_n, sessions): load it with device='cpu'")  # fmt: skip

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Serve the LoRA adapter at `path` (a PEFT folder or a GGUF LoRA file) as `name`; requests
        pick it with SamplingParams(adapter=name). AdapterError when it does not fit this model."""
        self._cpu_only("serving LoRA adapters")
        self.adapters.load(name, path)

    def unload_adapter(self, name: str) -> bool:
        """Stop serving `name`: True when gone now; False when running requests still use it (it
        goes when they end; new requests for it are refused at once)."""
        return self.adapters.unload(name)

    def generate(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, on_chunk: ChunkCallback | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> GenerationResult:
        return self.generator.generate(prompt, params, on_chunk, speculative)

    def generate_n(self, prompt: str | Sequence[int], params: SamplingParams) -> list[GenerationResult]:
        """params.n samples that share one prefill of the prompt."""
        return self.generator.generate_n(prompt, params)

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, on_chunk: ChunkCallback | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> GenerationStream:
        return self.generator.stream(prompt, params, on_chunk, speculative)

    def generate_batch(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Several prompts decoded together (one batched forward per step); a result per prompt."""
        self._cpu_only("generate_batch")
        if self._batch is None:
            from kvgen.batch import BatchGenerator  # the engine imports this module's neighbours

            self._batch = BatchGenerator(self)
        return self._batch.generate(prompts, params)

    def use_chat_template(self, source: str) -> None:
        """Format conversations with `source` (Jinja) instead of the model's own chat template."""
        self.tokenizer = self.generator.tokenizer = self.tokenizer.with_chat_template(source)

    def session(self, system_prompt: str | None = None, reply_format: str = "auto") -> Session:
        """A conversation that keeps its cache between turns; `reply_format` says how its chat
        replies split into reasoning and content (auto: found from the model, see kvgen.replies)."""
        return Session(self.generator, system_prompt, reply_format)


load_model = LLM.load
