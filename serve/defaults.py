"""What a request gets for the generation options it leaves out: the server's defaults, which are OpenAI's.

The library and `mirror-sd generate` decode greedily, 64 tokens (runtime/config.py GenerationConfig), the right
defaults for reproducible runs. An OpenAI client expects otherwise: a request without `temperature` samples at
1.0, a chat request without `max_tokens` runs to the end of the context (a text completion's stops after
COMPLETION_MAX_TOKENS, as OpenAI's and vLLM's do), and one without `seed` gets a different answer each time. The
server applies these over the pipeline's config, in this order (later wins):

1. OPENAI_DEFAULTS;
2. the bundle's `generation_config.json` where there is one (the model's recommended sampling, as vLLM reads it:
   temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens). `mirror-sd export` does not write one; a
   deployer may put the model's own there. vLLM's `--generation-config` picks another source (`GenerationSource`):
   `vllm` none, or a folder holding one; `--override-generation-config` (JSON, the file's keys) goes over it;
3. the generation options given to `mirror-sd serve` (--mode, --max-new-tokens);
4. the request's own fields.

A request without `max_new_tokens` gets the serve command's, else (a text completion) COMPLETION_MAX_TOKENS, else the
generation config's max_new_tokens, else what is left of the context after its prompt, and never more than is left; one
without a seed a random one, which the response reports (header `x-seed`) so that the answer can be had again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from mirror_sd.errors import BadInputError
from mirror_sd.partitions.manifest import GENERATION_CONFIG
from mirror_sd.runtime.config import GenerationConfig, random_seed

OPENAI_DEFAULTS: Mapping[str, Any] = MappingProxyType({"temperature": 1.0})  # OpenAI's API samples by default
COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens: OpenAI's legacy default, and vLLM's
# transformers' generation_config.json keys the server takes, by the GenerationConfig option each one sets (vLLM's)
FROM_HF = {name: name for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")}
# --generation-config's named sources: the bundle's generation_config.json, or none (vLLM's own defaults, here OpenAI's)
GENERATION_SOURCES = ("auto", "vllm")
# formats `--tool-call-parser` reads an answer's tool calls in (serve/tool_parser.py)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic", "mistral", "qwen3_coder")
# reasoning models' think blocks `--reasoning-parser` reads as the message's reasoning (serve/reasoning.py)
REASONING_PARSERS = ("deepseek_r1", "qwen3")
# The serve command's settings that `mirror-sd serve` (mirror_sd/cli.py) and Ray's builder (serve/ray_app.py) both
# read: the generation options whose server-wide default it takes (3. above), where its API key comes from when not
# given (the environment keeps it off `ps`), and its log levels.
SERVE_GENERATION = ("mode", "max_new_tokens")
API_KEY_ENV = "MIRROR_SD_API_KEY"
LOG_LEVELS = ("debug", "info", "warning", "error")


def bundle_defaults(bundle: Path) -> dict[str, Any]:
    """The sampling options of the bundle's generation_config.json ({} where it has none); a file that is not valid
    JSON or holds a value the option does not take is a BadInputError naming the file."""
    path = Path(bundle) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BadInputError(f"{path}: not a readable JSON file: {e}") from None
    if not isinstance(doc, dict):
        raise BadInputError(f"{path}: expected a JSON object")
    return _options(doc, str(path))


def _options(doc: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The options a generation config's keys set, checked (a bad value is a BadInputError naming `where`)."""
    out = {option: doc[key] for key, option in FROM_HF.items() if doc.get(key) is not None}
    try:
        GenerationConfig().updated(**out)
    except BadInputError as e:
        raise BadInputError(f"{where}: {e}", option=e.option) from None
    return out


