"""Sampled sd and mirror with every window verified against the target's own draws (the draft drawing with the same
numbers) against speculative sampling with residual resampling (the code before): one arm per process, the code each
imports given by PYTHONPATH (a tree of the earlier commit for the residual arm), arms alternated by the caller. The
real pair, the serving prompts, 64 new tokens, one seed per prompt, at temperatures 0.7 and 1.0: tokens per second
over the whole call, accepted draft tokens per verified window token, and whether each mode's text equals ar's.

    .venv/bin/python lab/scripts/sampled_own_draws_ab.py build/bundles/smollm2-feature --arm own-draws --out x.jsonl
    PYTHONPATH=/tmp/old .venv/bin/python lab/scripts/sampled_own_draws_ab.py ... --arm residual --out x.jsonl
    .venv/bin/python lab/scripts/sampled_own_draws_ab.py --summarise x.jsonl --out results/sampled-own-draws.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

TEMPERATURES = (0.7, 1.0)
MODES = ("ar", "sd", "mirror")


def run(bundle: str, arm: str, prompts: int, out: Path, round_: int) -> None:
    from mirror_sd.bench import serving
    from mirror_sd.runtime.pipeline import Pipeline

    pipe = Pipeline.load(bundle)
    chats = [list(p.messages) for p in serving.serving_prompts()[:prompts]]
    pipe.generate(chats[0], mode="mirror", max_new_tokens=8, temperature=1.0)  # warm-up
    with out.open("a") as f:
        for temperature in TEMPERATURES:
            for i, chat in enumerate(chats):
                texts = {}
                for mode in MODES:
                    start = time.perf_counter()
                    r = pipe.generate(chat, mode=mode, max_new_tokens=64, temperature=temperature, seed=i,
                                      ignore_eos=True)
                    wall = time.perf_counter() - start
                    texts[mode] = r.token_ids
                    f.write(json.dumps({"arm": arm, "round": round_, "temperature": temperature, "prompt": i,
                                        "mode": mode, "tokens_per_s": len(r.token_ids) / wall,
                                        "accepted": r.stats["accepted_tokens"], "proposed": r.stats["proposed_tokens"],
                                        "equals_ar": r.token_ids == texts["ar"]}) + "\n")
    pipe.close()


def summarise(rows: list[dict]) -> dict:
    out: dict = {}
    for arm in sorted({r["arm"] for r in rows}):
        for t in TEMPERATURES:
            for mode in MODES:
                sel = [r for r in rows if r["arm"] == arm and r["temperature"] == t and r["mode"] == mode]
                if not sel:
                    continue
                proposed = sum(r["proposed"] for r in sel)
                out.setdefault(arm, {}).setdefault(str(t), {})[mode] = {
                    "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in sel),
                    "accepted_per_proposed": sum(r["accepted"] for r in sel) / proposed if proposed else None,
                    "equal_to_ar": f"{sum(r['equals_ar'] for r in sel)} of {len(sel)}", "generations": len(sel)}
    for t in map(str, TEMPERATURES):
        for mode in ("sd", "mirror"):
            own, res = out.get("own-draws", {}).get(t, {}), out.get("residual", {}).get(t, {})
            if mode in own and mode in res and "ar" in own and "ar" in res:
                out.setdefault("ratios", {}).setdefault(t, {})[mode] = {
                    "own_draws_over_residual": own[mode]["median_tokens_per_s"] / res[mode]["median_tokens_per_s"],
                    "over_ar_own_draws": own[mode]["median_tokens_per_s"] / own["ar"]["median_tokens_per_s"],
                    "over_ar_residual": res[mode]["median_tokens_per_s"] / res["ar"]["median_tokens_per_s"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle", nargs="?")
    parser.add_argument("--arm", choices=("own-draws", "residual"))
    parser.add_argument("--round", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--summarise", type=Path, help="a JSON-lines file of both arms' runs")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.summarise:
        from mirror_sd.bench.machine import describe_machine

        rows = [json.loads(line) for line in args.summarise.read_text().splitlines()]
        doc = {"question": __doc__.split("\n\n")[0], "bundle": "build/bundles/smollm2-feature", "new_tokens": 64,
               "machine": describe_machine(), "summary": summarise(rows), "runs": rows}
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        return
    run(args.bundle, args.arm, args.prompts, args.out, args.round)


if __name__ == "__main__":
    main()
