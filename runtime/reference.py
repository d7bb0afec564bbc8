"""A slow, single-threaded reference generator: the second oracle for the fast decoders.

No KV cache is kept between forwards: every forward runs the whole sequence from an empty cache, so none of the
scheduler's cache trimming, branching or threading is involved. Greedy only. gamma 0 is plain target decoding;
gamma > 0 is vanilla speculative decoding with the draft, which must give the same tokens.

A feature draft (runtime/feature_draft.py) reads the target's taps: every input of the committed sequence with
the taps of the position before it, from a prefix run over the whole sequence; each drafted input with the
draft's own hidden state one position back (the surrogate).
"""

from __future__ import annotations

import numpy as np

from mirror_sd.partitions.manifest import DRAFT_HIDDEN, FEATURES, LOGITS, SURROGATE, USE_SURROGATE
from mirror_sd.runtime.engines import DraftEngine
from mirror_sd.runtime.feature_draft import empty_channel
from mirror_sd.runtime.target import Target


def reference_generate(target: Target, draft: DraftEngine | None, prompt: list[int], max_new_tokens: int,
                       gamma: int = 0, eos_token_ids: tuple[int, ...] = ()) -> list[int]:
    """The new tokens (up to and including the first EOS) of greedy decoding of `prompt`."""

    def target_tokens(seq: list[int]) -> np.ndarray:
        """The target's greedy next token after every position of seq: [len(seq)]."""
        logits, _ = target.forward(seq, target.empty_cache())
        return np.argmax(logits, axis=-1)

    def draft_token(seq: list[int]) -> int:
        out = draft.prefill(np.asarray([seq], np.int64))
        column = int(np.argmax(out[LOGITS][0, -1]))
        return column if draft.output_ids is None else int(draft.output_ids[column])  # a reduced vocabulary

    features = draft is not None and bool(getattr(draft.facts, "feature_taps", ()))
    seq = list(prompt)
    new: list[int] = []
    while len(new) < max_new_tokens and not (new and new[-1] in eos_token_ids):
        # 1. the draft proposes a window, one token at a time (never more than could be committed)
        size = min(gamma, max_new_tokens - len(new) - 1) if draft is not None else 0
        window: list[int] = reference_feature_window(target, draft, seq, size) if features and size else []
        for _ in range(0 if features else size):
            window.append(draft_token(seq + window))
        # 2. the target scores the sequence with the window: its token after seq[-1], after window[0], ...
        choices = target_tokens(seq + window)[len(seq) - 1:]  # [size + 1]
        # 3. accept the longest prefix of the window the target agrees with, then the target's own token
        accepted = 0
        while accepted < size and window[accepted] == choices[accepted]:
            accepted += 1
        for token in window[:accepted] + [int(choices[accepted])]:
            if len(new) < max_new_tokens and not (new and new[-1] in eos_token_ids):
                new.append(token)
        seq = list(prompt) + new
    return new


def reference_feature_window(target: Target, draft: DraftEngine, seq: list[int], size: int) -> list[int]:
    """`size` tokens of a feature draft: inputs seq[1:] with real taps, then its own on surrogates."""
    taps = target.run_prefix(seq, target.empty_cache()).taps  # [n, n_taps, H]
    window: list[int] = []
    hidden: list[np.ndarray] = []  # the draft's hidden state at each drafted input's position before it
    for _ in range(size):
        x = np.asarray([seq[1:] + window], np.int64)
        total, real = x.shape[1], len(seq) - 1
        channel = empty_channel(draft.facts, 1, total)
        channel[FEATURES][0, :real] = taps[:real]
        for j, h in enumerate(hidden):
            channel[SURROGATE][0, real + j], channel[USE_SURROGATE][0, real + j] = h, 1
        out = draft.prefill(x, channel)
        column = int(np.argmax(out[LOGITS][0, -1]))
        window.append(column if draft.output_ids is None else int(draft.output_ids[column]))
        hidden.append(out[DRAFT_HIDDEN][0, -1])
    return window
