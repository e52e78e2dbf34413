"""Command line: `kvgen generate`, `kvgen chat`, `kvgen serve`, `kvgen models`.

A mistake in the input (a path, a file, a prompt, a parameter) prints one line on stderr and exits
with status 2; only bugs show a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Sequence

from kvgen.config import CACHE_KINDS
from kvgen.errors import KvgenError
from kvgen.result import GenerationResult
from kvgen.loading.registry import DEFAULT_MODEL, KNOWN_MODELS
from kvgen.loading.weight_format import WEIGHT_MODES
from kvgen.replies.formats import REPLY_FORMATS, reply_parser
from kvgen.sampling.grammar import StructuredOutput
from kvgen.sampling.params import SamplingParams

EXIT_USAGE = 2


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", default=DEFAULT_MODEL, help=f"short name, .gguf file or HF folder (default {DEFAULT_MODEL})")
    parser.add_argument("--dtype", default=None, help="compute dtype: float32 (the CPU's default), bfloat16 (a GPU's default), float16")
    parser.add_argument("--weights", default="auto", choices=WEIGHT_MODES,
                        help="auto (default: 4-bit kernels for quantized GGUF, 16bit for F16 / BF16 weights), "
                             "fp32 (exact reference), 16bit (F16 / BF16 kept, fp32 sums), int8, q4")  # fmt: skip
    parser.add_argument("--max-context", type=int, default=None, help="cap the context length (default: the model's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar while loading")


def _add_template_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chat-template-file", default=None, metavar="PATH",
                        help="format conversations with this Jinja chat template instead of the model's own")  # fmt: skip


def _add_device_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu (default), or cuda / cuda:N: a GPU with a CUDA build of "
                        "PyTorch (bf16 float weights, CUDA graph decode; the default cache only)")  # fmt: skip
    parser.add_argument("--torch-compile", action="store_true", help="on a GPU: compile the decode step with "
                        "torch.compile before capturing its CUDA graphs (fused kernels; it compiles at first use)")  # fmt: skip


def _add_kv_options(parser: argparse.ArgumentParser) -> None:
    """The cache options; each kind takes some of them (config.KIND_OPTIONS) and refuses the rest."""
    parser.add_argument("--kv-cache", default="contiguous", choices=CACHE_KINDS, help="KV cache kind (docs/kv-caches.md)")
    parser.add_argument("--kv-window", type=int, default=None, help="window of recent tokens kept (window, sinks, chunked)")
    parser.add_argument("--kv-sinks", type=int, default=4, help="first tokens always kept (sinks; default 4)")
    parser.add_argument("--kv-chunk", type=int, default=None, help="attention chunk size (chunked)")
    parser.add_argument("--kv-extra", type=int, default=0, help="older tokens kept past the window, for exact rewinds (window, chunked)")
    parser.add_argument("--kv-pool-chunk", type=int, default=8, help="positions pooled into one slot (compressed)")
    parser.add_argument("--kv-exact-window", type=int, default=64, help="recent positions kept exact (compressed)")
    parser.add_argument("--kv-hot-tokens", type=int, default=256, help="positions kept in fp32 RAM (tiered)")
    parser.add_argument("--kv-warm-tokens", type=int, default=1024, help="positions kept packed in RAM, the rest on disk (tiered)")
    parser.add_argument("--kv-warm-dtype", default="fp16", help="warm tier packing (tiered): fp32 fp16 bf16 int8")
    parser.add_argument("--kv-dtype-k", default="fp32", help="key storage (quantized cache): fp32 fp16 bf16 fp8 int8 int4 int3 kvquant3")
    parser.add_argument("--kv-dtype-v", default="fp32", help="value storage (quantized cache), as for keys")
    parser.add_argument("--kv-block-size", type=int, default=16, help="tokens per block (paged)")
    parser.add_argument("--kv-budget-mb", type=float, default=512.0, help="size of the block pool (paged; the server's pool)")
    parser.add_argument("--kv-residual", type=int, default=None,
                        help="recent tokens kept in fp32 (quantized, one sequence; default 32)")  # fmt: skip


def _add_sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", "-n", type=int, default=128)
    parser.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeating prompt or output tokens")
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--min-new-tokens", type=int, default=0, help="hold off EOS until this many tokens")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeat for several); not printed")
    parser.add_argument("--include-stop", action="store_true", help="print the stop string that ended the text")
    structured = parser.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE", help="constrain the output to this JSON schema")
    structured.add_argument("--json-object", action="store_true", help="constrain the output to any JSON object")
    structured.add_argument("--regex", help="constrain the output to this regular expression")
    structured.add_argument("--grammar", metavar="FILE", help="constrain the output to a Lark or GBNF (llama.cpp) grammar")
    parser.add_argument("--speculative", default=None, choices=("lookup", "self", "draft", "eagle"),
                        help="speculative decoding: lookup (n-gram in the context), self (first layers), "
                             "draft (--draft-model), eagle (the shipped head)")  # fmt: skip
    parser.add_argument("--draft-tokens", type=int, default=None,
                        help="first draft length, adapting from there (default 4; eagle: one-token drafts)")
    parser.add_argument("--draft-model", default=None, help="draft model for --speculative draft (same tokenizer)")
    parser.add_argument("--draft-weights", default=None, choices=WEIGHT_MODES,
                        help="weights of the draft model (default q4)")
    parser.add_argument("--draft-layers", type=int, default=None, help="layers of the self-draft (default: half)")
    parser.add_argument("--draft-alternatives", type=int, default=None,
                        help="eagle: runner-up first tokens verified beside each draft (greedy only; default 1)")  # fmt: skip
    parser.add_argument("--prediction", default=None, metavar="TEXT",
                        help="the expected output (the text being edited): prompt lookup drafts from it first; "
                             "implies --speculative lookup")  # fmt: skip
    parser.add_argument("--lora", default=None, metavar="PATH",
                        help="apply this LoRA adapter (a PEFT folder or a GGUF LoRA file) without merging it")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgen", description="Run language models from GGUF or Hugging Face files.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="continue a prompt, streaming the text")
    generate.add_argument("prompt")
    generate.add_argument("--chat-template", action="store_true", help="wrap the prompt as a user turn of the chat template")
    _add_model_options(generate)
    _add_template_option(generate)
    _add_device_option(generate)
    _add_kv_options(generate)
    _add_sampling_options(generate)
    chat = commands.add_parser("chat", help="interactive multi-turn chat that keeps its KV cache between turns")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_model_options(chat)
    _add_template_option(chat)
    _add_device_option(chat)
    _add_kv_options(chat)
    _add_sampling_options(chat)
    commands.add_parser("models", help="list the short model names and whether they are installed")
    kv_check = commands.add_parser("kv-check", help="measure each K/V storage dtype on this model and recommend one")
    kv_check.add_argument("model_name", nargs="?", default=None, help="same as --model")
    kv_check.add_argument("--text", default=None, help="calibration text file (default: a built-in passage)")
    kv_check.add_argument("--tokens", type=int, default=512, help="calibration tokens to score")
    _add_model_options(kv_check)
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    serve.add_argument("model_name", nargs="?", default=None, help="same as --model")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", action="append", help="require 'Authorization: Bearer KEY'; repeat for several keys, each its own "
                       "prefix-cache tenant (default: env KVGEN_API_KEY, else none)")  # fmt: skip
    serve.add_argument("--api-keys-file", default=None, help="more API keys, one a line (# comments)")
    serve.add_argument("--allow-priority", action="store_true", help="honour the requests' `priority` field (else it is a 400)")
    serve.add_argument("--allow-runtime-lora", action="store_true",
                       help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (the server then reads "
                            "adapter paths that clients name; guard it with --api-key)")  # fmt: skip
    serve.add_argument("--reply-format", choices=REPLY_FORMATS, default="auto",
                       help="how chat replies split into reasoning_content, content and tool calls: <think> blocks (think), "
                            "gpt-oss's channels (harmony), none (plain); auto reads the model's vocabulary and chat template")  # fmt: skip
    serve.add_argument("--max-tokens-limit", type=int, default=4096, help="the most max_tokens a request may ask for")
    serve.add_argument("--max-concurrent", type=int, default=256, help="requests served at once; more get HTTP 429")
    serve.add_argument("--max-num-seqs", type=int, default=64, help="requests in one batch")
    serve.add_argument("--max-tokens-per-step", type=int, default=512, help="token budget of one forward (chunked prefill)")
    serve.add_argument("--speculative-max-batch", type=int, default=1, metavar="N",
                       help="speculative requests whose drafts cost work (eagle, self) draft only while at most N "
                            "requests decode; lookup always drafts (default 1)")  # fmt: skip
    serve.add_argument("--no-prefix-cache", action="store_true")
    serve.add_argument("--eviction", default="lru", choices=("lru", "lfu"), help="prefix-cache eviction policy")
    serve.add_argument("--kv-cache-dir", default=None, metavar="DIR",
                       help="keep evicted prefix-cache blocks on disk here, across restarts (one server per directory)")
    serve.add_argument("--lora", action="append", default=None, metavar="NAME=PATH",
                       help="serve this LoRA adapter (PEFT folder or GGUF LoRA file) as NAME: requests pick it with "
                            "model=NAME; repeat for several")  # fmt: skip
    serve.add_argument("--lora-budget-mb", type=float, default=None, metavar="MB",
                       help="the most MiB of LoRA weights in RAM: idle adapters past it are evicted (least recently used) "
                            "and read again from their file on next use (default: no limit)")  # fmt: skip
    serve.add_argument("--kv-disk-budget-mb", type=float, default=None,
                       help="the most MB of block files in --kv-cache-dir (default 1024); least recently used go first")
    _add_model_options(serve)
    _add_template_option(serve)
    _add_kv_options(serve)  # the engine's pool: fp32 blocks (contiguous, paged) or quantized blocks
    _add_replica_options(serve)
    return parser


def _add_replica_options(parser: argparse.ArgumentParser) -> None:
    """Replicas of the engine on Ray Serve (pip install kvgen[ray]; docs/scaling.md)."""
    group = parser.add_argument_group("replicas (Ray Serve)")
    group.add_argument("--replicas", type=int, default=None, help="run N engine replicas on Ray Serve, routed by prefix cache")
    group.add_argument("--ray-address", default=None, help="join this Ray cluster ('auto': the one `ray start` runs here)")
    group.add_argument("--min-replicas", type=int, default=None, help="autoscale: the fewest replicas")
    group.add_argument("--max-replicas", type=int, default=None, help="autoscale: the most replicas")
    group.add_argument("--target-ongoing-requests", type=float, default=None, help="autoscale: requests per replica to aim at")
    group.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica (its torch threads)")
    group.add_argument("--router", default="prefix", choices=("prefix", "pow2"),
                       help="prefix: to the replica holding the prompt's prefix (default); pow2: Ray's power of two choices")
    group.add_argument("--router-imbalance", type=int, default=8,
                       help="queued requests the prefix match may have over the least loaded replica (default 8)")


def _structured(args: argparse.Namespace) -> StructuredOutput | None:
    from pathlib import Path

    def read(path: str, what: str) -> str:
        if not Path(path).is_file():
            raise ValueError(f"{what} file {path!r} not found: give a readable file")
        return Path(path).read_text()

    if args.json_schema:
        return StructuredOutput.json_schema(read(args.json_schema, "--json-schema"))
    if args.json_object:
        return StructuredOutput.json_object()
    if args.regex:
        return StructuredOutput.regex(args.regex)
    if args.grammar:
        text = read(args.grammar, "--grammar")
        return StructuredOutput.gbnf(text) if "::=" in text else StructuredOutput.lark(text)
    return None


def _sampling(args: argparse.Namespace) -> SamplingParams:
    if args.include_stop and not args.stop:
        raise ValueError("--include-stop prints the stop string that ended the text: give one with --stop")
    return SamplingParams(
        max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty, seed=args.seed,
        stop=tuple(args.stop), structured=_structured(args), include_stop_str_in_output=args.include_stop,
    )  # fmt: skip


def _cache_config(args: argparse.Namespace, engine: bool = False):  # -> CacheConfig
    """The cache options as one CacheConfig. For the engine (`serve`) --kv-block-size and
    --kv-budget-mb size its block pool (EngineConfig), whatever the kind, so they stay out of it."""
    from kvgen.config import CacheConfig

    if not hasattr(args, "kv_cache"):  # kv-check takes no cache options: it scores every K/V dtype itself
        return CacheConfig()
    block_size, budget_mb = (16, 512.0) if engine else (args.kv_block_size, args.kv_budget_mb)
    return CacheConfig(
        args.kv_cache, block_size, budget_mb, args.kv_dtype_k, args.kv_dtype_v, residual=args.kv_residual,
        window=args.kv_window, extra=args.kv_extra, sinks=args.kv_sinks, chunk=args.kv_chunk,
        pool_chunk=args.kv_pool_chunk, exact_window=args.kv_exact_window, hot_tokens=args.kv_hot_tokens,
        warm_tokens=args.kv_warm_tokens, warm_dtype=args.kv_warm_dtype,
    )  # fmt: skip


def _load(args: argparse.Namespace, engine: bool = False):  # -> LLM; imported lazily so `kvgen models` starts fast
    from kvgen.llm import LLM

    cache = _cache_config(args, engine)  # checked before the model loads: a bad option fails fast
    if engine:
        from kvgen.cache_factory import check_engine_cache

        check_engine_cache(cache)
    template = _read_template(getattr(args, "chat_template_file", None))
    llm = LLM.load(
        args.model, dtype=args.dtype, progress=not args.no_progress, max_context=args.max_context,
        weights=args.weights, cache=cache, device=getattr(args, "device", "cpu"),
        torch_compile=getattr(args, "torch_compile", False),
    )  # fmt: skip
    if template is not None:
        try:
            llm.use_chat_template(template)
        except ValueError as error:
            raise ValueError(f"--chat-template-file {args.chat_template_file}: {error}") from None
    return llm


def _read_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return open(path, encoding="utf-8").read()
    except OSError as error:
        raise ValueError(f"--chat-template-file {path}: cannot read it ({error.strerror})") from None


# The options that only mean something with --speculative (or --prediction, which implies lookup).
SPECULATIVE_OPTIONS = ("draft_tokens", "draft_model", "draft_weights", "draft_layers", "draft_alternatives")


def _speculative(args: argparse.Namespace):  # -> SpeculativeConfig | None
    if args.prediction is not None and args.speculative not in (None, "lookup"):
        raise ValueError(f"--prediction drafts by prompt lookup, which --speculative {args.speculative} replaces: "
                         "leave --speculative out or use lookup")  # fmt: skip
    method = args.speculative or ("lookup" if args.prediction is not None else None)
    if method is None:
        if given := [name for name in SPECULATIVE_OPTIONS if getattr(args, name) is not None]:
            raise ValueError(f"--{given[0].replace('_', '-')} is only used with --speculative: add --speculative")
        return None
    from kvgen.llm import LLM
    from kvgen.speculative.config import SpeculativeConfig

    draft = None
    for name in ("draft_model", "draft_weights"):
        if method != "draft" and getattr(args, name) is not None:
            raise ValueError(f"--{name.replace('_', '-')} is only used by --speculative draft, not {method}")
    if method == "draft":
        if args.draft_model is None:
            raise ValueError("--speculative draft needs --draft-model (a model with the same tokenizer)")
        draft = LLM.load(args.draft_model, progress=False, weights=args.draft_weights or "q4")
    return SpeculativeConfig(
        method, num_draft_tokens=args.draft_tokens, draft_model=draft, draft_layers=args.draft_layers,
        draft_alternatives=args.draft_alternatives, prediction=args.prediction,
    )  # fmt: skip


def stats_line(result: GenerationResult) -> str:
    t, u = result.timings, result.usage
    cached = f" ({u.cached_tokens} cached)" if u.cached_tokens else ""
    return (
        f"[prompt {u.prompt_tokens} tokens{cached}, generated {u.completion_tokens} tokens | "
        f"prefill {t.prefill_tokens_per_second:.1f} tok/s, decode {t.decode_tokens_per_second:.1f} tok/s"
        + (f", draft acceptance {result.speculative.acceptance_rate:.0%}" if result.speculative else "")
        + "]"
    )


def _with_adapter(llm, args: argparse.Namespace, params: SamplingParams) -> SamplingParams:
    """--lora: load the adapter and have every request use it."""
    if args.lora is None:
        return params
    llm.load_adapter("lora", args.lora)
    return dataclasses.replace(params, adapter="lora")


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling(args)
    speculative = _speculative(args)
    llm = _load(args)
    params = _with_adapter(llm, args, params)
    prompt = args.prompt
    if args.chat_template:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    stream = llm.stream(prompt, params, speculative=speculative)
    if not args.chat_template:
        print(args.prompt, end="", flush=True)
    for chunk in stream:
        print(chunk.text, end="", flush=True)
    print()
    print(stats_line(stream.result), file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling(args)
    speculative = _speculative(args)
    llm = _load(args)
    params = _with_adapter(llm, args, params)
    session = llm.session(system_prompt=args.system)
    print("kvgen chat: type a message; /reset starts over, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            session = llm.session(system_prompt=args.system)
            continue
        if not line:
            continue
        parser = reply_parser(session.reply_format, session.generator.tokenizer.apply_chat_template(
            session.messages + [{"role": "user", "content": line}]))  # fmt: skip
        for chunk in session.chat(line, params, speculative):
            _print_parts(parser.feed(chunk.text))
        _print_parts(parser.feed("", final=True))
        print()
        assert session.last_result is not None
        print(stats_line(session.last_result), file=sys.stderr)


def _print_parts(parts: list) -> None:
    """A chat reply as it streams: reasoning on stderr (so stdout holds only answers), the rest on stdout."""
    for part in parts:
        if part.kind == "reasoning":
            print(part.text, end="", file=sys.stderr, flush=True)
        elif part.kind == "call":
            print(f"\n[call {part.text}] ", end="", flush=True)
        else:
            print(part.text, end="", flush=True)


def cmd_models(_: argparse.Namespace) -> int:
    for name, known in KNOWN_MODELS.items():
        try:
            path = known.locate()
        except Exception as error:  # a half-installed package should not hide the others
            path, note = None, f"broken install ({error})"
        else:
            note = str(path) if path else f"not installed: {known.install_hint}"
        print(f"{name:14s} {known.description}\n{'':14s} {note}")
    from kvgen.families import family_table

    print("\nModel families (any GGUF / HF folder of these architectures):")
    print(family_table())
    return 0


def cmd_kv_check(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvgen.kv_check import CALIBRATION_TEXT, check, report

    if args.model_name:
        args.model = args.model_name
    if args.text and not Path(args.text).is_file():
        raise ValueError(f"calibration text {args.text!r} not found: give a readable text file")
    text = Path(args.text).read_text(errors="replace") if args.text else CALIBRATION_TEXT
    llm = _load(args)
    ids = llm.tokenizer.encode(text)[: args.tokens + 1]
    if len(ids) < 64:
        raise ValueError(f"the calibration text has only {len(ids)} tokens; give at least 64")
    exact, results = check(llm.model, llm.tokenizer, ids)
    print(f"{llm.path.name}: {len(ids) - 1} calibration tokens, exact-cache perplexity {exact.perplexity:.3f}")
    print(report(results))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from kvgen.server.launch import lora_specs, serve, server_config

    if args.model_name:
        args.model = args.model_name
    if args.kv_disk_budget_mb is not None and args.kv_cache_dir is None:
        raise ValueError("--kv-disk-budget-mb limits the disk tier: also pass --kv-cache-dir DIR (or drop it)")
    config = server_config(args, env_key=os.environ.get("KVGEN_API_KEY"))  # bad options fail before the model loads
    adapters = lora_specs(args.lora, config.model_name)
    if args.lora_budget_mb is not None and not args.lora_budget_mb > 0:
        raise ValueError(f"--lora-budget-mb must be a positive number of MiB, got {args.lora_budget_mb}")
    if args.replicas is not None or args.ray_address is not None:
        if adapters or args.lora_budget_mb is not None:
            raise ValueError("--lora is not supported with --replicas yet: serve adapters from one server (drop --replicas)")
        if args.chat_template_file is not None:
            raise ValueError("--chat-template-file is not supported with --replicas yet: serve from one server (drop --replicas)")
        return _serve_replicas(args, config)
    _refuse_replica_options(args)
    llm = _load(args, engine=True)
    if args.lora_budget_mb is not None:
        llm.adapters.set_budget(args.lora_budget_mb)
    return serve(args, llm, config, adapters)


def _refuse_replica_options(args: argparse.Namespace) -> None:
    given = [f"--{n.replace('_', '-')}" for n in ("min_replicas", "max_replicas", "target_ongoing_requests") if getattr(args, n) is not None]
    given += ["--router"] * (args.router != "prefix") + ["--replica-cpus"] * (args.replica_cpus != 1.0)
    if given:
        raise ValueError(f"{given[0]} configures replicas: also pass --replicas N (or --ray-address)")


def _serve_replicas(args: argparse.Namespace, config) -> int:
    """Each replica loads the model itself: only the options are checked here."""
    from kvgen.cache_factory import check_engine_cache
    from kvgen.server.launch import engine_config

    try:
        from kvgen.replicas.launch import serve_replicas
    except ImportError as error:
        raise ValueError(f"--replicas runs on Ray Serve, which is not installed ({error}): pip install 'kvgen[ray]'") from None
    from kvgen.replicas.options import ReplicaOptions, ReplicaSpec

    if args.kv_cache_dir is not None and (args.replicas or 1) + (args.max_replicas or 0) > 1:
        raise ValueError("--kv-cache-dir is one server's directory: replicas cannot share it; drop it with --replicas")
    cache = _cache_config(args, engine=True)
    check_engine_cache(cache)
    options = ReplicaOptions(
        replicas=1 if args.replicas is None else args.replicas, min_replicas=args.min_replicas,
        max_replicas=args.max_replicas, target_ongoing_requests=args.target_ongoing_requests,
        cpus_per_replica=args.replica_cpus, max_ongoing_requests=args.max_num_seqs, router=args.router,
        imbalance=args.router_imbalance,
    )  # fmt: skip
    load = {"dtype": args.dtype, "weights": args.weights, "max_context": args.max_context, "cache": cache}
    spec = ReplicaSpec(str(args.model), load, engine_config(args), config)
    return serve_replicas(spec, options, args.host, args.port, args.ray_address)


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "models": cmd_models, "kv-check": cmd_kv_check, "serve": cmd_serve}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (KvgenError, ValueError) as error:
        # ValueError: parameter validation (SamplingParams, dtype) and the generator's input checks.
        print(f"kvgen: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
