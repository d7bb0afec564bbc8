"""The draft graph's weight format: its MatMul weights as 8-bit blocks (ONNX Runtime's MatMulNBits), or fp32.

Why: a draft forward reads every weight of the draft once for one or a few rows, so it costs what its weights take
to read: int8 blocks make it several times cheaper at the same tokens per step (docs/design.md: Draft weights in
int8). The target verifies every draft token, so the weight format changes how many tokens a step accepts, never
the output; the target's weights are a choice of their own (export/target_weights.py).

Every MatMul with a constant weight becomes MatMulNBits: symmetric 8-bit blocks of BLOCK_SIZE along the input axis,
one fp32 scale per block, computed with int8 activations (accuracy level 4: ONNX Runtime's fastest CPU kernel for
it). The embedding is a Gather (one row read per token) and stays fp32. OpenVINO reads MatMulNBits as compressed
weights, so the same file serves both runtimes and the static NPU packages (package/compress.py leaves weights that
are compressed already as they are).
"""

from __future__ import annotations

from pathlib import Path

from mirror_sd.errors import BadInputError
from mirror_sd.export.weight_blocks import BLOCK_SIZE, QUANTIZED_OP, quantize_matmuls
from mirror_sd.partitions.manifest import DRAFT_WEIGHT_FORMATS

__all__ = ["ACCURACY_LEVEL", "BLOCK_SIZE", "DEFAULT_WEIGHT_FORMAT", "FLOAT32", "INT8", "MIN_TOP1_AGREEMENT",
           "QUANTIZED_OP", "check_weight_format", "quantize_draft"]

FLOAT32, INT8 = DRAFT_WEIGHT_FORMATS
DEFAULT_WEIGHT_FORMAT = INT8
ACCURACY_LEVEL = 4  # int8 activations in the kernel
# Export fails if the int8 graph's greedy token agrees with the fp32 reference's on fewer grid positions than this:
# only a broken quantization gets there (the real drafts agree on every position; tiny random-weight drafts, whose
# logits are near ties, on most).
MIN_TOP1_AGREEMENT = 0.5


def check_weight_format(value: str) -> str:
    if value not in DRAFT_WEIGHT_FORMATS:
        raise BadInputError(f"draft weights must be one of {', '.join(DRAFT_WEIGHT_FORMATS)}, not {value!r}")
    return value


def quantize_draft(path: Path, data_files: tuple[str, ...] = ()) -> int:
    """Rewrite the ONNX file at `path` (and its external-data files `data_files`, beside it, if any) with 8-bit block
    weights; returns how many MatMuls were quantized. Export runs this in its staging directory, so a failure
    leaves nothing behind."""
    return quantize_matmuls(path, data_files, bits=8, accuracy_level=ACCURACY_LEVEL)
