"""A prompt's KV computed on faster graphs than the target's own steps: the target's prefix and suffix graphs in bf16
on OpenVINO, or a compressed target's graphs with its weights expanded to float32 on ONNX Runtime.

A prefill is bound by arithmetic. ONNX Runtime's CPU provider multiplies in float32 only, where OpenVINO reads the
same graphs (GroupQueryAttention included) and computes them in bf16 on CPUs with bf16 arithmetic (AMX,
AVX512-BF16), as OpenVINO GenAI does there by default: `prefill_precision="bf16"`. A target with int8 or int4 weights
multiplies int8 activations (MatMulNBits at accuracy level 4), which on a CPU without VNNI or AMX prefills slower than
float32 MatMuls over the same weights: `prefill_precision="float32"` runs its graphs with every MatMulNBits expanded
to a float32 MatMul holding the same values (the weights are then held twice: blocks for the steps, float32 here).
Either way (LoadOptions) every prompt token but the last is prefilled here, into the target's KV memory; the prompt's
last token and every generated one run on the target as deployed (float32, int8 or int4 on ONNX Runtime), so the
first new token comes from the target's own step. What keeps the output exact:
- sd, mirror and lookup share the prompt's KV, so they equal ar;
- every prompt is prefilled on one grid of chunks from position 0 (PROMPT_GRAPH_CHUNK, runtime/target.py), so a
  position runs in the same chunk in any generation: OpenVINO computes the last rows of some chunk widths otherwise,
  and ONNX Runtime a one-row chunk; the batching engine's prefills then equal a generation alone
  (tests/test_prompt_graphs.py);
- the engine's prefix cache reuses only positions prefilled here, in whole chunks of the grid (runtime/batching.py):
  an earlier answer's KV came from the target's steps, where the same text inside a later prompt is prefilled here.
The target as deployed is then the pair: the prompt's KV at the prompt precision, the rest in the target's own (its
agreement with float32 is measured, docs/design.md "Prompts prefilled in bf16" and "Compressed targets' prompts in
float32").

On OpenVINO an int8 or int4 target's MatMulNBits weights are expanded to float32 as well, the same values: OpenVINO's
own compressed-weight path was slower and computed one- and two-row chunks otherwise than wider ones.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from mirror_sd.errors import BadInputError, ManifestError
from mirror_sd.partitions.manifest import BOUNDARY, TAPS, Manifest, resolve_inside
from mirror_sd.partitions.spec import (
    KEEP,
    SEQLENS,
    TOTAL_LENGTH,
)
from mirror_sd.runtime import cpu_attention
from mirror_sd.runtime.backends import PROTOBUF_LIMIT, open_openvino, open_openvino_model, ort_session, proto_bytes
from mirror_sd.runtime.kv_codes import as_float32, kv_width, stored
from mirror_sd.runtime.kv_slots import kv_names
from mirror_sd.runtime.target import KVView, _Bound, kv_pairs

QUANTIZED_OP = "MatMulNBits"
PROMPT_PRECISIONS = ("bf16", "float32")  # LoadOptions.prefill_precision's values other than "target"
WARM_UP_TOKENS = 16  # the forward PromptGraphs runs at load


def dequantized(node: onnx.NodeProto, initializers: Mapping[str, np.ndarray]) -> np.ndarray:
    """A symmetric MatMulNBits node's weight [K, N] in float32 (export/weight_blocks.py writes them)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    k, n, bits, block = attrs["K"], attrs["N"], attrs["bits"], attrs["block_size"]
    packed = initializers[node.input[1]].reshape(n, -1)
    if bits == 8:
        q = packed.astype(np.int32)
    elif bits == 4:  # two weights a byte, the first in the low nibble
        q = np.stack([packed & 0x0F, packed >> 4], -1).reshape(n, -1).astype(np.int32)
    else:
        raise ManifestError(f"{node.name}: {bits}-bit weights are not read back here")
    q -= 2 ** (bits - 1)  # no zero points: symmetric blocks are stored offset by half the range
    scales = initializers[node.input[2]].reshape(n, -1, 1)
    return (q.reshape(n, -1, block) * scales).reshape(n, -1)[:, :k].T


