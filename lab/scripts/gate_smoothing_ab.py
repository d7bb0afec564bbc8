"""sd and mirror with the speculation gate at several smoothings (and max_explore_every), and speculating at every
step, against ar, side by side in one process on the feature bundle (results/gate-smoothing.json).

python lab/scripts/gate_smoothing_ab.py PER_KIND|ctxLENGTH SMOOTHING/MAX_EXPLORE[,...] ROUNDS
e.g. `4 0.3/64,0.1/64 2` (4 prompts per kind of bench/prompts.py, two rounds) or `ctx2048 0.1/64 1` (the context
benchmark's prompts of 2,048 tokens). Prints per arm: [median, mean of per-prompt tokens/s over ar's, mean tokens
per step, per-kind medians]. Each arm keeps its own gate memory.
"""
import statistics
import sys

from mirror_sd.models.benchmark_prompts import select
from mirror_sd.runtime import gate as G
from mirror_sd.runtime.pipeline import Pipeline

SMOOTH = {"value": 0.3}
orig = G.SpeculationGate.resumed.__func__
def resumed(cls, state):
    g = orig(cls, state); g.smoothing, g.max_explore_every = SMOOTH["value"]; return g
G.SpeculationGate.resumed = classmethod(resumed)
pipe = Pipeline.load("build/bundles/smollm2-feature")
if sys.argv[1].startswith("ctx"):
    from types import SimpleNamespace

    from mirror_sd.bench.context import context_prompts
    ids = context_prompts(pipe, int(sys.argv[1][3:]), 4)
    prompts = [SimpleNamespace(kind="ctx", name=f"ctx{i}", messages=p) for i, p in enumerate(ids)]
else:
    prompts = select(int(sys.argv[1]))
smooths = [tuple(float(y) for y in x.split("/")) for x in sys.argv[2].split(",")]
arms = {"ar": (dict(mode="ar"), None)}
for mode in ("sd", "mirror"):
    for s in smooths:
        arms[f"{mode}-g{s[0]}/{int(s[1])}"] = (dict(mode=mode), (s[0], int(s[1])))
    arms[f"{mode}-always"] = (dict(mode=mode, adaptive_speculation=False), None)
memories = {name: {} for name in arms}
def run(name, p, n):
    kw, s = arms[name]
    SMOOTH["value"] = s or (0.3, 64)
    pipe._gate_memory = memories[name]
    return pipe.generate(list(p.messages) if not isinstance(p.messages[0], int) else list(p.messages), max_new_tokens=n, temperature=0.0, **kw)
for name in arms:
    run(name, prompts[0], 8)
rows = []
for rep in range(int(sys.argv[3]) if len(sys.argv) > 3 else 1):
    for i, p in enumerate(prompts):
        names = list(arms); k = (i + rep) % len(names); names = names[k:] + names[:k]
        for name in names:
            r = run(name, p, 32)
            rows.append((p.kind, p.name + str(rep), name, len(r.token_ids) / r.stats.wall_s, r.stats.mean_accepted_tokens))
ar = {(k, n): t for k, n, m, t, _ in rows if m == "ar"}
out = {}
for name in arms:
    ratios = [t / ar[(k, n)] for k, n, m, t, _ in rows if m == name]
    per_kind = {}
    for k, n, m, t, a in rows:
        if m == name: per_kind.setdefault(k, []).append(t / ar[(k, n)])
    out[name] = [round(statistics.median(ratios), 3), round(statistics.mean(ratios), 3), round(statistics.mean(a for k, n, m, t, a in rows if m == name), 2),
                 {k: round(statistics.median(v), 2) for k, v in per_kind.items()}]
for k, v in out.items(): print(k, v)
