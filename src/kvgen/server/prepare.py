"""Chat and completions requests -> engine jobs (prompt ids + SamplingParams per choice) and the
OutputSpec their responses are written with. Pure work (templates, tokenizing, grammar compiling):
the app runs it off the event loop. Every failure is an APIError (4xx) naming the field."""

from __future__ import annotations

from typing import Any

from kvgen.replies.formats import skips_special_tokens, starts_in_reasoning
from kvgen.server.choices import Job
from kvgen.server.errors import APIError
from kvgen.server.limits import check_count, encode_bounded
from kvgen.server.outputs import OutputSpec
from kvgen.server.params import Sampling, build_params, requested_structure
from kvgen.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, NamedToolChoice, SamplingFields
from kvgen.server.reply_grammar import reply_grammar
from kvgen.server.tools import Tool, ToolPlan, make_plan, render_conversation


def render_chat_prompt(tokenizer, messages: list[dict[str, Any]], plan: ToolPlan, limit: int, param: str = "messages",
                       template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], str]:  # fmt: skip
    """The conversation through the model's chat template (tools shown per `plan`) -> (prompt ids,
    prompt text). A template that rejects the conversation (e.g. roles that do not alternate) is a 400."""
    rendered, template_tools = render_conversation(messages, plan, tokenizer.chat_template_supports_tools)
    try:
        text = tokenizer.apply_chat_template(rendered, tools=template_tools, **(template_kwargs or {}))
    except Exception as error:  # noqa: BLE001 - a template may raise anything on unexpected input
        message = str(error).removeprefix("the model's chat template rejected the conversation: ")
        raise APIError(400, f"the model's chat template rejected these messages: {message[:500]}", param=param,
                       code="invalid_messages") from None  # fmt: skip
    return encode_bounded(tokenizer, text, limit, param, add_special_tokens=False), text


def template_variables(tokenizer, extra: dict[str, Any] | None, reasoning_effort: str | None,
                       effort_param: str = "reasoning_effort") -> dict[str, Any]:  # fmt: skip
    """chat_template_kwargs plus the reasoning effort, each checked to be a variable the chat
    template reads (else it could not change the prompt: a 400 naming it)."""
    variables = dict(extra or {})
    for name in variables:
        if name in _TEMPLATE_OWN or not tokenizer.chat_template_reads(name):
            raise APIError(400, f"chat_template_kwargs: the model's chat template does not take {name!r}: leave it out",
                           param="chat_template_kwargs", code="unsupported_parameter")  # fmt: skip
    if reasoning_effort is not None:
        if not tokenizer.chat_template_reads("reasoning_effort"):
            raise APIError(400, f"{effort_param} is not supported: the served model's chat template takes no reasoning effort",
                           param=effort_param, code="unsupported_parameter")  # fmt: skip
        variables["reasoning_effort"] = reasoning_effort
    return variables


_TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "documents", "bos_token", "eos_token", "pad_token")


