"""ServerConfig: what `kvgen serve` was started with, validated when built (a bad limit fails at start,
never on a request)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from kvgen.replies.formats import REPLY_FORMATS
from kvgen.server.limits import ServerLimits


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_tokens_limit: int = 4096  # the most a request may ask for
    max_prompt_tokens: int | None = None  # default: the engine's context
    max_concurrent: int = 256  # requests served at once; more get 429
    api_keys: tuple[str, ...] = ()  # more keys (each a tenant: its own prefix-cache namespace)
    allow_priority: bool = False  # honour the `priority` extension (else a request that sets it is a 400)
    # POST /v1/load_lora_adapter reads any path the server can read: off unless asked for.
    allow_runtime_lora: bool = False
    limits: ServerLimits = field(default_factory=ServerLimits)
    # How chat replies are parsed into reasoning, content and tool calls: auto (from the model's
    # vocabulary and chat template), plain, think (<think> blocks) or harmony (gpt-oss).
    reply_format: str = "auto"

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("the served model needs a name")
        for name in ("max_tokens_limit", "max_concurrent"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "max_concurrent" else 1):
                raise ValueError(f"server option {name} must be a positive integer, got {value!r}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"server option max_prompt_tokens must be positive, got {self.max_prompt_tokens}")
        if self.reply_format not in REPLY_FORMATS:
            raise ValueError(f"server option reply_format must be one of {', '.join(REPLY_FORMATS)}, got {self.reply_format!r}")
        for key in self.keys:
            if not key or len(key) > 512 or any(c.isspace() for c in key):
                raise ValueError("an API key must be 1 to 512 characters without whitespace")

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.api_keys + ((self.api_key,) if self.api_key else ())))


def tenant_salt(api_key: str | None, cache_salt: str | None) -> str:
    """The prefix-cache namespace of a request: a hash of its API key (one tenant never hits another's
    blocks) plus the request's own cache_salt."""
    tenant = hashlib.sha256(api_key.encode()).hexdigest()[:32] if api_key else ""
    return f"{tenant}:{cache_salt}" if cache_salt else tenant


def read_keys_file(path: str | Path) -> tuple[str, ...]:
    """API keys, one a line (blank lines and # comments skipped)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise ValueError(f"cannot read the API keys file {path}: {error.strerror}") from error
    keys = tuple(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ValueError(f"the API keys file {path} holds no key")
    return keys
