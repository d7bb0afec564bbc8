"""One stream, each bundle's planned mode and ar beside OpenVINO GenAI at its defaults (this CPU: bf16 compute, u8 KV
cache) in its three single-stream methods (plain, prompt lookup, speculative with the plain draft): the benchmark's
prompts, greedy, tokens/s over the whole call (prefill included), methods alternating per prompt.

    .venv/bin/python lab/scripts/precision_single_stream.py build/bundles/smollm2-feature-int8 \
        build/bundles/smollm2-feature --per-kind 2 --out lab/results/x.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mirror_sd.bench.ov_genai as ov_genai
from mirror_sd.bench.baselines import Sources, open_baselines
from mirror_sd.bench.machine import describe_machine
from mirror_sd.models.benchmark_prompts import select
from mirror_sd.runtime.pipeline import Pipeline


def genai_defaults(threads: int, *_unused) -> dict:
    return {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundles", nargs="+", help="ours; the first one's sources give GenAI its target")
    parser.add_argument("--per-kind", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    ov_genai._properties = genai_defaults  # GenAI as a user gets it, not pinned to f32 as the benchmark pins it
    pipes = {Path(b).name: Pipeline.load(b) for b in args.bundles}
    genai = open_baselines(Path(args.bundles[0]), names=["ov-genai-ar", "ov-genai-pld", "ov-genai-sd"],
                           threads=args.threads, sources=Sources.real_pair(Path(args.bundles[0])))
    runs: dict[str, list[float]] = {}
    prompts = select(args.per_kind)
    for i, p in enumerate(prompts):
        messages = list(p.messages)
        ids = next(iter(pipes.values())).prompt_ids(messages)
        # "planned": the mode and settings the bundle's plan.json gives (no mode asked for)
        calls = [(f"{name} {mode}", pipe, {"mode": "ar"} if mode == "ar" else {})
                 for name, pipe in pipes.items() for mode in ("ar", "planned")]
        calls += [(m.name + " (defaults)", m, None) for m in genai]
        k = i % len(calls)
        for label, runner, options in calls[k:] + calls[:k]:
            start = time.perf_counter()
            if options is None:  # a GenAI method, on the same token ids
                result = runner.generate(ids, max_new_tokens=args.new_tokens, temperature=0.0, seed=0)
            else:
                result = runner.generate(messages, max_new_tokens=args.new_tokens, temperature=0.0, **options)
            wall = time.perf_counter() - start
            runs.setdefault(label, []).append(len(result.token_ids) / wall)
        print(p.name, {k: round(v[-1], 1) for k, v in runs.items()}, flush=True)
    summary = {label: statistics.median(v) for label, v in runs.items()}
    fastest_genai = max(v for k, v in summary.items() if k.startswith("ov-genai"))
    report = {"what": __doc__.splitlines()[0], "machine": describe_machine(), "bundles": args.bundles,
              "prompts": len(prompts), "new_tokens": args.new_tokens,
              "created": time.strftime("%Y-%m-%d %H:%M:%S"), "median_tokens_per_s": summary,
              "over_fastest_genai": {k: v / fastest_genai for k, v in summary.items()}, "runs": runs}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["over_fastest_genai"], indent=1))


if __name__ == "__main__":
    main()
