"""ONNX Runtime GenAI's model builder, taking Gemma 3's RoPE settings as it reads them.

The builder (onnxruntime-genai 0.18.0) reads Gemma 3's RoPE from the config as transformers 4 wrote
it: `rope_parameters` one flat dict with its `rope_type`, the global layers' base in `rope_theta`,
the sliding layers' in `rope_local_base_freq`. transformers 5 writes one dict per layer type
(`{"full_attention": {...}, "sliding_attention": {...}}`), and the builder stops at
`KeyError: 'rope_type'`. This runs the builder's own command line with the config it is handed put
back into that form (the same two bases, nothing else changed); the weights it reads are untouched.

    python benchmarks/peers/ortgenai_builder.py -i HF_FOLDER -o OUT -p int4 -e cpu
"""

from __future__ import annotations

from typing import Any


def flatten_rope(config: Any) -> Any:
    """A config whose `rope_parameters` hold one dict per layer type -> the flat form (in place)."""
    rope = getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict) or "full_attention" not in rope or "sliding_attention" not in rope:
        return config
    full, sliding = dict(rope["full_attention"]), rope["sliding_attention"]
    if full.get("rope_type", "default") != "default" or sliding.get("rope_type", "default") != "default":
        raise ValueError(f"only default RoPE per layer type is put back into the flat form, not {rope}")
    config.rope_parameters = full
    config.rope_theta = full["rope_theta"]
    config.rope_local_base_freq = sliding["rope_theta"]
    return config


class _FlatRopeConfig:
    """Stands in for `AutoConfig` inside the builder module: its configs come back flattened."""

    def __init__(self, auto_config: Any):
        self._auto_config = auto_config

    def from_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        return flatten_rope(self._auto_config.from_pretrained(*args, **kwargs))


def main() -> None:
    from onnxruntime_genai.models import builder

    builder.AutoConfig = _FlatRopeConfig(builder.AutoConfig)  # the config the builder's model classes read
    # The builder module's own `if __name__ == "__main__"` block, at onnxruntime-genai 0.18.0.
    args = builder.get_args()
    extra_options = builder.parse_extra_options(
        args.model_name, args.input, args.output, args.precision, args.execution_provider, args.cache_dir,
        args.extra_options, builder_config_version=args.builder_config_version, target_options=args.target_options,
        drafter_options=args.drafter_options, speculative_options=args.speculative_options,
        runtime_config=args.runtime_config, search=args.search,
    )  # fmt: skip
    builder.create_model(args.model_name, args.input, args.output, args.precision, args.execution_provider,
                         args.cache_dir, **extra_options)  # fmt: skip


if __name__ == "__main__":
    main()
