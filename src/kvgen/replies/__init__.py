"""A chat model's reply as the API hands it out: reasoning, content and tool calls, parsed from the
generated text by the format the model writes (`formats.py`): `<think>` blocks (Qwen3, DeepSeek-R1,
SmolLM3), OpenAI's harmony channels (gpt-oss), or plain text."""

from kvgen.replies.formats import REPLY_FORMATS, ReplyFormat, detect_reply_format, reply_parser, skips_special_tokens
from kvgen.replies.parts import ParsedReply, Part, ReplyParser, parse_reply

__all__ = ["REPLY_FORMATS", "ParsedReply", "Part", "ReplyFormat", "ReplyParser", "detect_reply_format", "parse_reply", "reply_parser", "skips_special_tokens"]
