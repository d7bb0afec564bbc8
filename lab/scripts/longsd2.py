"""sd at long context with and without the speculation gate: decode tok/s of ar, sd (gate) and sd (every step
speculating) on the context benchmark's prompts. python lab/scripts/longsd2.py 4096"""
import statistics
import sys

from mirror_sd.bench.context import context_prompts
from mirror_sd.runtime.config import GenerationConfig
from mirror_sd.runtime.pipeline import Pipeline

pipe = Pipeline.load("build/bundles/smollm2-feature")
length = int(sys.argv[1]); mode = sys.argv[2] if len(sys.argv) > 2 else "sd"
prompts = context_prompts(pipe, length, 4)
rates = {"ar": [], "adaptive": [], "always": []}
steps = {"adaptive": [], "always": []}
for rep in range(2):
    for p in prompts:
        for name in ("ar", "adaptive", "always"):
            cfg = GenerationConfig(mode="ar" if name == "ar" else mode, max_new_tokens=32, gamma=2,
                                   adaptive_speculation=(name != "always"), draft_confidence_threshold=0.4, kappa=4, branch_budget=2)
            r = pipe.generate(p, cfg)
            s = r.stats
            rate = (s["new_tokens"] - 1) / (s["wall_s"] - s["ttft_s"])
            rates[name].append(rate)
            if name != "ar": steps[name].append(s["mean_accepted_tokens"])
print(length, mode, {k: round(statistics.median(v), 1) for k, v in rates.items()}, {k: round(statistics.mean(v), 2) for k, v in steps.items()})
