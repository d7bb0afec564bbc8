"""The batching engine in-process with the target's attention on the project's kernel (runtime/cpu_attention.py)
against ONNX Runtime's GroupQueryAttention (LoadOptions.native_attention): the serving section's prompts, `clients`
concurrent, greedy ar, 64 new tokens, prefix caching off, two rounds alternating; outputs compared between the two and
with solo generations; then a 2,048-token prompt's TTFT. (Its first runs patched ort_session with the kernel from
lab/native/, before the kernel moved into runtime/native/.)

    .venv/bin/python lab/scripts/kernel_engine_ab.py [clients] [requests] > results/kernel-engine-ab.txt
"""
import sys
import time
from pathlib import Path

import numpy as np

from mirror_sd.bench.serving import closed_loop, prompt_ids, serving_prompts
from mirror_sd.runtime.pipeline import Pipeline

CLIENTS = int(sys.argv[1]) if len(sys.argv) > 1 else 64
N = int(sys.argv[2]) if len(sys.argv) > 2 else 96
pipes = {k: Pipeline.load(Path("build/bundles/smollm2-feature"), max_num_seqs=64, enable_prefix_caching=False,
                          native_attention=k) for k in (False, True)}
assert pipes[True].target.native_attention and not pipes[False].target.native_attention
ids = [prompt_ids(pipes[True].codec, p.messages) for p in serving_prompts()[:N]]
def point(pipe):
    cfg = pipe.generation_config.updated(mode="ar", max_new_tokens=64)
    res, wall = closed_loop(lambda i: pipe.engine().submit(*pipe.check(ids[i], cfg)).wait(), len(ids), CLIENTS)
    return sum(len(r.token_ids) for r in res) / wall, [r.token_ids for r in res]
for p in pipes.values(): point(p)
outs = {}
for r in range(2):
    for k in (False, True):
        rate, toks = point(pipes[k]); outs[k] = toks
        print(f"kernel={k} {rate:.1f} tok/s", flush=True)
print("outputs equal between kernels:", sum(a == b for a, b in zip(outs[False], outs[True])), "of", len(ids))
# solo vs batched with the kernel, first 12 prompts
solo = [pipes[True].generate(ids[i], max_new_tokens=64, mode="ar").token_ids for i in range(12)]
print("kernel: batched equals solo:", sum(a == b for a, b in zip(solo, outs[True][:12])), "of 12")
# TTFT of a 2,048-token prompt
long = (ids[0] * 40)[:2048]
for k in (False, True):
    ts = []
    for _ in range(3):
        t = time.perf_counter(); pipes[k].generate(long, max_new_tokens=1, mode="ar"); ts.append(time.perf_counter() - t)
    print(f"kernel={k} 2048-token TTFT median {np.median(ts):.2f} s")
