"""Huge pages under the weights, A/B in one process: two pipelines on the same bundle, one loaded with
huge_pages=True and one without, measured alternately (so drift on this shared machine falls on both alike).
Target steps (1 and 5 tokens) at 64 and 1,024 context tokens, a 1,024-token prefill, and ar / mirror decode on
chat prompts. Pipelines loaded later ran a few percent faster on this machine whatever they were, so both orders run.

python lab/scripts/huge_pages_ab.py BUNDLE OUT.json
"""
import json
import statistics
import sys
import time

import numpy as np

from mirror_sd.runtime.pipeline import Pipeline

bundle, out = sys.argv[1], sys.argv[2]
PROMPTS = ["Explain why the sky is blue.", "Write a short poem about autumn.", "Give three tips for learning Python.",
           "Summarise the plot of Hamlet in two sentences.", "How do I boil an egg?", "What makes a good password?"]
ids = [int(x) for x in np.random.default_rng(0).integers(100, 40000, size=1100)]


def med_ms(values):
    return round(statistics.median(values) * 1000, 2)


def one_order(huge_first: bool) -> dict:
    pipes, loads = {}, {}
    for name in (("huge", "plain") if huge_first else ("plain", "huge")):
        started = time.perf_counter()
        pipes[name] = Pipeline.load(bundle, huge_pages=name == "huge")
        loads[name] = round(time.perf_counter() - started, 2)
    row = {"order": list(pipes), "load_s": loads, "collapse": vars(pipes["huge"].huge_pages)}
    for n in (64, 1024):
        caches = {k: p.target.prefill(ids[:n], p.target.empty_cache())[1] for k, p in pipes.items()}
        for t in (1, 5):
            times = {k: [] for k in pipes}
            for _ in range(40):
                for k, p in pipes.items():
                    s = time.perf_counter()
                    p.target.forward(ids[n:n + t], caches[k], logits_for=t)
                    times[k].append(time.perf_counter() - s)
            row[f"step_T{t}_at_{n}_ms"] = {k: med_ms(v) for k, v in times.items()}
    times = {k: [] for k in pipes}
    for _ in range(3):
        for k, p in pipes.items():
            s = time.perf_counter()
            p.target.prefill(ids[:1024], p.target.empty_cache())
            times[k].append(time.perf_counter() - s)
    row["prefill_1024_ms"] = {k: med_ms(v) for k, v in times.items()}
    for mode in ("ar", "mirror"):
        rates = {k: [] for k in pipes}
        for k, p in pipes.items():
            p.generate([{"role": "user", "content": PROMPTS[0]}], mode=mode, max_new_tokens=8, temperature=0.0)
        for q in PROMPTS * 2:
            for k, p in pipes.items():
                s = p.generate([{"role": "user", "content": q}], mode=mode, max_new_tokens=32, temperature=0.0).stats
                rates[k].append((s.new_tokens - 1) / (s.wall_s - s.ttft_s))
        row[f"{mode}_decode_tokens_per_s"] = {k: round(statistics.median(v), 1) for k, v in rates.items()}
    return row


runs = [one_order(True), one_order(False)]
ratios = {key: round(statistics.mean(r[key]["plain"] / r[key]["huge"] if "ms" in key else r[key]["huge"] / r[key]["plain"]
                                     for r in runs), 3)
          for key in runs[0] if key.endswith(("_ms", "_per_s"))}
doc = {"what": "huge pages under the weights (Pipeline.load(huge_pages=True), runtime/huge_pages.py) against the same "
               "bundle loaded without, alternately in one process, both load orders; ratios are plain/huge for times "
               "and huge/plain for rates (above 1: huge pages faster), the mean of the two orders",
       "bundle": bundle, "threads": "the bundle plan's", "created": time.strftime("%Y-%m-%d %H:%M:%S"),
       "speedup": ratios, "runs": runs}
with open(out, "w") as f:
    json.dump(doc, f, indent=1)
print(json.dumps(ratios))
