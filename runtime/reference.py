"""A slow, single-threaded reference generator: the second oracle for the fast decoders.

No KV cache is kept between forwards: every forward runs the whole sequence from an empty cache, so none of the
scheduler's cache trimming, branching or threading is involved. Greedy only, with a generation's penalties where
`params` gives some (runtime/sampling.py penalize) and its grammar's masks where `grammar` holds one. gamma 0 is
plain target decoding; gamma > 0 is vanilla speculative decoding with the draft, which must give the same tokens.
confidence > 0 ends a window after a token the draft gives a probability below it
(GenerationConfig.draft_confidence_threshold), or, with rule "window", after the token where the product of the
window's probabilities falls below it.
`reference_logprobs` gives the target's log-probabilities of a generation's tokens from one forward over the whole
sequence: the oracle for the decoders' logprobs (runtime/logprobs.py); `reference_prompt_logprobs` the prompt's.

A feature draft (runtime/feature_draft.py) reads the target's taps: every input of the committed sequence with
the taps of the position before it, from a prefix run over the whole sequence; each drafted input with the
draft's own hidden state one position back (the surrogate).
"""

from __future__ import annotations

import numpy as np

from mirror_sd.partitions.manifest import DRAFT_HIDDEN, FEATURES, LOGITS, STREAM_IDS, SURROGATE, USE_SURROGATE
from mirror_sd.runtime.engines import DraftEngine
from mirror_sd.runtime.feature_draft import empty_channel
from mirror_sd.runtime.grammar import GrammarState
from mirror_sd.runtime.logprobs import TokenLogprob
from mirror_sd.runtime.sampling import SamplingParams, penalize, probability
from mirror_sd.runtime.target import Target


def reference_generate(target: Target, draft: DraftEngine | None, prompt: list[int], max_new_tokens: int,
                       gamma: int = 0, eos_token_ids: tuple[int, ...] = (), confidence: float = 0.0,
                       rule: str = "token", params: SamplingParams | None = None,
                       grammar: GrammarState | None = None) -> list[int]:
    """The new tokens (up to and including the first EOS) of greedy decoding of `prompt` (held to a
    grammar where `grammar` is a fresh state of one)."""
    params = params or SamplingParams()
    if not params.greedy:
        raise ValueError("the reference generator is greedy only")

    def target_tokens(seq: list[int], window: list[int]) -> np.ndarray:
        """The target's greedy token after seq and after each of window's tokens: [len(window) + 1]."""
        logits, _ = target.forward(seq + window, target.empty_cache())
        return np.argmax(penalize(logits[len(seq) - 1:], params, seq, len(prompt), window, grammar), axis=-1)

    seq = list(prompt)
    new: list[int] = []
    while len(new) < max_new_tokens and not (new and new[-1] in eos_token_ids):
        # 1. the draft proposes a window, one token at a time (never more than could be committed)
        size = min(gamma, max_new_tokens - len(new) - 1) if draft is not None else 0
        window = reference_window(target, draft, seq, size, confidence, rule)[0] if size else []
        # 2. the target scores the sequence with the window: its token after seq[-1], after window[0], ...
        choices = target_tokens(seq, window)  # [len(window) + 1]
        # 3. accept the longest prefix of the window the target agrees with, then the target's own token
        accepted = 0
        while accepted < len(window) and window[accepted] == choices[accepted]:
            accepted += 1
        for token in window[:accepted] + [int(choices[accepted])]:
            if len(new) < max_new_tokens and not (new and new[-1] in eos_token_ids):
                new.append(token)
        seq = list(prompt) + new
    return new


def reference_logprobs(target: Target, prompt: list[int], new: list[int], k: int = 0) -> list[TokenLogprob]:
    """Each of `new`'s tokens (a generation from `prompt`) with its log-probability under the target and the k
    likeliest tokens at its position, from one forward over prompt + new[:-1] from an empty cache."""
    logits, _ = target.forward(list(prompt) + list(new[:-1]), target.empty_cache())
    return _scored(logits[len(prompt) - 1:], new, k)  # row i chose new[i]


