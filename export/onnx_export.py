"""Export the draft (a SplitSegment) and the early-exit head (ExitTopK) to ONNX and describe them as PartitionSpecs.
The target's prefix and suffix are written node by node instead (export/target_graphs.py).

We use the TorchScript exporter (dynamo=False): on this project's models it is far faster than the dynamo
exporter, both runtimes fuse its nodes anyway, and parity is checked after export (docs/design.md: The TorchScript
exporter). Sample inputs are B=2, T=3, an own past of 5 and a shared past of 4: tracing with T=1 bakes a
grouped-query shortcut into the graph that fails at T>1.
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import onnx
import torch

from mirror_sd.errors import ExportError
from mirror_sd.partitions.manifest import (
    BOUNDARY,
    DRAFT_HIDDEN,
    EXIT_IDS,
    EXIT_LOGPROBS,
    FEATURES,
    LOGITS,
    STREAM_IDS,
    SURROGATE,
    USE_SURROGATE,
    ModelFacts,
)
from mirror_sd.partitions.spec import (
    BATCH,
    KEEP,
    KEPT,
    SEQUENCE,
    SHARED,
    TOTAL,
    PartitionSpec,
    TensorSpec,
    kv_specs,
)

OPSET = 17
TRACE_BATCH, TRACE_SHARED, TRACE_PAST, TRACE_NEW = 2, 4, 5, 3
# Above this many parameter bytes the weights go to an external-data file (protobuf's 2 GiB limit).
EXTERNAL_DATA_BYTES = 1_500_000_000


def draft_spec(segment, facts: ModelFacts, file: str) -> PartitionSpec:
    """The draft's I/O contract ("split-past", partitions/spec.py). A draft's facts say whether its logits cover a
    reduced vocabulary and whether it proposes stream tokens."""
    dtype = facts.dtype
    past, present = kv_specs(range(segment.start, segment.end), facts.num_kv_heads, facts.head_dim, dtype)
    inputs = (TensorSpec("input_ids", "int64", (BATCH, SEQUENCE)),
              TensorSpec("position_ids", "int64", (BATCH, SEQUENCE)),
              TensorSpec("shared_mask", "int64", (BATCH, SHARED)),
              TensorSpec("attention_mask", "int64", (BATCH, TOTAL)),
              TensorSpec(KEEP, "int64", (1,)))
    taps = getattr(facts, "feature_taps", ())
    if taps:  # the feature channel (partitions/manifest.py)
        inputs += (TensorSpec(FEATURES, dtype, (BATCH, SEQUENCE, len(taps), facts.hidden_size)),
                   TensorSpec(SURROGATE, dtype, (BATCH, SEQUENCE, facts.hidden_size)),
                   TensorSpec(USE_SURROGATE, "int64", (BATCH, SEQUENCE)))
    inputs += past
    width = getattr(facts, "output_vocab_size", 0) or facts.vocab_size
    heads = (TensorSpec(LOGITS, dtype, (BATCH, KEPT, width)),)
    if taps:
        heads += (TensorSpec(DRAFT_HIDDEN, dtype, (BATCH, KEPT, facts.hidden_size)),)
    streams = getattr(facts, "streams", 0)
    if streams:
        heads += (TensorSpec(STREAM_IDS, "int64", (BATCH, KEPT, streams)),)
    # a draft whose layers slide a window (Gemma 3 270M's 512): the NPU package's static graphs count its slots over
    # lane ++ padded past ++ new, so a package's context must stay within it (package/build.py)
    windows = getattr(segment, "windows", None) or getattr(getattr(segment, "body", None), "windows", None) or ()
    shortest = min((w for w in windows if w), default=None)
    return PartitionSpec("draft", (segment.start, segment.end), file, inputs, heads + present, "openvino", "default",
                         tokens_per_forward=getattr(facts, "tokens_per_forward", 1), kv="split-past",
                         extra={"sliding_window": shortest} if shortest else {})


def exit_spec(facts: ModelFacts, file: str, top_k: int, exit_head: str) -> PartitionSpec:
    """The early-exit head's contract: the prefix's hidden state in, top-k ids and log-probs out; no KV."""
    exit_layer = facts.exit_layer
    inputs = (TensorSpec(BOUNDARY, facts.dtype, (BATCH, SEQUENCE, facts.hidden_size)),)
    outputs = (TensorSpec(EXIT_IDS, "int64", (BATCH, SEQUENCE, top_k)),
               TensorSpec(EXIT_LOGPROBS, "float32", (BATCH, SEQUENCE, top_k)))
    return PartitionSpec("target_exit", (exit_layer, exit_layer), file, inputs, outputs, "onnxruntime", "default",
                         kv="", extra={"exit_head": exit_head})


def sample_inputs(spec: PartitionSpec, facts: ModelFacts) -> tuple[torch.Tensor, ...]:
    b, shared, p, t = TRACE_BATCH, TRACE_SHARED, TRACE_PAST, TRACE_NEW
    if spec.role == "target_exit":
        return (torch.randn(b, t, facts.hidden_size),)
    ids = torch.randint(0, facts.vocab_size, (b, t))
    positions = torch.arange(shared + p, shared + p + t).expand(b, t).contiguous()
    masks = (torch.ones(b, shared, dtype=torch.int64), torch.ones(b, p + t, dtype=torch.int64),
             torch.tensor([2], dtype=torch.int64))  # the heads on 2 of the 3 new positions: kept apart from T
    taps = getattr(facts, "feature_taps", ())
    if taps:
        masks += (torch.randn(b, t, len(taps), facts.hidden_size), torch.randn(b, t, facts.hidden_size),
                  torch.tensor([[0, 0, 1]] * b, dtype=torch.int64))
    past = []
    for _ in spec.kv_layers:
        past += [torch.randn(1, facts.num_kv_heads, shared, facts.head_dim) for _kv in range(2)]
        past += [torch.randn(b, facts.num_kv_heads, p, facts.head_dim) for _kv in range(2)]
    return (ids, positions, *masks, *past)


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
