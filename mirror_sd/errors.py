"""Typed errors raised at the project's boundaries.

Every error a user can cause derives from MirrorSDError; the CLI prints its message and exits non-zero without a
traceback. Anything else escaping is a bug and keeps its traceback.
"""


class MirrorSDError(Exception):
    """Base class of every error a user can cause (bad input, bad files, failed checks)."""

    exit_code = 2


class BadInputError(MirrorSDError, ValueError):
    """An argument or option the user gave is out of range or inconsistent. `option`: the option at fault where
    one is (e.g. "gamma", "prompt"), for callers that point at it (the server names the request field)."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


class UnsupportedArchitectureError(MirrorSDError):
    """The model's architecture has no exporter here."""


class ManifestError(MirrorSDError):
    """A bundle's manifest is unreadable, of an unknown version, or inconsistent with itself or the bundle."""


class ExportError(MirrorSDError):
    """Exporting a model to ONNX failed."""


class ParityError(ExportError):
    """An exported graph does not reproduce the PyTorch model within tolerance (an error, never a warning)."""


class PackageError(MirrorSDError):
    """A package is unreadable, of an unknown format version, fails a checksum, or has a member that would land
    outside its directory."""


class ContextLimitError(BadInputError):
    """A prompt plus the tokens asked for would not fit the context: the model's positions or the KV buffers the
    runtime allocated (raised before any device work). Where known: the `limit` in tokens, the prompt's tokens, and
    the new tokens asked for (None: the prompt alone is over its limit), for a server to word as OpenAI does."""

    def __init__(self, message: str, limit: int | None = None, prompt_tokens: int | None = None,
                 new_tokens: int | None = None) -> None:
        super().__init__(message)
        self.limit, self.prompt_tokens, self.new_tokens = limit, prompt_tokens, new_tokens


def check_int(name: str, value: object, low: int) -> None:
    """BadInputError unless `value` is an int >= low. A bool is refused although it is an int: `True` given for a
    count is a mistake, never a 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise BadInputError(f"{name} must be an integer >= {low}, got {value!r}", option=name)


def first_line(e: BaseException) -> str:
    """An exception's message cut to its first line (a library's own may run to a page), or its type's name."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
