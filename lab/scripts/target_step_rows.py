"""A target step's prefix and suffix (median ms over 20 calls) at T = 1 .. 10 rows after a 100-token context, twice,
as the feature bundle's pipeline runs them (its plan's threads): the cost table window_rule_sim.py scores with.

python lab/scripts/target_step_rows.py
"""
import statistics
import time

from mirror_sd.runtime.pipeline import Pipeline

pipe = Pipeline.load("build/bundles/smollm2-feature")
t = pipe.target
_, cache = t.prefill(list(range(1000, 1100)), t.empty_cache())
for _ in range(2):
    row = {}
    for rows in range(1, 11):
        xs = []
        for _ in range(20):
            s = time.perf_counter()
            b = t.run_prefix(list(range(2000, 2000 + rows)), cache)
            m = time.perf_counter()
            t.run_suffix(b)
            e = time.perf_counter()
            xs.append(((m - s) * 1000, (e - m) * 1000))
        row[rows] = (round(statistics.median(x[0] for x in xs), 1), round(statistics.median(x[1] for x in xs), 1))
    print("rows: (prefix ms, suffix ms)", row, flush=True)
