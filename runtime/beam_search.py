"""Beam search over the target alone (`GenerationConfig.num_beams` > 1), as transformers' `generate` runs it.

`BeamSearch` is the algorithm as data: given each running beam's likeliest next tokens and their log-probabilities,
it keeps the `num_beams` best running beams and the `num_beams` best finished ones, and says when to stop. It follows
transformers' beam search (generation/utils.py, `_beam_search`) step for step: the 2 * num_beams best continuations
of all beams (more where there are several end tokens), finished ones scored by log-probability over generated
length ** length_penalty, only the best num_beams of a step's candidates allowed to finish, and its three stopping
rules (early_stopping: "heuristic" is its False, "early" its True, "never" its "never"). The scores are float32 sums
as torch keeps them, so ties break alike.

`beam_search` runs searches for several prompts on the batching engine as vLLM's server does: every running beam
of every search is a one-token request with its top log-probabilities, so one engine step serves them all, and
each beam's prefix comes from the KV the engine kept of its parent's request (the prefix cache): no beam's
context is computed twice. Without a batching engine (the OpenVINO target) the requests run one after another.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from mirror_sd.errors import BadInputError
from mirror_sd.runtime.config import GRAMMAR_OPTIONS, GenerationConfig
from mirror_sd.runtime.logprobs import MAX_TOP_LOGPROBS
from mirror_sd.runtime.perf_metrics import PerfMetrics
from mirror_sd.runtime.result import Beam, GenerationResult
from mirror_sd.runtime.stats import Recorder
from mirror_sd.runtime.text import TextCodec, TextSink

UNREACHABLE = np.float32(-1.0e9)  # transformers' score of a candidate that may not be taken


def candidates_per_step(num_beams: int, ending_tokens: int) -> int:
    """How many continuations a step keeps (transformers' beams_to_keep): enough that num_beams go on even where
    the likeliest all end the text."""
    return max(2, 1 + ending_tokens) * num_beams


class BeamSearchStopped(RuntimeError):
    """A beam search was told to stop (beam_search's `stop`) before it ended."""


def check_beam_search(cfg: GenerationConfig) -> None:
    """What a beam search of `cfg` (its end-of-sequence tokens resolved: Pipeline.check) cannot take, whatever its
    width (BadInputError): it ranks texts by the target's own log-probabilities, greedy, so nothing that would
    change or mask them, and it ends where a beam takes an ending token or reaches max_new_tokens."""
    grammar = next((name for name in GRAMMAR_OPTIONS if getattr(cfg, name)), "")
    changed = [name for name, given in (
        ("do_sample" if cfg.do_sample else "temperature", cfg.temperature > 0), ("logit_bias", cfg.logit_bias),
        ("repetition_penalty", cfg.repetition_penalty != 1.0), ("presence_penalty", cfg.presence_penalty),
        ("frequency_penalty", cfg.frequency_penalty), ("min_tokens", cfg.min_tokens),
        ("allowed_token_ids", cfg.allowed_token_ids), ("bad_words", cfg.bad_words_ids),
        ("no_repeat_ngram_size", cfg.no_repeat_ngram_size), (grammar, grammar),
        ("stop", cfg.stop), ("logprobs", cfg.logprobs is not None),
        ("prompt_logprobs", cfg.prompt_logprobs is not None)) if given]
    if changed:
        raise BadInputError(f"a beam search ranks texts by the target's own log-probabilities, greedy: it does not "
                            f"take {changed[0]}", option=changed[0])
    keep = candidates_per_step(cfg.num_beams, len(cfg.ending_token_ids))
    if keep > MAX_TOP_LOGPROBS:
        raise BadInputError(f"{cfg.num_beams} beams with {len(cfg.ending_token_ids)} ending tokens keep {keep} "
                            f"continuations a step, past the {MAX_TOP_LOGPROBS} a step can score: at most "
                            f"{MAX_TOP_LOGPROBS // candidates_per_step(1, len(cfg.ending_token_ids))} beams here",
                            option="num_beams")


def one_at_a_time(cfg: GenerationConfig) -> GenerationConfig:
    """`cfg`, refused where it asks for several texts: Pipeline.generate alone runs a beam search (its beams are
    whole only once it ends: nothing to stream, and one request of the engine's is one token of one beam) and
    several samples (each a generation of its own)."""
    if cfg.num_beams > 1:
        raise BadInputError("a beam search runs through Pipeline.generate only: its beams are whole only once it ends",
                            option="num_beams")
    if cfg.num_return_sequences > 1:
        raise BadInputError("several samples come from Pipeline.generate only: a stream or a request gives one "
                            "(sample i of several: the checked config's nth_sample(i))", option="num_return_sequences")
    return cfg


@dataclass(frozen=True)
class Hypothesis:
    tokens: tuple[int, ...]  # generated tokens, an ending token included
    score: float  # float32 log-probability sum over len(tokens) ** length_penalty


class BeamSearch:
    """One prompt's beam search, advanced one token at a time by `advance`."""

    def __init__(self, num_beams: int, max_new_tokens: int, ending_token_ids: Sequence[int],
                 length_penalty: float = 1.0, early_stopping: str = "heuristic") -> None:
        self.num_beams, self.max_new_tokens = num_beams, max_new_tokens
        self.ending = frozenset(ending_token_ids)
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.keep = candidates_per_step(num_beams, len(self.ending))
        # running beams, best first; before the first step one beam (transformers' others score -1e9 until then)
        self.running: list[tuple[int, ...]] = [()]
        self.running_scores = np.zeros(1, np.float32)
        self.finished: list[Hypothesis | None] = [None] * num_beams  # best first; None: an empty place (-1e9)
        self.finished_scores = np.full(num_beams, UNREACHABLE, np.float32)
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.done = False

    @property
    def length(self) -> int:
        """Tokens each running beam holds: the steps taken."""
        return len(self.running[0])

    @property
    def full(self) -> bool:
        """Whether every finished place holds a beam (transformers' is_sent_finished, all of it)."""
        return all(h is not None for h in self.finished)

    def advance(self, tops: Sequence[Sequence[tuple[int, float]]]) -> None:
        """One step: tops[i] holds running beam i's likeliest next tokens with their log-probabilities (at least
        `keep` of them, or the whole vocabulary), likeliest first."""
        if self.done:
            raise ValueError("the beam search has ended")
        if len(tops) != len(self.running):
            raise ValueError(f"{len(tops)} beams' continuations for {len(self.running)} running beams")
        # the best `keep` continuations of all beams: ties go to the lower flat index (beam, then token), as
        # torch.topk over [num_beams * vocab] breaks them
        flat = [(np.float32(self.running_scores[b] + np.float32(lp)), b, token)
                for b, top in enumerate(tops) for token, lp in top]
        flat.sort(key=lambda c: (-c[0], c[1], c[2]))
        chosen = flat[:self.keep]
        length = self.length + 1  # tokens in each candidate
        scores = np.array([c[0] for c in chosen], np.float32)
        sequences = [self.running[b] + (token,) for _, b, token in chosen]
        ends = np.array([length >= self.max_new_tokens or token in self.ending for _, _, token in chosen])
        # the running beams of the next step: the best candidates that did not end
        running_scores = scores + ends.astype(np.float32) * UNREACHABLE
        order = sorted(range(len(chosen)), key=lambda j: -running_scores[j])[:self.num_beams]
        self._finish(sequences, scores, ends, length)
        self.running = [sequences[j] for j in order]
        self.running_scores = running_scores[order]
        self._check_heuristic(length)
        self.done = not self.improvable or (self.full and self.early_stopping == "early") or bool(ends.all())

    def _finish(self, sequences: list[tuple[int, ...]], scores: np.ndarray, ends: np.ndarray, length: int) -> None:
        """transformers' _update_finished_beams: candidates among the step's best num_beams that ended join the
        finished beams where they score better."""
        normalised = scores / np.float32(length ** self.length_penalty)
        if self.full and self.early_stopping == "early":
            normalised = normalised + UNREACHABLE
        if not self.improvable:
            normalised = normalised + UNREACHABLE
        may_finish = ends & (np.arange(len(sequences)) < self.num_beams)
        normalised = normalised + (~may_finish).astype(np.float32) * UNREACHABLE
        merged_scores = np.concatenate([self.finished_scores, normalised])
        merged = self.finished + [Hypothesis(s, float(n)) if f else None
                                  for s, n, f in zip(sequences, normalised, may_finish)]
        # best first; ties to the earlier place (the finished beams before the step's candidates), as torch.topk
        order = sorted(range(len(merged)), key=lambda j: -merged_scores[j])[:self.num_beams]
        self.finished = [merged[j] for j in order]
        self.finished_scores = merged_scores[order]

    def _check_heuristic(self, length: int) -> None:
        """transformers' _check_early_stop_heuristic: can a running beam still beat the worst finished one?"""
        if not self.improvable:
            return
        hypothetical = (self.max_new_tokens if self.early_stopping == "never" and self.length_penalty > 0
                        else length)
        best_running = self.running_scores[0] / np.float32(hypothetical ** self.length_penalty)
        if not self.full:
            return  # an empty place counts -1e9: any running beam beats it
        self.improvable = bool(best_running > self.finished_scores.min())

    def best(self, n: int) -> list[Hypothesis]:
        """The best `n` finished beams, best first (all of them exist once the search is done)."""
        return [h for h in self.finished[:n] if h is not None]


Step = Callable[[list[list[int]], int], list[list[tuple[int, float]]]]


def beam_search(step: Step, codec: TextCodec, prompts: Sequence[tuple[list[int], GenerationConfig]],
                stop: threading.Event | None = None, load_time: float = -1.0) -> list[GenerationResult]:
    """Each (ids, checked config) prompt's beam search. step(contexts, k): each context's k likeliest next tokens
    with their log-probabilities (the target's raw log-softmax), likeliest first, one batched call per step. `stop`,
    once set, ends the searches before their next step (BeamSearchStopped). load_time: the pipeline's
    (PerfMetrics')."""
    searches = [BeamSearch(cfg.num_beams, cfg.max_new_tokens, cfg.ending_token_ids, cfg.length_penalty,
                           cfg.early_stopping) for _, cfg in prompts]
    keep = max(s.keep for s in searches)
    if keep > MAX_TOP_LOGPROBS:  # Pipeline.check refuses such a config; a caller that did not check it
        raise ValueError(f"{keep} continuations per beam: at most {MAX_TOP_LOGPROBS}")
    start = time.perf_counter()
    steps: list[list[float]] = [[] for _ in searches]  # when each search's steps ended: token i of every beam
    ttft: list[float | None] = [None] * len(searches)
    while not all(s.done for s in searches):
        if stop is not None and stop.is_set():
            raise BeamSearchStopped("the beam search was stopped")
        live = [i for i, s in enumerate(searches) if not s.done]
        contexts = {}  # the same context asked once (a search's first step: one beam)
        for i in live:
            for beam in _first_children_first(searches[i].running):
                contexts.setdefault((i, beam), prompts[i][0] + list(beam))
        keys = list(contexts)
        answers = dict(zip(keys, step([contexts[k] for k in keys], keep)))
        now = time.perf_counter()
        for i in live:
            searches[i].advance([answers[(i, beam)] for beam in searches[i].running])
            ttft[i] = now - start if ttft[i] is None else ttft[i]
            steps[i].append(now)
    end = time.perf_counter()
    return [_result(codec, ids, cfg, search, ttft[i] or 0.0, start, end, steps[i], load_time)
            for i, ((ids, cfg), search) in enumerate(zip(prompts, searches))]


def _first_children_first(running: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The running beams with one child of each parent ahead of its siblings: the engine admits requests in this
    order, so each parent's slot goes to a child that continues it, and a sibling (which copies the head) never
    takes another parent's slot before that parent's own child has."""
    seen: set[tuple[int, ...]] = set()
    first, rest = [], []
    for beam in running:
        (rest if beam[:-1] in seen else first).append(beam)
        seen.add(beam[:-1])
    return first + rest


def _result(codec: TextCodec, ids: list[int], cfg: GenerationConfig, search: BeamSearch, ttft_s: float,
            start: float, end: float, steps: list[float], load_time: float) -> GenerationResult:
    beams = []
    decode_s = 0.0
    for h in search.best(cfg.num_return_sequences):
        sink = TextSink.of(codec, cfg, ids)
        for token in h.tokens:
            sink.add(token)
        decode_s += sink.decode_s
        beams.append(Beam(list(h.tokens), sink.text, h.score, sink.finish_reason or "length", sink.stop_reason))
    best = beams[0]
    recorder = Recorder()
    recorder.counts.target_steps = search.length  # its own steps: another prompt's search may run on
    stats = recorder.finish(mode="beam", gamma=0, kappa=0, new_tokens=len(best.token_ids), ttft_s=ttft_s,
                            wall_s=end - start, target_device="", draft_device="", draft_engine={})
    # the best beam's token i came at the search's step i (the step it was chosen at)
    metrics = PerfMetrics.of_generation(load_time, start, end, [(steps[i], i) for i in range(len(best.token_ids))],
                                        len(ids), decode_s)
    return GenerationResult(best.token_ids, best.text, stats, best.finish_reason, stop_reason=best.stop_reason,
                            beams=tuple(beams), perf_metrics=metrics)
