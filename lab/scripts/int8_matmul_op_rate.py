"""One MatMulNBits node (int8 blocks of 32, 576 x 1536) on ONNX Runtime's kernel and on lab/native/int8_matmul_op.cc,
2 threads, medians of 9: GOP/s and the largest difference between their outputs.

    cd lab/scripts && ../../.venv/bin/python int8_matmul_op_rate.py
"""

from __future__ import annotations

import tempfile

import gemm_rates
import int8_matmul_engine_ab as lab_op
import numpy as np
import onnxruntime as ort
from onnx import helper


def model(domain: str):
    m = gemm_rates.blocks(8)
    for node in m.graph.node:
        if node.op_type == "MatMulNBits":
            node.domain = domain
    if domain == lab_op.MMQ:
        m.opset_import.append(helper.make_opsetid(lab_op.MMQ, 1))
    return m


def session(m, library: str | None):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.force_spinning_stop", "1")
    if library:
        options.register_custom_ops_library(library)
    return ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main() -> None:
    library = str(lab_op.build(tempfile.mkdtemp()))
    arms = {"MatMulNBits": session(model("com.microsoft"), None), "lab op": session(model(lab_op.MMQ), library)}
    rng = np.random.default_rng(0)
    for rows in (1, 16, 64, 512):
        x = rng.standard_normal((rows, gemm_rates.K)).astype(np.float32)
        outs = {name: sess.run(None, {"x": x})[0] for name, sess in arms.items()}
        rates = {name: round(gemm_rates.rate(sess, x)) for name, sess in arms.items()}
        print(rows, rates, "max diff", float(np.abs(outs["MatMulNBits"] - outs["lab op"]).max()), flush=True)


if __name__ == "__main__":
    main()
