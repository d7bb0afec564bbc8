"""Export one Segment to ONNX and describe it as a PartitionSpec.

We use the TorchScript exporter (dynamo=False): on this project's models it takes about a second per graph against
10-40 s for the dynamo exporter, both runtimes fuse its ~1,200 nodes anyway, and parity is checked after export.
Sample inputs are B=2, T=3, P=5: tracing with T=1 bakes a grouped-query shortcut into the graph that fails at T>1.
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import onnx
import torch

from mirror_sd.errors import ExportError
from mirror_sd.partitions.manifest import BOUNDARY, EXIT_IDS, EXIT_LOGPROBS, LOGITS, STREAM_IDS, ModelFacts
from mirror_sd.partitions.spec import BATCH, SEQUENCE, TOTAL, PartitionSpec, Role, TensorSpec, kv_specs

OPSET = 17
TRACE_BATCH, TRACE_PAST, TRACE_NEW = 2, 5, 3
# Above this many parameter bytes the weights go to an external-data file (protobuf's 2 GiB limit).
EXTERNAL_DATA_BYTES = 1_500_000_000
DEFAULT_PLACEMENT = {"target_prefix": ("onnxruntime", "default"), "target_suffix": ("onnxruntime", "default"),
                     "draft": ("openvino", "default")}


def partition_spec(role: Role, segment, facts: ModelFacts, file: str, top_k: int = 0,
                   exit_head: str | None = None) -> PartitionSpec:
    """The I/O contract of `segment` in `role` (names, dtypes, symbolic axes). A draft's facts say whether its
    logits cover a reduced vocabulary and whether it proposes stream tokens."""
    dtype = facts.dtype
    first = (TensorSpec(BOUNDARY, dtype, (BATCH, SEQUENCE, facts.hidden_size)) if role == "target_suffix"
             else TensorSpec("input_ids", "int64", (BATCH, SEQUENCE)))
    past, present = kv_specs(range(segment.start, segment.end), facts.num_kv_heads, facts.head_dim, dtype)
    inputs = (first, TensorSpec("attention_mask", "int64", (BATCH, TOTAL)),
              TensorSpec("position_ids", "int64", (BATCH, SEQUENCE)), *past)
    if role == "target_prefix":
        heads = (TensorSpec(BOUNDARY, dtype, (BATCH, SEQUENCE, facts.hidden_size)),
                 TensorSpec(EXIT_IDS, "int64", (BATCH, SEQUENCE, top_k)),
                 TensorSpec(EXIT_LOGPROBS, "float32", (BATCH, SEQUENCE, top_k)))
    else:
        width = getattr(facts, "output_vocab_size", 0) or facts.vocab_size
        heads = (TensorSpec(LOGITS, dtype, (BATCH, SEQUENCE, width)),)
        streams = getattr(facts, "streams", 0)
        if streams:
            heads += (TensorSpec(STREAM_IDS, "int64", (BATCH, SEQUENCE, streams)),)
    backend, device = DEFAULT_PLACEMENT[role]
    extra = {"exit_head": exit_head} if exit_head else {}
    return PartitionSpec(role, (segment.start, segment.end), file, inputs, heads + present, backend, device,
                         tokens_per_forward=getattr(facts, "tokens_per_forward", 1), extra=extra)


def sample_inputs(spec: PartitionSpec, facts: ModelFacts) -> tuple[torch.Tensor, ...]:
    b, p, t = TRACE_BATCH, TRACE_PAST, TRACE_NEW
    first = (torch.randn(b, t, facts.hidden_size) if spec.role == "target_suffix"
             else torch.randint(0, facts.vocab_size, (b, t)))
    mask = torch.ones(b, p + t, dtype=torch.int64)
    positions = torch.arange(p, p + t).expand(b, t).contiguous()
    past = [torch.randn(b, facts.num_kv_heads, p, facts.head_dim) for _ in spec.kv_layers for _kv in range(2)]
    return (first, mask, positions, *past)


def export_segment(segment: torch.nn.Module, spec: PartitionSpec, facts: ModelFacts, bundle_dir: Path) -> PartitionSpec:
    """Write `spec.file` (and external data if the weights are large); returns the spec with its data files."""
    path = bundle_dir / spec.file
    weight_bytes = sum(p.numel() * p.element_size() for p in segment.parameters())
    external = weight_bytes > EXTERNAL_DATA_BYTES
    # Large graphs are traced into a scratch folder (the exporter writes one file per tensor there), then saved
    # once more with all weights in a single `<file>.data` next to the graph.
    target = bundle_dir / f".{spec.file}.parts" / spec.file if external else path
    target.parent.mkdir(exist_ok=True)
    segment.eval()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer warnings about shape-dependent Python values are expected
            torch.onnx.export(
                segment, sample_inputs(spec, facts), str(target), dynamo=False, opset_version=OPSET,
                input_names=[t.name for t in spec.inputs], output_names=[t.name for t in spec.outputs],
                dynamic_axes={t.name: t.dynamic_axes for t in spec.inputs + spec.outputs},
                external_data=external, do_constant_folding=True,
            )
    except Exception as e:  # the exporter raises many types; all mean this graph could not be written
        raise ExportError(f"exporting {spec.role} failed: {type(e).__name__}: {e}") from e
    if not external:
        return spec
    data_file = spec.file + ".data"
    onnx.save_model(onnx.load(str(target)), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data_file)
    shutil.rmtree(target.parent)
    return replace(spec, data_files=(data_file,))
