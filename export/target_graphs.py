"""The target's prefix and suffix as ONNX graphs written directly from the model's weights, for ONNX Runtime.

Why not the torch exporter here: the runtime keeps the target's KV cache in preallocated buffers on the session's
device and binds each layer's buffer as both its past input and its present output (ONNX Runtime's IOBinding).
ONNX Runtime's GroupQueryAttention (com.microsoft) reads such a shared buffer up to `seqlens_k` and writes only the
new positions into it, with rotary embedding and attention in one fused kernel (CPU and CUDA). Nothing is copied
per step, and trimming the cache after a rejection is a length. Writing the graph node by node also lets every
projection of a layer be one MatMul (q, k and v packed; gate and up packed), and the LM head run only on the last
`num_logits_to_keep` positions: prefill needs one position, a verification window its own.

Graph I/O (batch B, new tokens T, buffer capacity C chosen by the runtime):
  target_prefix  input_ids [B,T] int64, seqlens_k [B] int32 (total length - 1 per row), total_sequence_length []
                 int32, past_key_values.{i}.key/.value [B,kv_heads,C,head_dim]
                 -> hidden_states [B,T,H] (the residual stream after layer l_e - 1), present.{i}.* [B,kv_heads,C,hd],
                 and for a feature draft taps [B,T,n,H] (the residual stream after each of its tap layers)
  target_suffix  hidden_states [B,T,H], seqlens_k, total_sequence_length, num_logits_to_keep [1] int64, past KV
                 -> logits [B,n,V] for the last n = num_logits_to_keep positions, present KV
Bound to one buffer, present IS past with the T new positions written. Run on plain arrays instead (the parity
checks), past holds exactly the valid positions and present is past + new.

Supported: the Llama layout of every architecture export/architectures.py registers, with q/k/v biases (Qwen2), per-head
q/k RMS norms before the rotary embedding (Qwen3), packed projections and a rotary embedding over part of each head
(Phi-3, Phi-4-mini), layers without a rotary embedding (SmolLM3), Gemma's norms, scaled embedding, GELU MLPs, rotary
angles per layer type (Gemma 3) and soft caps (Gemma 2), sliding-window layers (Mistral, Qwen2, Phi-3) and any
rotary scaling transformers implements (cos/sin are taken from the model's own rotary module; longrope's within its
original context).

Head sizes: GroupQueryAttention rotates only heads whose size is a multiple of ROTARY_HEAD_MULTIPLE. A model whose
heads are not (24, say) gets them padded with zeros to the next multiple inside the graphs (_HeadLayout): the KV
buffers hold the padded heads (the manifest's head_dim is the padded size, the partitions' extra the model's own),
and the result is the model's exactly, since every padded value is zero and multiplies or adds only zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from mirror_sd.errors import ExportError, UnsupportedArchitectureError
from mirror_sd.export import onnx_export
from mirror_sd.export.architectures import Architecture
from mirror_sd.partitions.manifest import BOUNDARY, LOGITS, TAPS, TARGET_DTYPES, ModelFacts
from mirror_sd.partitions.spec import (
    BATCH,
    CAPACITY,
    KEEP,
    KEPT,
    SEQLENS,
    SEQUENCE,
    TOTAL_LENGTH,
    PartitionSpec,
    Role,
    TensorSpec,
    past_key_name,
    past_value_name,
    present_key_name,
    present_value_name,
)

OPSET = 17
MS_DOMAIN = "com.microsoft"
# ORT 1.31 reads ONNX IR version 10 at most; onnx 1.23 would write 11+ by default.
IR_VERSION = 10
# GroupQueryAttention refuses a rotary embedding on heads of any other size ("head_size shall be a multiple of 16")
ROTARY_HEAD_MULTIPLE = 16
# ONNX Runtime's CUDA GroupQueryAttention (a float16 target's): its largest head size (the memory-efficient kernel's;
# flash attention stops at 256 and hands larger heads to it) and its most query heads (one thread each in a block)
CUDA_MAX_HEAD_SIZE, CUDA_MAX_HEADS = 1024, 1024


def kv_head_dim(head_dim: int) -> int:
    """The head size the target graphs attend over and keep in their KV buffers: the model's own, rounded up to a
    multiple of ROTARY_HEAD_MULTIPLE."""
    return -(-head_dim // ROTARY_HEAD_MULTIPLE) * ROTARY_HEAD_MULTIPLE


def graph_facts(model_facts: dict) -> dict:
    """The model's facts as the target graphs see it: head_dim is the KV's head size (kv_head_dim)."""
    return {**model_facts, "head_dim": kv_head_dim(model_facts["head_dim"])}


def check_attention(model_facts: dict, dtype: str) -> None:
    """ExportError, in one line, for an attention the target graphs cannot run: checked before any export work
    (a kernel's own refusal would come at the first parity run, after every graph was written)."""
    heads, kv_heads, head_dim = (model_facts[k] for k in ("num_attention_heads", "num_kv_heads", "head_dim"))
    if heads % kv_heads:
        raise ExportError(f"GroupQueryAttention needs the query heads ({heads}) to be a multiple of the KV heads "
                          f"({kv_heads})")
    if dtype == "float16" and kv_head_dim(head_dim) > CUDA_MAX_HEAD_SIZE:
        raise ExportError(f"ONNX Runtime's CUDA attention takes heads of at most {CUDA_MAX_HEAD_SIZE} values, not "
                          f"{kv_head_dim(head_dim)} (head size {head_dim}): export it with --target-dtype float32")
    if dtype == "float16" and heads > CUDA_MAX_HEADS:
        raise ExportError(f"ONNX Runtime's CUDA attention takes at most {CUDA_MAX_HEADS} query heads, not {heads}: "
                          "export it with --target-dtype float32")


def target_input_specs(role: Role, facts: ModelFacts, layers: range) -> tuple[TensorSpec, ...]:
    first = (TensorSpec("input_ids", "int64", (BATCH, SEQUENCE)) if role == "target_prefix"
             else TensorSpec(BOUNDARY, facts.dtype, (BATCH, SEQUENCE, facts.hidden_size)))
    specs = [first, TensorSpec(SEQLENS, "int32", (BATCH,)), TensorSpec(TOTAL_LENGTH, "int32", ())]
    if role == "target_suffix":
        specs.append(TensorSpec(KEEP, "int64", (1,)))
    return tuple(specs) + _kv(layers, facts, past_key_name, past_value_name)


def target_output_specs(role: Role, facts: ModelFacts, layers: range, taps: tuple[int, ...] = ()
                        ) -> tuple[TensorSpec, ...]:
    # what the host reads (logits, a feature draft's taps) is float32 whatever the target computes in; the boundary
    # and the KV stay on the device in the target's own dtype
    head = (TensorSpec(BOUNDARY, facts.dtype, (BATCH, SEQUENCE, facts.hidden_size)) if role == "target_prefix"
            else TensorSpec(LOGITS, "float32", (BATCH, KEPT, facts.vocab_size)))
    tap_out = (TensorSpec(TAPS, "float32", (BATCH, SEQUENCE, len(taps), facts.hidden_size)),) if taps else ()
    return (head, *tap_out) + _kv(layers, facts, present_key_name, present_value_name)


def _kv(layers: range, facts: ModelFacts, key_name, value_name) -> tuple[TensorSpec, ...]:
    shape = (BATCH, facts.num_kv_heads, CAPACITY, facts.head_dim)
    return tuple(TensorSpec(n(i), facts.dtype, shape) for i in layers for n in (key_name, value_name))


@dataclass
class _Graph:
    """Nodes and initializers under construction; names are made unique by a counter."""

    nodes: list
    initializers: list
    count: int = 0
    float_type: type = np.float32  # the dtype float weights are stored and computed in


    def name(self, hint: str) -> str:
        self.count += 1
        return f"{hint}_{self.count}"

    def weight(self, hint: str, array: np.ndarray) -> str:
        name = self.name(hint)
        if array.dtype == np.float32:
            array = array.astype(self.float_type)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(self, op: str, inputs: list[str], outputs: int | list[str] = 1, domain: str | None = None,
             **attrs) -> list[str]:
        names = outputs if isinstance(outputs, list) else [self.name(op.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, names, name=self.name(op), domain=domain, **attrs))
        return names

    def to_float32(self, x: str, output: str) -> None:
        """`output` = x as float32 (the tensors the host reads)."""
        if self.float_type == np.float32:
            self.node("Identity", [x], [output])
        else:
            self.node("Cast", [x], [output], to=TensorProto.FLOAT)

    def rms_norm(self, x: str, weight: torch.Tensor | np.ndarray, eps: float) -> str:
        return self.node("SimplifiedLayerNormalization", [x, self.weight("norm", _np(weight))], axis=-1,
                         epsilon=float(eps))[0]

    def skip_rms_norm(self, x: str, residual: str, weight: torch.Tensor, eps: float) -> tuple[str, str]:
        """(norm(residual + x), residual + x) in one pass over the activations."""
        normed, total = self.name("skipnorm"), self.name("residual")
        self.node("SkipSimplifiedLayerNormalization", [x, residual, self.weight("norm", _np(weight))],
                  [normed, "", "", total], domain=MS_DOMAIN, epsilon=float(eps))
        return normed, total

    def linear(self, x: str, weights: list[torch.Tensor | np.ndarray],
               biases: list[torch.Tensor | np.ndarray | None] | None = None) -> str:
        """x @ concat(W_i)^T (+ biases): several projections of one input as one MatMul."""
        w = np.concatenate([_np(t) for t in weights], axis=0).T  # [in, sum(out)]
        y = self.node("MatMul", [x, self.weight("w", w)])[0]
        if biases and any(b is not None for b in biases):
            b = np.concatenate([_np(bi) if bi is not None else np.zeros(wi.shape[0], np.float32)
                                for bi, wi in zip(biases, weights)])
            y = self.node("Add", [y, self.weight("b", b)])[0]
        return y


def _np(t: torch.Tensor | np.ndarray) -> np.ndarray:
    return t if isinstance(t, np.ndarray) else t.detach().to(torch.float32).cpu().numpy()


@dataclass(frozen=True)
class _HeadLayout:
    """Where each of a head's `size` values sits in the graphs' heads of `padded` values (padded >= size; the rest
    are zeros). GroupQueryAttention's rotary pairs value i with i + padded/2, the model's rotate_half pairs i with
    i + size/2: a query's or key's two halves go to [0, size/2) and [padded/2, padded/2 + size/2). A value vector
    keeps its order."""

    size: int
    padded: int

    def slots(self, heads: int, rotary: bool) -> np.ndarray:
        """[heads * size]: the index in heads * padded of each value of each head."""
        half = self.size // 2
        within = np.arange(self.size)
        if rotary:
            within = np.where(within < half, within, within - half + self.padded // 2)
        return (np.arange(heads)[:, None] * self.padded + within).reshape(-1)

    def pad(self, w: np.ndarray, heads: int, rotary: bool, axis: int = 0) -> np.ndarray:
        """w with its `axis` of heads * size values spread over heads * padded, zeros between."""
        shape = list(w.shape)
        shape[axis] = heads * self.padded
        out = np.zeros(shape, w.dtype)
        index = [slice(None)] * w.ndim
        index[axis] = self.slots(heads, rotary)
        out[tuple(index)] = w
        return out


def _rotary_caches(arch: Architecture, backbone, facts: ModelFacts, layout: _HeadLayout
                   ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer, cos/sin [max_positions, rotary/2] from the model's own rotary module (its scaling included; layers
    that share angles share the arrays: Gemma 3 turns its sliding layers by other angles than its full ones)."""
    positions = torch.arange(facts.max_position_embeddings)[None]
    dummy = torch.zeros(1, 1, facts.hidden_size)
    with torch.no_grad():
        angles = arch.rotary_angles(backbone.rotary_emb, dummy, positions)
    made: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for pair in angles:
        if id(pair) not in made:
            made[id(pair)] = _rotary_cache(*pair, layout)
    return [made[id(pair)] for pair in angles]


def _rotary_cache(cos: torch.Tensor, sin: torch.Tensor, layout: _HeadLayout) -> tuple[np.ndarray, np.ndarray]:
    """transformers returns both halves concatenated (rotate_half layout); GroupQueryAttention takes one half, and
    turns the first 2 x its width values of each head (all of them, or part: Phi-4-mini's partial_rotary_factor). A
    padded head's extra pairs get cos 1, sin 0 (they rotate zeros)."""
    cos, sin = _np(cos[0]), _np(sin[0])
    turned = cos.shape[-1]
    half = turned // 2
    if turned % 2 or turned > layout.size or not np.allclose(cos[:, :half], cos[:, half:]):
        raise UnsupportedArchitectureError("only non-interleaved rotary embeddings are supported")
    _check_turned(turned, layout.size)
    if turned < layout.size:
        return cos[:, :half], sin[:, :half]
    extra = ((0, 0), (0, layout.padded // 2 - half))
    return np.pad(cos[:, :half], extra, constant_values=1.0), np.pad(sin[:, :half], extra)


def check_rotary(arch: Architecture) -> None:
    """UnsupportedArchitectureError, before any weight loads, for a rotary embedding over part of each head that
    GroupQueryAttention cannot turn."""
    size = arch.facts()["head_dim"]
    _check_turned(min(arch.rotary_turned(), size), size)


def _check_turned(turned: int, size: int) -> None:
    if turned == size:
        return
    if kv_head_dim(size) != size:
        raise UnsupportedArchitectureError(
            f"a rotary embedding over part of each head ({turned} of {size} values) needs heads of a multiple of "
            f"{ROTARY_HEAD_MULTIPLE} values")
    if turned % ROTARY_HEAD_MULTIPLE:
        raise UnsupportedArchitectureError(
            f"GroupQueryAttention turns a multiple of {ROTARY_HEAD_MULTIPLE} values of a head, not {turned}")


def _head_layout(arch: Architecture, facts: ModelFacts) -> _HeadLayout:
    size = arch.facts()["head_dim"]
    if facts.head_dim != kv_head_dim(size):
        raise ExportError(f"the target graphs keep heads of {kv_head_dim(size)} values for the model's {size}, "
                          f"not the {facts.head_dim} its facts give")
    return _HeadLayout(size, facts.head_dim)


def padded_inputs(model, arch: Architecture) -> dict[torch.nn.Module, tuple[np.ndarray, int]]:
    """Each Linear of the target whose input axis the graphs pad (the attention output projections, where heads are
    padded): the index of each of its inputs in the graphs' axis, and that axis's width. Its weights are rounded onto
    a block grid in that layout (export/target_weights.py), since the graph's blocks run along it."""
    size = arch.facts()["head_dim"]
    layout, heads = _HeadLayout(size, kv_head_dim(size)), arch.facts()["num_attention_heads"]
    if layout.padded == size:
        return {}
    slots = layout.slots(heads, rotary=False)
    return {layer.self_attn.o_proj: (slots, heads * layout.padded) for layer in arch.backbone(model).layers}


ACTIVATIONS = {"silu": ("SiLU", "SiLUActivation"), "gelu_tanh": ("GELUTanh", "PytorchGELUTanh")}


def _check_layer(layer, arch: Architecture) -> None:
    act = getattr(layer.mlp, "act_fn", None) or getattr(layer.mlp, "activation_fn", None)  # Phi-3's name
    if type(act).__name__ not in ACTIVATIONS[arch.activation]:
        raise UnsupportedArchitectureError(f"{arch.model_type}: only {arch.activation} MLPs are supported, not "
                                           f"{type(act).__name__}")


def build_target_graph(model, arch: Architecture, facts: ModelFacts, role: Role, start: int, end: int,
                       taps: tuple[int, ...] = ()) -> onnx.ModelProto:
    """The ONNX model of layers [start, end) of the target in `role` (target_prefix holds the embedding, target_suffix
    the final norm and LM head; taps: the prefix also outputs the residual stream after these layers)."""
    if taps and (role != "target_prefix" or not all(start < t <= end for t in taps)):
        raise ExportError(f"taps {list(taps)} must lie in the prefix's layers ({start}, {end}]")
    backbone = arch.backbone(model)
    config = model.config
    if facts.dtype not in TARGET_DTYPES:
        raise ExportError(f"the target graphs compute in one of {', '.join(TARGET_DTYPES)}, not {facts.dtype!r}")
    g = _Graph([], [], float_type=np.dtype(facts.dtype).type)
    heads, kv_heads, hd = facts.num_attention_heads, facts.num_kv_heads, facts.head_dim
    layout = _head_layout(arch, facts)
    eps = float(config.rms_norm_eps)
    windows, turns = arch.sliding_windows(), arch.rotary_layers()
    attention_cap, logits_cap = arch.softcaps()
    caches = _rotary_caches(arch, backbone, facts, layout)
    cache_names: dict[int, list[str]] = {}  # per distinct cache, the graph's cos and sin
    for i in range(start, end):
        if turns[i] and id(caches[i]) not in cache_names:
            cache_names[id(caches[i])] = [g.weight("cos_cache", caches[i][0]), g.weight("sin_cache", caches[i][1])]

    def norm(x: str, module) -> str:
        return g.rms_norm(x, arch.norm_scale(module), eps)

    if role == "target_prefix":
        x = g.node("Gather", [g.weight("embed_tokens", _np(backbone.embed_tokens.weight)), "input_ids"])[0]
        scale = arch.embed_scale(backbone)
        if scale is not None:  # Gemma: the embedding times sqrt(hidden_size), in the weights' dtype
            x = g.node("Mul", [x, g.weight("embed_scale", np.array(scale, np.float32))])[0]
    else:
        x = BOUNDARY
    h = norm(x, arch.layer_norms(backbone.layers[start])[0])
    tapped: dict[int, str] = {}  # layer count -> the residual stream after it
    for i in range(start, end):
        layer = backbone.layers[i]
        _check_layer(layer, arch)
        attn = layer.self_attn
        weights, biases = _qkv(arch, attn, layout, heads, kv_heads)
        qkv = g.linear(h, weights, biases)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3: RMS norm per head, before the rotary embedding
            sizes = g.weight("qkv_sizes", np.array([heads * hd, kv_heads * hd, kv_heads * hd], np.int64))
            q, k, v = g.node("Split", [qkv, sizes], 3, axis=-1)
            q = _head_norm(g, arch, q, attn.q_norm, heads, layout)
            k = _head_norm(g, arch, k, attn.k_norm, kv_heads, layout)
        else:  # GroupQueryAttention takes q, k and v packed: no split (a copy per layer in prefill)
            q, k, v = qkv, "", ""
        window = windows[i]
        # the model's own scale (1/sqrt of its head size): padding adds only zero terms to q.k
        attrs = dict(num_heads=heads, kv_num_heads=kv_heads, do_rotary=int(turns[i]), rotary_interleaved=0,
                     scale=float(attn.scaling))
        if attention_cap is not None:  # Gemma 2: scores c tanh(s / c) before the mask, as transformers' eager attention
            attrs["softcap"] = float(attention_cap)
        if window is not None:
            # both count the query itself: a query sees keys at positions > its own - window (checked by parity)
            attrs["local_window_size"] = int(window)
        rotary = cache_names[id(caches[i])] if turns[i] else []  # no caches without a rotary
        a = g.node("GroupQueryAttention",
                   [q, k, v, past_key_name(i), past_value_name(i), SEQLENS, TOTAL_LENGTH, *rotary],
                   [g.name("attn"), present_key_name(i), present_value_name(i)], domain=MS_DOMAIN, **attrs)[0]
        o = g.linear(a, [layout.pad(_np(attn.o_proj.weight), heads, rotary=False, axis=1)], [attn.o_proj.bias])
        _, after_attention, before_mlp, after_mlp = arch.layer_norms(layer)
        if after_attention is not None:  # Gemma: the block's output normalised before the residual add
            o = norm(o, after_attention)
        # the residual add and the next norm in one op (a decode step is ~13 ops a layer; each costs dispatch)
        h, x = g.skip_rms_norm(o, x, arch.norm_scale(before_mlp), eps)
        # two MatMuls rather than one packed and a Split: the same weight bytes, no copy of the activations
        (gate_w, gate_b), (up_w, up_b) = arch.gate_up(layer.mlp)
        gate, up = g.linear(h, [gate_w], [gate_b]), g.linear(h, [up_w], [up_b])
        if arch.activation == "gelu_tanh":
            act = g.node("FastGelu", [gate], domain=MS_DOMAIN)[0]  # GELU's tanh approximation
        else:
            act = g.node("Mul", [gate, g.node("Sigmoid", [gate])[0]])[0]  # SiLU
        down = g.linear(g.node("Mul", [act, up])[0], [layer.mlp.down_proj.weight], [layer.mlp.down_proj.bias])
        if after_mlp is not None:
            down = norm(down, after_mlp)
        if i + 1 < end:
            h, x = g.skip_rms_norm(down, x, arch.norm_scale(arch.layer_norms(backbone.layers[i + 1])[0]), eps)
        else:
            x = g.node("Add", [x, down])[0]
        tapped[i + 1] = x

    if role == "target_prefix":
        g.node("Identity", [x], [BOUNDARY])
        if taps:  # [B,T,H] each -> [B,T,n,H]
            axis = g.weight("axis", np.array([2], np.int64))
            g.to_float32(g.node("Concat", [g.node("Unsqueeze", [tapped[t], axis])[0] for t in taps], axis=2)[0], TAPS)
    else:
        # only the last n positions reach the norm and the LM head: x[:, -n:]
        begin = g.node("Neg", [KEEP])[0]
        last = g.node("Slice", [x, begin, g.weight("end", np.array([np.iinfo(np.int64).max], np.int64)),
                                g.weight("axis", np.array([1], np.int64))])[0]
        h = norm(last, backbone.norm)
        lm_head = arch.lm_head(model)
        head_w = g.linear(h, [lm_head.weight], [getattr(lm_head, "bias", None)])
        if logits_cap is not None:  # Gemma 2: the logits c tanh(x / c)
            cap = g.weight("logits_cap", np.array(logits_cap, np.float32))
            head_w = g.node("Mul", [g.node("Tanh", [g.node("Div", [head_w, cap])[0]])[0], cap])[0]
        g.to_float32(head_w, LOGITS)

    layers = range(start, end)
    inputs = [_value_info(t) for t in target_input_specs(role, facts, layers)]
    outputs = [_value_info(t) for t in target_output_specs(role, facts, layers, taps)]
    graph = helper.make_graph(g.nodes, role, inputs, outputs, g.initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)],
                             ir_version=IR_VERSION, producer_name="mirror-sd")


def _qkv(arch: Architecture, attn, layout: _HeadLayout, heads: int, kv_heads: int) -> tuple[list, list]:
    """The q, k and v projections' weights and biases in the graphs' head layout (_HeadLayout)."""
    weights, biases = [], []
    for (weight, bias), n, rotary in zip(arch.qkv(attn), (heads, kv_heads, kv_heads), (True, True, False)):
        weights.append(layout.pad(_np(weight), n, rotary))
        biases.append(None if bias is None else layout.pad(_np(bias), n, rotary))
    return weights, biases


def _head_norm(g: _Graph, arch: Architecture, x: str, norm, n_heads: int, layout: _HeadLayout) -> str:
    """RMS norm over each head's values: [B,T,n*P] -> [B,T,n,P] -> norm -> [B,T,n*P]. A padded head's zeros scale
    its mean square by r = size/P; epsilon scaled by r and the weight by sqrt(r) give the model's norm exactly:
    x w sqrt(r) / sqrt(r ms + r eps) = x w / sqrt(ms + eps). The padding stays zero."""
    p, ratio = layout.padded, layout.size / layout.padded
    weight = layout.pad(_np(arch.norm_scale(norm)) * np.float32(np.sqrt(ratio)), 1, rotary=True)
    shaped = g.node("Reshape", [x, g.weight("shape", np.array([0, 0, n_heads, p], np.int64))])[0]
    normed = g.rms_norm(shaped, weight, arch.norm_eps(norm) * ratio)
    return g.node("Reshape", [normed, g.weight("shape", np.array([0, 0, n_heads * p], np.int64))])[0]


def _value_info(t: TensorSpec):
    types = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int64": TensorProto.INT64,
             "int32": TensorProto.INT32, "bool": TensorProto.BOOL}
    return helper.make_tensor_value_info(t.name, types[t.dtype], list(t.shape))


def write_target_graph(model, arch: Architecture, facts: ModelFacts, role: Role, start: int, end: int,
                       bundle_dir: Path, extra: dict | None = None, taps: tuple[int, ...] = ()) -> PartitionSpec:
    """Build and save one target partition; returns its spec (weights over onnx_export.EXTERNAL_DATA_BYTES go to
    `<file>.data`)."""
    file = f"{role}.onnx"
    try:
        proto = build_target_graph(model, arch, facts, role, start, end, taps)
    except (AttributeError, KeyError, ValueError) as e:  # a module layout this builder does not know
        raise ExportError(f"building the {role} graph failed: {type(e).__name__}: {e}") from e
    weight_bytes = sum(len(t.raw_data) for t in proto.graph.initializer)
    data_files: tuple[str, ...] = ()
    if weight_bytes > onnx_export.EXTERNAL_DATA_BYTES:
        data_files = (file + ".data",)
        onnx.save_model(proto, str(bundle_dir / file), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data_files[0])
    else:
        onnx.save_model(proto, str(bundle_dir / file))
    layers = range(start, end)
    size = arch.facts()["head_dim"]
    recorded: dict[str, Any] = {"kv": "shared-buffer"}
    if size != facts.head_dim:  # the KV's head_dim is padded
        recorded["model_head_dim"] = size
    cap = arch.softcaps()[0]
    if cap is not None:  # Gemma 2's: OpenVINO's own GroupQueryAttention takes none (runtime/prompt_graphs.py)
        recorded["softcap"] = float(cap)
    return PartitionSpec(role, (start, end), file, target_input_specs(role, facts, layers),
                         target_output_specs(role, facts, layers, taps), "onnxruntime", "default",
                         data_files=data_files, extra={**recorded, **(extra or {})})
