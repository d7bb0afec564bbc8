"""Prompt lookup when sampling (runtime/verify.py own_draws_accept): mode lookup against ar on the benchmark's
summarisation and RAG prompts, sampled at temperature 0.7 and 1.0 with one seed per prompt, arms alternating per
prompt, in one process. Each lookup text must equal ar's under the same seed.

    .venv/bin/python lab/scripts/sampled_lookup_ab.py build/bundles/smollm2-feature --out results/sampled-lookup.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from mirror_sd.models.benchmark_prompts import PROMPTS
from mirror_sd.runtime.pipeline import Pipeline

KINDS = ("summarisation", "rag", "qa")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--per-kind", type=int, default=4)
    args = parser.parse_args()
    pipe = Pipeline.load(Path(args.bundle))
    prompts = [p for kind in KINDS for p in [q for q in PROMPTS if q.kind == kind][:args.per_kind]]
    pipe.generate(list(prompts[0].messages), mode="ar", max_new_tokens=8)  # first shapes met outside the timing
    runs = []
    for temperature in (0.7, 1.0):
        for k, prompt in enumerate(prompts):
            for mode in (("lookup", "ar") if k % 2 == 0 else ("ar", "lookup")):
                out = pipe.generate(list(prompt.messages), mode=mode, max_new_tokens=args.tokens,
                                    temperature=temperature, seed=1000 + k)
                s = out.stats
                runs.append({"temperature": temperature, "prompt": prompt.name, "kind": prompt.kind, "mode": mode,
                             "tokens": len(out.token_ids), "wall_s": s["wall_s"], "ttft_s": s["ttft_s"],
                             "target_steps": s["target_steps"], "lookup_steps": s["lookup_steps"],
                             "lookup_proposed_tokens": s["lookup_proposed_tokens"],
                             "lookup_accepted_tokens": s["lookup_accepted_tokens"],
                             "declined_copies": s["declined_copies"], "token_ids": out.token_ids})
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "token_ids"}), flush=True)
    summary = {}
    for temperature in (0.7, 1.0):
        for kind in KINDS:
            sel = {m: [r for r in runs if r["temperature"] == temperature and r["kind"] == kind and r["mode"] == m]
                   for m in ("lookup", "ar")}
            # decode rate after the first token: the prefill is the same work in both modes
            rate = {m: [(r["tokens"] - 1) / (r["wall_s"] - r["ttft_s"]) for r in sel[m]] for m in sel}
            summary[f"T={temperature} {kind}"] = {
                "median_decode_ratio_lookup_over_ar": round(statistics.median(
                    a / b for a, b in zip(rate["lookup"], rate["ar"])), 3),
                "tokens_per_step_lookup": round(sum(r["tokens"] for r in sel["lookup"])
                                                / sum(r["target_steps"] for r in sel["lookup"]), 3),
                "copied_accepted_share": round(sum(r["lookup_accepted_tokens"] for r in sel["lookup"])
                                               / max(1, sum(r["lookup_proposed_tokens"] for r in sel["lookup"])), 3),
                "texts_equal": all(a["token_ids"] == b["token_ids"] for a, b in zip(sel["lookup"], sel["ar"]))}
    doc = {"question": "what does prompt lookup give sampled generations, verified against the target's own draws?",
           "bundle": args.bundle, "new_tokens": args.tokens, "summary": summary, "runs": runs}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
