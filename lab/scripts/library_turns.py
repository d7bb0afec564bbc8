"""A chat's second turn: TTFT with the first turn's KV reused against the same turn prefilled from nothing, side by
side in one process, and whether the tokens are the same. `--via library`: `Pipeline.generate` (the target's own
buffers; from nothing after an unrelated call); `--via engine`: the batching engine's prefix cache (from nothing on a
second pipeline loaded with enable_prefix_caching off). The serving benchmark's multi-turn prompt: a ~2,000-token
documentation passage to summarise, then a follow-up question.

    .venv/bin/python lab/scripts/library_turns.py build/bundles/smollm2-feature --out lab/results/library-turns.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from mirror_sd.bench.context import _passages
from mirror_sd.bench.machine import describe_machine
from mirror_sd.runtime.pipeline import Pipeline

FOLLOW_UP = "Thank you. Which three points of your summary matter most to a beginner, and why?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--via", choices=("library", "engine"), default="library")
    args = ap.parse_args()
    pipe = Pipeline.load(args.bundle, target_threads=2)
    fresh_pipe = (Pipeline.load(args.bundle, target_threads=2, enable_prefix_caching=False)
                  if args.via == "engine" else None)

    def run(p: Pipeline, prompt, mode: str):
        if args.via == "library":
            return p.generate(prompt, mode=mode, max_new_tokens=args.new)
        return p.engine().submit(*p.check(prompt, mode=mode, max_new_tokens=args.new)).wait()
    text = pipe.codec.encode(_passages(), special=False)
    out: dict = {"bundle": args.bundle, "via": args.via, "prompt_tokens": args.tokens, "new_tokens": args.new,
                 "runs": []}
    for r in range(args.rounds):
        for mode in ("ar", "mirror"):
            passage = pipe.codec.decode(text[(r * 2 + (mode == "mirror")) * args.tokens:][:args.tokens - 40])
            chat = [{"role": "user", "content": "Summarise this documentation for a beginner:\n\n" + passage}]
            first = run(pipe, chat, mode)
            turn = chat + [{"role": "assistant", "content": first.text}, {"role": "user", "content": FOLLOW_UP}]
            reused = run(pipe, turn, mode)
            if fresh_pipe is None:
                pipe.generate("Why?", mode="ar", max_new_tokens=2)  # nothing of the chat held after it
            fresh = run(fresh_pipe or pipe, turn, mode)
            out["runs"].append({"mode": mode, "turn1_prompt_tokens": len(pipe.prompt_ids(chat)),
                                "turn1_ttft_s": first.stats.ttft_s, "turn2_ttft_s": reused.stats.ttft_s,
                                "turn2_cached_tokens": reused.stats.cached_prompt_tokens,
                                "turn2_fresh_ttft_s": fresh.stats.ttft_s,
                                "same_tokens": reused.token_ids == fresh.token_ids})
            print(json.dumps(out["runs"][-1]), flush=True)
    for mode in ("ar", "mirror"):
        runs = [x for x in out["runs"] if x["mode"] == mode]
        med = {k: statistics.median(x[k] for x in runs) for k in ("turn1_ttft_s", "turn2_ttft_s", "turn2_fresh_ttft_s")}
        out[mode] = {**med, "turn2_over_turn1": med["turn2_ttft_s"] / med["turn1_ttft_s"],
                     "turn2_over_fresh": med["turn2_ttft_s"] / med["turn2_fresh_ttft_s"],
                     "all_same_tokens": all(x["same_tokens"] for x in runs)}
    out["machine"] = describe_machine(Path.cwd())
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    pipe.close()
    if fresh_pipe is not None:
        fresh_pipe.close()


if __name__ == "__main__":
    main()
