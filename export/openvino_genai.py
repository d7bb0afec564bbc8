"""Hugging Face causal LM -> the OpenVINO GenAI model format, in the main environment (no optimum-intel).

optimum-intel does this conversion elsewhere, but it pins transformers < 5.6 and pulls a CUDA torch, so it cannot
live in this environment. What GenAI's LLMPipeline needs is small and done here in four steps, the same ones
optimum-intel takes (`optimum/exporters/openvino/stateful.py`):

1. `ov.convert_model` (PyTorch frontend) of the whole model with plain-tensor KV (the export's `Segment`, all
   layers, embedding and LM head): inputs input_ids [B,T], attention_mask [B,P+T], position_ids [B,T], past
   key/value per layer [B,kv_heads,P,head_dim]; outputs logits [B,T,V] and present key/value. The attention runs
   through torch's scaled_dot_product_attention so the graph carries OpenVINO's ScaledDotProductAttention op,
   which GenAI's continuous-batching backend (used for speculative decoding) rewrites into PagedAttention;
2. a `beam_idx` [B] input that gathers every past KV along the batch axis (optimum-intel's fuse_cache_reorder);
3. `apply_make_stateful_transformation`: past/present pairs become internal state (ReadValue/Assign), with a
   zero initializer of the right batch (optimum-intel's build_state_initializer);
4. the tokenizer and detokenizer as OpenVINO models (openvino_tokenizers.convert_tokenizer), config.json and
   generation_config.json next to openvino_model.xml/bin.

Weights stay fp32 (compress_to_fp16=False) so the baselines compare with the fp32 target everywhere; a draft is
converted with int8 weights where the bundle's own draft has them (bench/baselines.py), so the speculative baseline
drafts at the same weight precision as ours.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from mirror_sd.errors import BadInputError, ExportError
from mirror_sd.outputs import move_into_place

MARKER = "mirror_sd_ov.json"  # written last: a directory without it is an unfinished conversion
MODEL_XML = "openvino_model.xml"


def fingerprint(directory: Path) -> str:
    """Cheap identity of a source directory: names, sizes and modification times of its files."""
    items = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in Path(directory).iterdir() if f.is_file())
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def _segment(model):
    from mirror_sd.export.architectures import architecture_of
    from mirror_sd.export.segments import Segment

    arch = architecture_of(model.config)
    return Segment(model, arch, 0, arch.num_layers, embed=True, head="final"), arch


def _convert_graph(model):
    """Step 1: an ov.Model with named, dynamic inputs and outputs (stateless: KV in and out as tensors)."""
    import openvino as ov

    segment, arch = _segment(model)
    facts = arch.facts()
    layers, kv_heads, head_dim = facts["num_layers"], facts["num_kv_heads"], facts["head_dim"]
    # batch 2, 3 new tokens, past 5: tracing with one token or an empty past can bake a shape shortcut in
    batch, new, past = 2, 3, 5
    example = (torch.randint(0, facts["vocab_size"], (batch, new)), torch.ones(batch, past + new, dtype=torch.long),
               torch.arange(past, past + new)[None].expand(batch, -1).contiguous(),
               *[torch.zeros(batch, kv_heads, past, head_dim) for _ in range(2 * layers)])
    kv_shape = ov.PartialShape([-1, kv_heads, -1, head_dim])
    shapes = [ov.PartialShape([-1, -1])] * 3 + [kv_shape] * (2 * layers)
    types = [ov.Type.i64] * 3 + [ov.Type.f32] * (2 * layers)
    with torch.no_grad(), warnings.catch_warnings():
        # the tracer warns on shape-dependent Python branches; the example shapes above take the general ones
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        ov_model = ov.convert_model(segment, example_input=example, input=list(zip(shapes, types)))
    in_names = ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    out_names = ["logits"] + [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    for port, name in zip(ov_model.inputs, in_names, strict=True):
        port.get_tensor().set_names({name})
        port.get_node().set_friendly_name(name)  # GenAI's PagedAttention rewrite finds parameters by this name
    for port, name in zip(ov_model.outputs, out_names, strict=True):
        port.get_tensor().set_names({name})
    return ov_model, in_names[3:], out_names[1:]


def _fuse_cache_reorder(ov_model, kv_inputs: list[str]) -> None:
    """Step 2: beam_idx [B] gathers each past KV along batch (GenAI feeds it; for one sequence it is [0])."""
    import openvino as ov
    from openvino import opset13

    beam_idx = opset13.parameter(name="beam_idx", dtype=ov.Type.i32, shape=ov.PartialShape([-1]))
    beam_idx.output(0).get_tensor().add_names({"beam_idx"})
    ov_model.add_parameters([beam_idx])
    for name in kv_inputs:
        port = ov_model.input(name)
        consumers = port.get_target_inputs()
        gather = opset13.gather(port, beam_idx, opset13.constant(0))
        for consumer in consumers:
            consumer.replace_source_output(gather.output(0))
    ov_model.validate_nodes_and_infer_types()


def _make_stateful(ov_model, kv_inputs: list[str], kv_outputs: list[str]) -> None:
    """Step 3: KV pairs become state, initialised to zeros of shape [batch of input_ids, kv_heads, 0, head_dim]."""
    from openvino import opset13
    from openvino._offline_transformations import apply_make_stateful_transformation

    apply_make_stateful_transformation(ov_model, dict(zip(kv_inputs, kv_outputs, strict=True)))
    ids = ov_model.input("input_ids")
    batch = opset13.gather(opset13.shape_of(ids, output_type="i64"), opset13.constant([0]), opset13.constant(0))
    for op in ov_model.get_ops():
        if op.get_type_name() == "ReadValue":
            dims = [d.min_length for d in op.get_output_partial_shape(0)]
            dims[0] = batch
            shape = opset13.concat([opset13.constant(np.array([d], dtype=np.int64)) if isinstance(d, int) else d
                                    for d in dims], axis=0)
            op.set_arguments([opset13.broadcast(opset13.constant(0.0, dtype=op.get_output_element_type(0)), shape)])
    ov_model.validate_nodes_and_infer_types()


def _write_tokenizer(tokenizer_dir: Path, out: Path) -> None:
    """Step 4: openvino_tokenizer.xml / openvino_detokenizer.xml and the HF tokenizer files beside them."""
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer, detokenizer = convert_tokenizer(hf_tokenizer, with_detokenizer=True)
    ov.save_model(tokenizer, out / "openvino_tokenizer.xml")
    ov.save_model(detokenizer, out / "openvino_detokenizer.xml")
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)


def convert(model_dir: str | Path, out_dir: str | Path, fingerprint: str = "", weights: str = "float32") -> Path:
    """Convert the HF causal LM in `model_dir` (fp32, with its tokenizer files) to a GenAI model directory
    `out_dir`. Reused when `out_dir` carries a marker with the same `fingerprint`; built in a sibling temporary
    directory and moved into place, so a failure leaves nothing half-written. weights "int8": MatMul weights
    compressed to int8 (NNCF, symmetric per channel), for a draft or a target beside an int8 one; "int4": to
    symmetric int4 groups; "float32": unchanged."""
    import openvino as ov
    from transformers import AutoModelForCausalLM

    src, out = Path(model_dir), Path(out_dir)
    if is_converted(out, fingerprint):
        return out
    if not (src / "config.json").is_file():
        raise BadInputError(f"{src} is not a Hugging Face model directory (no config.json)")
    arch = _convertible(src)
    # sdpa, not eager: the graph must carry ScaledDotProductAttention for GenAI's PagedAttention rewrite
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="sdpa").eval()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        ov_model, kv_in, kv_out = _convert_graph(model)
        _fuse_cache_reorder(ov_model, kv_in)
        _make_stateful(ov_model, kv_in, kv_out)
        if weights in ("int8", "int4"):  # NNCF's symmetric modes (int4 in groups, as the NPU packages take it)
            from mirror_sd.package.compress import compress_weights

            ov_model = compress_weights(ov_model, f"{weights}_sym")
        ov.save_model(ov_model, tmp / MODEL_XML, compress_to_fp16=False)
        _write_tokenizer(src, tmp)
    except (RuntimeError, ValueError) as e:  # conversion failures surface from OpenVINO as RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"OpenVINO GenAI conversion of {src} failed: {type(e).__name__}: {e}") from None
    # a longrope model's graph holds the angles within its original context (export/segments.py): its context ends
    # there, as the bundles' does
    model.config.max_position_embeddings = arch.max_positions()
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    (tmp / MARKER).write_text(json.dumps({"source": str(src), "fingerprint": fingerprint}) + "\n")
    move_into_place(tmp, out)
    return out


def _convertible(src: Path):
    """The model's architecture; ExportError for a model GenAI's pipeline would not run as itself: its PagedAttention
    rewrite drops a sliding window, and transformers' sdpa attention (which the rewrite finds) takes no soft cap
    (Gemma 2)."""
    from transformers import AutoConfig

    from mirror_sd.export.architectures import architecture_of

    arch = architecture_of(AutoConfig.from_pretrained(src))
    if any(w is not None for w in arch.sliding_windows()):
        raise ExportError(f"{src}: OpenVINO GenAI's continuous batching drops sliding windows; no GenAI baseline of it")
    if any(cap is not None for cap in arch.softcaps()):
        raise ExportError(f"{src}: its soft-capped attention has no sdpa form for GenAI's rewrite; no GenAI baseline")
    return arch


def is_converted(directory: Path, fingerprint: str = "") -> bool:
    marker = Path(directory) / MARKER
    return marker.is_file() and json.loads(marker.read_text()).get("fingerprint") == fingerprint
