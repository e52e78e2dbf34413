"""Which device a model runs on: the CPU (kvgen's C kernels) or a CUDA GPU (bf16 weights, SDPA,
decode steps replayed from CUDA graphs — models/cuda_graphs.py).

kvgen installs the CPU build of PyTorch; the GPU path needs a CUDA build of the same torch API.
"""

from __future__ import annotations

import torch

from kvgen.models.base import DecoderLM
from kvgen.models.half_linear import C_STEP_LINEARS


def resolve_device(device: str | torch.device) -> torch.device:
    """'cpu', 'cuda' or 'cuda:N' -> a device this process can use, or a ValueError saying why not."""
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from None
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported: use cpu, cuda or cuda:N")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} needs an NVIDIA GPU and a CUDA build of PyTorch; this torch "
                             f"({torch.__version__}) sees none. kvgen installs the CPU wheel: install a CUDA torch "
                             "to run on a GPU, or use device 'cpu'")  # fmt: skip
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return resolved


def check_torch_compile(torch_compile: bool, device: torch.device) -> None:
    """torch_compile compiles the GPU's graph-captured decode step; the CPU's decode runs C kernels."""
    if torch_compile and device.type != "cuda":
        raise ValueError("torch_compile compiles the decode step a GPU captures in CUDA graphs; on the CPU "
                         "decode runs kvgen's C kernels: load without torch_compile (--torch-compile), or with "
                         "device 'cuda'")  # fmt: skip


def default_dtype(device: torch.device) -> str:
    """Weights' compute dtype when none is asked for: fp32 on the CPU, bf16 on a GPU."""
    return "float32" if device.type == "cpu" else "bfloat16"


def gpu_weights_mode(weights: str) -> str:
    """A GPU runs float weights (dequantized to the dtype); the quantized modes are CPU kernels."""
    if weights not in ("auto", "fp32"):
        raise ValueError(f"--weights {weights} runs kvgen's CPU kernels; on a GPU the weights are dequantized to "
                         "the compute dtype (bf16 by default): use weights 'auto' or 'fp32'")  # fmt: skip
    return "fp32"


def move_model(model: DecoderLM, device: torch.device) -> DecoderLM:
    """Move a float-weight decoder onto `device`, keeping a tied head tied (one copy on the GPU)."""
    if device.type == "cpu":
        return model
    if hasattr(model, "new_state_cache"):
        raise ValueError(f"{model.config.architecture} models run on the CPU: the GPU path runs decoder-only "
                         "transformer families (Llama, Qwen, Mistral, Gemma, Phi-3)")  # fmt: skip
    if any(isinstance(m, C_STEP_LINEARS) for m in model.modules()):
        raise ValueError("quantized and 16bit weights run on the CPU kernels: load with weights 'fp32' to run on a GPU")
    tied = model.lm_head.weight.data_ptr() == model.embed_tokens.data_ptr()
    model.to(device)
    if tied:
        model.lm_head.weight = model.embed_tokens
    return model
