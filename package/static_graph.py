"""The bundle's dynamic draft graph -> a static OpenVINO model (runtime/static_draft.py describes the contract).

The draft ONNX graph reads a split past - the shared context lane [1, kv_heads, P, head_dim] and each row's own past
[B, kv_heads, S, head_dim] - and returns only the new tokens' KV. For an NPU every shape is fixed: batch B, new
tokens T, the lane at its full length L (rows read the slots their shared_mask marks) and the own past at S slots
(attention_mask S + T), and the heads run on all T new tokens. Output names stay `present.{i}.*`.
"""

from __future__ import annotations

from mirror_sd.errors import PackageError
from mirror_sd.partitions.manifest import FEATURES, SURROGATE, USE_SURROGATE
from mirror_sd.partitions.spec import KEEP


def make_static(model, batch: int, tokens: int, kv_length: int, own_slots: int):
    """Reshape `model` (an ov.Model of a bundle's draft; changed in place and returned) to static shapes. Its heads
    run on every new token: num_logits_to_keep becomes the constant T."""
    import numpy as np
    from openvino import opset13 as ops


    for param in list(model.get_parameters()):
        if param.output(0).get_any_name() == KEEP:
            constant = ops.constant(np.array([tokens], np.int64)).output(0)
            for target in list(param.output(0).get_target_inputs()):
                target.replace_source_output(constant)
            model.remove_parameter(param)
    shapes = {}
    for port in model.inputs:
        name = port.get_any_name()
        shape = port.get_partial_shape()
        if name == "attention_mask":
            shapes[name] = [batch, own_slots + tokens]
        elif name == "shared_mask":
            shapes[name] = [batch, kv_length]
        elif name.startswith("shared_key_values."):
            shapes[name] = [1, shape[1].get_length(), kv_length, shape[3].get_length()]
        elif name.startswith("past_key_values."):
            shapes[name] = [batch, shape[1].get_length(), own_slots, shape[3].get_length()]
        elif name in ("input_ids", "position_ids", USE_SURROGATE):
            shapes[name] = [batch, tokens]
        elif name == FEATURES:  # the feature channel (partitions/manifest.py): [B, T, n_taps, H]
            shapes[name] = [batch, tokens, shape[2].get_length(), shape[3].get_length()]
        elif name == SURROGATE:
            shapes[name] = [batch, tokens, shape[2].get_length()]
        else:
            raise PackageError(f"the draft graph has an input {name!r} a static package does not know")
    try:
        model.reshape(shapes)
    except RuntimeError as e:
        raise PackageError(f"the draft graph cannot take static shapes {shapes}: {e}") from None
    model.validate_nodes_and_infer_types()
    for port in model.outputs:
        if not port.get_partial_shape().is_static:
            raise PackageError(f"draft output {port.get_any_name()} is not static after reshaping")
    return model
