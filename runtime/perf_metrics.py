"""A generation's timings in OpenVINO GenAI's form (`result.perf_metrics`), so that code written for GenAI's
PerfMetrics (its benchmark_genai sample) reads ours:

    metrics = pipe.generate(prompt).perf_metrics
    for _ in range(4):
        metrics += pipe.generate(prompt).perf_metrics     # several calls pooled, as GenAI pools them
    print(metrics.get_ttft().mean, metrics.get_tpot().mean, metrics.get_throughput().mean)

GenAI's definitions, kept so that a figure means what it means there: the getters' durations in milliseconds (the raw
ones in microseconds, token times in milliseconds, as GenAI's), each getter a mean and a population standard deviation
over the pooled calls, (-1, -1) where nothing was measured; TTFT from the start of the call (tokenization included) to
the first token; TPOT over the tokens after the first, each step's duration shared by the tokens it committed (a
speculative step's several tokens count as several, each a share of the step; the first step, the prefill, left out);
throughput 1000 / TPOT. `Pipeline.generate` and `stream` time the call: a list's results each from the call's start (one
prompt's first token may wait for another's), several samples as one call. A generation's own figures (the batching
engine's requests, the server's) start at its submission and have no tokenization. Detokenization sums the incremental
decoding of the text as it streams (twice per token). Not measured here, so not given: GenAI's inference, sampling and
grammar-compile times.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from mirror_sd.errors import BadInputError


class MeanStd(NamedTuple):
    """GenAI's MeanStdPair: `.mean` and `.std`."""

    mean: float
    std: float


def mean_std(values: Sequence[float]) -> MeanStd:
    """Mean and population standard deviation, as GenAI computes them; (-1, -1) for none."""
    if not values:
        return MeanStd(-1.0, -1.0)
    mean = sum(values) / len(values)
    return MeanStd(mean, math.sqrt(max(0.0, sum(v * v for v in values) / len(values) - mean * mean)))


