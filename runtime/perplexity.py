"""The perplexity of a text under the target, to compare a model's precisions (float32, int8, int4) on the user's own
text, computed as transformers' strided recipe does (llama.cpp's `llama-perplexity` scores the second halves of
chunks that do not overlap instead: its figures differ).

The text's tokens run in windows of `window` tokens, each beginning `stride` after the previous one's beginning; every
token after the first is scored once, from the logits of the row before it in the first window that holds it
(GenerationConfig.prompt_logprobs), so every token after the first window is scored with at least window - stride
tokens before it. A window is one prefill of the target as deployed (its precision, its backend).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mirror_sd.errors import BadInputError

if TYPE_CHECKING:
    from mirror_sd.runtime.pipeline import Pipeline

WINDOW = 512  # tokens per window by default, where the context holds them (llama-perplexity's default context)


@dataclass(frozen=True)
class Perplexity:
    perplexity: float  # exp(nll)
    nll: float  # mean negative log-likelihood per scored token, in nats
    tokens: int  # tokens scored (all but the text's first)
    windows: int
    window: int
    stride: int

    def as_dict(self) -> dict[str, float | int]:
        return {"perplexity": self.perplexity, "nll": self.nll, "tokens": self.tokens, "windows": self.windows,
                "window": self.window, "stride": self.stride}


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """The windows over n tokens: (begin, end, first scored position); the scored positions [first, end) of the
    windows together are 1 .. n - 1, each once."""
    out, scored_to = [], 1
    for begin in range(0, n - 1, stride):
        end = min(begin + window, n)
        if end > scored_to:
            out.append((begin, end, scored_to))
            scored_to = end
        if end == n:
            break
    return out


def perplexity(pipe: Pipeline, ids: Sequence[int], window: int | None = None, stride: int | None = None,
               progress: Callable[[int, int], None] | None = None) -> Perplexity:
    """The perplexity of `ids` (token ids, at least two) under the pipeline's target; window defaults to WINDOW (or
    what the context holds), stride to half the window. progress(done, total) is called after each window."""
    for name, value in (("window", window), ("stride", stride)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise BadInputError(f"the {name} must be a whole number of tokens, not {value!r}", option=name)
    window = min(WINDOW, pipe.longest_prompt) if window is None else window
    stride = window // 2 if stride is None else stride
    if window < 2:
        raise BadInputError(f"the window must hold at least 2 tokens, not {window}", option="window")
    if not 1 <= stride < window:  # windows overlap: each one's first token is scored in the window before it
        raise BadInputError(f"the stride must be in [1, {window - 1}] (below the window), not {stride}",
                            option="stride")
    if window > pipe.longest_prompt:  # a window's prefill, and the one token generated after it
        raise BadInputError(f"a window of {window} tokens does not fit: this target takes prompts of at most "
                            f"{pipe.longest_prompt} tokens with one generated after them", option="window")
    if len(ids) < 2:
        raise BadInputError("the text must have at least 2 tokens: the first is never scored", option="prompt")
    spans = windows(len(ids), window, stride)
    total, count = 0.0, 0
    for i, (begin, end, first) in enumerate(spans):
        result = pipe.generate(list(ids[begin:end]), mode="ar", max_new_tokens=1, prompt_logprobs=0)
        scores = result.prompt_logprobs[first - begin:]
        total -= math.fsum(s.logprob for s in scores)
        count += len(scores)
        if progress is not None:
            progress(i + 1, len(spans))
    nll = total / count
    return Perplexity(math.exp(nll), nll, count, len(spans), window, stride)
