"""Many clients on a compressed target: the batching engine in-process on the int8 bundle (and the float32 one),
against OpenVINO GenAI's continuous batching at its defaults (this CPU: bf16 compute, u8 KV cache) on the same
target with NNCF's int8 weights and with float32 ones; a closed loop of C clients over the serving section's prompts,
greedy ar, 64 new tokens, prefix caching off, the arms alternating, two rounds each.

    .venv/bin/python lab/scripts/serving_compressed.py [requests] > lab/results/serving-compressed.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

import mirror_sd.bench.ov_genai as ov_genai
from mirror_sd.bench.baselines import CACHE, Sources, genai_dir
from mirror_sd.bench.serving import closed_loop, prompt_ids, serving_prompts
from mirror_sd.runtime.pipeline import Pipeline

BUNDLES = {"int8": Path("build/bundles/smollm2-feature-int8"), "float32": Path("build/bundles/smollm2-feature")}
TOKENS, ROUNDS = 64, 2


def genai_defaults(threads: int, *_unused) -> dict:
    return {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}


def run(arm, ids: list[list[int]], clients: int, count: int) -> tuple[int, float]:
    """The first `count` prompts through one arm (ours: (pipeline, its ids, its config); GenAI's pipeline) from
    `clients` clients: tokens generated and the wall time."""
    if isinstance(arm, tuple):
        pipe, own, cfg = arm
        results, wall = closed_loop(lambda i: pipe.engine().submit(*pipe.check(own[i], cfg)).wait(), count, clients)
        return sum(len(x.token_ids) for x in results), wall
    replies, wall = arm.closed_loop(ids[:count], clients, TOKENS)
    return sum(len(x.token_ids) for x in replies), wall


def main() -> None:
    requests = int(sys.argv[1]) if len(sys.argv) > 1 else 96
    clients = [int(c) for c in sys.argv[2].split(",")] if len(sys.argv) > 2 else [16, 64]
    ov_genai._properties = genai_defaults  # GenAI as a user gets it
    prompts = serving_prompts()[:requests]
    source = Sources.real_pair(BUNDLES["float32"]).target
    for c in clients:
        arms = {}
        for fmt, bundle in BUNDLES.items():
            pipe = Pipeline.load(bundle, max_num_seqs=c, enable_prefix_caching=False)
            print(f"ours {fmt}: step width {pipe.target.step_width}, kernel {pipe.target.native_attention}",
                  flush=True)
            ids = [prompt_ids(pipe.codec, p.messages) for p in prompts]
            cfg = pipe.generation_config.updated(mode="ar", max_new_tokens=TOKENS)
            arms[f"ours {fmt}"] = (pipe, ids, cfg)
        eos = list(next(iter(arms.values()))[0].manifest.tokenizer.eos_token_ids)
        for fmt in BUNDLES:
            arms[f"GenAI CB {fmt} (defaults)"] = ov_genai.GenAIServing(
                genai_dir(source, CACHE, "target", fmt), threads=2, eos_token_ids=eos, max_num_seqs=c)

        ids = arms["ours float32"][1]
        for name in arms:
            run(arms[name], ids, c, 16)  # shapes met once
        for r in range(ROUNDS):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            for name in order:
                tokens, wall = run(arms[name], ids, c, len(prompts))
                print(f"{c} clients, round {r}, {name}: {tokens / wall:6.1f} tokens/s ({tokens} tokens, {wall:.1f} s)",
                      flush=True)
        for arm in arms.values():
            if isinstance(arm, tuple):
                arm[0].close()


if __name__ == "__main__":
    main()
