"""The batching engine in-process with lab/native/gqa_attention.cc in place of every GroupQueryAttention of the
target's sessions (ort_session patched: the nodes' domain changed, the kernel's library registered) against the
engine as it is: the serving section's prompts, 64 clients, greedy ar, 64 new tokens, prefix caching off, two rounds
alternating; outputs compared between the two and with solo generations; then a 2,048-token prompt's TTFT.

    .venv/bin/python lab/scripts/kernel_engine_ab.py [clients] [requests] > results/kernel-engine-ab.txt
"""
import subprocess
import sys
import time

import onnx
from pathlib import Path
import mirror_sd.runtime.backends as backends
import mirror_sd.runtime.target as target_mod
from mirror_sd.bench.serving import closed_loop, prompt_ids, serving_prompts
from mirror_sd.runtime.pipeline import Pipeline
LIB = "/tmp/exp/libgqa.so"
subprocess.run(["g++", "-O3", "-march=native", "-fPIC", "-shared", "-std=c++17", "-fvisibility=hidden", "-o", LIB, "lab/native/gqa_attention.cc"], check=True)
orig = backends.ort_session
SWAP = {"on": False}
def patched(path, providers=None, threads=1, spinning=None, data_folder=None):
    if not SWAP["on"]:
        return orig(path, providers, threads, spinning, data_folder)
    if isinstance(path, bytes):
        model = onnx.load_from_string(path)
    else:
        model = onnx.load(str(path), load_external_data=False); data_folder = Path(path).parent
    if not any(n.op_type == "GroupQueryAttention" for n in model.graph.node):
        return orig(path, providers, threads, spinning, data_folder)
    for n in model.graph.node:
        if n.op_type == "GroupQueryAttention":
            n.domain = "mirror_sd"
    model.opset_import.append(onnx.helper.make_opsetid("mirror_sd", 1))
    import onnxruntime as ort
    real_opts = ort.SessionOptions
    class Opts(real_opts):
        def __init__(self):
            super().__init__(); self.register_custom_ops_library(LIB)
    ort.SessionOptions = Opts
    try:
        return orig(model.SerializeToString(), providers, threads, spinning, data_folder)
    finally:
        ort.SessionOptions = real_opts
backends.ort_session = patched
target_mod.ort_session = patched
CLIENTS = int(sys.argv[1]) if len(sys.argv) > 1 else 64
N = int(sys.argv[2]) if len(sys.argv) > 2 else 96
pipes = {}
for k in (False, True):
    SWAP["on"] = k
    pipes[k] = Pipeline.load(Path("build/bundles/smollm2-feature"), max_num_seqs=64, enable_prefix_caching=False)
    pipes[k].engine()
SWAP["on"] = False
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
import numpy as np
long = (ids[0] * 40)[:2048]
for k in (False, True):
    ts = []
    for _ in range(3):
        t = time.perf_counter(); pipes[k].generate(long, max_new_tokens=1, mode="ar"); ts.append(time.perf_counter() - t)
    print(f"kernel={k} 2048-token TTFT median {np.median(ts):.2f} s")
