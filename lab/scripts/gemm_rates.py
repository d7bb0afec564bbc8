"""ONNX Runtime's CPU GEMMs on one of SmolLM2's MLP shapes (576 x 1536), 2 threads, medians of 9: float32 MatMul,
MatMulNBits with int8 and int4 blocks of 32 (int8 activations, accuracy level 4: the int8 and int4 targets' kernel),
and MatMulInteger (u8 x s8, one scale per tensor: VNNI's rate with no block scales). GOP/s = 2 M K N / time.

    .venv/bin/python lab/scripts/gemm_rates.py > lab/results/gemm-rates.txt
"""

from __future__ import annotations

import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import matmul_nbits_quantizer as nbits_quantizer

K, N = 576, 1536
rng = np.random.default_rng(0)
W = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
X = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])
Y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])


def session(model):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def model(nodes, initializers):
    graph = helper.make_graph(nodes, "g", [X], [Y], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def float32():
    return model([helper.make_node("MatMul", ["x", "w"], ["y"])], [numpy_helper.from_array(W, "w")])


def blocks(bits: int):
    config = nbits_quantizer.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, accuracy_level=4,
                                                          bits=bits)
    quantizer = nbits_quantizer.MatMulNBitsQuantizer(float32(), algo_config=config)
    quantizer.process()
    return quantizer.model.model


def integer():
    weights = np.clip(np.round(W / (np.abs(W).max() / 127)), -127, 127).astype(np.int8)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "w", "xz"], ["y32"]),
             helper.make_node("Cast", ["y32"], ["y"], to=TensorProto.FLOAT)]
    return model(nodes, [numpy_helper.from_array(weights, "w")])


def rate(sess, x: np.ndarray) -> float:
    """GOP/s of one session on `x` ([rows, K]): warmed up, then the median of 9 timings."""
    rows = x.shape[0]
    for _ in range(3):
        sess.run(None, {"x": x})
    times, repeats = [], max(1, 2000 // rows)
    for _ in range(9):
        start = time.perf_counter()
        for _ in range(repeats):
            sess.run(None, {"x": x})
        times.append((time.perf_counter() - start) / repeats)
    return 2 * rows * K * N / float(np.median(times)) / 1e9


def main() -> None:
    arms = {"float32 MatMul": session(float32()), "MatMulNBits int8": session(blocks(8)),
            "MatMulNBits int4": session(blocks(4)), "MatMulInteger u8 x s8": session(integer())}
    print(f"M rows x {K} x {N}, GOP/s (2 threads, medians of 9)")
    for rows in (1, 16, 64, 512):
        x = rng.standard_normal((rows, K)).astype(np.float32)
        rates = {name: rate(sess, x) for name, sess in arms.items()}
        print(f"{rows:4d} rows: " + ", ".join(f"{name} {rate:5.0f}" for name, rate in rates.items()), flush=True)


if __name__ == "__main__":
    main()
