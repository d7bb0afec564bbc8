"""The draft graph's weight format: its MatMul weights as 8-bit blocks (ONNX Runtime's MatMulNBits), or fp32.

Why: a draft forward reads every weight of the draft once for one or a few rows, so it costs what its weights take
to read: int8 blocks make it several times cheaper at the same tokens per step (docs/design.md: Draft weights in
int8). The target verifies every draft token, so the weight format changes how many tokens a step accepts, never
the output; the target's own graphs stay fp32.

Every MatMul with a constant weight becomes MatMulNBits: symmetric 8-bit blocks of BLOCK_SIZE along the input axis,
one fp32 scale per block, computed with int8 activations (accuracy level 4: ONNX Runtime's fastest CPU kernel for
it). The embedding is a Gather (one row read per token) and stays fp32. OpenVINO reads MatMulNBits as compressed
weights, so the same file serves both runtimes and the static NPU packages (package/compress.py leaves weights that
are compressed already as they are).
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx

from mirror_sd.errors import BadInputError, ExportError
from mirror_sd.partitions.manifest import DRAFT_WEIGHT_FORMATS

FLOAT32, INT8 = DRAFT_WEIGHT_FORMATS
DEFAULT_WEIGHT_FORMAT = INT8
BLOCK_SIZE = 32
ACCURACY_LEVEL = 4  # int8 activations in the kernel
QUANTIZED_OP = "MatMulNBits"
# Export fails if the int8 graph's greedy token agrees with the fp32 reference's on fewer grid positions than this:
# only a broken quantization gets there (the real drafts agree on every position; tiny random-weight drafts, whose
# logits are near ties, on most).
MIN_TOP1_AGREEMENT = 0.5


def check_weight_format(value: str) -> str:
    if value not in DRAFT_WEIGHT_FORMATS:
        raise BadInputError(f"draft weights must be one of {', '.join(DRAFT_WEIGHT_FORMATS)}, not {value!r}")
    return value


def _unshare_constants(model: onnx.ModelProto) -> None:
    """Give every Identity of an initializer its own copy of it, and drop the Identity. The exporter shares a constant
    two MatMuls use through such a node (a feature draft's stream heads read the same rows of its head), and the
    quantizer rewrites only MatMuls whose weight is an initializer: the other would read fp32 weights."""
    initializers = {t.name: t for t in model.graph.initializer}
    kept = []
    for node in model.graph.node:
        if node.op_type == "Identity" and node.input[0] in initializers:
            copy = onnx.TensorProto()
            copy.CopyFrom(initializers[node.input[0]])
            copy.name = node.output[0]
            model.graph.initializer.append(copy)
        else:
            kept.append(node)
    del model.graph.node[:]
    model.graph.node.extend(kept)


def quantize_draft(path: Path, data_files: tuple[str, ...] = ()) -> int:
    """Rewrite the ONNX file at `path` (and its external-data files `data_files`, beside it, if any) with 8-bit block
    weights; returns how many MatMuls were quantized. Export runs this in its staging directory, so a failure
    leaves nothing behind."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = logger.level
    logger.setLevel(logging.WARNING)  # it logs every node it looks at
    try:
        model = onnx.load(str(path))
        _unshare_constants(model)
        quantizer = MatMulNBitsQuantizer(model, block_size=BLOCK_SIZE, is_symmetric=True, bits=8,
                                         accuracy_level=ACCURACY_LEVEL)
        quantizer.process()
    finally:
        logger.setLevel(level)
    model = quantizer.model.model
    count = sum(node.op_type == QUANTIZED_OP for node in model.graph.node)
    if count == 0:
        raise ExportError("int8 draft weights: the draft graph has no MatMul with a constant weight to quantize")
    for name in data_files:  # the graph is in memory: written again below, in the same files
        (path.parent / name).unlink()
    if data_files:
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data_files[0])
    else:
        onnx.save(model, str(path))
    return count
