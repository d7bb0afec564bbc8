"""One draft forward against one target step, for bundles side by side (issue 12's "a draft forward costs <= 15%
of a target T=1 step"): medians through runtime/profile.py's timers, several rounds (shared cores are noisy), with
the draft on each runtime asked for (the plan picks one of them where the draft runs on the CPU).

    python -m mirror_sd.bench.draft_cost build/bundles/smollm2 build/bundles/smollm2-feature \\
        --out results/smollm2-feature-draft-cost.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

PAST = 200  # context tokens before the timed forward


def measure(bundles: list[Path], rounds: int, repeats: int, backends: tuple[str, ...] = ("openvino",)) -> dict:
    from mirror_sd.runtime import profile
    from mirror_sd.runtime.pipeline import Pipeline

    pipes = {f"{b.name}@{backend}": Pipeline.load(b, target_threads=2, draft_threads=1, use_plan=False,
                                                   draft_backend=backend) for b in bundles for backend in backends}
    past = list(range(1000, 1000 + PAST))
    runs = []
    for _ in range(rounds):
        run = {}
        for name, pipe in pipes.items():
            prefix, suffix = profile.time_target(pipe.target, past, (1, 5), repeats)
            draft = profile.time_draft(pipe.draft, past, (1, 8), (1,), repeats)
            t1, d1 = prefix[1] + suffix[1], draft[(1, 1)]
            run[name] = {"target_T1_ms": 1e3 * t1, "target_T5_ms": 1e3 * (prefix[5] + suffix[5]),
                         "draft_b1_ms": 1e3 * d1, "draft_b8_ms": 1e3 * draft[(8, 1)],
                         "tokens_per_forward": pipe.manifest.draft.tokens_per_forward, "draft_over_target_T1": d1 / t1}
        runs.append(run)
    return {"in_generation": {name: in_generation(pipe) for name, pipe in pipes.items()},
            "what": f"a draft forward (batch 1 and 8, one new token after {PAST} context tokens) against a target "
                    "step (prefix + suffix, T=1 and T=5); medians of `repeats` calls, target 2 threads + draft 1; "
                    "runs keyed bundle@draft runtime",
            "machine": platform.processor() or platform.machine(), "created": time.strftime("%Y-%m-%d %H:%M:%S"),
            "repeats": repeats, "runs": runs}


def in_generation(pipe, per_kind: int = 1, max_new_tokens: int = 48) -> dict:
    """The same ratio where it is paid: draft forwards inside sd generations (every step speculating, on the
    benchmark's prompts) against target steps inside ar generations, medians of the traced intervals. Beside the
    target the draft runs with caches the target's weights have flushed, at a new context length every call."""
    import statistics

    from mirror_sd.models.benchmark_prompts import select

    prompts = select(per_kind)
    phases: dict[str, list[float]] = {"draft": [], "target": []}
    for mode in ("ar", "sd"):
        options = {} if mode == "ar" else {"adaptive_speculation": False, "prompt_lookup_num_tokens": 0}
        pipe.generate(prompts[0].messages, mode=mode, max_new_tokens=4, **options)  # warm-up
        for p in prompts:
            result = pipe.generate(p.messages, mode=mode, max_new_tokens=max_new_tokens, trace=True, **options)
            trace = result.stats.trace
            if mode == "ar":  # a step: its prefix and the suffix after it (the prefill's chunks left out)
                spans = [(name, e - s) for name, s, e in trace if name in ("prefix", "suffix")][2:]
                phases["target"] += [a + b for (_, a), (_, b) in zip(spans[::2], spans[1::2])]
            else:
                phases["draft"] += [e - s for name, s, e in trace if name == "draft"]
    draft, target = statistics.median(phases["draft"]), statistics.median(phases["target"])
    return {"draft_forward_ms": 1e3 * draft, "target_T1_ms": 1e3 * target, "draft_over_target_T1": draft / target,
            "draft_forwards": len(phases["draft"]), "target_steps": len(phases["target"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundles", type=Path, nargs="+")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--draft-backends", default="openvino,onnxruntime", help="the draft's runtimes, comma-separated")
    args = p.parse_args(argv)
    doc = measure(args.bundles, args.rounds, args.repeats, tuple(args.draft_backends.split(",")))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["runs"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
