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
    rank: int | None = None  # 1 + how many tokens are likelier there, where asked for (a prompt's tokens, vLLM's)


def prompt_logprobs(logits: np.ndarray, prompt: Sequence[int], start: int, k: int) -> tuple[TokenLogprob, ...]:
    """The ranked logprobs of the prompt tokens that logits [n, V] of positions start .. start + n - 1 score: row i
    the token at start + i + 1, where the prompt has one (a prompt's last row scores the first new token instead)."""
    tokens = prompt[start + 1:start + 1 + len(logits)]
    return token_logprobs(logits[:len(tokens)], tokens, k, ranks=True)


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], k: int, ranks: bool = False
                   ) -> tuple[TokenLogprob, ...]:
    """logits [n, V]: row i the target's logits at tokens[i]'s position (n == len(tokens)); k: alternatives kept;
    ranks: each token's rank as well. A prompt's rows come 256 at a time: the work stays in the logits' float32, one
    pass each for the max, the exponentials and the ranks, and only the sums go to float64, where a row's
    log-sum-exp loses nothing against its max."""
    z = np.asarray(logits, np.float32)
    rows, ids = np.arange(len(z)), np.asarray(tokens, np.int64)
    peak = z.max(axis=-1, keepdims=True)
    lse = peak[:, 0].astype(np.float64) + np.log(np.exp(z - peak).sum(axis=-1, dtype=np.float64))
    own = z[rows, ids]
    rank = (np.count_nonzero(z > own[:, None], axis=-1) + 1).tolist() if ranks else [None] * len(z)
    out = []
    for i, token in enumerate(ids.tolist()):
        top: tuple[tuple[int, float], ...] = ()
        if k:
            # the k largest, unordered (a partition, not a sort of V; the first largest alone for one), then in order
            head = z[i].argmax(keepdims=True) if k == 1 else np.argpartition(z[i], -k)[-k:]
            head = head[np.lexsort((head, -z[i, head]))]
            top = tuple((int(t), float(z[i, t] - lse[i])) for t in head)
        out.append(TokenLogprob(token, float(own[i] - lse[i]), top, rank[i]))
    return tuple(out)
