"""ONNX Runtime's profile of the batching engine under serving_bound_at_64.py's load (64 clients, the serving
prompts, greedy ar, 64 new tokens, prefix caching off): kernel time per operator, and per MatMul weight the rows it
ran and its GFLOP/s. The profiler slows the run; its wall time is not a figure.

    .venv/bin/python lab/scripts/engine_kernel_profile.py [requests] > results/engine-kernel-profile.txt
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
from pathlib import Path

import onnxruntime as ort

from mirror_sd.bench.serving import closed_loop, prompt_ids, serving_prompts
from mirror_sd.runtime.pipeline import Pipeline

BUNDLE = Path("build/bundles/smollm2-feature")
CLIENTS, TOKENS = 64, 64
sessions: list = []
_init = ort.InferenceSession.__init__


def main() -> None:
    requests = int(sys.argv[1]) if len(sys.argv) > 1 else 96
    folder = tempfile.mkdtemp()

    def profiled(self, source, sess_options=None, providers=None, *args, **kwargs):
        if sess_options is not None:
            sess_options.enable_profiling = True
            sess_options.profile_file_prefix = f"{folder}/ort"
        _init(self, source, sess_options, providers, *args, **kwargs)
        sessions.append(self)

    ort.InferenceSession.__init__ = profiled
    pipe = Pipeline.load(BUNDLE, max_num_seqs=CLIENTS, enable_prefix_caching=False)
    ids = [prompt_ids(pipe.codec, p.messages) for p in serving_prompts()[:requests]]
    cfg = pipe.generation_config.updated(mode="ar", max_new_tokens=TOKENS)
    results, _wall = closed_loop(lambda i: pipe.engine().submit(*pipe.check(ids[i], cfg)).wait(), len(ids), CLIENTS)
    files = [s.end_profiling() for s in sessions]
    pipe.close()
    by_op: collections.Counter = collections.Counter()
    rows: collections.Counter = collections.Counter()
    seconds: collections.Counter = collections.Counter()
    for f in filter(None, files):
        for e in json.loads(Path(f).read_text()):
            if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
                continue
            op, dur = e["args"]["op_name"], e["dur"] / 1e6
            by_op[op] += dur
            if op == "MatMul":
                a = next(iter(e["args"]["input_type_shape"][0].values()))
                out = next(iter(e["args"]["output_type_shape"][0].values()))
                weight = (a[-1], out[-1])
                n = 1
                for d in a[:-1]:
                    n *= d
                rows[weight] += n
                seconds[weight] += dur
        os.remove(f)
    total = sum(by_op.values())
    print(f"{sum(len(r.token_ids) for r in results)} tokens; kernel time {total:.2f} s")
    for op, s in by_op.most_common(6):
        print(f"  {op:34s} {s:6.2f} s {s / total:6.1%}")
    for (k, n), count in rows.items():
        print(f"  MatMul {k:4d} x {n:5d}: {count:7d} rows, {seconds[(k, n)]:5.2f} s, "
              f"{2 * count * k * n / seconds[(k, n)] / 1e9:4.0f} GFLOP/s")


if __name__ == "__main__":
    main()
