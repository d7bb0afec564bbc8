"""Does ORT CPU GQA run with fp16 / int8 KV caches, and how fast at 4096 context (one layer, T=1)?"""
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper

H, KV, D, CAP, L = 9, 3, 64, 4608, int(sys.argv[1]) if len(sys.argv) > 1 else 4096
def graph(qt, ct, quant=None, sshape=(1,)):
    attrs = dict(num_heads=H, kv_num_heads=KV, scale=D ** -0.5)
    ins = ["q", "k", "v", "pk", "pv", "sl", "tl"]
    inputs = [helper.make_tensor_value_info("q", qt, [1, "T", H * D]), helper.make_tensor_value_info("k", qt, [1, "T", KV * D]),
              helper.make_tensor_value_info("v", qt, [1, "T", KV * D]),
              helper.make_tensor_value_info("pk", ct, [1, KV, CAP, D]), helper.make_tensor_value_info("pv", ct, [1, KV, CAP, D]),
              helper.make_tensor_value_info("sl", TP.INT32, [1]), helper.make_tensor_value_info("tl", TP.INT32, [1])]
    if quant:
        attrs.update(k_quant_type=quant, v_quant_type=quant, kv_cache_bit_width=8)
        ins += ["", "", "", "", "", "ks", "vs"]
        inputs += [helper.make_tensor_value_info("ks", TP.FLOAT, list(sshape)), helper.make_tensor_value_info("vs", TP.FLOAT, list(sshape))]
    n = helper.make_node("GroupQueryAttention", ins, ["o", "pk", "pv"], domain="com.microsoft", **attrs)
    n.output[1] = "pko"; n.output[2] = "pvo"
    g = helper.make_graph([n], "g", inputs, [helper.make_tensor_value_info("o", qt, None),
                                             helper.make_tensor_value_info("pko", ct, None), helper.make_tensor_value_info("pvo", ct, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]); m.ir_version = 9; return m.SerializeToString()
def run(name, qt, ct, npq, npc, quant=None):
    so = ort.SessionOptions(); so.intra_op_num_threads = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    try:
        s = ort.InferenceSession(graph(qt, ct, quant), so, providers=["CPUExecutionProvider"])
    except Exception as e:
        print(name, "LOAD FAIL", str(e)[-300:]); return
    rng = np.random.default_rng(0)
    feed = {"q": rng.standard_normal((1, 1, H * D)).astype(npq), "k": rng.standard_normal((1, 1, KV * D)).astype(npq),
            "v": rng.standard_normal((1, 1, KV * D)).astype(npq),
            "pk": (rng.standard_normal((1, KV, CAP, D)) * (20 if npc == np.int8 else 1)).astype(npc),
            "pv": (rng.standard_normal((1, KV, CAP, D)) * (20 if npc == np.int8 else 1)).astype(npc),
            "sl": np.array([L], np.int32), "tl": np.array([L + 1], np.int32)}
    if quant: feed.update(ks=np.array([0.05], np.float32), vs=np.array([0.05], np.float32))
    b = s.io_binding()
    for k, v in feed.items(): b.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(v))
    pk = ort.OrtValue.ortvalue_from_numpy(feed["pk"]); pv = ort.OrtValue.ortvalue_from_numpy(feed["pv"])
    b.bind_ortvalue_input("pk", pk); b.bind_ortvalue_input("pv", pv)
    b.bind_ortvalue_output("pko", pk); b.bind_ortvalue_output("pvo", pv); b.bind_output("o")
    try:
        s.run_with_iobinding(b)
    except Exception as e:
        print(name, "RUN FAIL", str(e)[:300]); return
    ts = []
    for _ in range(200):
        t = time.perf_counter(); s.run_with_iobinding(b); ts.append(time.perf_counter() - t)
    print(f"{name}: {np.median(ts)*1e3:.3f} ms/layer at {L}  (x30 layers = {np.median(ts)*30e3:.2f} ms)", flush=True)
run("fp32", TP.FLOAT, TP.FLOAT, np.float32, np.float32)
run("fp16/fp16", TP.FLOAT16, TP.FLOAT16, np.float16, np.float16)
run("fp32/fp16cache", TP.FLOAT, TP.FLOAT16, np.float32, np.float16)
run("fp32/int8 per-tensor", TP.FLOAT, TP.INT8, np.float32, np.int8, "PER_TENSOR")
run("fp16/int8 per-tensor", TP.FLOAT16, TP.INT8, np.float16, np.int8, "PER_TENSOR")

for shape in ([KV * D], [1, KV, 1, D], [KV, 1, D]):
    name = f"per-channel {shape}"
    try:
        s = ort.InferenceSession(graph(TP.FLOAT, TP.INT8, "PER_CHANNEL", shape), ort.SessionOptions(), providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        feed = {"q": rng.standard_normal((1, 1, H * D)).astype(np.float32), "k": rng.standard_normal((1, 1, KV * D)).astype(np.float32),
                "v": rng.standard_normal((1, 1, KV * D)).astype(np.float32),
                "pk": np.zeros((1, KV, CAP, D), np.int8), "pv": np.zeros((1, KV, CAP, D), np.int8),
                "sl": np.array([0], np.int32), "tl": np.array([1], np.int32),
                "ks": np.full(shape, 0.05, np.float32), "vs": np.full(shape, 0.05, np.float32)}
        out = s.run(None, feed)
        print(name, "OK", out[1][0, :, 0, :4])
    except Exception as e:
        print(name, "FAIL", str(e)[-300:])
