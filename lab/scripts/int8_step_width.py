"""An int8 target's one-row steps, padded to two rows or not: whether sd and mirror equal ar on the real pair, and
what a padded step costs.

exactness: the benchmark's prompts (two per kind, 64 new tokens, greedy, the gates off so that every step that can
speculate does), sd and mirror against ar, at target_step_width 2 (the int8 default) and 0 (unpadded).
cost: the target's step of 1, 2 and 3 tokens at 64 and 1,024 context tokens, per bundle and thread count (medians
of 5 x 20 steps; run on a quiet machine).

    .venv/bin/python lab/scripts/int8_step_width.py build/bundles/smollm2-feature-int8 build/bundles/smollm2-feature \
        --out results/int8-step-width.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from mirror_sd.bench.machine import describe_machine
from mirror_sd.models.benchmark_prompts import select
from mirror_sd.runtime.pipeline import Pipeline


def exactness(bundle: str, width: int) -> dict:
    pipe = Pipeline.load(bundle, target_step_width=width)
    differ = []
    total = 0
    for p in select(2):
        messages = list(p.messages)
        ar = pipe.generate(messages, mode="ar", max_new_tokens=64, temperature=0.0).token_ids
        for mode in ("sd", "mirror"):
            out = pipe.generate(messages, mode=mode, max_new_tokens=64, temperature=0.0,
                                adaptive_speculation=False).token_ids
            total += 1
            if out != ar:
                differ.append({"prompt": p.name, "mode": mode,
                               "first_difference": next(i for i, (a, b) in enumerate(zip(ar, out)) if a != b)})
    print(bundle, width, f"{total - len(differ)} of {total} equal ar", flush=True)
    return {"step_width": width, "generations": total, "equal_ar": total - len(differ), "differ": differ}


def step_cost(bundle: str, threads: int) -> dict:
    target = Pipeline.load(bundle, target_threads=threads, target_step_width=0).target
    rng = np.random.default_rng(0)
    out = {}
    for context in (64, 1024):
        _, cache = target.prefill(rng.integers(100, 40000, context).tolist(), target.empty_cache())
        runs: dict[int, list[float]] = {}
        for _ in range(5):
            for width in (1, 2, 3):
                times = []
                for _ in range(20):
                    start = time.perf_counter()
                    target.forward([5] * width, cache, logits_for=width)
                    times.append(time.perf_counter() - start)
                runs.setdefault(width, []).append(statistics.median(times))
        out[context] = {width: statistics.median(v) * 1000 for width, v in runs.items()}
        print(bundle, threads, context, {w: round(ms, 2) for w, ms in out[context].items()}, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("int8_bundle")
    parser.add_argument("others", nargs="*", help="bundles whose step cost is measured beside it")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {"machine": describe_machine(),
              "exactness": [exactness(args.int8_bundle, w) for w in (2, 0)],
              "step_ms": {b: {t: step_cost(b, t) for t in (1, 2)} for b in [args.int8_bundle, *args.others]}}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
