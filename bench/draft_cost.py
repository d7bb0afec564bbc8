"""One draft forward against one target step, for bundles side by side (issue 12's "a draft forward costs <= 15%
of a target T=1 step"): medians through runtime/profile.py's timers, several rounds (shared cores are noisy).

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


def measure(bundles: list[Path], rounds: int, repeats: int) -> dict:
    from mirror_sd.runtime import profile
    from mirror_sd.runtime.pipeline import Pipeline

    pipes = {b.name: Pipeline.load(b, target_threads=2, draft_threads=1, use_plan=False) for b in bundles}
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
    return {"what": f"a draft forward (batch 1 and 8, one new token after {PAST} context tokens) against a target "
                    "step (prefix + suffix, T=1 and T=5); medians of `repeats` calls, target 2 threads + draft 1",
            "machine": platform.processor() or platform.machine(), "created": time.strftime("%Y-%m-%d %H:%M:%S"),
            "repeats": repeats, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundles", type=Path, nargs="+")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    doc = measure(args.bundles, args.rounds, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["runs"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
