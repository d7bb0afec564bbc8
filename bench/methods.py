"""The one interface every benchmarked generator implements: the project's own modes and the external baselines.

The harness (bench/runner.py) applies the chat template once and hands every method the same prompt ids, so the
methods compare on identical input; generation stops at EOS or max_new_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

PROJECT_METHODS = ("ar", "sd", "mirror")  # the project's own decoders (bench/pipeline_methods.py)
BASELINE_METHODS = ("hf-generate", "hf-assisted", "ov-genai-sd", "ov-genai-ar", "ov-genai-pld")  # bench/baselines.py


@dataclass
class MethodResult:
    token_ids: list[int]  # new tokens only; an EOS that ended generation is included (as Pipeline does)
    ttft_s: float  # prompt in -> first new token available
    total_s: float  # wall time of the whole generate call
    stats: dict[str, Any] = field(default_factory=dict)  # method-specific extras (may be empty)


@runtime_checkable
class Method(Protocol):
    name: str  # e.g. "hf-generate", "hf-assisted", "ov-genai-sd"

    def generate(self, prompt_ids: list[int], *, max_new_tokens: int, temperature: float,
                 seed: int) -> MethodResult: ...

    def close(self) -> None: ...
