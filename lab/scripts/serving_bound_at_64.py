"""Where the serving section's 64-client gap to OpenVINO GenAI goes: the same load (the section's first `requests`
prompts, 64 clients in a closed loop, greedy ar, 64 new tokens, prefix caching off) on the batching engine
in-process, through `mirror-sd serve` over HTTP (streamed chat completions), and on GenAI's continuous batching in
float32 (the section's baseline), two rounds each, one process at a time; the in-process rounds also time every
ONNX Runtime run of the engine (its share of the wall time).

    .venv/bin/python lab/scripts/serving_bound_at_64.py [requests] > results/serving-bound-at-64.txt
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import onnxruntime as ort

from mirror_sd.bench.baselines import CACHE, Sources, genai_dir
from mirror_sd.bench.ov_genai import GenAIServing
from mirror_sd.bench.serving import ServerProcess, chat, closed_loop, prompt_ids, serving_prompts
from mirror_sd.runtime.pipeline import Pipeline

BUNDLE = Path("build/bundles/smollm2-feature")
CLIENTS, TOKENS, ROUNDS = 64, 64, 2
ort_seconds = [0.0]
_run = ort.InferenceSession.run_with_iobinding


def _timed_run(self, binding, run_options=None):
    start = time.perf_counter()
    try:
        return _run(self, binding, run_options)
    finally:
        ort_seconds[0] += time.perf_counter() - start


def main() -> None:
    requests = int(sys.argv[1]) if len(sys.argv) > 1 else 96
    prompts = serving_prompts()[:requests]
    pipe = Pipeline.load(BUNDLE, max_num_seqs=CLIENTS, enable_prefix_caching=False)
    ids = [prompt_ids(pipe.codec, p.messages) for p in prompts]
    eos = list(pipe.manifest.tokenizer.eos_token_ids)
    cfg = pipe.generation_config.updated(mode="ar", max_new_tokens=TOKENS)

    def in_process(i: int):
        return pipe.engine().submit(*pipe.check(ids[i], cfg)).wait()

    closed_loop(in_process, 16, CLIENTS)  # the engine's shapes met once
    ort.InferenceSession.run_with_iobinding = _timed_run
    for r in range(ROUNDS):
        ort_seconds[0] = 0.0
        results, wall = closed_loop(in_process, len(ids), CLIENTS)
        tokens = sum(len(x.token_ids) for x in results)
        print(f"in-process round {r}: {tokens / wall:6.1f} tokens/s, {tokens} tokens in {wall:.1f} s, ONNX Runtime "
              f"runs {ort_seconds[0]:.1f} s ({ort_seconds[0] / wall:.0%})", flush=True)
    ort.InferenceSession.run_with_iobinding = _run
    pipe.close()

    server = ServerProcess(BUNDLE, 3072, CLIENTS)
    server.command.append("--no-enable-prefix-caching")
    with server:
        closed_loop(lambda i: chat(server.port, prompts[i], "ar", TOKENS), 16, CLIENTS)
        for r in range(ROUNDS):
            replies, wall = closed_loop(lambda i: chat(server.port, prompts[i], "ar", TOKENS), len(prompts), CLIENTS)
            errors = [x.error for x in replies if x.error]
            tokens = sum(x.tokens or 0 for x in replies)
            print(f"HTTP round {r}: {tokens / wall:6.1f} tokens/s, {tokens} tokens in {wall:.1f} s, "
                  f"{len(errors)} errors", flush=True)

    cb = GenAIServing(genai_dir(Sources.real_pair(BUNDLE).target, CACHE, "target"), threads=2, eos_token_ids=eos,
                      max_num_seqs=CLIENTS)
    cb.closed_loop(ids[:16], CLIENTS, TOKENS)
    for r in range(ROUNDS):
        replies, wall = cb.closed_loop(ids, CLIENTS, TOKENS)
        tokens = sum(len(x.token_ids) for x in replies)
        print(f"GenAI CB round {r}: {tokens / wall:6.1f} tokens/s, {tokens} tokens in {wall:.1f} s", flush=True)


if __name__ == "__main__":
    main()
