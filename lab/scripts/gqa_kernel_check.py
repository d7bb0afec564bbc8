"""runtime/native/attention.cc against ONNX Runtime's GroupQueryAttention on SmolLM2's attention shapes (9 query
heads over 3 KV heads of 64, KV buffers of 2,100 positions shared by past and present, bound in place as the target
binds them): first the outputs and the KV written, case by case (batches, windows after a past, a local window, a
soft cap, no rotary, q / k / v apart); then 30 layers' time per step, both kernels alternating, medians.

    .venv/bin/python lab/scripts/gqa_kernel_check.py > results/cpu-attention-kernel.txt

It compiles the kernel with g++ into a temporary folder first. Rows of several tokens after a past are compared with
ONNX Runtime's kernel row by row (it refuses them at batch > 1).
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

SOURCE = Path(__file__).resolve().parents[2] / "runtime" / "native" / "attention.cc"
H, KV, D, C = 9, 3, 64, 2100  # query heads, KV heads, head size, KV positions
LAYERS, REPEATS = 30, 7
rng = np.random.default_rng(0)
_angles = np.arange(C)[:, None] / (10000 ** (np.arange(D // 2)[None] / (D // 2)))
COS, SIN = np.cos(_angles).astype(np.float32), np.sin(_angles).astype(np.float32)


def build(folder: str) -> str:
    lib = f"{folder}/libgqa.so"
    subprocess.run(["g++", "-O3", "-march=native", "-fPIC", "-shared", "-std=c++17", "-fvisibility=hidden", "-o", lib,
                    str(SOURCE)], check=True)
    return lib


def model(domain: str, window: int, rotary: int, packed: bool, softcap: float) -> bytes:
    def value(name, dims, kind=TensorProto.FLOAT):
        return helper.make_tensor_value_info(name, kind, dims)

    width = (H + 2 * KV) * D if packed else H * D
    inputs = [value("q", ["B", "S", width])]
    inputs += [] if packed else [value("k", ["B", "S", KV * D]), value("v", ["B", "S", KV * D])]
    inputs += [value("pk", ["B", KV, C, D]), value("pv", ["B", KV, C, D]), value("seqlens", ["B"], TensorProto.INT32),
               value("total", [], TensorProto.INT32), value("cos", [C, D // 2]), value("sin", [C, D // 2])]
    attrs = dict(num_heads=H, kv_num_heads=KV, do_rotary=rotary, rotary_interleaved=0, scale=D ** -0.5)
    if window > 0:
        attrs["local_window_size"] = window
    if softcap:
        attrs["softcap"] = softcap
    names = ["q", "" if packed else "k", "" if packed else "v", "pk", "pv", "seqlens", "total", "cos", "sin"]
    node = helper.make_node("GroupQueryAttention", names, ["o", "prk", "prv"], domain=domain, **attrs)
    outputs = [value("o", ["B", "S", H * D]), value("prk", ["B", KV, C, D]), value("prv", ["B", KV, C, D])]
    graph = helper.make_graph([node], "attention", inputs, outputs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString()


def session(lib: str, domain: str, window: int = -1, rotary: int = 1, packed: bool = True, softcap: float = 0.0):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.add_session_config_entry("session.force_spinning_stop", "1")
    if domain == "mirror_sd.gqa":
        opts.register_custom_ops_library(lib)
    return ort.InferenceSession(model(domain, window, rotary, packed, softcap), opts,
                                providers=["CPUExecutionProvider"])


def run(sess, new: list[np.ndarray], keys, values, seqlens: np.ndarray) -> np.ndarray:
    """One call with the KV buffers bound as both past and present; the attention's output."""
    binding = sess.io_binding()
    binding.bind_output("o", "cpu")
    for name, array in zip(("q", "k", "v"), new):
        binding.bind_cpu_input(name, array)
    binding.bind_ortvalue_input("pk", keys)
    binding.bind_ortvalue_input("pv", values)
    binding.bind_ortvalue_output("prk", keys)
    binding.bind_ortvalue_output("prv", values)
    binding.bind_cpu_input("seqlens", seqlens)
    binding.bind_cpu_input("total", np.array(int(seqlens.max()) + 1, np.int32))
    binding.bind_cpu_input("cos", COS)
    binding.bind_cpu_input("sin", SIN)
    sess.run_with_iobinding(binding)
    return binding.get_outputs()[0].numpy().copy()


def ortvalue(array: np.ndarray):
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))


