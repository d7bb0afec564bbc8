"""The draft side: rollouts and branch-complete rollouts over the draft engine, plus the branch planner.

A `Drafter` is used by exactly one thread (the scheduler's draft thread, or the main thread when overlap is off).
It keeps one context lane - the KV of one token sequence in buffers the engine allocated once (runtime/kv.py) -
and the rows of its last branch set. A request starts from whichever of them shares the longest prefix with what
it needs: after a branch hit the hit row's few own slots move into the lane (its lane prefix stays where it is),
after a miss the lane is cut back to the accepted tokens. Cutting back is a length; nothing is copied but the
new positions.

Branch sets run as one batch: row b is the branch (A_b, c_b). Every row reads the lane up to what it shares with
its own sequence (one broadcast read of the lane for all rows, no per-row copy), then its own past: the tokens it
fed since, left-padded to a common width with mask 0 (a hole, never a key). With a plain draft every later forward
adds one token to every row: gamma forwards produce every branch's window.

A streaming draft (manifest `draft.streams` = S > 0) also proposes S more tokens per forward (`stream_ids`). Its
rollouts verify themselves (Speculative Streaming): each forward feeds, per row, the tokens its cache lacks (a
context remainder, or the last token chosen) followed by the proposals of the previous forward. The main stream's
choice after the last fed non-proposal token is the row's next token; proposal j is accepted iff it equals the
main stream's choice at the position before it, and then the choice after it is the next token too. After the
first mismatch nothing more of the row is used: the rejected proposals' slots become holes, and the new proposals
are the stream guesses at the last accepted position. Choices are made exactly as one token per forward would
make them (argmax, or a draw with the row's generator, "sample and match"), so a window is the same tokens with
the same draws, in fewer forwards. Rows of a batch advance by their own counts until each has gamma tokens.

That self-check costs a forward per window at least: the first forward of a window has no proposals to check,
so a gamma-4 window takes two forwards however good the streams are. Greedy windows may instead take the last
proposals as drafted (streaming "trust"): when the room left in a row's window fits in the proposals just made,
they fill it unchecked, and the target's verification is their only check. The window can then differ from a
one-token-per-forward window (a stream guess where the main stream would have chosen otherwise), so acceptance
can drop; the output cannot change (the target verifies every token). Sampled windows always self-check: a
proposal is taken where it is the draft's own draw, drawn with the number the target draws with there, so that the
two land on one token wherever their distributions agree (runtime/verify.py).

A draft over a reduced vocabulary (`draft.output_vocab_size` > 0) gives logits over its own columns; tokens are
mapped to target ids through the bundle's draft vocabulary; a sampled token is drawn over its columns in target
id order, so that the draft's draw and the target's with the same number land on one token where they can.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from mirror_sd.partitions.manifest import LOGITS, STREAM_IDS
from mirror_sd.runtime.config import streaming_mode
from mirror_sd.runtime.engines import DraftEngine
from mirror_sd.runtime.kv import LayerKV, OwnPast, common_prefix, positions
from mirror_sd.runtime.messages import BranchKey, BranchSet, DraftWindow, ExitCandidates, Features
from mirror_sd.runtime.sampling import TARGET_STREAM, SamplingParams, choose, penalize, probability, rng_for
from mirror_sd.runtime.stats import Recorder

PAD_ID = 0  # any id: padded slots are masked out
# The most prompt tokens a draft reads. A longer prompt's head is held without KV and masked out of the draft's
# attention (positions still count it): on a small machine the draft reads the prompt after the target's prefill,
# time every sd/mirror generation on a long prompt waits for or shares its cores with, and a one- to four-layer
# draft predicts the next tokens from the recent text. Output never depends on it. A draft with a shorter attention
# window (DraftFacts.attention_window) reads only that (docs/design.md: Draft prompt windows and the try window).
PROMPT_WINDOW = 1024
# "trust" is what streaming on means (runtime/config.py STREAMING_MODES): several times the tokens per forward of
# "verify" at nearly its acceptance (docs/design.md: Streaming drafts trust their proposals); sampled windows fall
# back to "verify" by themselves.


_NONE = np.zeros(0, np.int64)
# A window token is accepted more often than the exit head's probability of it says: the draft chose it, so it is
# already a likely token. The probability's square root follows the measured acceptance, and ranking outcomes by it
# held the correction on more rejected steps (docs/design.md: Branch ranking by the exit probability's square root).
EXIT_ACCEPT_POWER = 0.5


def reads_first(committed: int, seen: int, gamma: int) -> bool:
    """Whether a draft that has seen `seen` of `committed` tokens reads the others into its cache before its next
    rollout, as it reads a prompt: more went by than one step commits (steps of the target alone, copied windows),
    and the rollout's row, whose length a static package bounds, would not hold them."""
    return committed - seen > gamma + 1


