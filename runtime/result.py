"""What a generation gives back: a Chunk per committed token while it runs, a GenerationResult at the end."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mirror_sd.runtime.logprobs import TokenLogprob
from mirror_sd.runtime.perf_metrics import PerfMetrics
from mirror_sd.runtime.stats import GenerationStats


@dataclass(frozen=True)
class Beam:
    """One finished beam of a beam search (GenerationConfig.num_beams > 1)."""

    token_ids: list[int]  # new tokens only; an ending token included, as in GenerationResult
    text: str
    score: float  # its log-probability under the target over its length ** length_penalty (transformers' score)
    finish_reason: str  # "eos" or "length"
    stop_reason: int | None = None  # the stop token that ended it (GenerationConfig.stop_token_ids), as vLLM's


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]  # new tokens only; an EOS that ended generation is included
    text: str  # their text, without special tokens, cut before a stop string
    stats: GenerationStats  # typed; also reads as a mapping (stats["acceptance_rate"]), stats.as_dict() for JSON
    # "eos", "stop", "length", or "cancelled" (a request the batching engine was told to stop, or a generation its
    # streamer stopped: runtime/streamers.py)
    finish_reason: str
    # one per token of token_ids where GenerationConfig.logprobs asked for them (runtime/logprobs.py), else None
    logprobs: tuple[TokenLogprob, ...] | None = None
    # one per prompt token where GenerationConfig.prompt_logprobs asked for them (ranked), else None; the first is
    # None (nothing comes before it). A request cancelled before its prefill ended has those computed by then.
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # vLLM's: the stop token (GenerationConfig.stop_token_ids) or stop string that ended the text; None where an EOS
    # token, max_new_tokens or a cancel did
    stop_reason: int | str | None = None
    # a beam search's best num_return_sequences beams, best first (the result's tokens and text are the first's);
    # None for any other generation
    beams: tuple[Beam, ...] | None = None
    # num_return_sequences sampled: every sample in seed order (sample i drawn with the seed + i), the first this
    # result's own tokens and text; None for any other generation
    samples: tuple[GenerationResult, ...] | None = None
    # the seed a sampled generation drew with (its config's, or the one Pipeline.check drew where it had none): the
    # same call with it gives the same text; None where it was greedy
    seed: int | None = None
    # its timings in OpenVINO GenAI's form (runtime/perf_metrics.py; a beam search's: its best beam's token i came
    # at its step i); None for a request the batching engine cancelled before it started
    perf_metrics: PerfMetrics | None = None

    def __str__(self) -> str:  # print(result) shows the answer, as OpenVINO GenAI's DecodedResults does
        return self.text

    @property
    def texts(self) -> list[str]:
        """Every text the generation gave (OpenVINO GenAI's DecodedResults.texts): the beams', best first, the
        samples', in seed order, or the one text."""
        several = self.beams or self.samples
        return [s.text for s in several] if several else [self.text]


class GenerationResults(list):
    """Pipeline.generate's results for a list of prompts, in their order: a list of GenerationResult, with OpenVINO
    GenAI's DecodedResults' `texts` and `perf_metrics` (the call's: every prompt's generations as one call)."""

    def __init__(self, results: Iterable[GenerationResult], perf_metrics: PerfMetrics | None = None) -> None:
        super().__init__(results)
        self.perf_metrics = perf_metrics

    @property
    def texts(self) -> list[str]:
        """Every text of every prompt, in order (each result's `texts`: its beams or samples, or its one text)."""
        return [text for result in self for text in result.texts]

    def __str__(self) -> str:
        """As GenAI prints a DecodedResults: one text as it is; several a line each, a beam's after its score."""
        texts = self.texts
        if len(texts) == 1:
            return texts[0]
        lines = []
        for result in self:
            lines += [f"{b.score:f}: {b.text}" for b in result.beams] if result.beams else result.texts
        return "\n".join(lines)


@dataclass(frozen=True)
class Chunk:
    token_id: int
    text: str  # new text this token made safe to show (may be empty)
    logprob: TokenLogprob | None = None  # where GenerationConfig.logprobs asked for it
