"""The target on OpenVINO: the bundle's target graphs rewritten for runtimes without GroupQueryAttention.

The bundle's target graphs use ONNX Runtime's GroupQueryAttention over buffers shared by past and present
(export/target_graphs.py). OpenVINO reads that op but cannot write into an input, so `portable_graph` rewrites
each one into standard ONNX ops with the draft's "split-past" interface (partitions/spec.py): the rotary
embedding from explicit position_ids, attention over the context read from shared_key_values.{i}.* plus the new
tokens, and present.{i}.* carrying only the new positions' KV. `OpenVINOTarget` keeps each layer's cache in a
host buffer of `capacity` positions, feeds the first `length` of them and writes the new positions back after the
call. Trimming is a length, as on ONNX Runtime.

What it costs: OpenVINO takes an input only as a contiguous array, so it copies the fed part of each buffer into
its own memory on every call (the context's KV once per step). This backend is for CPU-only machines without the
ONNX Runtime path's speed at long context; the benchmark reports both.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from mirror_sd.errors import BadInputError, ManifestError
from mirror_sd.partitions.manifest import BOUNDARY, EXIT_IDS, EXIT_LOGPROBS, TAPS, Manifest, resolve_inside
from mirror_sd.partitions.spec import (
    KEEP,
    SEQLENS,
    TOTAL_LENGTH,
    past_key_name,
    past_value_name,
    shared_key_name,
    shared_value_name,
)
from mirror_sd.runtime.backends import open_openvino, open_openvino_model
from mirror_sd.runtime.target import Boundary, Target, kv_pairs

POSITIONS = "position_ids"
_NEG = float(np.finfo(np.float32).min)


class _Rewriter:
    """Emits the replacement nodes; shared pieces (gathered cos/sin, masks) are built once per graph."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.nodes: list[onnx.NodeProto] = []
        self.count = 0
        self.cached: dict[tuple, str] = {}

    def name(self, hint: str) -> str:
        self.count += 1
        return f"portable_{hint}_{self.count}"

    def const(self, array: np.ndarray, hint: str = "c") -> str:
        key = ("const", array.dtype.str, array.shape, array.tobytes())
        if key not in self.cached:
            name = self.name(hint)
            self.graph.initializer.append(numpy_helper.from_array(array, name))
            self.cached[key] = name
        return self.cached[key]

    def initializer_shape(self, name: str) -> tuple[int, ...]:
        for t in self.graph.initializer:
            if t.name == name:
                return tuple(t.dims)
        raise ManifestError(f"GroupQueryAttention input {name!r} is not an initializer")

    def head_size(self, past: str) -> int:
        """A KV input's head size (its last dimension, fixed by the manifest's head_dim)."""
        for i in self.graph.input:
            if i.name == past:
                dim = i.type.tensor_type.shape.dim[-1]
                if dim.HasField("dim_value"):
                    return int(dim.dim_value)
        raise ManifestError(f"GroupQueryAttention input {past!r} is no graph input of a fixed head size")

    def ints(self, *values: int) -> str:
        return self.const(np.array(values, np.int64), "i")

    def node(self, op: str, inputs: list[str], **attrs) -> str:
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=self.name(op), **attrs))
        return out

    def once(self, key: tuple, build) -> str:
        if key not in self.cached:
            self.cached[key] = build()
        return self.cached[key]

    # -- shared pieces -------------------------------------------------------------------------------------------
    def rotary(self, cache: str) -> str:
        """cos or sin rows for the new tokens: [B,1,T,hd/2]."""
        return self.once(("rot", cache), lambda: self.node(
            "Unsqueeze", [self.node("Gather", [cache, POSITIONS], axis=0), self.ints(1)]))

    def context_length(self, shared_key: str) -> str:
        """P, the fed context's length, as a 1-element int64 tensor."""
        return self.once(("P",), lambda: self.node("Slice", [self.node("Shape", [shared_key]), self.ints(2),
                                                             self.ints(3)]))

    def biases(self, shared_key: str, window: int) -> tuple[str | None, str]:
        """Additive masks for the context part [B,1,T,P] (None without a window: every context slot is visible) and
        the new part [B,1,T,T] (causal); a window keeps the keys at positions > the query's - window."""

        def build() -> tuple[str | None, str]:
            q_pos = self.node("Unsqueeze", [POSITIONS, self.ints(1, 3)])  # [B,1,T,1]
            new_pos = self.node("Unsqueeze", [POSITIONS, self.ints(1, 2)])  # [B,1,1,T]: the new keys' positions
            allowed = self.node("LessOrEqual", [new_pos, q_pos])  # [B,1,T,T] causal
            shared = None
            if window > 0:
                low = self.node("Sub", [q_pos, self.const(np.array(window, np.int64))])  # keys must be > q - w
                allowed = self.node("And", [allowed, self.node("Greater", [new_pos, low])])
                length = self.node("Squeeze", [self.context_length(shared_key), self.ints(0)])
                ctx_pos = self.node("Range", [self.const(np.array(0, np.int64)), length,
                                              self.const(np.array(1, np.int64))])  # [P]
                shared = self._bias(self.node("Greater", [ctx_pos, low]))
            return shared, self._bias(allowed)

        return self.once(("bias", window), build)

    def _bias(self, allowed: str) -> str:
        return self.node("Where", [allowed, self.const(np.array(0.0, np.float32)),
                                   self.const(np.array(_NEG, np.float32))])

    # -- one GroupQueryAttention ---------------------------------------------------------------------------------
    def attention(self, node: onnx.NodeProto) -> None:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        turns = attrs.get("do_rotary", 0) == 1  # a layer without a rotary (SmolLM3's NoPE) has no caches
        if attrs.get("rotary_interleaved", 0) != 0:
            raise ManifestError("portable target graphs need GroupQueryAttention with a non-interleaved rotary")
        heads, kv_heads = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
        window = int(attrs.get("local_window_size", -1))  # keys a query sees, itself included (<= 0: all)
        q, k, v, past_k, past_v = node.input[:5]
        cos_cache, sin_cache = (node.input[7], node.input[8]) if turns else ("", "")
        out, present_k, present_v = node.output
        hd = self.head_size(past_k)
        if not k:  # q, k and v packed in the first input
            sizes = self.const(np.array([heads * hd, kv_heads * hd, kv_heads * hd], np.int64), "qkv_sizes")
            q, k, v = (self.name("split") for _ in range(3))
            self.nodes.append(helper.make_node("Split", [node.input[0], sizes], [q, k, v], name=self.name("Split"),
                                               axis=-1))
        shared_k, shared_v = past_k.replace("past_key_values.", "shared_key_values."), \
            past_v.replace("past_key_values.", "shared_key_values.")
        def heads_first(x: str, n: int) -> str:  # [B,T,n*hd] -> [B,n,T,hd]
            return self.node("Transpose", [self.node("Reshape", [x, self.ints(0, 0, n, -1)])], perm=[0, 2, 1, 3])

        def rotate(x: str) -> str:  # rotate_half layout: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), the rest kept
            if not turns:
                return x
            turned = 2 * self.initializer_shape(cos_cache)[1]  # the first `turned` values of a head
            cos, sin = self.rotary(cos_cache), self.rotary(sin_cache)
            x1 = self.node("Slice", [x, self.ints(0), self.ints(turned // 2), self.ints(3)])
            x2 = self.node("Slice", [x, self.ints(turned // 2), self.ints(turned), self.ints(3)])
            first = self.node("Sub", [self.node("Mul", [x1, cos]), self.node("Mul", [x2, sin])])
            second = self.node("Add", [self.node("Mul", [x2, cos]), self.node("Mul", [x1, sin])])
            kept = [self.node("Slice", [x, self.ints(turned), self.ints(hd), self.ints(3)])] if turned < hd else []
            return self.node("Concat", [first, second, *kept], axis=-1)

        q4, k4, v4 = rotate(heads_first(q, heads)), rotate(heads_first(k, kv_heads)), heads_first(v, kv_heads)
        group = heads // kv_heads
        rows = self.node("Reshape", [q4, self.ints(0, kv_heads, -1, 0)])  # [B,kv,g*T,hd]: a group's queries as rows
        if not attrs.get("scale"):
            raise ManifestError(f"GroupQueryAttention {node.name!r} has no scale attribute")
        scale = self.const(np.array(attrs["scale"], np.float32))

        cap = attrs.get("softcap", 0.0)  # Gemma 2: scores c tanh(s / c), before the mask

        def scores(keys: str) -> str:
            s = self.node("Mul", [self.node("MatMul", [rows, self.node("Transpose", [keys], perm=[0, 1, 3, 2])]),
                                  scale])
            if cap:
                c = self.const(np.array(cap, np.float32))
                s = self.node("Mul", [self.node("Tanh", [self.node("Div", [s, c])]), c])
            return s

        shared_bias, new_bias = self.biases(shared_k, window if window > 0 else 0)
        tile = self.ints(1, 1, group, 1)
        s_ctx = scores(shared_k)
        if shared_bias is not None:
            s_ctx = self.node("Add", [s_ctx, self.node("Tile", [shared_bias, tile])])
        s_new = self.node("Add", [scores(k4), self.node("Tile", [new_bias, tile])])
        probs = self.node("Softmax", [self.node("Concat", [s_ctx, s_new], axis=-1)], axis=-1)
        length = self.context_length(shared_k)
        p_ctx = self.node("Slice", [probs, self.ints(0), length, self.ints(3)])
        p_new = self.node("Slice", [probs, length, self.ints(np.iinfo(np.int64).max), self.ints(3)])
        mixed = self.node("Add", [self.node("MatMul", [p_ctx, shared_v]), self.node("MatMul", [p_new, v4])])
        per_head = self.node("Reshape", [mixed, self.ints(0, heads, -1, 0)])  # [B,heads,T,hd]
        merged = self.node("Transpose", [per_head], perm=[0, 2, 1, 3])
        self.nodes.append(helper.make_node("Reshape", [merged, self.ints(0, 0, -1)], [out], name=self.name("out")))
        self.nodes.append(helper.make_node("Identity", [k4], [present_k], name=self.name("present")))
        self.nodes.append(helper.make_node("Identity", [v4], [present_v], name=self.name("present")))


def portable_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a shared-buffer target graph with every GroupQueryAttention rewritten (see the module docstring).
    Inputs: the graph's first input, position_ids [B,T], shared_key_values.{i}.* [1,kv,P,hd] (and for the suffix
    num_logits_to_keep); outputs: the graph's head and present.{i}.* [B,kv,T,hd]."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # in memory: a serialized copy cannot pass protobuf's 2 GiB
    model = copy
    graph = model.graph
    rewriter = _Rewriter(graph)
    for node in graph.node:
        if node.op_type == "GroupQueryAttention":
            rewriter.attention(node)
        else:
            rewriter.nodes.append(node)
    del graph.node[:]
    graph.node.extend(rewriter.nodes)
    inputs = []
    for value in graph.input:
        if value.name in (SEQLENS, TOTAL_LENGTH):
            continue
        if value.name.startswith("past_key_values."):
            value = onnx.ValueInfoProto.FromString(value.SerializeToString())
            value.name = value.name.replace("past_key_values.", "shared_key_values.")
            value.type.tensor_type.shape.dim[0].dim_value = 1
            value.type.tensor_type.shape.dim[2].dim_param = "context"
        inputs.append(value)
    inputs.insert(1, helper.make_tensor_value_info(POSITIONS, TensorProto.INT64, ["batch", "sequence"]))
    del graph.input[:]
    graph.input.extend(inputs)
    for value in graph.output:
        if value.name.startswith("present."):
            value.type.tensor_type.shape.dim[2].dim_param = "sequence"
    return model


class OpenVINOTarget(Target):
    """The target on OpenVINO from the rewritten graphs, with host KV buffers (see the module docstring)."""

    def __init__(self, bundle: Path, manifest: Manifest, device: str | None = None, threads: int = 1,
                 capacity: int | None = None, cache_dir: str | Path | None = None) -> None:
        super().__init__(manifest, capacity)
        facts = manifest.target
        self._graphs = {}
        self._layers = {}
        for role in ("target_prefix", "target_suffix"):
            spec = manifest.partition(role)
            proto = portable_graph(onnx.load(str(resolve_inside(bundle, spec.file))))
            self._graphs[role] = open_openvino_model(proto, device, threads, cache_dir)
            self._layers[role] = spec.kv_layers
        self._exit = open_openvino(resolve_inside(bundle, manifest.partition("target_exit").file), device, threads,
                                   cache_dir)
        self.device = f"OpenVINO:{self._graphs['target_prefix'].device}"
        shape = (1, facts.num_kv_heads, self.capacity, facts.head_dim)
        self.buffers = {name: np.zeros(shape, np.dtype(facts.dtype)) for role in self._layers
                        for i in self._layers[role] for name in (past_key_name(i), past_value_name(i))}

    def _run(self, role: str, first: tuple[str, np.ndarray], start: int, new: int, extra: dict | None = None
             ) -> np.ndarray:
        feed = {first[0]: first[1], "position_ids": np.arange(start, start + new, dtype=np.int64)[None]}
        for i in self._layers[role]:
            for past, shared in ((past_key_name(i), shared_key_name(i)), (past_value_name(i), shared_value_name(i))):
                feed[shared] = self.buffers[past][:, :, :start]
        feed.update(extra or {})
        out = self._graphs[role].run(feed)
        for past, present in kv_pairs(self._layers[role]):  # the new positions' KV into the buffers
            self.buffers[past][:, :, start:start + new] = out[present]
        # the request reuses its output memory on the next call: keep copies of the head outputs
        return {name: np.array(a) for name, a in out.items() if not name.startswith("present.")}

    def _run_prefix(self, ids: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray | None]:
        out = self._run("target_prefix", ("input_ids", ids), start, ids.shape[1])
        return out[BOUNDARY], (out[TAPS][0] if TAPS in out else None)

    def _run_suffix(self, boundary: Boundary, logits_for: int) -> np.ndarray:
        out = self._run("target_suffix", (BOUNDARY, boundary.hidden), boundary.start, boundary.positions,
                        {KEEP: np.array([logits_for], np.int64)})
        return out["logits"]

    def exit_candidates(self, boundary: Boundary, kappa: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        out = self._exit.run({BOUNDARY: boundary.hidden})
        k = kappa or self.top_k
        return np.array(out[EXIT_IDS][0, :, :k]), np.array(out[EXIT_LOGPROBS][0, :, :k])

    def boundary_array(self, boundary: Boundary) -> np.ndarray:
        return boundary.hidden

    def host_kv(self) -> dict[str, np.ndarray]:
        return self.buffers


def open_portable_target(bundle: str | Path, manifest: Manifest, device: str | None = None, threads: int = 1,
                         capacity: int | None = None, cache_dir: str | Path | None = None) -> OpenVINOTarget:
    if manifest.target.dtype != "float32":
        # the rewrite above emits float32 constants and masks; a float16 target is exported for the CUDA EP
        raise BadInputError(f"the OpenVINO target backend runs a float32 target; this bundle's target graphs are "
                            f"{manifest.target.dtype} (for ONNX Runtime's CUDA execution provider): export it again "
                            "with --target-dtype float32", option="target_backend")
    return OpenVINOTarget(Path(bundle).resolve(), manifest, device, threads, capacity, cache_dir)