@dataclass(frozen=True)
class GenerationSource:
    """Where the server's sampling defaults come from (vLLM's --generation-config and --override-generation-config):
    `source` "auto" (the bundle's generation_config.json), "vllm" (none), or a folder holding one; `override`: keys of
    such a file, over the source's. Checked when made: a folder without the file, an unknown key or a bad value is a
    BadInputError."""

    source: str = "auto"
    override: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise BadInputError(f"generation_config must be auto, vllm or a folder, got {self.source!r}",
                                option="generation_config")
        if self.source not in GENERATION_SOURCES and not (Path(self.source) / GENERATION_CONFIG).is_file():
            raise BadInputError(f"generation_config {self.source!r}: not {' or '.join(GENERATION_SOURCES)}, nor a "
                                f"folder holding {GENERATION_CONFIG}", option="generation_config")
        if not isinstance(self.override, Mapping):
            raise BadInputError("override_generation_config must be a JSON object of generation_config.json's keys",
                                option="override_generation_config")
        unknown = sorted(set(self.override) - set(FROM_HF))
        if unknown:
            raise BadInputError(f"override_generation_config: unknown key(s) {', '.join(unknown)}; the server takes "
                                f"{', '.join(FROM_HF)}", option="override_generation_config")
        object.__setattr__(self, "override", dict(self.override))  # a copy Ray can pickle
        _options(self.override, "override_generation_config")
        if self.source not in GENERATION_SOURCES:
            bundle_defaults(Path(self.source))  # read now: a bad file stops the server before it loads anything

    @classmethod
    def given(cls, source: str | None, override: str | Mapping[str, Any] | None) -> GenerationSource:
        """From the serve command's flags or the Ray builder's arguments: the override as JSON text (the command
        line's) or an object (a config file's); None for either: its default."""
        if isinstance(override, str):
            try:
                override = json.loads(override)
            except ValueError:
                raise BadInputError("override_generation_config must be JSON, e.g. '{\"temperature\": 0.6}', got "
                                    f"{override!r}", option="override_generation_config") from None
        return cls(source or "auto", {} if override is None else override)

    def options(self, bundle: Path | None) -> dict[str, Any]:
        """The options this source sets for a server of `bundle` (None: not known yet, as before a Ray replica
        loads it)."""
        if self.source == "auto":
            base = bundle_defaults(bundle) if bundle is not None else {}
        else:
            base = {} if self.source == "vllm" else bundle_defaults(Path(self.source))
        dropped = {FROM_HF[key] for key, value in self.override.items() if value is None}  # null: the key removed
        out = {**base, **_options(self.override, "override_generation_config")}
        return {option: value for option, value in out.items() if option not in dropped}


BUNDLE_SOURCE = GenerationSource()  # --generation-config auto: the bundle's generation_config.json
# a generation config's max_new_tokens among the defaults: a request's default length after the serve command's and a
# text completion's 16 (vLLM's CompletionRequest defaults to 16 before it), ahead of the context's end
MODEL_MAX_NEW_TOKENS = "model_max_new_tokens"


def server_defaults(bundle: Path | None = None, given: Mapping[str, Any] | None = None,
                    source: GenerationSource = BUNDLE_SOURCE) -> Mapping[str, Any]:
    """The server's generation defaults by option name: OpenAI's, then `source`'s (the bundle's generation_config.json
    unless the serve command chose another), then `given` (the serve command's options), checked as a
    GenerationConfig checks them."""
    model = source.options(bundle)
    model_max = model.pop("max_new_tokens", None)  # below a text completion's 16, as vLLM ranks them (resolve)
    out = {**OPENAI_DEFAULTS, **model, **(given or {})}
    GenerationConfig().updated(**out)  # a bad value is refused at start, naming the option
    if model_max is not None:
        out[MODEL_MAX_NEW_TOKENS] = model_max
    return MappingProxyType(out)


def resolve(defaults: Mapping[str, Any], requested: Mapping[str, Any], room: int,
            most: int | None = None) -> dict[str, Any]:
    """The options one request runs with, over the pipeline's config: `requested` over `defaults`, and a random seed
    where neither set one. A request without max_new_tokens gets the serve command's (`defaults`), else `most`, else the
    generation config's, else all there is, within the rest of the context (`room` tokens; at least 1: a prompt that
    fills it is refused by the context check), as vLLM caps it: a default is no reason to refuse a request."""
    out = {**defaults, **requested}
    model_max = out.pop(MODEL_MAX_NEW_TOKENS, None)
    if "max_new_tokens" not in requested:
        out["max_new_tokens"] = max(min(room, defaults.get("max_new_tokens") or most or model_max or room), 1)
    if out.get("seed") is None:  # drawn here, not by the pipeline: the answer's x-seed header reports it
        out["seed"] = random_seed()
    return out
