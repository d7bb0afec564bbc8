"""Turning logits into a token: greedy, or a sample from the warped distribution (temperature, min_p, top_k, top_p),
after the logit bias and the penalties on tokens the text already holds.

Pure functions. Randomness comes from explicit numpy Generators keyed by (seed, stream, position): the target's
stream at a position is what the target alone draws with there, and a draft drawing a window's token at that position
draws with it too (runtime/verify.py), from a branch or from a fresh rollout alike.

The bias and penalties (`penalize`) are part of the target's distribution: a position's penalised logits depend on the
tokens before it only, so a verification row is penalised for the window tokens before it, exactly as the step that
would have produced that position alone, and sd and mirror still equal ar. vLLM's order: OpenAI's logit bias, the
repetition penalty (transformers' CTRL rule: a positive logit divided by it, a negative one multiplied) on every token
of the prompt and the text so far, then OpenAI's frequency and presence penalties on the generated tokens' counts, then
vLLM's masks (allowed_token_ids: every other token; min_tokens: the tokens that end the text, at the positions before
that many new tokens; bad words: a word's last token after the rest of it, except where that would leave
allowed_token_ids no token; transformers' no_repeat_ngram_size: a token that would repeat an n-gram of the prompt
and text, likewise), then a grammar's mask (runtime/grammar.py), which holds to the same rule. A greedy draft
applies the bias and penalties to its own logits too, as a guess of what the penalised target takes (runtime/draft.py
DrafterBase._greedy); its windows are checked against the penalised target like any others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # a type only: the grammar's masks come from the generation's own state
    from mirror_sd.runtime.grammar import GrammarState

TARGET_STREAM = 1  # rng_for's stream of the target's draws (the only one drawn from)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # 0: no top-k filter
    seed: int = 0
    repetition_penalty: float = 1.0  # 1: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0  # 0: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted
    min_tokens: int = 0  # the ending tokens are masked at the positions before this many new tokens
    ending: tuple[int, ...] = ()  # the tokens that end the text, sorted
    allowed: tuple[int, ...] = ()  # the only tokens that may come (empty: any)
    banned: tuple[tuple[int, ...], ...] = ()  # token sequences: the last is masked after the others' generated run
    no_repeat_ngram: int = 0  # n: a token that would make an n-gram of the prompt and text come twice is masked

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the target's logits change before a token is chosen from them (bias, penalties or masks)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias) or bool(self.allowed) or (self.min_tokens > 0 and bool(self.ending))
                or bool(self.banned) or self.no_repeat_ngram > 0)


def penalize(logits: np.ndarray, params: SamplingParams, context: Sequence[int], prompt_len: int,
             window: Sequence[int] = (), grammar: GrammarState | None = None) -> np.ndarray:
    """The target's `logits` [n, V] with the logit bias and the penalties: row i is the position after context +
    window[:i] (context: the prompt's `prompt_len` tokens, then the generated ones); then every token the
    generation's `grammar` does not allow at each row at -inf (runtime/grammar.py; its GrammarError where it cannot go
    on). `logits` itself where none applies. Every row takes the context's penalties at once; a row after window
    tokens then has those tokens' entries computed again from its biased logits with their counts there: each entry is
    the same float32 arithmetic a row alone after the same tokens gets, so a verification row equals the step it
    stands for bit for bit."""
    if grammar is not None:
        allowed = grammar.masks(context, prompt_len, window, len(logits))
        out = np.array(_penalize(logits, params, context, prompt_len, window), dtype=np.float32)
        out[~allowed] = -np.inf
        return out
    return _penalize(logits, params, context, prompt_len, window)


def _penalize(logits: np.ndarray, params: SamplingParams, context: Sequence[int], prompt_len: int,
              window: Sequence[int]) -> np.ndarray:
    if not params.penalized:
        return logits
    out = np.array(logits, dtype=np.float32)
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        out[:, list(ids)] += np.asarray(bias, np.float32)
    if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        _count_penalties(out, params, context, prompt_len, window)
    if params.allowed:
        kept = out[:, list(params.allowed)]
        out[:] = -np.inf
        out[:, list(params.allowed)] = kept
    early = params.min_tokens - (len(context) - prompt_len)  # rows before the min_tokens-th new token
    if early > 0 and params.ending:
        out[:early, list(params.ending)] = -np.inf
    if params.banned or params.no_repeat_ngram:
        allowed = out.copy() if params.allowed else None
        if params.banned:
            _ban(out, params.banned, context, prompt_len, window)
        if params.no_repeat_ngram:
            _no_repeat(out, params.no_repeat_ngram, context, window)
        if allowed is not None:  # where the bans leave allowed_token_ids no token, that position takes none of them
            dead = np.isneginf(out).all(axis=1)
            out[dead] = allowed[dead]
    return out


def _ban(out: np.ndarray, banned: tuple[tuple[int, ...], ...], context: Sequence[int], prompt_len: int,
         window: Sequence[int]) -> None:
    """vLLM's bad words, in place: at row i, a sequence's last token is masked where the generated tokens before the
    row (context[prompt_len:], then window[:i]) end with the rest of it (always, for a one-token sequence)."""
    longest = max(len(seq) for seq in banned) - 1
    # the generated tokens as far back as any sequence reaches (all of them where fewer)
    tail = list(context[max(len(context) - longest, prompt_len):]) if longest else []
    tokens = tail + list(window)
    for i in range(out.shape[0]):
        end = len(tail) + i  # tokens[:end]: the generated tokens before row i, as far back as any sequence reaches
        for seq in banned:
            n = len(seq) - 1
            if n == 0 or (end >= n and tokens[end - n:end] == list(seq[:-1])):
                out[i, seq[-1]] = -np.inf


def _no_repeat(out: np.ndarray, n: int, context: Sequence[int], window: Sequence[int]) -> None:
    """transformers' no_repeat_ngram_size, in place: at row i, every token that ends an n-gram of the tokens before
    the row (the prompt's and the text's: context, then window[:i]) whose first n - 1 tokens are their last n - 1 is
    masked, so that no n-gram comes twice."""
    tokens = np.asarray([*context, *window], np.int64)
    for i in range(out.shape[0]):
        end = len(context) + i  # tokens[:end]: the tokens before row i
        if end < n:
            continue
        grams = np.lib.stride_tricks.sliding_window_view(tokens[:end], n)
        if n > 1:
            grams = grams[(grams[:, :-1] == tokens[end - n + 1:end]).all(axis=1)]
        out[i, grams[:, -1]] = -np.inf


def _count_penalties(out: np.ndarray, params: SamplingParams, context: Sequence[int], prompt_len: int,
                     window: Sequence[int]) -> None:
    """The repetition, frequency and presence penalties on the biased logits `out`, in place."""
    biased = out.copy() if len(window) and out.shape[0] > 1 else out
    ctx = np.asarray(context, np.int64)
    counted, counts = np.unique(ctx[prompt_len:], return_counts=True)
    seen = np.unique(ctx) if params.repetition_penalty != 1.0 else counted  # the ids whose entries change
    every = np.zeros(seen.size, np.float32)
    every[np.searchsorted(seen, counted)] = counts
    out[:, seen] = _penalized(out[:, seen], every, params)
    for i in range(1, min(out.shape[0], len(window) + 1)):
        tokens, extra = np.unique(np.asarray(window[:i], np.int64), return_counts=True)
        before = np.zeros(tokens.size, np.int64)  # each one's count in the context's generated tokens
        if counted.size:
            at = np.searchsorted(counted, tokens).clip(max=counted.size - 1)
            hit = counted[at] == tokens
            before[hit] = counts[at[hit]]
        out[i, tokens] = _penalized(biased[i, tokens], (before + extra).astype(np.float32), params)


def _penalized(x: np.ndarray, counts: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Entries `x` (float32) of tokens the text holds, each generated `counts` times (0: in the prompt only):
    repetition first (transformers' division), then frequency and presence on the generated ones."""
    if params.repetition_penalty != 1.0:
        rp = np.float32(params.repetition_penalty)
        x = np.where(x > 0, x / rp, x * rp)
    if params.frequency_penalty or params.presence_penalty:
        x = np.where(counts > 0, x - (np.float32(params.frequency_penalty) * counts + np.float32(
            params.presence_penalty)), x)
    return x


