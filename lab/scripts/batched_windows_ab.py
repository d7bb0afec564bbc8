"""Copied windows at batch > 1 (BatchEngine._window_step): the benchmark's serving prompts through the engine
directly (no HTTP), closed loop, 64 new tokens, modes ar / lookup / mirror rotated in one process, every output
checked against the ar arm's. ar takes plain batched steps only; lookup and mirror rows verify windows copied from
their texts, up to `window_rows` rows at once (the load option), where the engine's gate measured that faster.

    .venv/bin/python lab/scripts/batched_windows_ab.py build/bundles/smollm2-feature --out results/batched-windows.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from slot_packing_ab import flush, write_results

from mirror_sd.bench import serving
from mirror_sd.runtime.pipeline import Pipeline

MODES = ("ar", "lookup", "mirror")


def point(pipe: Pipeline, clients: int, mode: str, tag: str, kinds: tuple[str, ...] = ()) -> dict:
    """One closed-loop point; kinds: only the serving prompts of these task kinds (all by default)."""
    engine = pipe.engine()
    flush(pipe, tag)
    prompts = serving.serving_prompts()
    indices = serving.point_prompts(serving.FULL, clients)
    if kinds:
        indices = [i for i, p in enumerate(prompts) if p.name.split("-")[0] in kinds][:len(indices)]
    counts = {"window_steps": 0, "window_s": 0.0}
    run_windows = engine.batch.run_windows

    def counted(rows):
        start = time.perf_counter()
        out = run_windows(rows)
        counts["window_steps"] += 1
        counts["window_s"] += time.perf_counter() - start
        return out

    engine.batch.run_windows = counted
    try:
        results, wall = serving.closed_loop(lambda i: engine.submit(*pipe.check(
            list(prompts[indices[i]].messages), mode=mode, max_new_tokens=serving.FULL.max_tokens)).wait(),
            len(indices), clients)
    finally:
        engine.batch.run_windows = run_windows
    tokens = sum(len(r.token_ids) for r in results)
    return {"clients": clients, "mode": mode, "kinds": sorted(kinds) or ["all"], "requests": len(indices),
            "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, **counts,
            "accepted_copied_tokens": sum(r.stats.lookup_accepted_tokens for r in results),
            "proposed_copied_tokens": sum(r.stats.lookup_proposed_tokens for r in results),
            "accepted_tokens": sum(r.stats["accepted_tokens"] for r in results),
            "proposed_tokens": sum(r.stats["proposed_tokens"] for r in results),
            "token_ids": [r.token_ids for r in results]}


def summarise(arms: dict[str, list[dict]]) -> dict:
    """One series' arms (name -> its runs, "ar" among them): median tokens/s and window steps, the ratio to ar, and
    how many outputs differ from the first ar run's."""
    reference = arms["ar"][0]["token_ids"]
    median = {a: statistics.median(x["tokens_per_s"] for x in xs) for a, xs in arms.items()}
    return {"tokens_per_s_median": median, "over_ar": {a: median[a] / median["ar"] for a in arms},
            "window_steps_median": {a: statistics.median(x["window_steps"] for x in xs) for a, xs in arms.items()},
            "outputs_differing_from_ar": sum(t != ref for xs in arms.values() for x in xs
                                             for t, ref in zip(x["token_ids"], reference))}


def by_clients(runs: list[dict], arms: tuple[str, ...]) -> dict:
    """`summarise` of each count of clients' runs, by arm (a run's "arm")."""
    return {f"{clients} clients": summarise({a: [x for x in runs if x["clients"] == clients and x["arm"] == a]
                                             for a in arms})
            for clients in sorted({x["clients"] for x in runs})}


def arguments() -> argparse.ArgumentParser:
    """The bundle, --out, --rounds and --clients: what the batched A/B scripts share."""
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", default="2,4")
    return parser


def main() -> None:
    parser = arguments()
    parser.add_argument("--kinds", default="all;summarisation,rag",
                        help="';'-separated sets of comma-separated task kinds, each a series of points (all: every "
                             "prompt)")
    args = parser.parse_args()
    pipe = Pipeline.load(Path(args.bundle), max_num_seqs=serving.MAX_NUM_SEQS, max_context=serving.FULL.max_context)
    runs = []
    for kinds in (tuple(k for k in ks.split(",") if k != "all") for ks in args.kinds.split(";")):
        for clients in (int(c) for c in args.clients.split(",")):
            for r in range(args.rounds):
                order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
                for mode in order:
                    runs.append(point(pipe, clients, mode, f"{clients}-{r}-{mode}-{kinds}", kinds))
                    print(json.dumps({k: v for k, v in runs[-1].items() if k != "token_ids"}), flush=True)
    window_rows = pipe.engine().batch.window_rows
    pipe.close()
    summary = {}
    for series in sorted({(tuple(x["kinds"]), x["clients"]) for x in runs}):
        arms = {m: [x for x in runs if (tuple(x["kinds"]), x["clients"]) == series and x["mode"] == m] for m in MODES}
        summary[f"{'+'.join(series[0])} @ {series[1]} clients"] = summarise(arms)
    write_results(args.out, "do rows verifying windows copied from their texts in one step (up to window_rows rows) "
                  "beat plain batched steps, and does every output stay the ar one?", args.bundle, summary, runs,
                  window_rows=window_rows)


if __name__ == "__main__":
    main()