def message_dict(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    if message.reasoning_content is not None:  # under both names chat templates read it by
        out["reasoning_content"] = out["thinking"] = message.reasoning_content
    return out


def _turn_end(body: ChatCompletionRequest) -> dict[str, bool]:
    """How the prompt ends: the assistant's turn opened (the default), nothing more, or inside the
    last message (continue_final_message: an assistant reply begun for the model)."""
    if body.continue_final_message:
        if body.add_generation_prompt:
            raise APIError(400, "continue_final_message continues the last message: set add_generation_prompt to false",
                           param="continue_final_message")  # fmt: skip
        if body.messages[-1].role != "assistant":
            raise APIError(400, "continue_final_message continues an assistant message: the last message is "
                                f"{body.messages[-1].role!r}", param="continue_final_message")  # fmt: skip
    return {"add_generation_prompt": body.add_generation_prompt, "continue_final_message": body.continue_final_message}


def vllm_sampling(body: SamplingFields) -> dict[str, Any]:
    """The request's vLLM sampling extensions, as Sampling's fields (chat and completions)."""
    names = ("top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "include_stop_str_in_output")
    return {name: getattr(body, name) for name in names}


def chat_tools(tools, tool_choice, parallel: bool | None, limits) -> ToolPlan:
    check_count("tools", len(tools or []), limits.max_tools)
    specs = [Tool(t.function.name, t.function.description, t.function.parameters or {"type": "object", "properties": {}})
             for t in tools or []]  # fmt: skip
    choice = tool_choice.function.name if isinstance(tool_choice, NamedToolChoice) else tool_choice
    return make_plan(specs, choice, parallel)


def prepare_chat(serving, body: ChatCompletionRequest, adapter: str | None = None) -> tuple[list[Job], OutputSpec]:
    limits, engine = serving.limits, serving.engine.engine
    check_count("messages", len(body.messages), limits.max_messages)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    plan = chat_tools(body.tools, body.tool_choice, body.parallel_tool_calls, limits)
    answer = requested_structure(body)
    if answer is not None and plan.active:
        param = "structured_outputs" if body.structured_outputs is not None else "response_format"
        raise APIError(400, f"{param} cannot be combined with tools (unless tool_choice is 'none')", param=param)
    reply_format = serving.reply_format
    variables = template_variables(engine.tokenizer, body.chat_template_kwargs, body.reasoning_effort) | _turn_end(body)
    ids, prompt_text = render_chat_prompt(engine.tokenizer, [message_dict(m) for m in body.messages], plan, serving.prompt_limit,
                                          template_kwargs=variables)  # fmt: skip
    structured = reply_grammar(reply_format, plan, answer, starts_in_reasoning(prompt_text))
    sampling = Sampling(
        max_tokens=body.max_completion_tokens or body.max_tokens, temperature=body.temperature, top_p=body.top_p,
        n=body.n or 1, seed=body.seed, stop=body.stop, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, logit_bias=body.logit_bias, logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs or 0, ignore_eos=body.ignore_eos, adapter=adapter,
        skip_special_tokens=skips_special_tokens(reply_format), **vllm_sampling(body),
    )  # fmt: skip
    params = build_params(sampling, "chat", serving.config.max_tokens_limit, engine, limits, structured)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    spec = OutputSpec(True, len(params), engine.tokenizer, bool(body.logprobs), plan, include_usage=include_usage,
                      reply_format=reply_format, prompt_text=prompt_text, prediction=body.prediction is not None)  # fmt: skip
    return [(ids, p) for p in params], spec


def _prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def prepare_completions(serving, body: CompletionRequest, adapter: str | None = None) -> tuple[list[Job], OutputSpec, list[list[int]]]:
    """(jobs, spec, the prompts' ids); choices i*n .. i*n+n-1 continue prompt i, with `adapter` (None: the base model)."""
    limits, engine = serving.limits, serving.engine.engine
    prompts = _prompts(body.prompt)
    check_count("prompt", len(prompts), limits.max_prompts)
    n = body.n or 1
    if not prompts or any(len(p) == 0 for p in prompts):
        raise APIError(400, "prompt is empty: give text or token ids", param="prompt")
    check_count("choices (prompts x n)", len(prompts) * n, limits.max_choices)
    if body.best_of not in (None, 1, n):
        raise APIError(400, "best_of other than n is not supported: leave it out or set it to n", param="best_of",
                       code="unsupported_parameter")  # fmt: skip
    prompt_ids = []
    for p in prompts:
        ids = encode_bounded(engine.tokenizer, p, serving.prompt_limit, "prompt") if isinstance(p, str) else p
        serving.check_prompt(ids, "prompt")
        prompt_ids.append(ids)
    echo = None
    if body.echo:
        echo = [p if isinstance(p, str) else engine.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
    sampling = Sampling(
        max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, n=n, seed=body.seed, stop=body.stop,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty, logit_bias=body.logit_bias,
        logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0, ignore_eos=body.ignore_eos, adapter=adapter,
        skip_special_tokens=body.skip_special_tokens, **vllm_sampling(body),
    )  # fmt: skip
    structured = requested_structure(body)
    params = build_params(sampling, "completions", serving.config.max_tokens_limit, engine, limits, structured)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    spec = OutputSpec(False, n, engine.tokenizer, body.logprobs is not None, echo=echo, include_usage=include_usage)
    return [(ids, p) for ids in prompt_ids for p in params], spec, prompt_ids
