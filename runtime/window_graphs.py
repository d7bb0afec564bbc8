"""The target's prefix and suffix rewritten so that each of R rows verifies a window of its own after its own past,
all in one run: the batching engine's speculative step, and a compressed target's batched steps (runtime/batching.py).

ONNX Runtime's GroupQueryAttention takes rows of several new tokens after a past only at batch 1 ("batch_size must
be 1 when sequence_length > 1 and past context is given", 1.31), so a batch of windows cannot be one call of the
exported graphs. Here every row's tokens are packed along one sequence, [1, N] with N the rows' tokens together:
each layer's MatMuls, norms and MLP run once over all N, as they would over a batch, and only the attention is split,
one GroupQueryAttention per row on that row's share, its own KV slot bound as its past and present. A row's result
is the same bits as that row's tokens run alone in a step of their own (tests/test_engine.py): attention is the only
place rows mix, and there each row attends alone.

The attention's rows are gathered from the N tokens (attention_gather, M positions), so that they need not be the
MatMuls' rows: a row of a target with int8 activations (Target.pads_rows) takes a copy of its last token's query
after its own, as a lone step of such a target is padded to two tokens (ONNX Runtime's one-row attention rounds
otherwise than a row of two, and the int8 activations after it turn that into logits apart; the causal mask hides the
copy from the row's tokens, and its key lands past them, where the row's next step writes), without its MatMuls
running a second row; and a spare row (a slot outside the step, filling the R rows, its output unused) is one copied
query, no MatMul row at all. attention_keep [N] puts each token's attention output back in its place.

Graph I/O beside the exported graphs' (export/target_graphs.py): input_ids [1, N] (the prefix) or hidden_states
[1, N, H] (the suffix), attention_gather [M] and attention_keep [N] int64, row_tokens [R] int64 (each row's share of
the M, >= 1), seqlens_k [R] (per row, of its attention's tokens, as there), total_sequence_length, and per row r
past_key_values.{i}.key.row{r} / present.{i}.key.row{r} [1, kv_heads, C, head_dim] (likewise .value). The suffix's
num_logits_to_keep keeps the last positions, as there: the rows that want logits go last (BatchTarget.run_windows).
"""

from __future__ import annotations

import copy

import onnx
from onnx import TensorProto, helper

from mirror_sd.errors import ManifestError
from mirror_sd.partitions.spec import SEQLENS

ROW_TOKENS = "row_tokens"
ATTENTION_GATHER, ATTENTION_KEEP = "attention_gather", "attention_keep"  # the module's docstring
_ONES = "row_tokens.ones"
# GroupQueryAttention's inputs: the new tokens' query, key and value (split per row along the sequence), the past
# key and value (one row's slot each), seqlens_k (split per row), then shared ones (total length, cos and sin caches)
_NEW, _PAST, _SEQLENS, _SHARED = (0, 1, 2), (3, 4), 5, (6, 7, 8)


def row_name(name: str, row: int) -> str:
    return f"{name}.row{row}"


def per_row_attention(model: onnx.ModelProto, rows: int) -> onnx.ModelProto:
    """A copy of `model` (a target prefix or suffix) whose attention runs per row: see the module's docstring."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, not {rows}")
    out = copy.deepcopy(model)
    graph = out.graph
    kv_inputs = {i.name for i in graph.input if i.name.startswith("past_key_values.")}
    nodes = [helper.make_node("Split", [SEQLENS, _ONES], [row_name(SEQLENS, r) for r in range(rows)], axis=0)]
    for node in graph.node:
        if node.op_type != "GroupQueryAttention":
            nodes.append(node)
            continue
        extra = [name for name in node.input[max(_SHARED) + 1:] if name]
        if extra:
            raise ManifestError(f"{node.name}: per-row attention does not split the inputs {extra}")
        parts: dict[int, list[str]] = {}
        for slot in _NEW:
            name = node.input[slot] if slot < len(node.input) else ""
            if name:  # an empty key and value: the query input packs all three
                parts[slot] = [row_name(name, r) for r in range(rows)]
                nodes.append(helper.make_node("Gather", [name, ATTENTION_GATHER], [f"{name}.rows"], axis=1))
                nodes.append(helper.make_node("Split", [f"{name}.rows", ROW_TOKENS], parts[slot], axis=1))
        results = []
        for r in range(rows):
            inputs = list(node.input)
            for slot, names in parts.items():
                inputs[slot] = names[r]
            for slot in _PAST:
                inputs[slot] = row_name(node.input[slot], r)
            inputs[_SEQLENS] = row_name(SEQLENS, r)
            outputs = [row_name(name, r) for name in node.output]
            attention = helper.make_node(node.op_type, inputs, outputs, name=row_name(node.name, r),
                                         domain=node.domain)
            attention.attribute.extend(node.attribute)
            nodes.append(attention)
            results.append(outputs[0])
        nodes.append(helper.make_node("Concat", results, [f"{node.output[0]}.rows"], axis=1))
        nodes.append(helper.make_node("Gather", [f"{node.output[0]}.rows", ATTENTION_KEEP], [node.output[0]], axis=1))
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.append(helper.make_tensor(_ONES, TensorProto.INT64, [rows], [1] * rows))
    row_tokens = helper.make_tensor_value_info(ROW_TOKENS, TensorProto.INT64, [rows])
    inputs = [i for i in graph.input if i.name not in kv_inputs] + [row_tokens]
    inputs += [helper.make_tensor_value_info(ATTENTION_GATHER, TensorProto.INT64, ["attention_tokens"]),
               helper.make_tensor_value_info(ATTENTION_KEEP, TensorProto.INT64, ["tokens"])]
    inputs += [_one_row(i, r) for i in graph.input if i.name in kv_inputs for r in range(rows)]
    outputs = [o for o in graph.output if not o.name.startswith("present.")]
    outputs += [_one_row(o, r) for o in graph.output if o.name.startswith("present.") for r in range(rows)]
    del graph.input[:]
    graph.input.extend(inputs)
    del graph.output[:]
    graph.output.extend(outputs)
    return out


def _one_row(value: onnx.ValueInfoProto, row: int) -> onnx.ValueInfoProto:
    """A KV input or output of one row: its batch dimension 1."""
    one = copy.deepcopy(value)
    one.name = row_name(value.name, row)
    one.type.tensor_type.shape.dim[0].Clear()
    one.type.tensor_type.shape.dim[0].dim_value = 1
    return one
