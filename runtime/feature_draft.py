"""The draft side for a feature draft: a draft that reads the target's hidden states (models/feature_draft.py).

Input token x_q goes into the draft with the target's taps at position q - 1, the residual stream after the draft's
tap layers, all at or below the exit layer: the prefix gives them before the suffix runs. Where the target has not
run q - 1 yet, because the token was drafted, the draft's own hidden state at q - 1 stands in for them (the
surrogate), as in EAGLE. A rollout of gamma tokens from a sequence of n tokens is one forward over the inputs the
lane lacks, all with real taps, then gamma - 1 forwards of one token each on surrogates. A draft with stream heads
(manifest `draft.streams` = S) also proposes S tokens after each forward's token; in greedy windows ("trust", the
default streaming mode) they are taken as drafted once they fill the rest of the window, so a gamma-token window
takes gamma - S forwards. The target verifies them like any drafted token: the output cannot change.

The target sends its taps as `FeatureBlock`s (runtime/messages.py) with every request: the prompt's after the
prefill, each verification window's, each target-only step's. A `FeatureStore` keeps them for the sequence they
were computed on; a position's taps stay valid for any sequence that shares the tokens up to it. So a branch
(A, c) of a verification window has real taps for every input it feeds: the window's prefix ran [pending] + w,
which covers position len(C) - 1 + A, the one before c. Every committed token's input therefore has real taps.

Only inputs with real taps enter the context lane (slot j holds input j + 1). The surrogate-fed inputs of a
rollout live in its rows' own past and are dropped after it: once the target has verified them, the next request
feeds them again with their real taps. After a branch hit the hit row's real inputs move into the lane, as with
token drafts (runtime/draft.py).

A `FeatureDrafter` is used by exactly one thread: the scheduler's draft thread, or the main thread when overlap is
off. A failure resets it, taps included: the rest of that generation runs on the target alone (counted fallbacks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mirror_sd.partitions.manifest import DRAFT_HIDDEN, FEATURES, LOGITS, STREAM_IDS, SURROGATE, USE_SURROGATE
from mirror_sd.runtime.config import streaming_mode
from mirror_sd.runtime.draft import PAD_ID, DrafterBase
from mirror_sd.runtime.engines import DraftEngine
from mirror_sd.runtime.kv import LayerKV, common_prefix
from mirror_sd.runtime.messages import (
    FeatureBlock,
    Features,
)
from mirror_sd.runtime.sampling import SamplingParams
from mirror_sd.runtime.stats import Recorder

# The most prompt inputs a feature draft reads (a token draft reads up to runtime/draft.py PROMPT_WINDOW). Its inputs
# carry the target's taps, which have attended to the whole prompt already, so reading fewer drafts as well, in less
# of the time the first steps after a long prompt share their cores with (docs/design.md: Draft prompt windows and
# the try window).
FEATURE_PROMPT_WINDOW = 256


def empty_channel(facts, batch: int, width: int) -> dict[str, np.ndarray]:
    """A feature draft's channel inputs for a [batch, width] feed, all zero: no taps, no surrogate (the caller fills
    what it has)."""
    return {FEATURES: np.zeros((batch, width, len(facts.feature_taps), facts.hidden_size), facts.dtype),
            SURROGATE: np.zeros((batch, width, facts.hidden_size), facts.dtype),
            USE_SURROGATE: np.zeros((batch, width), np.int64)}


class FeatureGapError(RuntimeError):
    """The draft was asked to feed an input whose taps it never received."""


class FeatureStore:
    """Taps [capacity, n_taps, H] of positions [0, length), each computed by the target on tokens[:p + 1]. The first
    block an empty store takes may start past 0: a prompt whose head the batching engine's prefix cache held, of
    which the draft reads only the last prompt_window inputs (their taps are sent); the head's taps are never read."""

    def __init__(self, capacity: int, n_taps: int, width: int, dtype: str) -> None:
        self.taps = np.zeros((capacity, n_taps, width), dtype)
        self.tokens = np.zeros(0, np.int64)
        self.length = 0

    def reset(self) -> None:
        self.tokens, self.length = np.zeros(0, np.int64), 0

    def absorb(self, block: FeatureBlock) -> None:
        seq = np.asarray(block.tokens, np.int64)
        valid = self.valid_for(seq)
        end = block.start + len(block.taps)
        if block.start > valid and self.length:
            raise FeatureGapError(f"taps from position {block.start} arrived, but only {valid} are known")
        if end > self.taps.shape[0] or end > seq.size:
            raise FeatureGapError(f"taps up to position {end} do not fit the store or their sequence")
        self.taps[block.start:end] = block.taps
        self.tokens, self.length = seq[:end], end

    def valid_for(self, seq: np.ndarray) -> int:
        """How many leading positions of `seq` have their taps here."""
        return min(self.length, common_prefix(self.tokens, seq))


