"""Which committed draft `make demo` and `make models` default to: the streaming and the feature bundle side by side.

Both bundles load in one process (each with its committed plan); every benchmark prompt runs ar, sd and mirror on
both, the bundle order alternating from prompt to prompt, greedy, the same new-token count. Figures are medians
over prompts; ratios are per prompt, then the median.

    .venv/bin/python lab/scripts/draft_choice.py build/bundles/smollm2 build/bundles/smollm2-feature \
        --out results/draft-choice.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from mirror_sd.bench.machine import describe_machine
from mirror_sd.models.benchmark_prompts import select
from mirror_sd.runtime.pipeline import Pipeline

MODES = ("ar", "sd", "mirror")


def run_one(pipe: Pipeline, ids: list[int], mode: str, max_new_tokens: int) -> dict:
    first: list[float] = []
    start = time.perf_counter()
    result = pipe.generate(ids, mode=mode, max_new_tokens=max_new_tokens,
                           streamer=lambda _t, _s: first or first.append(time.perf_counter()))
    wall = time.perf_counter() - start
    s = result.stats
    return {"tokens": result.token_ids, "wall_s": wall, "ttft_s": (first[0] if first else start + wall) - start,
            "tokens_per_second": len(result.token_ids) / wall, "mean_accepted_tokens": s.mean_accepted_tokens,
            "new_tokens": len(result.token_ids)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundles", nargs=2, type=Path)
    parser.add_argument("--per-kind", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    pipes = {b.name: Pipeline.load(b) for b in args.bundles}
    prompts = select(args.per_kind)
    names = list(pipes)
    for pipe in pipes.values():  # warm-up: first calls allocate
        for mode in MODES:
            run_one(pipe, pipe.prompt_ids(list(prompts[0].messages)), mode, 16)
    rows = []
    for i, prompt in enumerate(prompts):
        order = names if i % 2 == 0 else names[::-1]
        row = {"prompt": prompt.name}
        for name in order:
            pipe = pipes[name]
            ids = pipe.prompt_ids(list(prompt.messages))
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                row[f"{name}/{mode}"] = run_one(pipe, ids, mode, args.max_new_tokens)
        for name in names:
            ar = row[f"{name}/ar"]["tokens"]
            row[f"{name}/identical"] = all(row[f"{name}/{m}"]["tokens"] == ar for m in MODES)
        rows.append(row)
        print(f"[{i + 1}/{len(prompts)}] {prompt.name}: " + ", ".join(
            f"{k} {v['tokens_per_second']:.1f}" for k, v in row.items() if isinstance(v, dict)), file=sys.stderr)

    def med(key: str, field: str) -> float:
        return statistics.median(r[key][field] for r in rows)

    def ratio(num: str, den: str) -> float:
        return statistics.median(r[num]["tokens_per_second"] / r[den]["tokens_per_second"] for r in rows)

    summary = {}
    for name in names:
        summary[name] = {mode: {"tokens_per_second": med(f"{name}/{mode}", "tokens_per_second"),
                                "ttft_s": med(f"{name}/{mode}", "ttft_s"),
                                "tokens_per_step": med(f"{name}/{mode}", "mean_accepted_tokens"),
                                "over_ar": ratio(f"{name}/{mode}", f"{name}/ar")} for mode in MODES}
        summary[name]["identical_prompts"] = sum(r[f"{name}/identical"] for r in rows)
    a, b = names
    summary[f"{b}_over_{a}"] = {mode: ratio(f"{b}/{mode}", f"{a}/{mode}") for mode in MODES}
    doc = {"what": __doc__.splitlines()[0], "bundles": [str(p) for p in args.bundles], "prompts": len(prompts),
           "max_new_tokens": args.max_new_tokens, "greedy": True, "machine": describe_machine(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "summary": summary,
           "rows": [{k: ({f: v[f] for f in v if f != "tokens"} if isinstance(v, dict) else v) for k, v in r.items()}
                    for r in rows]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
