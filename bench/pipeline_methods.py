"""The project's own decoders (ar / sd / mirror, and mirror with one mechanism off) as benchmark Methods."""

from __future__ import annotations

import time
from typing import Any

from mirror_sd.bench.methods import MethodResult
from mirror_sd.runtime.pipeline import Pipeline

# The pipeline stats every summary reads; the rest of a run's stats dict is kept as it is.
PHASES = ("prefix_s", "suffix_s", "draft_s", "draft_wait_s")


class PipelineMethod:
    """One decoding configuration over a loaded Pipeline. Several methods may share a pipeline: generate calls
    never overlap (the harness runs one method at a time), and the pipeline holds no state between calls."""

    def __init__(self, name: str, pipe: Pipeline, mode: str, trace: bool = False,
                 notes: dict[str, Any] | None = None, **options: Any) -> None:
        self.name, self.pipe, self.mode, self.trace, self.options = name, pipe, mode, trace, options
        self.notes = notes or {}  # what describe() adds for the report (e.g. the bundle's exit layer and head)

    def generate(self, prompt_ids: list[int], *, max_new_tokens: int, temperature: float,
                 seed: int) -> MethodResult:
        first: list[float] = []
        start = time.perf_counter()
        # TTFT from the caller's clock (prompt in -> first token handed out), as the baselines measure it
        result = self.pipe.generate(prompt_ids, mode=self.mode, max_new_tokens=max_new_tokens,
                                    temperature=temperature, seed=seed, trace=self.trace,
                                    streamer=lambda _t, _s: first or first.append(time.perf_counter()),
                                    **self.options)
        total = time.perf_counter() - start
        stats = dict(result.stats)
        stats["target_threads"], stats["draft_threads"] = self.pipe.target_threads, self.pipe.draft_threads
        return MethodResult(list(result.token_ids), (first[0] if first else start + total) - start, total, stats)

    def close(self) -> None:
        """The pipeline belongs to the harness, which may share it between methods; nothing to release here."""

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "target_threads": self.pipe.target_threads,
                "draft_threads": self.pipe.draft_threads, **self.options, **self.notes}
