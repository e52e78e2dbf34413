"""A Session records a reasoning model's turn as its content, with the reasoning beside it for the
chat template to show again or drop."""

from __future__ import annotations

import copy
from pathlib import Path

from kvgen.llm import LLM
from kvgen.sampling.params import SamplingParams
from kvgen.session import Session

THINK_TEMPLATE = (Path(__file__).parent / "think_template.jinja").read_text()


def test_a_turn_keeps_its_reasoning_apart_from_its_content(smollm2: LLM) -> None:
    generator = copy.copy(smollm2.generator)  # the shared model, another template
    generator.tokenizer = smollm2.tokenizer.with_chat_template(THINK_TEMPLATE)
    session = Session(generator)
    assert session.reply_format == "think"
    text = "".join(chunk.text for chunk in session.chat("What is 2+2?", SamplingParams(max_new_tokens=12)))
    assert text == session.last_result.text != ""
    assert (session.last_reply.reasoning, session.last_reply.content) == (text, "")  # the template opened the block
    assert session.messages[-1] == {"role": "assistant", "content": "", "reasoning_content": text, "thinking": text}
    list(session.chat("And 3+3?", SamplingParams(max_new_tokens=4)))
    assert len(session.messages) == 4 and session.last_result.usage.cached_tokens > 0
    plain = Session(smollm2.generator, reply_format="plain")
    list(plain.chat("Hi", SamplingParams(max_new_tokens=4)))
    assert plain.messages[-1] == {"role": "assistant", "content": plain.last_result.text}
    session.close()
    plain.close()
