"""The target's MatMul weights in 8- or 4-bit blocks (`make export ... TARGET_WEIGHTS=int8|int4`).

Why: a decode step on a CPU reads every weight of the target once, so it costs about what the weights take to read:
8-bit blocks are a quarter of float32's bytes, 4-bit an eighth (docs/design.md: Target weights in blocks).

How, so that the export still proves itself: the torch target's Linear weights are first rounded onto the block grid
(`on_block_grid`, the rounding ONNX Runtime's quantizer applies), the float32 graphs are exported from that model and
checked by the ordinary parity grid against it (atol 1e-4, failing), and only then are the prefix's and the suffix's
MatMuls compressed, every weight checked to come back exactly (export/weight_blocks.py). The LM head is never below
8 bits (`lm_head_bits`: an int4 target's is int8, as NNCF's int4 keeps it). The embedding is a Gather (a row read per
token) and the early-exit head is small: both stay float32, so the branch hit rate keeps the exit head's precision.

What the user gets: sd and mirror verify against the compressed target, so their outputs equal its ar output token
for token; how often it agrees with the float32 model is measured at export (`validation.target_weights`) and
reported, not required. Both kernels compute with int8 activations (ONNX Runtime's accuracy level 4, its fast CPU path
for 8- and 4-bit blocks; `ACCURACY_LEVELS`), recorded in the manifest (`matmul_activations`) for the runtime.
"""

from __future__ import annotations

import copy
import os
from dataclasses import replace
from pathlib import Path

import torch

from mirror_sd.errors import BadInputError
from mirror_sd.export.architectures import Architecture
from mirror_sd.export.target_graphs import padded_inputs
from mirror_sd.export.weight_blocks import BLOCK_SIZE, at_accuracy_level, block_quantized, quantize_matmuls
from mirror_sd.partitions.manifest import (
    MANIFEST_NAME,
    TARGET_WEIGHT_FORMATS,
    WEIGHT_BITS,
    Manifest,
    lm_head_bits,
)

FLOAT32 = "float32"
BITS = WEIGHT_BITS
# ONNX Runtime's MatMulNBits compute type per format: 4 = int8 activations, its fast CPU kernels for 8- and 4-bit
# blocks (with float32 activations an 8-bit decode ran 10x slower, a 4-bit one 1.7x: docs/design.md, Target weights
# in blocks)
ACCURACY_LEVELS = {"int8": 4, "int4": 4}
INT8_ACTIVATIONS_LEVEL, FLOAT32_ACTIVATIONS_LEVEL = 4, 1
# Export fails where the compressed graphs' greedy token agrees with the same weights in float32 on fewer grid
# positions than this: only a broken kernel gets there (int8 activations round logits a little; tiny random-weight
# test models, whose logits are near ties, then agree on 80-90% of positions).
MIN_KERNEL_AGREEMENT = 0.5


def check_target_weights(value: str) -> str:
    if value not in TARGET_WEIGHT_FORMATS:
        raise BadInputError(f"target weights must be one of {', '.join(TARGET_WEIGHT_FORMATS)}, not {value!r}",
                            option="target_weights")
    return value


def on_block_grid(model: torch.nn.Module, weights: str, arch: Architecture) -> torch.nn.Module:
    """A copy of `model` whose every Linear weight is rounded onto `weights`' block grid, its LM head onto
    lm_head_bits', each along its input axis as the target graphs lay it out (padded heads: `padded_inputs`). A
    Linear that shares its weight with an embedding (a tied LM head) gets a parameter of its own: the embedding's rows
    stay float32."""
    check_target_weights(weights)
    rounded = copy.deepcopy(model)
    head = arch.lm_head(rounded)
    padded = padded_inputs(rounded, arch)
    with torch.no_grad():
        for module in rounded.modules():
            if isinstance(module, torch.nn.Linear):
                bits = lm_head_bits(weights) if module is head else BITS[weights]
                w = module.weight
                if module in padded:  # rounded with the zeros the graph puts between its inputs
                    slots, width = padded[module]
                    spread = w.new_zeros(w.shape[0], width)
                    spread[:, slots] = w
                    w = block_quantized(spread, bits)[:, slots]
                else:
                    w = block_quantized(w, bits)
                module.weight = torch.nn.Parameter(w, requires_grad=False)
    return rounded


def compress_target(bundle: Path, manifest: Manifest, weights: str) -> tuple[Manifest, int]:
    """Rewrite the bundle's target prefix and suffix with `weights`' blocks (their weights must be on its grid);
    returns the manifest that says so and how many MatMuls were compressed."""
    check_target_weights(weights)
    count = 0
    for role in ("target_prefix", "target_suffix"):
        spec = manifest.partition(role)
        count += quantize_matmuls(bundle / spec.file, spec.data_files, BITS[weights], ACCURACY_LEVELS[weights],
                                  lossless=True, bits_by_width={manifest.target.vocab_size: lm_head_bits(weights)})
    return replace(manifest, target=replace(manifest.target, weight_format=weights,
                                            matmul_activations=matmul_activations(weights))), count


def float32_activations_copy(bundle: Path, out: Path) -> Path:
    """A copy at `out` (hard links: the same filesystem as `bundle`) of a compressed-target bundle whose MatMulNBits
    take float32 activations: the same weights in float32 arithmetic, which tells what the kernel's int8 activations
    cost in agreement with float32 (bench/precision.py). Its decode steps are far slower (an 8-bit one 10x): a
    measurement, not a format to deploy."""
    manifest = Manifest.load(bundle)
    if manifest.target.matmul_activations != "int8":
        raise BadInputError(f"{bundle}: its target's MatMuls take {manifest.target.matmul_activations} activations "
                            "already", option="bundle")
    out.mkdir(parents=True)
    for f in Path(bundle).iterdir():
        if f.is_file():
            os.link(f, out / f.name)
    for role in ("target_prefix", "target_suffix"):
        at_accuracy_level(out / manifest.partition(role).file, FLOAT32_ACTIVATIONS_LEVEL)
    (out / MANIFEST_NAME).unlink()  # a link to the bundle's own
    replace(manifest, target=replace(manifest.target, matmul_activations="float32")).save(out)
    return out


def matmul_activations(weights: str) -> str:
    """What a target exported with `weights` multiplies its MatMuls' activations in (the manifest's field)."""
    return "int8" if ACCURACY_LEVELS.get(weights) == INT8_ACTIVATIONS_LEVEL else "float32"


__all__ = ["ACCURACY_LEVELS", "BITS", "BLOCK_SIZE", "FLOAT32", "FLOAT32_ACTIVATIONS_LEVEL", "INT8_ACTIVATIONS_LEVEL",
           "MIN_KERNEL_AGREEMENT", "check_target_weights", "compress_target", "float32_activations_copy",
           "matmul_activations", "on_block_grid"]
