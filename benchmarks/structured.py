"""Decode speed with and without a JSON-schema constraint, in the same run (target: <= 10% slower).

The constrained run generates greedy JSON for a nested schema until the grammar completes (K tokens);
the unconstrained run decodes the same prompt for exactly K tokens with EOS ignored. Both report
decode tokens/s from the generator's own timings (prefill excluded); the best of --repeats counts.
The grammar's own cost is also measured alone: the tokens are replayed through a fresh constraint,
timing mask + advance per token without any forward pass to hide behind.

    python benchmarks/structured.py --model smollm2 --repeats 3
    python benchmarks/structured.py --model smollm2 --tools   # the server's tool-call grammar instead

--tools: the same schema as the parameters of a `create_order` tool (beside a second tool), the prompt
rendered as the server renders tools (server/tools.py), tool_choice "required", one call: the grammar
is the one a chat request with tools runs under (tags, the tool name, the arguments' schema).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_class, print_table, write_results  # noqa: E402

from kvgen import LLM, SamplingParams, StructuredOutput  # noqa: E402
from kvgen.sampling import grammar as grammar_module  # noqa: E402
from kvgen.sampling.grammar import GrammarConstraint  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                     "email": {"type": "string", "format": "email", "maxLength": 40}},
                     "required": ["name", "email"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "properties": {"product": {"type": "string", "maxLength": 24},
                                             "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["product", "quantity"], "additionalProperties": False}},
    },
    "required": ["customer", "items"], "additionalProperties": False,
}  # fmt: skip


def schema_prompt(llm) -> tuple[list[int], StructuredOutput]:
    message = f"Write an order with a customer and three line items as JSON following this schema: {json.dumps(SCHEMA)}"
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": message}]), add_special_tokens=False)
    return ids, StructuredOutput.json_schema(SCHEMA)


def tool_prompt(llm) -> tuple[list[int], StructuredOutput]:
    from kvgen.server.tools import Tool, make_plan, render_conversation

    tools = [Tool("create_order", "Create an order for a customer", SCHEMA),
             Tool("get_time", "Current time in a timezone", {"type": "object", "properties": {"timezone": {"type": "string"}}})]  # fmt: skip
    plan = make_plan(tools, "required", parallel=False)
    messages = [{"role": "user", "content": "Order three items for Ada Lovelace (ada@example.com)."}]
    rendered, template_tools = render_conversation(messages, plan, llm.tokenizer.chat_template_supports_tools)
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(rendered, tools=template_tools), add_special_tokens=False)
    return ids, plan.structured()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--overlap", action="store_true", help="compute masks on a thread while the forward runs")
    parser.add_argument("--tools", action="store_true", help="generate a tool call under the server's tool grammar")
    args = parser.parse_args()
    grammar_module.OVERLAP_MASK = args.overlap

    llm = LLM.load(args.model, progress=False, weights=args.weights)
    ids, output = tool_prompt(llm) if args.tools else schema_prompt(llm)
    constrained_params = SamplingParams(max_new_tokens=256, structured=output)
    llm.generate(ids, SamplingParams(max_new_tokens=4))  # warm up

    constrained, free, tokens = [], [], []
    for _ in range(args.repeats):  # alternate so both see the same machine load
        result = llm.generate(ids, constrained_params)
        assert result.finish_reason == "stop", "the grammar did not complete: raise max_new_tokens"
        tokens = result.token_ids
        constrained.append(result.timings.decode_tokens_per_second)
        plain = llm.generate(ids, SamplingParams(max_new_tokens=len(tokens), ignore_eos=True))
        free.append(plain.timings.decode_tokens_per_second)

    grammar = GrammarConstraint.create(output, llm.tokenizer)
    vocab = llm.model.config.vocab_size
    started = time.perf_counter()
    for token in tokens:
        grammar.allowed_mask(vocab)
        grammar.advance(token)
    mask_ms = (time.perf_counter() - started) / len(tokens) * 1000

    best_constrained, best_free = max(constrained), max(free)
    # Each pair ran back to back under the same load: the median of the pairs' slowdowns is steadier
    # than one best-of figure on a shared machine.
    paired = sorted((1 - c / f) * 100 for c, f in zip(constrained, free))
    row = {
        "model": args.model, "tokens": len(tokens), "overlap": args.overlap,
        "unconstrained_tok_s": round(best_free, 2), f"{'tool_call' if args.tools else 'json_schema'}_tok_s": round(best_constrained, 2),
        "slowdown_pct": round(statistics.median(paired), 1), "slowdown_pct_best_of": round((1 - best_constrained / best_free) * 100, 1),
        "slowdown_pct_pairs": [round(p, 1) for p in paired],
        "mask_ms_per_token_alone": round(mask_ms, 3), "decode_ms_per_token": round(1000 / best_free, 2),
    }  # fmt: skip
    print_table([row], list(row))
    name = "structured" + ("-tools" if args.tools else "") + ("-overlap" if args.overlap else "") + f"-{cpu_class()}"
    path = write_results(name, {"rows": [row], "repeats": args.repeats, "schema": SCHEMA, "output": llm.tokenizer.decode(tokens)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