def expanded(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every MatMulNBits replaced by a MatMul over the float32 weight it holds (in place)."""
    graph = model.graph
    index = {t.name: i for i, t in enumerate(graph.initializer)}
    nodes, dropped = [], set()
    for node in graph.node:
        if node.op_type != QUANTIZED_OP:
            nodes.append(node)
            continue
        if len([name for name in node.input if name]) != 3:
            raise ManifestError(f"{node.name}: a MatMulNBits with zero points, a bias or g_idx is not expanded here")
        weight = dequantized(node, {name: numpy_helper.to_array(graph.initializer[index[name]])
                                    for name in node.input[1:3]})
        name = f"{node.name}_expanded_weight"
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weight, np.float32), name))
        nodes.append(helper.make_node("MatMul", [node.input[0], name], list(node.output), name=node.name))
        dropped.update(node.input[1:3])
    still_read = {name for node in nodes for name in node.input}
    kept = [t for t in graph.initializer if t.name not in dropped or t.name in still_read]
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return model


def has_bf16() -> bool:
    """Whether OpenVINO's CPU plugin computes bf16 natively here (AMX or AVX512-BF16)."""
    import openvino as ov

    return "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


class PromptGraphs:
    """The target's prefix and suffix at a prompt precision ("bf16": OpenVINO's CPU plugin; "float32": ONNX Runtime
    over a compressed target's weights expanded), writing into KV memory on the host whose element type is `kv`
    (the target's: float32, or float16 or uint8 codes on the attention kernel)."""

    def __init__(self, bundle: str | Path, manifest: Manifest, threads: int = 1,
                 cache_dir: str | Path | None = None, precision: str = "bf16", kv: np.dtype | str = "float32") -> None:
        facts = manifest.target
        kv = np.dtype(kv)
        if precision not in PROMPT_PRECISIONS:
            raise BadInputError(f"no prompt graphs in {precision!r}: {' or '.join(PROMPT_PRECISIONS)}",
                                option="prefill_precision")
        if facts.dtype != "float32":
            raise BadInputError(f"prompts prefilled apart need a float32 target; this bundle's is {facts.dtype} "
                                "(for ONNX Runtime's CUDA execution provider)", option="prefill_precision")
        if precision == "bf16" and not has_bf16():
            raise BadInputError("this CPU has no bf16 arithmetic (AMX or AVX512-BF16) for OpenVINO: leave "
                                "prefill_precision at 'target'", option="prefill_precision")
        if precision == "float32" and facts.weight_format == "float32":
            raise BadInputError("this target computes its prompts in float32 already: prefill_precision 'float32' is "
                                "for int8 and int4 targets", option="prefill_precision")
        self._graphs: dict[str, tuple[_OpenVINOGraph | _OrtGraph, tuple[int, ...]]] = {}
        # one binding (or infer request) per graph, and both the batching engine's thread and a library call on
        # another thread prefill here: one run at a time, its outputs copied before the next
        self._lock = threading.Lock()
        for role in ("target_prefix", "target_suffix"):
            spec = manifest.partition(role)
            path = resolve_inside(Path(bundle), spec.file)
            if precision == "bf16" and spec.extra.get("softcap"):  # the export records it
                raise BadInputError("this target soft-caps its attention scores (Gemma 2), which OpenVINO's "
                                    "GroupQueryAttention does not take: leave prefill_precision at 'target'",
                                    option="prefill_precision")
            if precision == "float32":
                graph = _OrtGraph(expanded(onnx.load(str(path))), spec, threads, kv)
            elif facts.weight_format == "float32":
                graph = _OpenVINOGraph(open_openvino(path, "CPU", threads, cache_dir, precision="bf16"),
                                       spec.kv_layers)
            else:
                graph = _OpenVINOGraph(open_openvino_model(expanded(onnx.load(str(path))), "CPU", threads, cache_dir,
                                                           precision="bf16"), spec.kv_layers)
            self._graphs[role] = (graph, tuple(spec.kv_layers))
        self.logits_name = manifest.partition("target_suffix").outputs[0].name
        self.forwards = 0
        # a backend builds its kernels and buffers at the first forward: once here, not in the first request's TTFT
        # (2x there on OpenVINO)
        warm = {name: np.zeros((1, facts.num_kv_heads, WARM_UP_TOKENS, kv_width(facts.head_dim, kv)), kv)
                for name in kv_names(manifest)}
        self.suffix(self.prefix(np.zeros((1, WARM_UP_TOKENS), np.int64), 0, warm)[0], 0, warm)
        self.forwards = 0

    def prefix(self, ids: np.ndarray, start: int, kv: Mapping[str, np.ndarray]
               ) -> tuple[np.ndarray, np.ndarray | None]:
        """ids [1, T] after `start` positions of `kv` (per KV tensor name, an array [1, kv_heads, >= start + T,
        head_dim] on the host): writes the prefix layers' KV of the T positions; returns the boundary hidden state
        [1, T, H] and the feature taps [T, n, H] (None without a feature draft)."""
        out = self._run("target_prefix", {"input_ids": ids}, start, ids.shape[1], kv)
        taps = out.get(TAPS)
        return out[BOUNDARY], None if taps is None else taps[0]

    def suffix(self, hidden: np.ndarray, start: int, kv: Mapping[str, np.ndarray]) -> np.ndarray:
        """The suffix layers on the prefix's hidden state, writing their KV: the last position's logits [1, 1, V]."""
        out = self._run("target_suffix", {BOUNDARY: hidden, KEEP: np.array([1], np.int64)}, start, hidden.shape[1],
                        kv)
        self.forwards += 1
        return out[self.logits_name]

    def _run(self, role: str, feed: dict[str, np.ndarray], start: int, new: int, kv: Mapping[str, np.ndarray]
             ) -> dict[str, np.ndarray]:
        graph, layers = self._graphs[role]
        total = start + new
        feed.update({SEQLENS: np.array([total - 1], np.int32), TOTAL_LENGTH: np.array(total, np.int32)})
        with self._lock:
            out = graph.run(feed, start, total, {past: kv[past] for past, _ in kv_pairs(layers)})
            return {name: np.array(out[name]) for name in (BOUNDARY, TAPS, self.logits_name) if name in out}


class _OpenVINOGraph:
    """A graph on OpenVINO: the past goes in as its own tensors and comes back with the new positions after it."""

    def __init__(self, graph, layers: tuple[int, ...]) -> None:
        self.graph = graph
        self.present = dict(kv_pairs(layers))

    def run(self, feed: dict[str, np.ndarray], start: int, total: int, kv: Mapping[str, np.ndarray]
            ) -> dict[str, np.ndarray]:
        for name in kv:  # the past as its own tensors (float32, the graphs' own): OpenVINO returns past + new, not
            # written in place; float16 or uint8 KV memory takes the new positions rounded or coded as the kernel would
            feed[name] = as_float32(kv[name][:, :, :start])
        out = self.graph.run(feed)
        for past in kv:
            kv[past][:, :, start:total] = stored(out[self.present[past]][:, :, start:total], kv[past].dtype)
        return out


class _OrtGraph:
    """A graph on ONNX Runtime's CPU provider, its past and present bound to the host KV memory itself (written in
    place, as the target's own steps write theirs)."""

    def __init__(self, model: onnx.ModelProto, spec, threads: int, kv: np.dtype) -> None:
        kernel = None
        if kv != np.float32:  # float16 or uint8 KV memory: the attention on the project's kernel, as the target's
            kernel = cpu_attention.library()
            if kernel is None or not cpu_attention.with_kernel(model, kv.name):
                raise BadInputError(f"prompt graphs writing {kv.name} KV need the project's attention kernel",
                                    option="kv_cache_precision")
        if proto_bytes(model) >= PROTOBUF_LIMIT:
            raise BadInputError(f"{spec.file}: its weights in float32 pass protobuf's 2 GiB; prefill_precision "
                                "'float32' takes smaller targets", option="prefill_precision")
        self.bound = _Bound(ort_session(model.SerializeToString(), ["CPUExecutionProvider"], threads,
                                        custom_ops=kernel), spec, None)
        self.head = spec.outputs[0].name

    def run(self, feed: dict[str, np.ndarray], start: int, total: int, kv: Mapping[str, np.ndarray]
            ) -> dict[str, np.ndarray]:
        self.bound.bind_kv({name: _view(array) for name, array in kv.items()})
        head, taps = self.bound.run(feed, ("cpu", 0))
        return {self.head: head.numpy(), **({} if taps is None else {TAPS: taps})}


def _view(array: np.ndarray) -> KVView:
    """Host KV memory [1, kv_heads, positions, width] (kv_codes.kv_width) as a view ONNX Runtime binds by address."""
    if not array.flags.c_contiguous or array.dtype not in (np.float32, np.float16, np.uint8):
        raise ValueError("the prompt graphs write KV memory that is float32, float16 or uint8 and contiguous")
    return KVView(array.ctypes.data, array.shape, array.dtype)