def reference_prompt_logprobs(target: Target, prompt: list[int], k: int = 0) -> list[TokenLogprob | None]:
    """Each prompt token's log-probability, rank and k likeliest alternatives under the target (None for the first),
    from one forward over the prompt from an empty cache."""
    logits, _ = target.forward(list(prompt), target.empty_cache())
    return [None, *_scored(logits[:-1], prompt[1:], k, ranks=True)]


def _scored(logits: np.ndarray, tokens: list[int], k: int, ranks: bool = False) -> list[TokenLogprob]:
    """Row i of logits [n, V] scoring tokens[i]: plainly, a full sort per row (slow)."""
    z = logits.astype(np.float64)
    logp = z - (z.max(-1, keepdims=True) + np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)))
    out = []
    for row, token in zip(logp, tokens):
        order = np.argsort(-row, kind="stable")
        rank = int(np.flatnonzero(row[order] == row[token])[0]) + 1 if ranks else None
        out.append(TokenLogprob(int(token), float(row[token]), tuple((int(t), float(row[t])) for t in order[:k]),
                                rank))
    return out


def _greedy(draft: DraftEngine, row: np.ndarray) -> tuple[int, float]:
    """The draft's greedy token (a target id) from its logits row over its columns, and its probability."""
    column = int(np.argmax(row))
    token = column if draft.output_ids is None else int(draft.output_ids[column])  # a reduced vocabulary
    return token, probability(row, column)


def reference_window(target: Target, draft: DraftEngine, seq: list[int], size: int, confidence: float = 0.0,
                     rule: str = "token") -> tuple[list[int], list[float]]:
    """Up to `size` greedy draft tokens continuing seq, and the draft's probability of each; the window ends after a
    token whose probability (rule "window": the product of the window's so far) is below `confidence`."""
    if getattr(draft.facts, "feature_taps", ()):
        return reference_feature_window(target, draft, seq, size, confidence, rule=rule)
    return reference_token_window(draft, seq, size, confidence, rule)


def _ends(probs: list[float], confidence: float, rule: str) -> bool:
    """Whether a window whose tokens have probabilities `probs` ends after its last one."""
    return float(np.prod(probs) if rule == "window" else probs[-1]) < confidence


def reference_token_window(draft: DraftEngine, seq: list[int], size: int, confidence: float = 0.0,
                           rule: str = "token") -> tuple[list[int], list[float]]:
    """A token draft's window (as reference_window), one token per forward over the whole sequence."""
    window: list[int] = []
    probs: list[float] = []
    while len(window) < size:
        token, p = _greedy(draft, draft.prefill(np.asarray([seq + window], np.int64))[LOGITS][0, -1])
        window.append(token)
        probs.append(p)
        if _ends(probs, confidence, rule):
            break
    return window, probs


def reference_feature_window(target: Target, draft: DraftEngine, seq: list[int], size: int,
                             confidence: float = 0.0, trust_streams: bool = False, rule: str = "token"
                             ) -> tuple[list[int], list[float]]:
    """A feature draft's window (as reference_window): inputs seq[1:] with real taps, then its own on
    surrogates. trust_streams: a draft with stream heads ends the window with their proposals once they fill it
    (streaming "trust"); those tokens have no probability (nan)."""
    taps = target.run_prefix(seq, target.empty_cache()).taps  # [n, n_taps, H]
    window: list[int] = []
    probs: list[float] = []
    hidden: list[np.ndarray] = []  # the draft's hidden state at each drafted input's position before it
    for _ in range(size):
        x = np.asarray([seq[1:] + window], np.int64)
        total, real = x.shape[1], len(seq) - 1
        channel = empty_channel(draft.facts, 1, total)
        channel[FEATURES][0, :real] = taps[:real]
        for j, h in enumerate(hidden):
            channel[SURROGATE][0, real + j], channel[USE_SURROGATE][0, real + j] = h, 1
        out = draft.prefill(x, channel)
        token, p = _greedy(draft, out[LOGITS][0, -1])
        window.append(token)
        probs.append(p)
        if _ends(probs, confidence, rule):
            break
        room = size - len(window)
        if trust_streams and 0 < room <= draft.facts.streams:
            window += out[STREAM_IDS][0, -1, :room].astype(np.int64).tolist()
            probs += [float("nan")] * room
            break
        hidden.append(out[DRAFT_HIDDEN][0, -1])
    return window, probs
