"""For each sampled lookup text of a sampled_lookup_ab.py run that differs from ar's under the same seed: the first
differing position, the target's logits there from a one-token step (ar's) and from a two-row window step, and where
that position's uniform draw falls against the inverse CDF's boundary between the two tokens in each. Written into
the run's file as "differences".

    .venv/bin/python lab/scripts/sampled_flip_margin.py build/bundles/smollm2-feature results/sampled-lookup.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from mirror_sd.models.benchmark_prompts import PROMPTS
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.sampling import TARGET_STREAM, SamplingParams, rng_for, warp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("results")
    args = parser.parse_args()
    doc = json.loads(Path(args.results).read_text())
    pipe = Pipeline.load(Path(args.bundle))
    target, by_name = pipe.target, {p.name: p for p in PROMPTS}
    pairs: dict[tuple[float, str], dict[str, dict]] = {}
    for run in doc["runs"]:
        pairs.setdefault((run["temperature"], run["prompt"]), {})[run["mode"]] = run
    seeds = {name: 1000 + k for k, name in enumerate(dict.fromkeys(r["prompt"] for r in doc["runs"]))}
    differences = []
    for (temperature, name), modes in pairs.items():
        ar, lookup = modes["ar"]["token_ids"], modes["lookup"]["token_ids"]
        if ar == lookup:
            continue
        pos = next(i for i, (a, b) in enumerate(zip(ar, lookup)) if a != b)
        base = list(pipe.prompt_ids(list(by_name[name].messages))) + ar[:pos]
        params = SamplingParams(temperature=temperature, seed=seeds[name])
        _, cache = target.prefill(base[:-1], target.empty_cache())
        one = target.forward([base[-1]], cache)[0][-1]
        _, cache = target.prefill(base[:-2], target.empty_cache())
        row = target.forward(base[-2:], cache)[0][-1]
        low = min(ar[pos], lookup[pos])
        where = {}
        for arm, logits in (("one_token_step", one), ("window_row", row)):
            cdf = np.cumsum(warp(logits, params))
            u = rng_for(params, TARGET_STREAM, len(base)).random() * cdf[-1]
            where[arm] = {"token": int(np.searchsorted(cdf, u, side="right")),
                          "draw_minus_boundary": float(u - cdf[low])}
        differences.append({"temperature": temperature, "prompt": name, "position": pos, "ar_token": ar[pos],
                            "lookup_token": lookup[pos], "max_abs_logit_diff": float(np.abs(one - row).max()),
                            **where})
        print(json.dumps(differences[-1]), flush=True)
    doc["differences"] = differences
    Path(args.results).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