def plan_branches(c: ExitCandidates, kappa: int, budget: int, unranked_accept: float = 0.0
                  ) -> tuple[BranchKey, ...]:
    """The `budget` most probable outcomes (A, token) of verifying `c.window`, under the early-exit proxy.

    P(A = r, token = v) ~ prod_{j<r} P(window[j] accepted) * P_exit(v at r), with v among the first kappa
    candidates at r (v != window[r], which would be an acceptance, not a correction). P(window[j] accepted) is its
    early-exit probability raised to EXIT_ACCEPT_POWER. For a token outside the first kappa candidates (whose
    probability the k-th one only bounds) it is at least `unranked_accept`, the acceptance measured so far of such
    tokens: a weak exit layer ranks few of the draft's tokens, and would otherwise rank deep outcomes, including
    the all-accepted one, below every early correction even when the draft is nearly always right.
    """
    gamma = len(c.window)
    floor = float(np.log(unranked_accept)) if unranked_accept > 0 else -np.inf
    scored: list[tuple[float, int, int]] = []
    prefix_lp = 0.0
    for r in range(gamma + 1):
        for v, lp in zip(c.topk_ids[r, :kappa].tolist(), c.topk_logprobs[r, :kappa].tolist()):
            if r < gamma and v == c.window[r]:
                continue
            scored.append((prefix_lp + lp, r, v))
        if r < gamma:
            hit = np.flatnonzero(c.topk_ids[r, :kappa] == c.window[r])
            if hit.size:
                prefix_lp += EXIT_ACCEPT_POWER * float(c.topk_logprobs[r, hit[0]])
            else:
                prefix_lp += max(EXIT_ACCEPT_POWER * float(c.topk_logprobs[r, :kappa][-1]), floor)
    scored.sort(key=lambda s: -s[0])  # stable: ties keep (r, rank) order
    return tuple((r, v) for _, r, v in scored[:budget])