def case(lib: str, batch: int, tokens: int, pasts: list[int], packed: bool = True, **attrs) -> str:
    sessions = session(lib, "com.microsoft", packed=packed, **attrs), session(lib, "mirror_sd.gqa", packed=packed, **attrs)
    keys0, values0 = (rng.standard_normal((batch, KV, C, D), np.float32) for _ in range(2))
    widths = [(H + 2 * KV) * D] if packed else [H * D, KV * D, KV * D]
    new = [rng.standard_normal((batch, tokens, w), np.float32) for w in widths]
    seqlens = np.array([p + tokens - 1 for p in pasts], np.int32)
    got = []
    for s in sessions:
        rows = [range(batch)] if batch == 1 or tokens == 1 or s is sessions[1] else [[r] for r in range(batch)]
        outs, keys, values = [], keys0.copy(), values0.copy()
        for r in rows:
            r = list(r)
            k, v = ortvalue(keys[r]), ortvalue(values[r])
            outs.append(run(s, [np.ascontiguousarray(n[r]) for n in new], k, v, seqlens[r]))
            keys[r], values[r] = k.numpy(), v.numpy()
        got.append((np.concatenate(outs), keys, values))
    (o1, k1, v1), (o2, k2, v2) = got
    diffs = float(np.abs(o1 - o2).max()), float(np.abs(k1 - k2).max()), float(np.abs(v1 - v2).max())
    ok = diffs[0] < 1e-5 and diffs[1] < 1e-5 and diffs[2] == 0
    return (f"batch {batch:2d} x {tokens:2d} tokens after {str(pasts[:4]):22s} {str(attrs or ''):18s} "
            f"{'packed' if packed else 'q/k/v '}: output {diffs[0]:.1e}, keys {diffs[1]:.1e}, values {diffs[2]:.1e}"
            f"{'' if ok else '  DIFFERS'}")


def window_against_steps(lib: str, domain: str, tokens: int = 5, past: int = 300) -> float:
    """The largest difference between `tokens` new tokens run as one window after `past` and the same tokens run one
    call each (0: every position the same bits either way)."""
    sess = session(lib, domain)
    keys0, values0 = (rng.standard_normal((1, KV, C, D), np.float32) for _ in range(2))
    new = rng.standard_normal((1, tokens, (H + 2 * KV) * D), np.float32)
    k, v = ortvalue(keys0), ortvalue(values0)
    window = run(sess, [new], k, v, np.array([past + tokens - 1], np.int32))
    k, v = ortvalue(keys0), ortvalue(values0)
    steps = np.concatenate([run(sess, [np.ascontiguousarray(new[:, t:t + 1])], k, v, np.array([past + t], np.int32))
                            for t in range(tokens)], axis=1)
    return float(np.abs(window - steps).max())


def step_ms(sess, batch: int, tokens: int, past: int, buffers) -> float:
    new = [rng.standard_normal((batch, tokens, (H + 2 * KV) * D), np.float32)]
    seqlens = np.full(batch, past + tokens - 1, np.int32)
    start = time.perf_counter()
    for keys, values in buffers:
        run(sess, new, keys, values, seqlens)
    return (time.perf_counter() - start) * 1000


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        lib = build(folder)
        print("outputs, largest difference from ONNX Runtime's GroupQueryAttention")
        pasts = [int(p) for p in rng.integers(1, 400, 16)]
        for args, kw in (((1, 1, [100]), {}), ((1, 1, [0]), {}), ((16, 1, pasts), {}),
                         ((1, 37, [500]), {}), ((1, 64, [0]), {}), ((1, 5, [300]), {"packed": False}),
                         ((1, 40, [200]), {"window": 16}), ((4, 1, [10, 50, 20, 300]), {"window": 32}),
                         ((1, 9, [70]), {"softcap": 5.0}), ((1, 9, [70]), {"rotary": 0}),
                         ((3, 4, [10, 100, 33]), {})):
            print(case(lib, *args, **kw), flush=True)
        theirs, ours = window_against_steps(lib, "com.microsoft"), window_against_steps(lib, "mirror_sd.gqa")
        print("\n5 tokens after 300 as one window against one call each, largest difference: ONNX Runtime "
              f"{theirs:.1e}, this kernel {ours:.1e}")
        print(f"\n{LAYERS} layers' attention, ms per step (median of {REPEATS}, the kernels alternating), 2 threads")
        ours, theirs = session(lib, "mirror_sd.gqa"), session(lib, "com.microsoft")
        for batch, tokens, past in ((16, 1, 250), (64, 1, 250), (1, 1, 2048), (1, 512, 0), (1, 512, 1536)):
            buffers = [tuple(ortvalue(rng.standard_normal((batch, KV, C, D), np.float32)) for _ in range(2))
                       for _ in range(LAYERS)]
            times = {"ort": [], "ours": []}
            for _ in range(REPEATS):
                times["ort"].append(step_ms(theirs, batch, tokens, past, buffers))
                times["ours"].append(step_ms(ours, batch, tokens, past, buffers))
            o, m = np.median(times["ort"]), np.median(times["ours"])
            print(f"{batch:2d} rows x {tokens:3d} tokens after {past:4d}: ONNX Runtime {o:7.1f}, this kernel {m:7.1f} "
                  f"({m / o:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