@dataclass
class _Rows:
    tokens: list[list[int]]
    bases: list[np.ndarray]
    shared: np.ndarray  # [B] lane slots each row reads
    real: list[LayerKV]  # per row, the KV of the inputs it fed with real taps (its first forward)
    forwards: int
    complete: bool = True

    def held(self, lane_tokens: np.ndarray, b: int) -> np.ndarray:
        """Row b's inputs with real taps: its lane prefix, then what it fed first."""
        return np.concatenate([lane_tokens[:self.shared[b]], self.bases[b][1 + self.shared[b]:]])

    def lane_kv(self, b: int) -> LayerKV:
        return self.real[b]


class FeatureDrafter(DrafterBase):
    """Lane slot j holds input j + 1, fed with real taps."""

    def __init__(self, engine: DraftEngine, params: SamplingParams, recorder: Recorder | None = None,
                 confidence: float = 0.0, store: FeatureStore | None = None, streaming: bool | str = True,
                 confidence_rule: str = "token") -> None:
        """store: the taps store of an earlier drafter on this engine, to write into (emptied first), instead of a new
        one. A pipeline passes it from one generation's drafter to the next: a new store's pages are mapped as the
        taps are first written, on the draft thread, which at long prompts costs more than the forwards of reading
        the prompt.
        streaming (runtime/config.py STREAMING_MODES), for a draft with stream heads: "trust" (True) takes their
        proposals as drafted once the room left in a row's window fits in them, in greedy windows; "verify" and
        "off" (False) draft one token per forward. A feature draft has no self-check: a fed proposal would need the
        hidden state of the position before it, which the same forward is computing."""
        facts = engine.facts
        if not facts.feature_taps:
            raise ValueError("FeatureDrafter needs a feature draft (the manifest's draft.feature_taps)")
        super().__init__(engine, params, recorder, confidence, confidence_rule)
        self.prompt_window = min(self.prompt_window, FEATURE_PROMPT_WINDOW)
        shape = (engine.lane_capacity + 1, len(facts.feature_taps), facts.hidden_size)
        if store is not None and (store.taps.shape != shape or store.taps.dtype != np.dtype(facts.dtype)):
            raise ValueError(f"a taps store of shape {store.taps.shape} does not fit this draft's {shape}")
        self.store = store if store is not None else FeatureStore(*shape, facts.dtype)
        self.store.reset()
        trust = streaming_mode(streaming) == "trust" and params.greedy and STREAM_IDS in engine.head_outputs
        self.streams = facts.streams if trust else 0

    def reset(self) -> None:
        super().reset()
        self.store.reset()

    # -- building blocks -----------------------------------------------------------------------------------
    def _inputs(self, seq: np.ndarray) -> np.ndarray:
        return seq[1:]  # input j + 1 is fed with the taps of position j

    def _receive(self, features: Features, seqs: tuple[np.ndarray, ...]) -> None:
        """Keep the taps sent with a request; every input of each seq (tokens 1..n-1) needs the taps of the position
        before it."""
        for block in features:
            self.store.absorb(block)
        for seq in seqs:
            if self.store.valid_for(seq) < seq.size - 1:
                raise FeatureGapError(f"a {seq.size}-token sequence needs taps of {seq.size - 1} positions, "
                                      f"{self.store.valid_for(seq)} are known")

    def _read(self, seq: np.ndarray, keep: int, window: int = 0) -> None:
        """Feed inputs keep+1 .. n-1 of seq (real taps) into the lane, in chunks; no heads are read. Of a long
        prompt, the last prompt_window inputs only (or `window`: _skip_head)."""
        chunk = self.engine.prompt_chunk
        for lo in range(self._skip_head(self._inputs(seq), keep, window) + 1, seq.size, chunk):
            hi = min(lo + chunk, seq.size)
            x = seq[None, lo:hi]
            mask = np.ones(x.shape, np.int64)
            own = self.engine.empty_own(1)
            channel = empty_channel(self.engine.facts, 1, x.shape[1])
            channel[FEATURES][0] = self.store.taps[lo - 1:hi - 1]
            shared = np.array([self.lane.length])
            _, new_kv = self._forward(x, shared, own, mask, 1, 0, channel)
            self.lane.append(new_kv, x[0])

    def _roll(self, bases: list[np.ndarray], shared: np.ndarray, draws: list, gamma: int,
              cancelled: Callable[[], bool]) -> _Rows:
        """gamma tokens continuing every base: row b reads lane slots [0, shared[b]) and feeds inputs
        shared[b]+1 .. n_b-1 with real taps (one forward for all rows), then one drafted token per forward on its
        own hidden state. A row stops early after a token the draft is not confident of, and leaves the batch."""
        n, engine = len(bases), self.engine
        self._window_p = [1.0] * n
        tokens: list[list[int]] = [[] for _ in range(n)]
        feeds = [base[1 + s:] for base, s in zip(bases, shared)]
        width = max(f.size for f in feeds)
        x, mask = np.full((n, width), PAD_ID, np.int64), np.zeros((n, width), np.int64)
        channel = empty_channel(self.engine.facts, n, width)
        for b, (base, s, feed) in enumerate(zip(bases, shared, feeds)):  # left-padded: the last column is newest
            x[b, width - feed.size:], mask[b, width - feed.size:] = feed, 1
            channel[FEATURES][b, width - feed.size:] = self.store.taps[s:base.size - 1]
        own = engine.empty_own(n)
        real: list[LayerKV] = []
        live = list(range(n))  # the rows in the batch, in batch order
        live_shared = shared
        forwards = 0
        while True:
            out, new_kv = self._forward(x, live_shared, own, mask, 1, len(live), channel)
            forwards += 1
            own = own.extended(new_kv, mask)
            if forwards == 1:
                real = [own.row(b) for b in range(n)]
            step_logits = out[LOGITS][:, -1]
            going = []  # batch positions of the rows that go on
            produced = len(live)
            for i, b in enumerate(live):
                if self.params.greedy:
                    token = self._greedy(step_logits[i], lambda b=b: [*bases[b].tolist(), *tokens[b]])
                else:
                    token = self.vocab.choose(step_logits[i], self.params, draws[b](len(tokens[b])))
                tokens[b].append(token)
                room = gamma - len(tokens[b])
                if room <= 0 or not self._confident(step_logits[i], token, b):
                    continue
                if room <= self.streams:  # the stream heads' proposals fill the window: take them as drafted
                    tokens[b] += out[STREAM_IDS][i, -1, :room].astype(np.int64).tolist()
                    produced += room
                else:
                    going.append(i)
            self.recorder.drafted(produced)
            if not going:
                return _Rows(tokens, bases, shared, real, forwards)
            if cancelled():
                return _Rows(tokens, bases, shared, real, forwards, complete=False)
            if len(going) < len(live):  # finished rows leave the batch
                own, live_shared, live = own.take(going), live_shared[going], [live[i] for i in going]
            x = np.asarray([[tokens[b][-1]] for b in live], np.int64)
            mask = np.ones((len(live), 1), np.int64)
            channel = empty_channel(self.engine.facts, len(live), 1)
            channel[SURROGATE][:] = out[DRAFT_HIDDEN][going, -1:]
            channel[USE_SURROGATE][:] = 1
