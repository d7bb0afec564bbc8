"""The bundle's dynamic draft graph -> a static OpenVINO model (runtime/static_draft.py describes the contract).

The draft ONNX graph takes the past KV and returns past + new concatenated ("present"). For an NPU the shapes are
fixed: batch B, new tokens T, a KV buffer of L slots (attention_mask L + T), and each present output is sliced to
its last T positions - the new tokens' KV - so the host writes only those into its preallocated buffer. The full
concatenations are no longer outputs (OpenVINO drops what no result needs). Output names stay `present.{i}.*`.
"""

from __future__ import annotations

import numpy as np

from mirror_sd.errors import PackageError


def make_static(model, batch: int, tokens: int, kv_length: int):
    """Reshape `model` (an ov.Model of a bundle's draft; changed in place and returned) to static shapes and cut
    its present outputs to the new tokens."""
    from openvino import opset13 as ops

    shapes = {}
    for port in model.inputs:
        name = port.get_any_name()
        if name == "attention_mask":
            shapes[name] = [batch, kv_length + tokens]
        elif name.startswith("past_key_values."):
            shape = port.get_partial_shape()
            shapes[name] = [batch, shape[1].get_length(), kv_length, shape[3].get_length()]
        elif name in ("input_ids", "position_ids"):
            shapes[name] = [batch, tokens]
        else:
            raise PackageError(f"the draft graph has an input {name!r} a static package does not know")
    try:
        model.reshape(shapes)
    except RuntimeError as e:
        raise PackageError(f"the draft graph cannot take static shapes {shapes}: {e}") from None
    axis = lambda v: np.array([v], np.int64)  # noqa: E731
    for result in list(model.get_results()):
        name = result.output(0).get_any_name()
        if not name.startswith("present."):
            continue
        source = result.input_value(0)  # [B, kv_heads, L + T, head_dim]
        new = ops.slice(source, axis(kv_length), axis(kv_length + tokens), axis(1), axis(2)).output(0)
        model.remove_result(result)
        source.get_tensor().set_names(set())  # the name moves to the sliced tensor
        new.get_tensor().set_names({name})
        model.add_results([ops.result(new)])
    model.validate_nodes_and_infer_types()
    for port in model.outputs:
        if not port.get_partial_shape().is_static:
            raise PackageError(f"draft output {port.get_any_name()} is not static after reshaping")
    return model
