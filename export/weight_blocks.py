"""MatMul weights as n-bit blocks: ONNX Runtime's MatMulNBits, for the draft's int8 weights and the target's int8 or
int4 ones.

Every MatMul with a constant weight [K, N] becomes MatMulNBits: symmetric blocks of BLOCK_SIZE along K, one float32
scale per block. ONNX Runtime's quantizer maps each block's largest-magnitude weight w_max to -2^(bits-1), so the
scale is w_max / -2^(bits-1), and rounds the rest to integers in [-2^(bits-1), 2^(bits-1) - 1]. `block_quantized`
applies that rule to a torch weight: a model whose weights went through it is exported in float32, proved by the
ordinary parity checks against itself, and then compressed without changing a single weight (`quantize_matmuls(...,
lossless=True)` checks that, weight by weight). OpenVINO reads MatMulNBits as compressed weights, so the same file
serves both runtimes.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from mirror_sd.errors import ExportError
from mirror_sd.partitions.manifest import WEIGHT_BLOCK_SIZE as BLOCK_SIZE
from mirror_sd.runtime.prompt_graphs import QUANTIZED_OP, dequantized


def block_quantized(weight: torch.Tensor, bits: int, block: int = BLOCK_SIZE) -> torch.Tensor:
    """`weight` [out, in] (a Linear's: y = x W^T, so blocks run along `in`) rounded as ONNX Runtime's symmetric
    MatMulNBits quantizer rounds it; float32 values, each an integer multiple of its block's scale."""
    out_features, in_features = weight.shape
    pad = -in_features % block  # the quantizer pads K with zeros to whole blocks
    w = torch.nn.functional.pad(weight.detach().float(), (0, pad)).reshape(out_features, -1, block)
    peak = w.gather(-1, w.abs().argmax(-1, keepdim=True))
    scale = peak / -(2 ** (bits - 1))
    q = torch.where(scale == 0, torch.zeros_like(w), torch.round(w / torch.where(scale == 0, 1.0, scale)))
    q = q.clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return (q * scale).reshape(out_features, -1)[:, :in_features].to(weight.dtype)


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


def at_accuracy_level(path: Path, level: int) -> int:
    """Rewrite the graph file at `path` (its external data untouched) with every MatMulNBits at ONNX Runtime's
    accuracy `level`, into a new file (`path` may be a hard link to another bundle's); returns how many."""
    model = onnx.load(str(path), load_external_data=False)
    count = 0
    for node in model.graph.node:
        for attr in node.attribute:
            if node.op_type == QUANTIZED_OP and attr.name == "accuracy_level":
                attr.i, count = level, count + 1
    partial = path.with_name(path.name + ".partial")
    onnx.save(model, str(partial))
    partial.replace(path)
    return count


def quantize_matmuls(path: Path, data_files: tuple[str, ...], bits: int, accuracy_level: int,
                     lossless: bool = False, bits_by_width: dict[int, int | None] | None = None) -> int:
    """Rewrite the ONNX file at `path` (and its external-data files `data_files`, beside it, if any) with `bits`-bit
    block weights, computed at ONNX Runtime's `accuracy_level`; returns how many MatMuls were quantized.
    bits_by_width: other bits for the MatMuls of these output widths (the target's LM head: its vocabulary).
    `lossless`: every weight must come back exactly (weights already on the block grid, `block_quantized`), else
    ExportError. Export runs this in its staging directory, so a failure leaves nothing behind."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = logger.level
    logger.setLevel(logging.WARNING)  # it logs every node it looks at
    try:
        model = onnx.load(str(path))
        _unshare_constants(model)
        before = {t.name: t for t in model.graph.initializer}
        constant = {node.name: before[node.input[1]] for node in model.graph.node
                    if node.op_type == "MatMul" and node.input[1] in before}
        # the weights as numbers only where they are checked: a large model's would double its memory here
        weights = {name: numpy_helper.to_array(t) for name, t in constant.items()} if lossless else {}
        node_bits = {name: (bits_by_width or {}).get(t.dims[-1], bits) for name, t in constant.items()}
        for b in sorted({b for b in node_bits.values() if b is not None}):
            quantizer = MatMulNBitsQuantizer(model, block_size=BLOCK_SIZE, is_symmetric=True, bits=b,
                                             accuracy_level=accuracy_level,
                                             nodes_to_exclude=[n for n, nb in node_bits.items() if nb != b])
            quantizer.process()
            model = quantizer.model.model
    finally:
        logger.setLevel(level)
    nodes = [node for node in model.graph.node if node.op_type == QUANTIZED_OP]
    if not nodes:
        raise ExportError(f"{path.name}: no MatMul with a constant weight to quantize")
    if lossless:
        after = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        for node in nodes:
            original = weights[node.name.rsplit("_Q", 1)[0]]
            worst = float(np.abs(dequantized(node, after) - original).max())
            if worst > 1e-6 * max(float(np.abs(original).max()), 1e-30):
                raise ExportError(f"{path.name}: {node.name}'s {node_bits[node.name.rsplit('_Q', 1)[0]]}-bit weights "
                                  f"differ from the float32 graph's by {worst:.3g}: its weights were not on the block "
                                  "grid")
    for name in data_files:  # the graph is in memory: written again below, in the same files
        (path.parent / name).unlink()
    if data_files:
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data_files[0])
    else:
        onnx.save(model, str(path))
    return len(nodes)
