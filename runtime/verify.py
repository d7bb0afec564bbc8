"""The verification core shared by sd and mirror: pure functions, no threads, no sessions.

The target ran on [pending] + window (gamma + 1 positions); its logits at position i give the target's token for
window slot i, and position gamma gives the bonus token. A `Verdict` says how many window tokens are accepted (A)
and which token follows them (the correction at slot A, or the bonus when A == gamma).

- Greedy (temperature 0): accept the longest prefix where the window equals the target's argmax; the correction
  is the argmax at slot A. The output is the target's greedy output token for token.
- Sampling: standard speculative sampling with residual resampling (Leviathan et al. 2023, Chen et al. 2023),
  not the paper's sample-and-match. Window token x_i was drawn from the draft's warped distribution q_i; it is
  accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the correction is drawn from
  norm(max(0, p_i - q_i)); if all are accepted the bonus is drawn from p_gamma. Each committed token then follows
  the target's warped distribution p exactly, whatever q is (tests/test_runtime_sampling.py measures it).
- A window proposed for sure (no draft logits: a grammar's forced tokens), sampled: each row draws the target's own
  token with the random stream of its position, as the target alone draws there, and the window is accepted while it
  equals those draws. A token is then accepted with probability p_i(x_i), as speculative sampling accepts a proposal
  of probability 1, and the committed tokens are the target alone's under the same seed (up to the rounding of a
  window row against a one-token step: a draw within about 1e-6 of the boundary between two tokens can go to the
  other one, as a greedy near-tie can).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from mirror_sd.runtime.sampling import SamplingParams, choose, sample, warp


@dataclass(frozen=True)
class Verdict:
    accepted: int  # A: window tokens accepted, 0..gamma
    token: int  # the target's own token after them: correction (A < gamma) or bonus (A == gamma)

    def committed(self, window: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(window[: self.accepted]) + (self.token,)


def greedy_accept(window: tuple[int, ...], target_logits: np.ndarray) -> Verdict:
    """window: gamma draft tokens; target_logits [gamma+1, V] from the target run on [pending] + window."""
    target_tokens = np.argmax(target_logits, axis=-1)  # [gamma+1]
    accepted = 0
    while accepted < len(window) and window[accepted] == target_tokens[accepted]:
        accepted += 1
    return Verdict(accepted, int(target_tokens[accepted]))


def own_draws_accept(window: tuple[int, ...], target_logits: np.ndarray, params: SamplingParams,
                     rng_at: Callable[[int], np.random.Generator]) -> Verdict:
    """A window proposed for sure, sampled: row i's token is the target's own draw with rng_at(i), the stream of
    its position; target_logits [gamma+1, V]."""
    for i, token in enumerate(window):
        own = choose(target_logits[i], params, rng_at(i))
        if own != token:
            return Verdict(i, own)
    return Verdict(len(window), choose(target_logits[len(window)], params, rng_at(len(window))))


def speculative_accept(window: tuple[int, ...], draft_logits: np.ndarray, target_logits: np.ndarray,
                       params: SamplingParams, rng: np.random.Generator) -> Verdict:
    """Speculative sampling. draft_logits [gamma, V]: the logits each window token was sampled from (warped
    with the same params); target_logits [gamma+1, V]."""
    for i, token in enumerate(window):
        p, q = warp(target_logits[i], params), warp(draft_logits[i], params)
        if rng.random() * q[token] < p[token]:  # accept with probability min(1, p/q); q[token] > 0 as it was drawn
            continue
        residual = np.maximum(p - q, 0.0)
        # p != q wherever a rejection can happen, so the residual has mass; the guard covers rounding only.
        return Verdict(i, sample(residual if residual.sum() > 0 else p, rng))
    return Verdict(len(window), sample(warp(target_logits[len(window)], params), rng))


def verify(window: tuple[int, ...], draft_logits: np.ndarray | None, target_logits: np.ndarray,
           params: SamplingParams, rng_at: Callable[[int], np.random.Generator] | None) -> Verdict:
    """rng_at(i): the random stream of the window's row i (runtime/sampling.py target_streams); speculative sampling
    draws the whole step from row 0's, a window proposed for sure (draft_logits None) each row from its own."""
    if params.greedy:
        return greedy_accept(window, target_logits)
    if rng_at is None:
        raise ValueError("sampled verification draws with each row's own stream (rng_at)")
    if draft_logits is None:
        return own_draws_accept(window, target_logits, params, rng_at)
    return speculative_accept(window, draft_logits, target_logits, params, rng_at(0))
