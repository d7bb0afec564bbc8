"""OpenVINO GenAI baselines: "ov-genai-ar" (LLMPipeline, the target alone), "ov-genai-sd" (LLMPipeline with
`draft_model=`: GenAI's speculative decoding, same target and the plain draft) and "ov-genai-pld" (LLMPipeline with
`prompt_lookup=True`: prompt-lookup decoding, windows copied from n-gram matches in the prompt and the text so far,
no draft model), on models converted by export/openvino_genai.py.

Both models get `threads` intra-op threads (INFERENCE_NUM_THREADS), the LATENCY hint, and fp32 compute and KV cache
(the CPU plugin's default KV cache for GenAI's paged attention is u8). The prompt goes in as
token ids (TokenizedInputs), so every method sees the same prompt; GenAI's own tokenizer is never used on it.
GenAI runs both pipelines on its continuous-batching backend on CPU (PagedAttention), and speculative decoding
proposes a fixed `num_assistant_tokens = gamma` per step. Sampling: do_sample, the temperature, top_k/top_p off,
rng_seed = seed.

Clocks: total_s is the wall time of the generate call; ttft_s comes from GenAI's own perf metrics (get_ttft: from
the start of generate to the first token, prefill included).

GenAIServing is the serving benchmark's side of GenAI (bench/serving.py): its ContinuousBatchingPipeline, plain or
speculative, with the same properties, driven by a closed loop of simulated clients.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mirror_sd.bench.methods import MethodResult

PLD_NGRAM = 3  # prompt lookup's longest n-gram matched (GenAI's sample uses 3)


def _properties(threads: int, defaults: bool = False) -> dict[str, Any]:
    """fp32 everywhere, as the target the others run: the CPU plugin otherwise stores GenAI's paged KV cache as u8
    (its default for PagedAttention), which flipped greedy tokens on a tiny test model. defaults: GenAI as a user
    gets it (threads and the hint only; on a CPU with AMX, bf16 compute and a u8 KV cache)."""
    given = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
    if defaults:
        return given
    return {**given, "INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
            "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}


class GenAIMethod:
    def __init__(self, name: str, target_dir: Path, *, threads: int, eos_token_ids: list[int],
                 draft_dir: Path | None = None, gamma: int = 4, prompt_lookup: bool = False,
                 defaults: bool = False) -> None:
        import openvino_genai as ov_genai

        if draft_dir is not None and prompt_lookup:
            raise ValueError("a GenAI pipeline takes a draft model or prompt lookup, not both")
        self.name, self.threads, self.gamma, self.eos = name, threads, gamma, list(eos_token_ids)
        extra: dict[str, Any] = {}
        if draft_dir is not None:
            extra["draft_model"] = ov_genai.draft_model(str(draft_dir), "CPU", **_properties(threads, defaults))
        if prompt_lookup:
            extra["prompt_lookup"] = True
        self.pipe = ov_genai.LLMPipeline(str(target_dir), "CPU", **extra, **_properties(threads, defaults))
        self.prompt_lookup = prompt_lookup
        self.speculative = draft_dir is not None
        if self.speculative:
            self._absorb_first_sampling_failure()

    def _absorb_first_sampling_failure(self) -> None:
        """GenAI 2026.4.1's speculative pipeline fails the first sampled generate of its life ("Check
        'content_length <= prompt_ids.size() + m_generated_ids.size()'", sequence_group.cpp) and samples normally
        from then on (seen here every time, on fresh pipelines). One throwaway sampled call absorbs it; a second
        failure is real and propagates."""
        for attempt in range(2):
            try:
                self._run([self.eos[0]], self._config(2, 1.0, 0))
                return
            except RuntimeError:
                if attempt:
                    raise

    def _run(self, prompt_ids: list[int], cfg):
        import openvino as ov
        import openvino_genai as ov_genai

        ids = np.array([prompt_ids], dtype=np.int64)
        return self.pipe.generate(ov_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids))), cfg)

    def _config(self, max_new_tokens: int, temperature: float, seed: int):
        import openvino_genai as ov_genai

        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens = max_new_tokens
        cfg.stop_token_ids = set(self.eos)
        cfg.eos_token_id = self.eos[0]
        if temperature > 0:
            cfg.do_sample, cfg.temperature, cfg.top_p, cfg.top_k, cfg.rng_seed = True, temperature, 1.0, 0, seed
        else:
            cfg.do_sample = False
        if self.speculative or self.prompt_lookup:
            cfg.num_assistant_tokens = self.gamma
        if self.prompt_lookup:
            cfg.max_ngram_size = PLD_NGRAM
        return cfg

    def generate(self, prompt_ids: list[int], *, max_new_tokens: int, temperature: float, seed: int) -> MethodResult:
        cfg = self._config(max_new_tokens, temperature, seed)
        start = time.perf_counter()
        result = self._run(prompt_ids, cfg)
        total = time.perf_counter() - start
        tokens = [int(t) for t in result.tokens[0]]
        metrics = result.perf_metrics
        stats: dict[str, Any] = {"threads": self.threads,
                                 "genai_generate_s": metrics.get_generate_duration().mean / 1000.0,
                                 "genai_tpot_s": metrics.get_tpot().mean / 1000.0}
        if self.speculative or self.prompt_lookup:
            stats.update(gamma=self.gamma, **_speculative_stats(result, len(tokens)))
        return MethodResult(tokens, metrics.get_ttft().mean / 1000.0, total, stats)

    def close(self) -> None:
        self.pipe = None


def _speculative_stats(result, new_tokens: int) -> dict[str, Any]:
    """Mean accepted tokens per target step from GenAI's speculative-decoding metrics, where it reports them: the
    main model's inference count is its number of steps (each step yields the accepted tokens + its own)."""
    extended = getattr(result, "extended_perf_metrics", None)
    if extended is None:
        return {}
    stats: dict[str, Any] = {}
    accepted = getattr(extended, "num_accepted_tokens", None)
    if accepted is not None:
        stats["accepted_draft_tokens"] = int(accepted)
    main = getattr(extended, "main_model_metrics", None)
    if main is not None:
        steps = len(main.raw_metrics.m_durations)
        if steps:
            stats["target_forwards"] = steps
            stats["mean_accepted_tokens"] = new_tokens / steps
    return stats


