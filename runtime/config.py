"""`GenerationConfig`: every option of one generation, each default written once, validated when it is made.

A pipeline holds one (`Pipeline.generation_config`: these defaults, with the bundle plan's gamma, kappa and
branch budget merged in). A call takes it, or a config of its own, and overrides by keyword:

    pipe.generate(prompt, max_new_tokens=32)                      # the pipeline's config, one field changed
    cfg = dataclasses.replace(pipe.generation_config, mode="sd")  # a config to reuse
    pipe.generate(prompt, cfg, temperature=0.7)

The CLI, the benchmark and the planner build theirs the same way, so no default lives anywhere else.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from mirror_sd.errors import BadInputError, check_int
from mirror_sd.partitions.plan_file import CONFIDENCE_RULES
from mirror_sd.runtime.prompt_lookup import COPY_SCHEDULES
from mirror_sd.runtime.sampling import SamplingParams

MODES = ("ar", "sd", "mirror")
# How a streaming draft uses its proposals (runtime/draft.py): not at all, self-checked by the next forward, or
# (greedy) the last ones taken as drafted. "verify" windows equal one-token-per-forward windows; "trust" windows
# take fewer forwards. True means "trust", False "off".
STREAMING_MODES = ("off", "verify", "trust")


@dataclass(frozen=True)
class GenerationConfig:
    mode: str = "mirror"  # MODES: the target alone, vanilla speculative decoding, Mirror-SD
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # sampling top-k (0: off)
    seed: int = 0
    stop: tuple[str, ...] = ()  # strings that end the text (a single string is taken as one)
    gamma: int = 4  # draft window length
    kappa: int | None = None  # early-exit candidates per position (None: the bundle's top_k, also the maximum)
    # branches per mirror step (None: adapts while the draft stays hidden; 0: none, every draft step is sd's)
    branch_budget: int | None = None
    # True: the draft runs on a thread of its own where it can work while the target does (mirror's branch sets, a
    # token-only draft reading the prompt during the prefill) or on another device; sd's and budget-0 mirror's
    # requests, each waited for at once, are served inline (Pipeline._threaded). False: the draft always runs on the
    # main thread, the same schedule serially
    overlap: bool = True
    draft_timeout_s: float = 10.0  # a draft answer later than this makes the step run on the target alone
    draft_streaming: str = "trust"  # STREAMING_MODES (or a bool)
    # a draft window ends after a token whose draft probability is below this (transformers' assisted generation
    # calls it assistant_confidence_threshold); 0: every window runs to gamma. Output never depends on it.
    draft_confidence_threshold: float = 0.0
    # what the threshold is compared with after each drafted token (partitions/plan_file.py CONFIDENCE_RULES): that
    # token's draft probability ("token", transformers' rule), or the draft's probability of the whole window so far,
    # the product of its tokens' ("window": for a calibrated draft, the chance the target takes all of it)
    draft_confidence_rule: str = "token"
    # greedy sd / mirror: before each step, speculate or run the target alone, whichever this generation has
    # measured faster (runtime/gate.py), and in mirror roll out a branch set under the suffix or not, likewise;
    # False: every step speculates (mirror's with a branch set, unless its budget is 0). Output never depends on
    # it. Sampling always speculates: the choice is timed, and which steps speculate decides which random draws make
    # the tokens.
    adaptive_speculation: bool = True
    # greedy sd / mirror: where the text's last few tokens (up to max_matching_ngram_size, at least 2) occurred
    # before, verify the (up to) prompt_lookup_num_tokens that followed them instead of a draft window, as
    # transformers' prompt_lookup_num_tokens and OpenVINO GenAI's prompt lookup do. 0: off.
    prompt_lookup_num_tokens: int = 4
    max_matching_ngram_size: int = 3
    # how a copied window's length moves within a generation (runtime/prompt_lookup.py COPY_SCHEDULES): "constant"
    # copies up to prompt_lookup_num_tokens every time; "heuristic" starts there and grows after a window the target
    # accepted whole, shrinks after one it cut short, as transformers' num_assistant_tokens_schedule does
    prompt_lookup_schedule: str = "heuristic"
    trace: bool = False  # True: stats.trace lists every phase as (phase, start_s, end_s)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise BadInputError(f"unknown mode {self.mode!r}; known: {', '.join(MODES)}", option="mode")
        for name, low in (("max_new_tokens", 1), ("top_k", 0), ("seed", 0), ("gamma", 1), ("kappa", 1),
                          ("branch_budget", 0), ("prompt_lookup_num_tokens", 0), ("max_matching_ngram_size", 2)):
            if getattr(self, name) is not None or name not in ("kappa", "branch_budget"):  # those two may be None
                check_int(name, getattr(self, name), low)
        if self.prompt_lookup_schedule not in COPY_SCHEDULES:
            raise BadInputError(f"unknown prompt_lookup_schedule {self.prompt_lookup_schedule!r}; known: "
                                f"{', '.join(COPY_SCHEDULES)}", option="prompt_lookup_schedule")
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise BadInputError(f"temperature must be a finite number >= 0, got {t!r}", option="temperature")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise BadInputError(f"top_p must be in (0, 1], got {self.top_p!r}", option="top_p")
        if self.draft_confidence_rule not in CONFIDENCE_RULES:
            raise BadInputError(f"unknown draft_confidence_rule {self.draft_confidence_rule!r}; known: "
                                f"{', '.join(CONFIDENCE_RULES)}", option="draft_confidence_rule")
        c = self.draft_confidence_threshold
        if not _is_number(c) or not 0 <= c < 1:
            raise BadInputError(f"draft_confidence_threshold must be in [0, 1), got {c!r}",
                                option="draft_confidence_threshold")
        if not isinstance(self.adaptive_speculation, bool):
            raise BadInputError(f"adaptive_speculation must be true or false, got {self.adaptive_speculation!r}",
                                option="adaptive_speculation")
        if not _is_number(self.draft_timeout_s) or not self.draft_timeout_s > 0:
            raise BadInputError(f"draft_timeout_s must be > 0, got {self.draft_timeout_s!r}", option="draft_timeout_s")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
            raise BadInputError("stop must be a list of non-empty strings", option="stop")
        # normalised once here: every reader sees a tuple of strings, a STREAMING_MODES name, floats and bools
        for name, value in (("stop", tuple(stop)), ("draft_streaming", streaming_mode(self.draft_streaming)),
                            ("temperature", float(t)), ("top_p", float(self.top_p)),
                            ("draft_confidence_threshold", float(c)), ("overlap", bool(self.overlap)),
                            ("draft_timeout_s", float(self.draft_timeout_s)), ("trace", bool(self.trace))):
            object.__setattr__(self, name, value)

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.seed)

    def updated(self, **overrides: Any) -> GenerationConfig:
        """A copy with `overrides`; an unknown option is a BadInputError naming it."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise BadInputError(f"unknown generation option(s) {', '.join(unknown)}; known: "
                                f"{', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **overrides) if overrides else self


def streaming_mode(value: bool | str) -> str:
    """A STREAMING_MODES name from a name or a bool (True: "trust", False: "off")."""
    if isinstance(value, bool):
        return "trust" if value else "off"
    if value not in STREAMING_MODES:
        raise BadInputError(f"draft streaming must be one of {', '.join(STREAMING_MODES)}, not {value!r}",
                            option="draft_streaming")
    return value


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
