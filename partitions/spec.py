"""Partition specs: which graph holds which layers, and what goes in and out of it. Plain data, no runtimes."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Callable, Literal, Mapping

from mirror_sd.errors import ManifestError

Role = Literal["target_prefix", "target_suffix", "target_exit", "draft"]
ROLES: tuple[Role, ...] = ("target_prefix", "target_suffix", "target_exit", "draft")
DTYPES = ("float32", "float16", "int64", "int32", "bool")
BACKENDS = ("onnxruntime", "openvino")  # the runtimes a partition can run on (runtime/backends.py opens them)
# where a prompt is prefilled: on the target's own graphs, on OpenVINO in bf16, or (an int8 or int4 target) on its
# weights expanded to float32 (runtime/prompt_graphs.py)
PREFILL_PRECISIONS = ("target", "bf16", "float32")
# the target's KV: its own element type, or float16 or uint8 codes (the CPU attention kernel's;
# LoadOptions.kv_cache_precision)
KV_CACHE_PRECISIONS = ("target", "float16", "uint8")

# Symbolic axis names shared by every graph. KV tensors are [batch, kv_heads, seq, head_dim] (the attention kernel's
# uint8 codes: head_dim + 8, runtime/kv_codes.py).
BATCH, SEQUENCE, PAST, TOTAL = "batch", "sequence", "past_sequence", "total_sequence"
CAPACITY = "kv_capacity"  # a preallocated KV buffer's slots (target graphs: past and present are one buffer)
KEPT = "kept"  # positions the LM head runs on (num_logits_to_keep)
SHARED = "shared_sequence"  # slots of a draft's shared past (one row every batch row reads)

# The KV tensors' names, with global layer numbers: past_key_name(3) == "past_key_values.3.key".
past_key_name: Callable[[int], str] = "past_key_values.{}.key".format
past_value_name: Callable[[int], str] = "past_key_values.{}.value".format
present_key_name: Callable[[int], str] = "present.{}.key".format
present_value_name: Callable[[int], str] = "present.{}.value".format
shared_key_name: Callable[[int], str] = "shared_key_values.{}.key".format
shared_value_name: Callable[[int], str] = "shared_key_values.{}.value".format

# How a partition's graph keeps its KV cache (PartitionSpec.kv), and the past inputs each of its layers takes:
# - "shared-buffer": past_key_values.{i}.* and present.{i}.* are one preallocated buffer of CAPACITY slots; the graph
#   reads seqlens_k + 1 - T of them and writes the T new positions in place (ONNX Runtime GroupQueryAttention).
# - "split-past": the past comes in two parts - shared_key_values.{i}.* [1, kv_heads, SHARED, hd], one row that every
#   batch row reads up to its shared_mask, and past_key_values.{i}.* [B, kv_heads, PAST, hd], each row's own - and
#   present.{i}.* holds only the T new positions. Nothing is concatenated with the shared part, so branch rows over
#   one context never copy it (runtime/draft.py).
KV_INTERFACES = {"shared-buffer": (past_key_name, past_value_name),
                 "split-past": (past_key_name, past_value_name, shared_key_name, shared_value_name)}
# The shared-buffer graphs' length inputs: seqlens_k [B] int32 (each row's total length - 1) and
# total_sequence_length [] int32; the suffix's LM head runs on the last num_logits_to_keep [1] int64 positions.
SEQLENS, TOTAL_LENGTH, KEEP = "seqlens_k", "total_sequence_length", "num_logits_to_keep"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int | str, ...]  # ints are fixed sizes, strings are symbolic (dynamic) axes

    @property
    def dynamic_axes(self) -> dict[int, str]:
        return {i: d for i, d in enumerate(self.shape) if isinstance(d, str)}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> TensorSpec:
        name, dtype, shape = (require_field(d, key, where) for key in ("name", "dtype", "shape"))
        if not isinstance(name, str) or not name:
            raise ManifestError(f"{where}: tensor name must be a non-empty string")
        if dtype not in DTYPES:
            raise ManifestError(f"{where}: tensor {name!r} has unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        if not isinstance(shape, list) or not all(isinstance(s, (int, str)) for s in shape):
            raise ManifestError(f"{where}: tensor {name!r} shape must be a list of ints and axis names")
        return cls(name, dtype, tuple(shape))


@dataclass(frozen=True)
class PartitionSpec:
    role: Role
    layers: tuple[int, int]  # half-open [start, end), global layer numbers (the draft's own numbering)
    file: str  # relative to the bundle directory
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    backend: str  # default runtime: "onnxruntime" for the target, "openvino" for the draft
    device: str  # default device for that backend
    data_files: tuple[str, ...] = ()  # external-data files next to `file`, if any
    tokens_per_forward: int = 1  # draft only: >1 for a multi-token (speculative streaming) draft
    extra: dict[str, Any] = field(default_factory=dict)  # role-specific facts, e.g. the exit head's kind
    kv: str = "shared-buffer"  # KV_INTERFACES: how the graph keeps its cache ("" for a graph without one)

    @property
    def kv_layers(self) -> range:
        return range(*self.layers)

    def input(self, name: str) -> TensorSpec:
        return _by_name(self.inputs, name, f"{self.role} inputs")

    def output(self, name: str) -> TensorSpec:
        return _by_name(self.outputs, name, f"{self.role} outputs")

    def to_dict(self) -> dict[str, Any]:
        d = to_json(self)
        return {k: d[k] for k in ("role", "layers", "file", "data_files", "backend", "device", "tokens_per_forward",
                                  "kv", "inputs", "outputs", "extra")}  # manifest.json's order

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> PartitionSpec:
        role = require_field(d, "role", where)
        if role not in ROLES:
            raise ManifestError(f"{where}: unknown role {role!r} (known: {', '.join(ROLES)})")
        where = f"{where} ({role})"
        layers = require_field(d, "layers", where)
        if not (isinstance(layers, list) and len(layers) == 2 and all(isinstance(x, int) for x in layers)):
            raise ManifestError(f"{where}: layers must be [start, end]")
        if not 0 <= layers[0] <= layers[1] or (layers[0] == layers[1] and role != "target_exit"):
            raise ManifestError(f"{where}: layers {layers} is not a non-empty range [start, end)")
        kv = d.get("kv", "")
        if kv not in (*KV_INTERFACES, ""):
            raise ManifestError(f"{where}: unknown KV interface {kv!r} (known: {', '.join(KV_INTERFACES)})")
        file = require_field(d, "file", where)
        if not isinstance(file, str) or not file:
            raise ManifestError(f"{where}: file must be a non-empty string")
        return cls(
            role=role,
            layers=(layers[0], layers[1]),
            file=file,
            inputs=tuple(TensorSpec.from_dict(t, f"{where} input") for t in require_field(d, "inputs", where)),
            outputs=tuple(TensorSpec.from_dict(t, f"{where} output") for t in require_field(d, "outputs", where)),
            backend=str(require_field(d, "backend", where)),
            device=str(require_field(d, "device", where)),
            data_files=tuple(d.get("data_files", ())),
            tokens_per_forward=int(d.get("tokens_per_forward", 1)),
            extra=dict(d.get("extra", {})),
            kv=kv,
        )


def kv_specs(layers: range, kv_heads: int, head_dim: int,
             dtype: str) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Past (inputs) and present (outputs) KV specs for `layers` of a "split-past" graph, named with global layer
    numbers: per layer the shared past, then the row's own past; present = the new positions only."""
    past, present = [], []
    for i in layers:
        past += [TensorSpec(n(i), dtype, (1, kv_heads, SHARED, head_dim)) for n in (shared_key_name, shared_value_name)]
        past += [TensorSpec(n(i), dtype, (BATCH, kv_heads, PAST, head_dim)) for n in (past_key_name, past_value_name)]
        present += [TensorSpec(n(i), dtype, (BATCH, kv_heads, SEQUENCE, head_dim))
                    for n in (present_key_name, present_value_name)]
    return tuple(past), tuple(present)


def to_json(x: Any, table: Callable[[Mapping], Mapping] = dict) -> Any:
    """A dataclass as JSON data (what json.dumps writes of it): its fields in order, each under its metadata "json"
    name where it has one; tuples as lists; every mapping passed through `table` (default: copied as it is)."""
    if is_dataclass(x):
        return {f.metadata.get("json", f.name): to_json(getattr(x, f.name), table) for f in fields(x)}
    if isinstance(x, Mapping):
        return {k: to_json(v, table) for k, v in table(x).items()}
    return [to_json(v, table) for v in x] if isinstance(x, (tuple, list)) else x


def _by_name(specs: tuple[TensorSpec, ...], name: str, what: str) -> TensorSpec:
    for t in specs:
        if t.name == name:
            return t
    raise ManifestError(f"{what} have no tensor named {name!r}")


def require_field(d: Any, key: str, where: str) -> Any:
    if not isinstance(d, dict):
        raise ManifestError(f"{where}: expected an object, got {type(d).__name__}")
    if key not in d:
        raise ManifestError(f"{where}: missing field {key!r}")
    return d[key]
