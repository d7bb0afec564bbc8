"""transformers baselines: "hf-generate" (the fp32 target alone) and "hf-assisted" (assisted generation with the
plain form of the streaming draft, bench/plain_draft.py, as `assistant_model=`).

Like with like: the assistant proposes a fixed window of `gamma` tokens per step (num_assistant_tokens=gamma,
schedule "constant") and never stops early on low confidence (assistant_confidence_threshold=0; transformers'
default 0.4 would end a window early and adapt the threshold), as the project's sd mode does. Greedy is
do_sample=False; temperature > 0 samples from the full distribution (top_k=0, top_p=1) with torch's global seed
set to `seed` before the call; transformers then uses speculative sampling with the assistant's probabilities.

Clocks: one generate call, timed whole (total_s); TTFT is when the streamer first receives a new token (the
streamer's first `put` is the prompt itself). Target forwards are counted with a forward hook, so
mean_accepted_tokens = new tokens / target forwards, counting the target's own token per step (1.00 for
hf-generate), as the project's stats do.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from mirror_sd.bench.methods import MethodResult


class _FirstTokenClock:
    """A transformers streamer that only notes when the first new token arrives (the first put is the prompt)."""

    def __init__(self) -> None:
        self.puts, self.first = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class _ForwardCounter:
    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        self.handle = model.register_forward_hook(self._count)

    def _count(self, *_args) -> None:
        self.calls += 1

    def remove(self) -> None:
        self.handle.remove()


def _load(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


class HFMethod:
    """transformers `generate` on the target, with or without an assistant model."""

    def __init__(self, name: str, target_dir: Path, *, threads: int, eos_token_ids: list[int], pad_token_id: int,
                 assistant_dir: Path | None = None, gamma: int = 4) -> None:
        torch.set_num_threads(threads)  # process-wide: the baselines run one at a time
        self.name, self.threads, self.gamma = name, threads, gamma
        self.eos, self.pad = list(eos_token_ids), pad_token_id
        self.model = _load(target_dir)
        self.assistant = None
        if assistant_dir is not None:
            self.assistant = _load(assistant_dir)
            cfg = self.assistant.generation_config  # transformers reads the window settings from here
            cfg.num_assistant_tokens = gamma
            cfg.num_assistant_tokens_schedule = "constant"
            cfg.assistant_confidence_threshold = 0.0

    def generate(self, prompt_ids: list[int], *, max_new_tokens: int, temperature: float, seed: int) -> MethodResult:
        torch.set_num_threads(self.threads)  # another method in the process may have changed it
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        sampling: dict[str, Any] = {"do_sample": False}
        if temperature > 0:
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
            torch.manual_seed(seed)
        if self.assistant is not None:
            sampling["assistant_model"] = self.assistant
        clock = _FirstTokenClock()
        target_calls = _ForwardCounter(self.model)
        draft_calls = _ForwardCounter(self.assistant) if self.assistant is not None else None
        try:
            start = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                          eos_token_id=self.eos, pad_token_id=self.pad, streamer=clock, **sampling)
            total = time.perf_counter() - start
        finally:
            target_calls.remove()
            if draft_calls is not None:
                draft_calls.remove()
        new = out[0, len(prompt_ids):].tolist()
        stats: dict[str, Any] = {"threads": self.threads, "target_forwards": target_calls.calls,
                                 "mean_accepted_tokens": len(new) / max(1, target_calls.calls)}
        if draft_calls is not None:
            # each assistant forward proposes one token; accepted = tokens beyond the target's own one per step
            accepted = len(new) - target_calls.calls
            stats.update(gamma=self.gamma, draft_forwards=draft_calls.calls,
                         acceptance_rate=accepted / max(1, draft_calls.calls))
        ttft = (clock.first if clock.first is not None else start + total) - start
        return MethodResult(new, ttft, total, stats)

    def close(self) -> None:
        self.model = self.assistant = None
