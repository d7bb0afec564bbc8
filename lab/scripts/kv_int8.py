"""Experiment: the feature bundle's target with an int8 KV cache (ORT GQA PER_CHANNEL, static scales calibrated from
the fp32 cache of a real prompt). Step times at 64/2048/4096 and greedy agreement with fp32."""
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, numpy_helper

from mirror_sd.bench.context import context_prompts
from mirror_sd.partitions.manifest import Manifest
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.target import _Bound, open_target

SRC = Path("build/bundles/smollm2-feature"); DST = Path("build/kvq/bundle")
pipe = Pipeline.load(SRC) if hasattr(Pipeline, "load") else Pipeline(SRC)
man = Manifest.load(SRC)
text = None
calib = context_prompts(pipe, 3000, 1)[0]
t32 = open_target(SRC, man, "cpu", threads=2, capacity=4608)
_, cache = t32.prefill(calib, t32.empty_cache())
L = cache.length
scales = {}
for name, buf in t32.buffers.items():
    a = buf.numpy()[0, :, :L, :]  # [kv, L, D]
    if ".key" in name:  # rotary pairs (i, i + D/2) share a bound: rope mixes them at unseen positions
        D = a.shape[-1]; h = D // 2
        pair = np.sqrt(a[..., :h] ** 2 + a[..., h:] ** 2).max(1)  # [kv, h]
        m = np.concatenate([pair, pair], -1)
    else:
        m = np.abs(a).max(1)
    scales[name] = (np.maximum(m, 1e-6) * float(sys.argv[1] if len(sys.argv) > 1 else 1.25) / 127).astype(np.float32)[:, None, :]  # [kv,1,D]
print("calibrated on", L, "tokens")
if DST.exists(): shutil.rmtree(DST)
DST.mkdir(parents=True)
for f in SRC.iterdir():
    if f.name not in ("target_prefix.onnx", "target_suffix.onnx"):
        shutil.copy(f, DST / f.name)
for role in ("target_prefix", "target_suffix"):
    m = onnx.load(SRC / f"{role}.onnx")
    for node in m.graph.node:
        if node.op_type != "GroupQueryAttention": continue
        pk, pv = node.input[3], node.input[4]
        ks, vs = pk + ".scale", pv + ".scale"
        m.graph.initializer.extend([numpy_helper.from_array(scales[pk], ks), numpy_helper.from_array(scales[pv], vs)])
        while len(node.input) < 12: node.input.append("")
        node.input.extend([ks, vs])
        node.attribute.extend([onnx.helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                               onnx.helper.make_attribute("v_quant_type", "PER_CHANNEL"),
                               onnx.helper.make_attribute("kv_cache_bit_width", 8)])
    for vi in list(m.graph.input) + list(m.graph.output):
        if vi.name.startswith("past_key_values") or vi.name.startswith("present"):
            vi.type.tensor_type.elem_type = TensorProto.INT8
    onnx.save(m, DST / f"{role}.onnx")
print("rewritten")

def int8_target():
    t = open_target(DST, man, "cpu", threads=2, capacity=4608)
    shape = [1, man.target.num_kv_heads, t.capacity, man.target.head_dim]
    t.buffers = {n: ort.OrtValue.ortvalue_from_shape_and_type(shape, np.int8, "cpu", 0) for n in t.buffers}
    t._prefix = _Bound(t._prefix.session, t._prefix.spec, t.buffers)
    t._suffix = _Bound(t._suffix.session, t._suffix.spec, t.buffers)
    return t
t8 = int8_target()

def greedy(t, ids, n=32):
    logits, c = t.prefill(ids, t.empty_cache()); out = [int(np.argmax(logits))]
    for _ in range(n - 1):
        lg, c = t.forward([out[-1]], c, logits_for=1); out.append(int(np.argmax(lg[-1])))
    return out

for length in (64, 2048, 4096):
    prompts = context_prompts(pipe, length, 3 if length > 64 else 3, None)
    for p in prompts[-2:]:
        p = p if length != 3000 else p
        a, b = greedy(t32, p), greedy(t8, p)
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"{length}: first divergence at {same}/32")
    ids = prompts[0]
    caches = {}
    for name, t in (("fp32", t32), ("int8", t8)):
        s = time.perf_counter(); _, caches[name] = t.prefill(ids, t.empty_cache()); caches[name+"_ttft"] = time.perf_counter() - s
    times = {"fp32": [], "int8": []}
    for i in range(31):
        for name, t in (("fp32", t32), ("int8", t8)):
            s = time.perf_counter(); t.forward(ids[-1:], caches[name], logits_for=1); d = time.perf_counter() - s
            if i: times[name].append(d)
    print(f"{length}: prefill fp32 {caches['fp32_ttft']:.3f}s int8 {caches['int8_ttft']:.3f}s; step fp32 "
          f"{statistics.median(times['fp32'])*1e3:.2f} ms int8 {statistics.median(times['int8'])*1e3:.2f} ms", flush=True)