class DraftVocab:
    """The draft's logits columns as target ids: the identity, or a reduced vocabulary (column i is ids[i])."""

    def __init__(self, target_vocab: int, ids: np.ndarray | None) -> None:
        self.size, self.ids = target_vocab, ids
        # Samples are drawn over the columns in ascending target-id order: the same draw, tie-breaks included,
        # as over the full row with -inf elsewhere, so that with the target's number at a position the draft's token
        # lands on the target's wherever their distributions agree (runtime/verify.py).
        self.order = None if ids is None else np.argsort(ids, kind="stable")
        self.column = None  # target id -> column, made the first time a probability is asked for

    def argmax(self, logits: np.ndarray) -> np.ndarray:
        """[..., Vd] -> [...] target ids of the argmax columns."""
        cols = np.argmax(logits, axis=-1)
        return cols if self.ids is None else self.ids[cols]

    def choose(self, row: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> int:
        """One position's token (a target id) from its draft logits row [Vd]."""
        if params.greedy:
            return int(self.argmax(row))
        if self.ids is None:
            return choose(row, params, rng)
        return int(self.ids[self.order[choose(row[self.order], params, rng)]])

    def prob(self, row: np.ndarray, token: int) -> float:
        """The draft's probability of `token` (a target id it chose) under the softmax of its logits row [Vd]."""
        if self.ids is None:
            col = token
        else:
            if self.column is None:
                self.column = np.zeros(self.size, np.int64)
                self.column[self.ids] = np.arange(self.ids.size)
            col = int(self.column[token])
        return probability(row, col)

    def full(self, rows: np.ndarray) -> np.ndarray:
        """[n, Vd] -> [n, V] logits over the target vocabulary, -inf where the draft has no column."""
        if self.ids is None:
            return rows
        out = np.full((rows.shape[0], self.size), -np.inf, rows.dtype)
        out[:, self.ids] = rows
        return out


@dataclass
class _Rows:
    """What a batched rollout produced: per row its tokens."""

    tokens: list[list[int]]
    shared: np.ndarray  # [B] lane slots each row reads
    own: OwnPast  # each row's own past: the tokens it fed (holes where proposals were rejected)
    fed: list[list[int]]  # per row, the real tokens of `own`, in order
    forwards: int
    complete: bool = True  # False: cancelled part way

    def held(self, lane_tokens: np.ndarray, b: int) -> np.ndarray:
        """The token sequence row b's caches hold: its lane prefix, then its own real tokens."""
        return np.concatenate([lane_tokens[:self.shared[b]], np.asarray(self.fed[b], np.int64)])

    def lane_kv(self, b: int) -> LayerKV:
        """The KV of row b's own real tokens (held past its lane prefix)."""
        return self.own.row(b)


def _confirm(choose_at: Callable[[int], tuple[int, bool]], proposals: np.ndarray, room: int
             ) -> tuple[list[int], bool]:
    """A row's new tokens from one forward: the main stream's choice after its last fed non-proposal token
    (choose_at(0)), then, while proposal i equals the choice before it, the choice after that proposal
    (choose_at(i + 1)); at most `room` tokens. Choices are made in order and only as far as they are used, so a
    sampling row draws exactly what one token per forward would draw. choose_at gives (token, confident); after a
    token the draft is not confident of, the row stops (returned second: True)."""
    token, confident = choose_at(0)
    new = [token]
    while confident and len(new) < room and len(new) <= proposals.size and proposals[len(new) - 1] == new[-1]:
        token, confident = choose_at(len(new))
        new.append(token)
    return new, not confident


class DrafterBase:
    """What both drafters share (this one and runtime/feature_draft.py's): the engine, the sampling parameters, the
    generation's recorder (None: nowhere), the draft's vocabulary, one context lane, the last branch set's rows, and
    the three requests, written once over what a drafter defines:
      _inputs(seq)   the inputs the lane holds for a token sequence (the tokens; a feature draft: all but the first)
      _receive(features, seqs)  take the target's taps sent with a request, and check that they cover `seqs`
      _read(seq, keep, window)  feed seq's inputs from `keep` on into the lane (a prompt; _skip_head)
      _roll(bases, shared, rngs, gamma, cancelled)  a batched rollout of gamma tokens continuing every base, row b
                     reading lane slots [0, shared[b]); its rows give `held(lane_tokens, b)` (row b's inputs, lane
                     prefix included) and `lane_kv(b)` (the KV of those past the lane prefix)."""

    def __init__(self, engine: DraftEngine, params: SamplingParams, recorder: Recorder | None,
                 confidence: float = 0.0, confidence_rule: str = "token") -> None:
        """confidence: a window ends after a token whose draft probability is below it (0: windows always run to
        gamma); confidence_rule "window" (runtime/config.py CONFIDENCE_RULES): after the token where the product of
        the window's probabilities so far falls below it. A draft is well calibrated: the target accepts a token
        about as often as the draft's probability of it, so a window stops where further tokens would cost more to
        draft and verify than they are likely to commit (docs/design.md: Windows end where the draft is unsure). Any
        window is verified as usual: the output never depends on it."""
        if engine.facts.output_vocab_size and engine.output_ids is None:
            raise ValueError("the draft predicts over a reduced vocabulary, but its engine has no output_ids "
                             "(open it with open_engine)")
        self.engine, self.params, self.recorder = engine, params, recorder or Recorder()
        self.vocab = DraftVocab(engine.facts.vocab_size, engine.output_ids)
        self.lane = engine.context_lane()
        self.rows = None  # kept until the next request: a branch hit continues its row
        self.confidence, self.confidence_rule = float(confidence), confidence_rule
        self._window_p: list[float] = []  # per rollout row: the draft's probability of its window so far
        # a draft with an attention window never reads past it: of a longer prompt, only the last window is read
        self.prompt_window = min(PROMPT_WINDOW, engine.facts.attention_window or PROMPT_WINDOW)
        # where the generated tokens start, for its penalties: the first context a request gives (a prompt to read,
        # or the prompt and the first token: the one before it is the prompt's last)
        self.prompt_len: int | None = None

    def _seen(self, context_len: int, reading: bool = False) -> None:
        if self.prompt_len is None:
            self.prompt_len = context_len if reading else max(context_len - 1, 0)

    def _greedy(self, row: np.ndarray, history: Callable[[], list[int]]) -> int:
        """The draft's greedy token (a target id) from its logits `row` [Vd]. Under a generation's logit bias or
        penalties, after applying them to the draft's logits as the target's are (the tokens before it:
        `history()`): its windows then guess what the penalised target takes. The target verifies them either way,
        so this changes speed, never output; sampled windows keep the draft's own distribution."""
        if not self.params.penalized:
            return int(self.vocab.argmax(row))
        return int(np.argmax(penalize(self.vocab.full(row[None]), self.params, history(), self.prompt_len or 0)[0]))

    def _skip_head(self, inputs: np.ndarray, keep: int, window: int = 0) -> int:
        """Reading a prompt into a lane that holds no KV yet: of more than prompt_window inputs (or `window`, where it
        is smaller and not 0), hold the head without KV (masked out) and return where reading starts, so that the
        draft reads the last ones only."""
        limit = min(self.prompt_window, window) if window > 0 else self.prompt_window
        if keep != self.lane.start or inputs.size - keep <= limit:
            return keep
        start = inputs.size - limit
        self.lane.skip(inputs[keep:start])
        return start

    def reset(self) -> None:
        """Forget every cache (after a failure: nothing half-updated is ever reused)."""
        self.lane.truncate(0)
        self.rows = None

    def _forward(self, x: np.ndarray, shared: np.ndarray, own: OwnPast, new_mask: np.ndarray, keep: int, rows: int,
                 channel: dict[str, np.ndarray] | None = None) -> tuple[dict[str, np.ndarray], LayerKV]:
        """One forward for `rows` rollout rows (0: reading a prompt); its heads on the last `keep` columns only."""
        start = time.perf_counter()
        out = self.engine.run(x, positions(shared, own, new_mask), self.lane, shared, own, new_mask, keep, channel)
        self.recorder.draft_forward(start, time.perf_counter(), rows)
        return out

    def _draws(self, length: int) -> Callable[[int], np.random.Generator]:
        """The generator a sampled rollout continuing `length` tokens draws its i-th token with: the target's own at
        that position, so that the draft's draw is the target's where their distributions agree there
        (runtime/verify.py: sampled windows are verified against the target's own draws)."""
        return lambda i: rng_for(self.params, TARGET_STREAM, length + i)

    def _confident(self, row: np.ndarray, token: int, b: int) -> bool:
        """Whether rollout row b's window may go on after `token`, chosen from logits `row` [Vd] (its tokens are
        checked in order; _roll starts each row's window at probability 1)."""
        if self.confidence <= 0:
            return True
        p = self.vocab.prob(row, token)
        if self.confidence_rule == "window":
            p = self._window_p[b] = self._window_p[b] * p
        return p >= self.confidence

    def _window(self, context_len: int, rows, b: int) -> DraftWindow:
        return DraftWindow(context_len, tuple(rows.tokens[b]), rows.forwards)

    def _take(self, inputs: np.ndarray, keep_last: bool = True) -> int:
        """Make the lane hold the longest prefix of `inputs` any cache has (at most all but the last when keep_last,
        so one is left to feed) and return its length. A row of the last branch set that shares more of them than
        the lane (a branch hit) moves into the lane first: the lane is cut to the row's prefix, the row's own slots
        follow."""
        common = common_prefix(self.lane.tokens, inputs)
        rows, self.rows = self.rows, None
        if rows is not None:
            best = max(range(len(rows.tokens)), key=lambda b: common_prefix(rows.held(self.lane.tokens, b), inputs))
            held = rows.held(self.lane.tokens, best)
            if common_prefix(held, inputs) > common:
                shared = int(rows.shared[best])
                self.lane.truncate(shared)
                self.lane.append(rows.lane_kv(best), held[shared:])
                common = common_prefix(self.lane.tokens, inputs)
        keep = min(common, inputs.size - 1) if keep_last else common
        self.lane.truncate(keep)
        return keep

    # -- requests ------------------------------------------------------------------------------------------
    def warm(self, context: tuple[int, ...], features: Features = (), window: int = 0) -> int:
        """Read `context` into the lane (the prompt); returns the inputs fed. window > 0: into an empty lane, read at
        most the last `window` inputs (fewer than the prompt window)."""
        seq = np.asarray(context, np.int64)
        self._seen(seq.size, reading=True)
        self._receive(features, (seq,))
        inputs = self._inputs(seq)
        keep = self._take(inputs, keep_last=False)
        self._read(seq, keep, window)
        return int(inputs.size - max(keep, self.lane.start))  # a long prompt's unread head is not fed

    def rollout(self, context: tuple[int, ...], gamma: int, features: Features = ()) -> DraftWindow:
        """gamma tokens continuing `context`; afterwards the lane holds what the rollout fed of context and window
        (a feature draft: context's inputs; a token draft: also the window but its last token, less any trusted
        ones: the target verifies those, the next rollout feeds them)."""
        seq = np.asarray(context, np.int64)
        self._seen(seq.size)
        self._receive(features, (seq,))
        keep = self._take(self._inputs(seq))
        rows = self._roll([seq], np.array([keep]), [self._draws(seq.size)], gamma, lambda: False)
        self.lane.append(rows.lane_kv(0), rows.held(self.lane.tokens, 0)[keep:])
        return self._window(seq.size, rows, 0)

    def branches(self, c: ExitCandidates, plan: tuple[BranchKey, ...], gamma: int,
                 cancelled: Callable[[], bool] = lambda: False, features: Features = ()) -> BranchSet:
        """One batched rollout: row b continues context + window[:A_b] + (c_b,) by gamma tokens. Every row reads as
        much of the lane as it shares with its inputs; the lane itself is not changed (a miss continues it), and
        the rows are kept for the next request (a hit continues its row)."""
        ctx = np.asarray(c.context, np.int64)
        self._seen(ctx.size)
        verified = np.concatenate([ctx, c.window]).astype(np.int64)
        bases = [np.concatenate([ctx, c.window[:r], [v]]).astype(np.int64) for r, v in plan]
        self._receive(features, (verified, *bases))
        self._take(self._inputs(verified), keep_last=False)  # a hit row joins the lane
        if not plan:
            return BranchSet.of({}, 0)
        shared = np.array([min(common_prefix(self.lane.tokens, self._inputs(b)), self._inputs(b).size - 1)
                           for b in bases], np.int64)
        # Each row draws with the generators a fresh rollout of its context would use, so a branch's window is
        # the window a miss would have drawn (up to batch rounding of the draft's logits).
        rows = self._roll(bases, shared, [self._draws(b.size) for b in bases], gamma, cancelled)
        if not rows.complete:
            return BranchSet.of({}, rows.forwards)  # cancelled: no windows
        self.rows = rows
        return BranchSet.of({key: self._window(bases[b].size, rows, b) for b, key in enumerate(plan)}, rows.forwards)


class Drafter(DrafterBase):
    def __init__(self, engine: DraftEngine, params: SamplingParams, streaming: bool | str = True,
                 recorder: Recorder | None = None, confidence: float = 0.0, confidence_rule: str = "token") -> None:
        """streaming: runtime/config.py STREAMING_MODES; True is "trust", False is "off" (a streaming draft one
        token per forward, its proposals ignored: the same tokens as "verify"). Tokens taken as drafted ("trust")
        carry no probability: only main-stream choices can end a window early."""
        super().__init__(engine, params, recorder, confidence, confidence_rule)
        mode = streaming_mode(streaming)
        has_streams = STREAM_IDS in engine.head_outputs
        self.streams = engine.facts.streams if mode != "off" and has_streams else 0
        self.trust = mode == "trust" and params.greedy

    # -- building blocks -----------------------------------------------------------------------------------
    def _inputs(self, seq: np.ndarray) -> np.ndarray:
        return seq

    def _receive(self, features: Features, seqs: tuple[np.ndarray, ...]) -> None:
        """A token draft reads no taps (the scheduler sends none)."""

    def _read(self, seq: np.ndarray, keep: int, window: int = 0) -> None:
        """Feed seq[keep:] into the lane in chunks (a prompt; of a long one, the last prompt_window tokens, or
        `window`: _skip_head)."""
        chunk = self.engine.prompt_chunk
        for lo in range(self._skip_head(seq, keep, window), seq.size, chunk):
            part = seq[None, lo:lo + chunk]
            mask = np.ones(part.shape, np.int64)
            own = self.engine.empty_own(1)
            _, new_kv = self._forward(part, np.array([self.lane.length]), own, mask, 1, 0)  # KV only: no heads
            self.lane.append(new_kv, part[0])

    def _roll(self, bases: list[np.ndarray], shared: np.ndarray, draws: list, gamma: int,
              cancelled: Callable[[], bool]) -> _Rows:
        """Continue every base by gamma tokens: row b reads lane slots [0, shared[b]) and feeds the rest of its base
        (>= 1 token), its i-th token drawn with draws[b](i) where sampled. Stops incomplete when `cancelled` says so
        between forwards."""
        n, vocab, params = len(bases), self.vocab, self.params
        self._window_p = [1.0] * n
        tokens: list[list[int]] = [[] for _ in range(n)]
        # per row: the tokens its caches lack, then the proposals to check
        feeds, props = [base[s:] for base, s in zip(bases, shared)], [_NONE] * n
        own, fed = self.engine.empty_own(n), [[] for _ in range(n)]
        stopped = [False] * n  # the row's window ended early (a token the draft was not confident of)
        forwards = 0
        while True:
            active = [b for b in range(n) if len(tokens[b]) < gamma and not stopped[b]]
            if not active:
                return _Rows(tokens, shared, own, fed, forwards)
            if forwards and cancelled():
                return _Rows(tokens, shared, own, fed, forwards, complete=False)
            width = max(feeds[b].size + props[b].size for b in active)
            # left-pad: every row's last column is its newest fed token; finished rows feed holes only
            x, mask = np.full((n, width), PAD_ID, np.int64), np.zeros((n, width), np.int64)
            for b in active:
                row = np.concatenate([feeds[b], props[b]])
                x[b, width - row.size:], mask[b, width - row.size:] = row, 1
            span = 1 + max(props[b].size for b in active)  # the columns where choices are made: the heads run there
            # finished rows feed only holes: they are not row-forwards
            out, new_kv = self._forward(x, shared, own, mask, span, len(active))
            forwards += 1
            step_logits, first = out[LOGITS], width - span  # [B,span,Vd]: column j is input column first + j
            choices = vocab.argmax(step_logits) if params.greedy and not params.penalized else None  # [B,span]

            def pick(b: int, at: int, i: int, choices: np.ndarray | None = choices,
                     step_logits: np.ndarray = step_logits, first: int = first) -> tuple[int, bool]:
                """Row b's main-stream token after input column `at`, its i-th proposal checked (this forward's
                outputs, bound here), and whether its window may go on after it."""
                row = step_logits[b, at - first]
                if choices is not None:
                    token = int(choices[b, at - first])
                elif params.greedy:  # penalised: after the row's base, its tokens, and the proposals held so far
                    token = self._greedy(row, lambda: [*bases[b].tolist(), *tokens[b], *props[b][:i].tolist()])
                else:  # the i-th proposal checked comes after the row's tokens so far
                    token = vocab.choose(row, params, draws[b](len(tokens[b]) + i))
                return token, self._confident(row, token, b)

            keep, produced = mask.copy(), 0
            for b in active:
                m = props[b].size
                col = width - m - 1  # the last fed token that is not a proposal: its choice is the next token
                new, stopped[b] = _confirm(lambda i, b=b, col=col: pick(b, col + i, i), props[b],
                                           gamma - len(tokens[b]))
                accepted = len(new) - 1  # proposals that held (and were used)
                keep[b, col + 1 + accepted:] = 0  # the rejected proposals' slots become holes
                fed[b] += x[b, width - feeds[b].size - m:col + 1 + accepted].tolist()
                tokens[b] += new
                produced += len(new)
                feeds[b] = np.asarray(new[-1:], np.int64)
                room = 0 if stopped[b] else gamma - len(tokens[b])
                if self.trust and 0 < room <= self.streams:  # the proposals fill the window: take them as drafted
                    trusted = out[STREAM_IDS][b, col + accepted - first, :room].astype(np.int64).tolist()
                    tokens[b] += trusted
                    produced += len(trusted)
                    props[b] = _NONE
                    continue
                more = min(self.streams, room - 1)  # never propose past the window
                props[b] = out[STREAM_IDS][b, col + accepted - first, :more].astype(np.int64) if more > 0 else _NONE
            own = own.extended(new_kv, keep)
            self.recorder.drafted(produced)
