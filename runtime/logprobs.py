"""The target's log-probabilities of the tokens a generation commits (OpenAI's `logprobs` / `top_logprobs`).

A pure function of logits the decoders already hold: the row that chose each committed token (a prefill's last
position, a step of the target alone, or a verification row: the accepted window tokens' and the correction's or
bonus'). No forward runs for them, so speculation changes neither the tokens nor their log-probabilities (up to the
float noise between step widths, ~1e-6 on the CPU).

They are the model's own distribution: the log-softmax of the raw logits, before temperature, top_k and top_p (as
OpenAI reports, and vLLM's default "raw_logprobs"). So a sampled token's logprob does not depend on the sampling
options, and a greedy and a sampled generation give the same figure for the same token after the same context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20  # alternatives per token at most, as OpenAI allows


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float  # log-softmax of the target's raw logits at the token's position
    top: tuple[tuple[int, float], ...]  # the k likeliest tokens there and theirs, likeliest first


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], k: int) -> tuple[TokenLogprob, ...]:
    """logits [n, V]: row i the target's logits at tokens[i]'s position (n == len(tokens)); k: alternatives kept."""
    z = logits.astype(np.float64)  # [n, V]; float64 so that a row's log-sum-exp loses nothing against its max
    z -= z.max(axis=-1, keepdims=True)
    z -= np.log(np.exp(z).sum(axis=-1, keepdims=True))
    out = []
    for row, token in zip(z, tokens):
        top: tuple[tuple[int, float], ...] = ()
        if k:
            head = np.argpartition(-row, k - 1)[:k]  # the k largest, unordered: a partition, not a sort of V
            head = head[np.lexsort((head, -row[head]))]
            top = tuple((int(t), float(row[t])) for t in head)
        out.append(TokenLogprob(int(token), float(row[token]), top))
    return tuple(out)
