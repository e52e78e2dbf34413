"""Errors a user can act on.

Every message says what was wrong and what to do about it. The CLI prints a `KvgenError` as one
line on stderr; anything else is a bug and keeps its traceback.
"""


class KvgenError(Exception):
    """Base class for problems caused by input (a path, a file, a prompt, a parameter)."""


class ModelLoadError(KvgenError, ValueError):
    """A model path or file could not be read as a model."""


class UnsupportedModelError(ModelLoadError):
    """The file is readable but uses an architecture or tensor type kvgen does not implement."""


class PromptTooLongError(KvgenError, ValueError):
    """The prompt does not fit in the model's context window."""