def rng_for(params: SamplingParams, stream: int, position: int) -> np.random.Generator:
    """The generator for `stream` at context length `position`: independent across streams and positions."""
    return np.random.default_rng([params.seed % 2**64, stream, position])  # numpy's seeds are non-negative


def target_streams(params: SamplingParams, position: int) -> Callable[[int], np.random.Generator]:
    """The generators of a window's rows after a context of `position` tokens: row i draws with the target's stream
    at position + i, as the target alone draws there (runtime/verify.py own_draws_accept)."""
    return lambda i: rng_for(params, TARGET_STREAM, position + i)


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities (float64, [..., V]) after temperature, min_p, top_k then top_p (vLLM's order). Not for greedy."""
    z = logits.astype(np.float64)
    # the largest is 0 before the division: a tiny temperature then gives -inf (probability 0), never inf - inf
    with np.errstate(over="ignore"):
        z = (z - z.max(axis=-1, keepdims=True)) / params.temperature
    if params.min_p > 0:  # the likeliest token's z is 0: keep those at least min_p times as likely
        z = np.where(z < np.log(params.min_p), -np.inf, z)
    if params.top_k and params.top_k < z.shape[-1]:
        kth = np.sort(z, axis=-1)[..., -params.top_k][..., None]
        z = np.where(z < kth, -np.inf, z)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass of the tokens strictly more probable
        keep_sorted = before < params.top_p  # always keeps the most probable token
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def probability(logits: np.ndarray, index: int) -> float:
    """The softmax probability of one entry of a logits row (unwarped)."""
    return float(1.0 / np.exp(logits - logits[index]).sum())


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from `probs` [V] by inverse CDF (one uniform number per draw)."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), probs.size - 1))


def choose(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> int:
    """The next token from one position's logits [V]: argmax when greedy, else a sample."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample(warp(logits, params), rng)
