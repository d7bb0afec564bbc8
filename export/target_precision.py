"""A float16 target: the same graphs written again in float16, once parity has proved them in float32.

Why: ONNX Runtime's CUDA GroupQueryAttention has float16 and bfloat16 kernels only. A float32 target under the
CUDA execution provider gets its attention placed on the CPU with copies of every layer's whole KV buffer around it
at every step: exactly the per-step cache copy the shared buffers exist to avoid, and those copies can break the
buffers' in-place writes (wrong tokens; the runtime refuses the pairing; docs/design.md: The target on CUDA:
float16, fixed-width steps). In float16 every node of the target has a CUDA kernel and the KV stays on the GPU.

What changes: the weights, the activations, the KV buffers and the boundary tensor between prefix, suffix and exit
head are float16; the logits and a feature draft's taps are cast to float32 in the graph, so the host reads what it
always reads. The early-exit head (a traced float32 graph) gets a Cast on its input. Greedy outputs are exact with
respect to the float16 target (ar, sd and mirror all verify against it), not to the float32 one: the export measures
and records how often the two agree (parity.target_top1_agreement).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from mirror_sd.errors import BadInputError
from mirror_sd.export.target_graphs import write_target_graph
from mirror_sd.partitions.manifest import BOUNDARY, TARGET_DTYPES, Manifest
from mirror_sd.partitions.spec import PartitionSpec, TensorSpec

# The share of the parity grid's positions where the rewritten target must pick the float32 reference's greedy
# token. Below it the rewrite is broken (or the model overflows float16), not merely rounded.
MIN_TARGET_AGREEMENT = 0.9
_ONNX_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


def check_target_dtype(dtype: str) -> None:
    if dtype not in TARGET_DTYPES:
        raise BadInputError(f"target dtype must be one of {', '.join(TARGET_DTYPES)}, not {dtype!r}")


def retype_target(bundle: Path, manifest: Manifest, model, arch, dtype: str) -> Manifest:
    """Rewrite the bundle's target graphs in `dtype` from `model`; returns the manifest that describes them."""
    check_target_dtype(dtype)
    if dtype == manifest.target.dtype:
        return manifest
    facts = replace(manifest.target, dtype=dtype)
    specs = []
    for spec in manifest.partitions:
        if spec.role in ("target_prefix", "target_suffix"):
            for name in (spec.file, *spec.data_files):  # onnx appends to an existing external-data file
                (bundle / name).unlink()
            taps = manifest.draft.feature_taps if spec.role == "target_prefix" else ()
            spec = write_target_graph(model, arch, facts, spec.role, *spec.layers, bundle, extra=spec.extra, taps=taps)
        elif spec.role == "target_exit":
            spec = _cast_input(bundle, spec, BOUNDARY, dtype)
        specs.append(spec)
    out = replace(manifest, target=facts, partitions=tuple(specs))
    out.validate(bundle)
    return out


def _cast_input(bundle: Path, spec: PartitionSpec, name: str, dtype: str) -> PartitionSpec:
    """The graph takes `name` in `dtype` and casts it to the float32 its nodes were traced with."""
    path = bundle / spec.file
    model = onnx.load(str(path), load_external_data=False)  # the weights stay where they are, untouched
    graph = model.graph
    (value,) = [i for i in graph.input if i.name == name]
    inner = f"{name}_float32"
    for node in graph.node:
        node.input[:] = [inner if x == name else x for x in node.input]
    graph.node.insert(0, helper.make_node("Cast", [name], [inner], name=f"{name}_to_float32", to=TensorProto.FLOAT))
    value.type.tensor_type.elem_type = _ONNX_TYPES[dtype]
    onnx.save_model(model, str(path))
    inputs = tuple(TensorSpec(t.name, dtype, t.shape) if t.name == name else t for t in spec.inputs)
    return replace(spec, inputs=inputs)
