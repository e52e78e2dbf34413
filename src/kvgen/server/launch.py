"""`kvgen serve`: build the engine and the app from the CLI options and run uvicorn."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from kvgen.engine.async_engine import AsyncLLMEngine
from kvgen.engine.config import EngineConfig
from kvgen.engine.engine import LLMEngine
from kvgen.server.app import create_app
from kvgen.server.config import ServerConfig, read_keys_file


def build(llm, engine_config: EngineConfig, server_config: ServerConfig):
    """(app, async engine) for an LLM: what `kvgen serve` runs, and what the tests start."""
    engine = AsyncLLMEngine(LLMEngine(llm, engine_config))
    return create_app(engine, server_config), engine


def server_config(args: argparse.Namespace, env_key: str | None) -> ServerConfig:
    """The server options, checked (ValueError) before anything is loaded. Keys: every --api-key and
    the --api-keys-file lines; KVGEN_API_KEY only when neither is given."""
    keys = tuple(args.api_key or ()) + (read_keys_file(args.api_keys_file) if args.api_keys_file else ())
    if not keys and env_key:
        keys = (env_key,)
    name = Path(str(args.model)).stem if Path(str(args.model)).suffix else str(args.model)
    return ServerConfig(name, None, args.max_tokens_limit, max_concurrent=args.max_concurrent, api_keys=keys,
                        allow_priority=args.allow_priority, allow_runtime_lora=args.allow_runtime_lora,
                        reply_format=args.reply_format)  # fmt: skip


def lora_specs(values: list[str] | None, model_name: str) -> list[tuple[str, Path]]:
    """`--lora NAME=PATH` values -> (name, path), checked (ValueError naming the flag) before the
    model loads: the form, a unique name other than the model's, a path that exists."""
    specs: list[tuple[str, Path]] = []
    for value in values or ():
        name, sep, path = value.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"--lora {value!r}: give NAME=PATH (the name requests put in `model`, a PEFT folder or GGUF LoRA file)")
        if name == model_name:
            raise ValueError(f"--lora {value!r}: {name!r} is the base model's name; requests naming it get no adapter: pick another name")
        if any(name == other for other, _ in specs):
            raise ValueError(f"--lora {value!r}: the name {name!r} is given twice")
        if not Path(path).exists():
            raise ValueError(f"--lora {value!r}: no such file or folder {path}")
        specs.append((name, Path(path)))
    return specs


def load_adapters(llm, specs: list[tuple[str, Path]]) -> None:
    """Load the --lora adapters (ValueError naming the flag when one does not fit the model)."""
    for name, path in specs:
        try:
            llm.load_adapter(name, path)
        except ValueError as error:
            raise ValueError(f"--lora {name}={path}: {error}") from None


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        max_tokens_per_step=args.max_tokens_per_step, max_num_seqs=args.max_num_seqs, block_size=args.kv_block_size,
        kv_budget_mb=args.kv_budget_mb, prefix_cache=not args.no_prefix_cache, eviction=args.eviction,
        max_context=args.max_context, kv_cache_dir=args.kv_cache_dir,
        kv_disk_budget_mb=1024.0 if args.kv_disk_budget_mb is None else args.kv_disk_budget_mb,
        speculative_max_batch=args.speculative_max_batch,
    )  # fmt: skip


def serve(args: argparse.Namespace, llm, server_config: ServerConfig, adapters: Sequence[tuple[str, Path]] = ()) -> int:
    """Run the server; `adapters` (from lora_specs) are loaded first, and requests name them in `model`."""
    import uvicorn

    load_adapters(llm, list(adapters))
    app, engine = build(llm, engine_config(args), server_config)
    served = f" with LoRA adapters {', '.join(name for name, _ in adapters)}" if adapters else ""
    print(f"kvgen: serving {server_config.model_name!r}{served} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.shutdown()
    return 0