@dataclass(frozen=True)
class RawPerfMetrics:
    """The measurements behind the getters, for statistics of one's own (a median, percentiles), under GenAI's
    RawPerfMetrics' names and in its units: durations in microseconds, token times in milliseconds (here on
    time.perf_counter())."""

    generate_durations: tuple[float, ...] = ()  # per call
    tokenization_durations: tuple[float, ...] = ()  # per call (a chat prompt's template rendering included)
    detokenization_durations: tuple[float, ...] = ()  # per generation: the text of its tokens
    m_times_to_first_token: tuple[float, ...] = ()  # per generation
    m_new_token_times: tuple[float, ...] = ()  # when each step's tokens came
    m_batch_sizes: tuple[int, ...] = ()  # how many tokens each step committed
    m_durations: tuple[float, ...] = ()  # per token after the first step: its step's duration / its tokens

    def __add__(self, other: RawPerfMetrics) -> RawPerfMetrics:
        return RawPerfMetrics(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


US_PER_S, MS_PER_S = 1e6, 1e3


def per_token_durations(times: Sequence[float], sizes: Sequence[int]) -> tuple[float, ...]:
    """GenAI's m_durations: every step after the first, its duration (us; `times` in ms) once per token it
    committed, divided among them."""
    out: list[float] = []
    for i in range(1, len(times)):
        out += [(times[i] - times[i - 1]) * 1000.0 / sizes[i]] * sizes[i]
    return tuple(out)


def in_ms(durations_us: Sequence[float]) -> MeanStd:
    """Mean and std in milliseconds of durations in microseconds (GenAI's getters)."""
    return mean_std([d / 1000.0 for d in durations_us])


@dataclass(frozen=True)
class PerfMetrics:
    """One or more generations' timings (GenAI's PerfMetrics; `+` pools those of one pipeline)."""

    load_time: float  # ms Pipeline.load took; -1 where the pipeline was not loaded by it
    num_generated_tokens: int
    num_input_tokens: int
    raw_metrics: RawPerfMetrics = field(default_factory=RawPerfMetrics)

    @classmethod
    def of_generation(cls, load_time: float, start: float, end: float, steps: Sequence[tuple[float, int]],
                      prompt_tokens: int, detokenization_s: float) -> PerfMetrics:
        """A generation's, from its start and end (time.perf_counter()) and `steps`: per committed token, when it
        came and the number of the target step that gave it (tokens of one step share it)."""
        times: list[float] = []
        sizes: list[int] = []
        last = None
        for at, step in steps:
            if step == last:
                sizes[-1] += 1
            else:  # a step's first token: when the step's tokens came
                times.append(at * MS_PER_S)
                sizes.append(1)
                last = step
        raw = RawPerfMetrics(generate_durations=((end - start) * US_PER_S,),
                             detokenization_durations=(detokenization_s * US_PER_S,),
                             m_times_to_first_token=_first(times, start),
                             m_new_token_times=tuple(times), m_batch_sizes=tuple(sizes),
                             m_durations=per_token_durations(times, sizes))
        return cls(load_time, sum(sizes), prompt_tokens, raw)

    @classmethod
    def of_call(cls, parts: Sequence[PerfMetrics], start: float, end: float, tokenization_s: float,
                input_tokens: int) -> PerfMetrics:
        """The generations of a call that began at `start`, tokenized its prompts (`input_tokens` tokens) in
        `tokenization_s` and returned at `end` (Pipeline.generate: a prompt, its samples, a list of prompts): one
        call, its TTFT the first token of any from the call's start, its steps each generation's (TPOT per
        sequence: GenAI's batched TPOT divides a step among the sequences in it)."""
        raws = [p.raw_metrics for p in parts]
        steps = sorted((t, n) for r in raws for t, n in zip(r.m_new_token_times, r.m_batch_sizes))
        raw = RawPerfMetrics(
            generate_durations=((end - start) * US_PER_S,), tokenization_durations=(tokenization_s * US_PER_S,),
            detokenization_durations=(sum(d for r in raws for d in r.detokenization_durations),),
            m_times_to_first_token=_first([t for t, _ in steps], start),
            m_new_token_times=tuple(t for t, _ in steps), m_batch_sizes=tuple(n for _, n in steps),
            m_durations=tuple(d for r in raws for d in r.m_durations))
        return cls(parts[0].load_time, sum(p.num_generated_tokens for p in parts), input_tokens, raw)

    def __add__(self, other: PerfMetrics) -> PerfMetrics:
        if not isinstance(other, PerfMetrics):
            return NotImplemented
        if other.load_time != self.load_time:  # GenAI's rule: the calls of one pipeline
            raise BadInputError("perf_metrics pool the generations of one pipeline: these come from two (their load "
                                f"times differ, {self.load_time:.1f} and {other.load_time:.1f} ms)")
        return PerfMetrics(self.load_time, self.num_generated_tokens + other.num_generated_tokens,
                           self.num_input_tokens + other.num_input_tokens, self.raw_metrics + other.raw_metrics)

    # GenAI's getters
    def get_load_time(self) -> float:
        return self.load_time

    def get_num_generated_tokens(self) -> int:
        return self.num_generated_tokens

    def get_num_input_tokens(self) -> int:
        return self.num_input_tokens

    def get_ttft(self) -> MeanStd:
        return in_ms(self.raw_metrics.m_times_to_first_token)

    def get_tpot(self) -> MeanStd:
        return in_ms(self.raw_metrics.m_durations)

    def get_throughput(self) -> MeanStd:
        """Tokens per second after the first token: 1000 / TPOT (GenAI's; its std carried over to first order);
        (-1, -1) where no token came after the first (GenAI's reads -1000 there)."""
        tpot = self.get_tpot()
        if tpot.mean <= 0:
            return MeanStd(-1.0, -1.0)
        return MeanStd(1000.0 / tpot.mean, tpot.std * 1000.0 / (tpot.mean * tpot.mean))

    def get_generate_duration(self) -> MeanStd:
        return in_ms(self.raw_metrics.generate_durations)

    def get_tokenization_duration(self) -> MeanStd:
        return in_ms(self.raw_metrics.tokenization_durations)

    def get_detokenization_duration(self) -> MeanStd:
        return in_ms(self.raw_metrics.detokenization_durations)


def _first(times_ms: Sequence[float], start: float) -> tuple[float, ...]:
    """The time to the first of `times_ms` from `start` (time.perf_counter()), in us; none where nothing came."""
    return ((times_ms[0] - start * MS_PER_S) * 1000.0,) if times_ms else ()
