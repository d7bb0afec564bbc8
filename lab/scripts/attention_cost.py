"""What attention over a long context costs the target on ONNX Runtime's CPU kernels, and what standard ops would
cost instead (issue 11: decode cost flat in context length, a verification step of several rows near a 1-row one).

Each graph is attention alone, for all of SmolLM2-135M's layers (30 x 9 query heads over 3 KV heads of 64), so the
figures add to a target step's cost without its weights:
- `gqa`: GroupQueryAttention (com.microsoft) over KV buffers of `capacity` positions bound with IOBinding as both
  past and present, rotary embedding inside: exactly what export/target_graphs.py writes and runtime/target.py runs;
- `matmul`: MatMul(Q, K^T) + mask, Softmax, MatMul(P, V) with the query heads of each KV head stacked as rows and K
  given already transposed and cut to the context: a lower bound for attention out of standard ops (no KV write, no
  rotary embedding, no copy of the context into a contiguous input, all of which a real graph would add);
- `read`: numpy summing as many bytes as the context's K and V (one thread): what merely reading them costs.

    python -m mirror_sd.bench.attention_cost --out results/attention-cost.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64  # SmolLM2-135M
CAPACITY = 8192


def _session(model, threads: int):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _gqa_model():
    from onnx import TensorProto, helper, numpy_helper

    half = np.zeros((CAPACITY, HEAD_DIM // 2), np.float32)
    inits = [numpy_helper.from_array(half, "cos"), numpy_helper.from_array(half + 1, "sin")]
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("qkv", f, [1, "T", (HEADS + 2 * KV_HEADS) * HEAD_DIM]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    outputs, nodes = [], []
    for i in range(LAYERS):
        inputs += [helper.make_tensor_value_info(f"past{i}.{kv}", f, [1, KV_HEADS, CAPACITY, HEAD_DIM]) for kv in "kv"]
        outputs += [helper.make_tensor_value_info(f"present{i}.{kv}", f, [1, KV_HEADS, CAPACITY, HEAD_DIM])
                    for kv in "kv"]
        nodes.append(helper.make_node(
            "GroupQueryAttention", ["qkv", "", "", f"past{i}.k", f"past{i}.v", "seqlens_k", "total", "cos", "sin"],
            [f"attn{i}", f"present{i}.k", f"present{i}.v"], domain="com.microsoft", num_heads=HEADS,
            kv_num_heads=KV_HEADS, do_rotary=1))
    nodes.append(helper.make_node("Sum", [f"attn{i}" for i in range(LAYERS)], ["out"]))
    outputs.insert(0, helper.make_tensor_value_info("out", f, [1, "T", HEADS * HEAD_DIM]))
    graph = helper.make_graph(nodes, "gqa", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def _matmul_model():
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("q", f, [1, KV_HEADS, "rows", HEAD_DIM]),
              helper.make_tensor_value_info("mask", f, ["rows", "S"])]
    nodes = []
    for i in range(LAYERS):
        inputs += [helper.make_tensor_value_info(f"kt{i}", f, [1, KV_HEADS, HEAD_DIM, "S"]),
                   helper.make_tensor_value_info(f"v{i}", f, [1, KV_HEADS, "S", HEAD_DIM])]
        nodes += [helper.make_node("MatMul", ["q", f"kt{i}"], [f"s{i}"]),
                  helper.make_node("Add", [f"s{i}", "mask"], [f"m{i}"]),
                  helper.make_node("Softmax", [f"m{i}"], [f"p{i}"], axis=-1),
                  helper.make_node("MatMul", [f"p{i}", f"v{i}"], [f"a{i}"])]
    nodes.append(helper.make_node("Sum", [f"a{i}" for i in range(LAYERS)], ["out"]))
    outputs = [helper.make_tensor_value_info("out", f, [1, KV_HEADS, "rows", HEAD_DIM])]
    return helper.make_model(helper.make_graph(nodes, "matmul", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def _median_ms(fn, repeats: int) -> float:
    from mirror_sd.runtime.profile import _median_time

    return 1e3 * _median_time(fn, repeats)


def measure(pasts: tuple[int, ...], rows: tuple[int, ...], threads: int, repeats: int) -> dict:
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    gqa, mm = _session(_gqa_model(), threads), _session(_matmul_model(), threads)
    buffers = [ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((1, KV_HEADS, CAPACITY, HEAD_DIM), np.float32))
               for _ in range(2 * LAYERS)]
    results = []
    for past in pasts:
        if past + max(rows) > CAPACITY:
            raise ValueError(f"a past of {past} does not fit {CAPACITY} positions")
        kv_bytes = 2 * LAYERS * KV_HEADS * (past + 1) * HEAD_DIM * 4
        block = np.ones(kv_bytes // 4, np.float32)
        row = {"past": past, "kv_mb": kv_bytes / 1e6, "read_ms": _median_ms(block.sum, repeats)}
        for t in rows:
            binding = gqa.io_binding()
            for i in range(LAYERS):
                for j, kv in enumerate("kv"):
                    binding.bind_ortvalue_input(f"past{i}.{kv}", buffers[2 * i + j])
                    binding.bind_ortvalue_output(f"present{i}.{kv}", buffers[2 * i + j])
            binding.bind_cpu_input("qkv", rng.standard_normal((1, t, (HEADS + 2 * KV_HEADS) * HEAD_DIM), np.float32))
            binding.bind_cpu_input("seqlens_k", np.array([past + t - 1], np.int32))
            binding.bind_cpu_input("total", np.array(past + t, np.int32))
            binding.bind_output("out")
            row[f"gqa_T{t}_ms"] = _median_ms(lambda b=binding: gqa.run_with_iobinding(b), repeats)
            span = past + t
            feed = {"q": rng.standard_normal((1, KV_HEADS, HEADS // KV_HEADS * t, HEAD_DIM), np.float32),
                    "mask": np.zeros((HEADS // KV_HEADS * t, span), np.float32)}
            for i in range(LAYERS):
                feed[f"kt{i}"] = rng.standard_normal((1, KV_HEADS, HEAD_DIM, span), np.float32)
                feed[f"v{i}"] = rng.standard_normal((1, KV_HEADS, span, HEAD_DIM), np.float32)
            row[f"matmul_T{t}_ms"] = _median_ms(lambda f=feed: mm.run(["out"], f), repeats)
        results.append(row)
    return {"what": __doc__.split("\n\n")[0], "shape": {"layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS,
                                                         "head_dim": HEAD_DIM, "capacity": CAPACITY},
            "threads": threads, "repeats": repeats, "machine": platform.processor() or platform.machine(),
            "created": time.strftime("%Y-%m-%d %H:%M:%S"), "results": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pasts", default="64,1024,4096", help="context lengths before the step, comma-separated")
    p.add_argument("--rows", default="1,2,5", help="new tokens per step, comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731 - a one-line parser
    doc = measure(ints(args.pasts), ints(args.rows), args.threads, args.repeats)
    for row in doc["results"]:
        print(" ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
