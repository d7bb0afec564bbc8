"""The verification core shared by sd and mirror: pure functions, no threads, no sessions.

The target ran on [pending] + window (gamma + 1 positions); its logits at position i give the target's token for
window slot i, and position gamma gives the bonus token. A `Verdict` says how many window tokens are accepted (A)
and which token follows them (the correction at slot A, or the bonus when A == gamma).

- Greedy (temperature 0): accept the longest prefix where the window equals the target's argmax; the correction
  is the argmax at slot A. The output is the target's greedy output token for token.
- Sampling (the paper's sample-and-match, both sides drawing with one number): each row draws the target's own token
  with the random stream of its position, as the target alone draws there, and the window is accepted while it equals
  those draws; the token after them is the target's draw at the first row that differs (or the bonus row's). The
  committed tokens are the target alone's under the same seed, in every mode and beside any other requests (up to the
  rounding of a window row against a one-token step: a draw within about 1e-6 of the boundary between two tokens can
  go to the other one, as a greedy near-tie can), so they follow its distribution exactly, whatever proposed the
  window. A draft draws its window with the same numbers (runtime/draft.py: the target's stream at each position, by
  inverse CDF over token ids), so its token and the target's agree wherever the two distributions put that number on
  the same token: fewer windows taken than speculative sampling with residual resampling at high temperatures
  (docs/design.md: Sampling: the target's own draws), for a seed that gives one text whatever the mode or the load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from mirror_sd.runtime.sampling import SamplingParams, choose


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
    """Sampled: row i's token is the target's own draw with rng_at(i), the stream of its position;
    target_logits [gamma+1, V]."""
    for i, token in enumerate(window):
        own = choose(target_logits[i], params, rng_at(i))
        if own != token:
            return Verdict(i, own)
    return Verdict(len(window), choose(target_logits[len(window)], params, rng_at(len(window))))


def verify(window: tuple[int, ...], target_logits: np.ndarray, params: SamplingParams,
           rng_at: Callable[[int], np.random.Generator] | None) -> Verdict:
    """rng_at(i): the random stream of the window's row i (runtime/sampling.py target_streams), for sampling."""
    if params.greedy:
        return greedy_accept(window, target_logits)
    if rng_at is None:
        raise ValueError("sampled verification draws with each row's own stream (rng_at)")
    return own_draws_accept(window, target_logits, params, rng_at)