@dataclass
class GenAIReply:
    """One request of a closed loop on GenAI's continuous batching, as its client would have seen it."""

    token_ids: list[int] = field(default_factory=list)
    ttft_s: float | None = None  # submitted -> the end of the step that gave its first token
    latency_s: float = 0.0  # submitted -> the end of the step that finished it
    error: str | None = None


class GenAIServing:
    """OpenVINO GenAI's ContinuousBatchingPipeline on one converted target (its speculative form with `draft_dir`),
    with _properties' fp32 compute and KV cache and `threads` threads, as the single-stream baselines.

    closed_loop drives it as a server would: C clients, each submitting its next request the moment its last one
    finishes, all on one pipeline whose step() runs every scheduled request together. The clients are simulated in
    the loop that calls step() rather than run as threads: GenAI hands out tokens only at the end of a step, so a
    thread polling its handle would see the same times, plus the GIL's jitter."""

    def __init__(self, target_dir: Path, *, threads: int, eos_token_ids: list[int], max_num_seqs: int,
                 draft_dir: Path | None = None, gamma: int = 4, prefix_caching: bool = False) -> None:
        import openvino_genai as ov_genai

        scheduler = ov_genai.SchedulerConfig()
        scheduler.max_num_seqs = max_num_seqs
        scheduler.enable_prefix_caching = prefix_caching
        properties = _properties(threads)
        if draft_dir is not None:
            properties["draft_model"] = ov_genai.draft_model(str(draft_dir), "CPU", **_properties(threads))
        self.pipe = ov_genai.ContinuousBatchingPipeline(str(target_dir), scheduler, "CPU", properties)
        self.threads, self.eos, self.gamma = threads, list(eos_token_ids), gamma
        self.speculative, self.prefix_caching = draft_dir is not None, prefix_caching
        self._ids = itertools.count()

    def _config(self, max_new_tokens: int):
        import openvino_genai as ov_genai

        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens = max_new_tokens
        cfg.stop_token_ids = set(self.eos)
        cfg.eos_token_id = self.eos[0]
        cfg.do_sample = False
        if self.speculative:
            cfg.num_assistant_tokens = self.gamma
        return cfg

    def closed_loop(self, prompts: list[list[int]], clients: int, max_new_tokens: int
                    ) -> tuple[list[GenAIReply], float]:
        """Greedy generations of `prompts` from `clients` simulated clients; the replies in prompt order and the wall
        time from the first submission to the last finish."""
        import openvino as ov
        import openvino_genai as ov_genai

        running = ov_genai.GenerationStatus.RUNNING
        replies = [GenAIReply() for _ in prompts]
        waiting = iter(range(len(prompts)))
        live: dict[int, tuple[Any, int, float]] = {}  # request id -> (handle, prompt index, submitted)

        def submit(now: float) -> None:
            i = next(waiting, None)
            if i is not None:
                rid = next(self._ids)
                ids = ov.Tensor(np.array([prompts[i]], dtype=np.int64))
                live[rid] = (self.pipe.add_request(rid, ids, self._config(max_new_tokens)), i, now)

        start = time.perf_counter()
        for _ in range(min(clients, len(prompts))):
            submit(start)
        while live:
            self.pipe.step()
            now = time.perf_counter()
            for rid, (handle, i, submitted) in list(live.items()):
                reply = replies[i]
                if handle.can_read():
                    for output in handle.read().values():
                        reply.token_ids += [int(t) for t in output.generated_ids]
                if reply.ttft_s is None and reply.token_ids:
                    reply.ttft_s = now - submitted
                status = handle.get_status()
                if status != running:
                    reply.latency_s = now - submitted
                    if status != ov_genai.GenerationStatus.FINISHED:
                        reply.error = f"GenAI ended the request with {status}"
                    del live[rid]
                    submit(now)
        return replies, time.perf_counter() - start

    def close(self) -> None:
        self.pipe = None
