"""The bundle manifest: the only contract between export and runtime.

`Manifest.load(bundle_dir)` reads `manifest.json` and validates it against itself and the directory; the runtime
reads nothing else to learn what a bundle holds.
"""

from __future__ import annotations

import json
import os
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath
from typing import Any

from mirror_sd.errors import ManifestError, first_line
from mirror_sd.partitions.spec import (
    KV_INTERFACES,
    ROLES,
    PartitionSpec,
    Role,
    present_key_name,
    present_value_name,
    require_field,
    to_json,
)

# 2: target graphs keep their KV in shared buffers (GroupQueryAttention), the early-exit head is a partition of its
# own (target_exit), the draft takes a split past. A version-1 bundle is refused with a pointer to `make export`.
FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
# optional in a bundle (and kept in its package): the model's recommended sampling, which the server's defaults take
# (serve/defaults.py), as vLLM reads it
GENERATION_CONFIG = "generation_config.json"
BOUNDARY = "hidden_states"  # the tensor that crosses from target_prefix to target_suffix
EXIT_IDS, EXIT_LOGPROBS = "exit_topk_ids", "exit_topk_logprobs"
LOGITS = "logits"
STREAM_IDS = "stream_ids"  # a streaming draft's extra proposals: [B,T,streams] target ids
DRAFT_VOCAB_FILE = "draft_vocab.json"  # a reduced-vocabulary draft's output index -> target id
# The feature channel (a draft that reads the target's hidden states, models/feature_draft.py): the prefix also
# gives the residual stream after each of the draft's tap layers, TAPS [B,T,n_taps,H]; the draft graph takes, per
# input token, the taps of the position before it (FEATURES [B,T,n_taps,H]) or, where the target has not run that
# position yet, its own hidden state there (SURROGATE [B,T,H], chosen where USE_SURROGATE [B,T] is 1), and gives
# its hidden state DRAFT_HIDDEN [B,kept,H] for the next forward's surrogate.
TAPS, FEATURES, SURROGATE, USE_SURROGATE, DRAFT_HIDDEN = ("taps", "features", "surrogate", "use_surrogate",
                                                         "draft_hidden")
# Parity of an exported graph with its torch source, for every float output: max |graph - torch| <= PARITY_ATOL +
# PARITY_RTOL * max |torch| (export/parity.py; package/build.py holds a static fp32 draft to it too). The relative
# term is fp32 rounding, which grows with a tensor's scale: SmolLM2's own fp32 logits (|x| up to ~33) differ from
# fp64 by 7e-5, OpenVINO's by 1.5e-4, and its residual stream carries massive activations (|h| ~ 2.6e4) whose
# rounding is ~1e-2 absolute.
PARITY_ATOL, PARITY_RTOL = 1e-4, 1e-5
# How the draft graph stores its MatMul weights (export/draft_weights.py): fp32, or 8-bit blocks (MatMulNBits). Its
# activations, KV and outputs are `dtype` either way.
DRAFT_WEIGHT_FORMATS = ("float32", "int8")
# What the target's graphs compute in and keep their KV and boundary tensor in: float32, or float16 for the CUDA
# execution provider (whose GroupQueryAttention has no float32 kernel). Logits and taps reach the host as float32.
TARGET_DTYPES = ("float32", "float16")
# How the target's prefix and suffix graphs store their MatMul weights (export/target_weights.py): as exported, or in
# 8- or 4-bit blocks (MatMulNBits). Outputs are exact with respect to the target as deployed, whichever it is.
TARGET_WEIGHT_FORMATS = ("float32", "int8", "int4")
# Weights per block of a compressed MatMul (one float32 scale each), the draft's int8 and the target's int8 / int4,
# and the bits of each compressed format's weights.
WEIGHT_BLOCK_SIZE = 32
WEIGHT_BITS = {"int8": 8, "int4": 4}
MATMUL_ACTIVATIONS = ("float32", "int8")


# The target's LM head is never stored below 8 bits (an int4 target keeps it in int8 blocks, as NNCF's and optimum's
# int4 modes keep the output layer in int8): it is a fifth of a small model's weights and picks every token.
LM_HEAD_MIN_BITS = 8


def weight_bytes(bits: int | None, float_itemsize: int) -> float:
    """Bytes a graph stores per MatMul weight in blocks of `bits` (their scales included; None: uncompressed)."""
    return float_itemsize if bits is None else bits / 8 + 4 / WEIGHT_BLOCK_SIZE


def lm_head_bits(weight_format: str) -> int | None:
    """Bits of a target LM head's blocks in `weight_format` (None: not compressed)."""
    bits = WEIGHT_BITS.get(weight_format)
    return None if bits is None else max(bits, LM_HEAD_MIN_BITS)


@dataclass(frozen=True)
class ModelFacts:
    """What the runtime needs to know about one model (target or draft)."""

    architecture: str  # transformers model_type, e.g. "llama"
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    dtype: str = "float32"
    kv_layout: str = "batch,kv_heads,sequence,head_dim"


@dataclass(frozen=True)
class TargetFacts(ModelFacts):
    exit_layer: int = 0  # l_e: the prefix holds layers [0, l_e)
    top_k: int = 8  # k: early-exit candidates per position
    exit_head: str = "logit_lens"  # which early-exit head target_exit carries
    exit_vocab_size: int = 0  # rows of the LM head target_exit runs (0: the whole vocabulary)
    weight_format: str = "float32"  # one of TARGET_WEIGHT_FORMATS (the prefix's and suffix's MatMuls)
    # What the compressed MatMuls multiply their activations in: "int8" (ONNX Runtime's accuracy level 4, whose
    # one-row step rounds otherwise than a row of a wider step: runtime/target.py pads such steps) or "float32".
    # Bundles from before the field: int8 targets computed in int8, int4 ones in float32.
    matmul_activations: str = ""

    def __post_init__(self) -> None:
        if not self.matmul_activations:
            object.__setattr__(self, "matmul_activations", "int8" if self.weight_format == "int8" else "float32")


@dataclass(frozen=True)
class DraftFacts(ModelFacts):
    tokens_per_forward: int = 1  # at most this many tokens per forward: 1 + streams
    # A draft may predict over a reduced vocabulary: its logits have output_vocab_size columns and column i is
    # target id output_vocab_file[i]. 0 / None: the full target vocabulary, column i is id i.
    output_vocab_size: int = 0
    output_vocab_file: str | None = None
    streams: int = 0  # extra proposed tokens per forward (the graph's stream_ids output), 0 for a plain draft
    # A feature draft reads the target's residual stream after these layers (each <= the exit layer, so the prefix
    # has them before the suffix runs); () for a draft that reads token ids only.
    feature_taps: tuple[int, ...] = ()
    # The most recent tokens the draft attends to (0: its whole context): the length it was trained on, where
    # drafting over a far longer context costs acceptance (docs/design.md: Draft prompt windows and the try window).
    # The runtime masks older slots out of its attention and reads only the last attention_window tokens of a longer
    # prompt; positions still count them.
    attention_window: int = 0
    weight_format: str = "float32"  # one of DRAFT_WEIGHT_FORMATS

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_taps", tuple(self.feature_taps))  # JSON gives a list

    @property
    def inputs_per_forward(self) -> int:
        """Tokens a rollout feeds per forward after its first: a streaming token draft feeds its stream proposals
        back to check them (tokens_per_forward); a feature draft's streams only propose (runtime/feature_draft.py),
        so it feeds one."""
        return 1 if self.feature_taps else self.tokens_per_forward


@dataclass(frozen=True)
class TokenizerFacts:
    files: tuple[str, ...]
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    chat_template: str | None = None


@dataclass(frozen=True)
class Manifest:
    target: TargetFacts
    draft: DraftFacts
    partitions: tuple[PartitionSpec, ...]
    tokenizer: TokenizerFacts
    format_version: int = FORMAT_VERSION
    producer: str = ""
    validation: dict[str, Any] = field(default_factory=dict)  # parity results recorded at export

    def partition(self, role: Role) -> PartitionSpec:
        for p in self.partitions:
            if p.role == role:
                return p
        raise ManifestError(f"manifest has no {role} partition")

    # -- serialisation ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {**to_json(self), "partitions": [p.to_dict() for p in self.partitions]}
        return {k: d[k] for k in ("format_version", "producer", "target", "draft", "partitions", "tokenizer",
                                  "validation")}  # manifest.json's order

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        version = require_field(d, "format_version", "manifest")
        if version != FORMAT_VERSION:
            again = " (export the bundle again with this version: make export)" if version == 1 else ""
            raise ManifestError(f"manifest format_version {version!r} is not supported (this build reads "
                                f"{FORMAT_VERSION}){again}")
        partitions = require_field(d, "partitions", "manifest")
        if not isinstance(partitions, list):
            raise ManifestError("manifest: partitions must be a list")
        tok = require_field(d, "tokenizer", "manifest")
        try:
            tokenizer = TokenizerFacts(
                files=tuple(require_field(tok, "files", "tokenizer")),
                eos_token_ids=tuple(int(i) for i in require_field(tok, "eos_token_ids", "tokenizer")),
                bos_token_id=tok.get("bos_token_id"),
                pad_token_id=tok.get("pad_token_id"),
                chat_template=tok.get("chat_template"),
            )
            target = TargetFacts(**require_field(d, "target", "manifest"))
            draft = DraftFacts(**require_field(d, "draft", "manifest"))
        except TypeError as e:  # unknown or missing keyword in the facts objects
            raise ManifestError(f"manifest: malformed model facts: {e}") from None
        for where, facts in (("tokenizer", tokenizer), ("target", target), ("draft", draft)):
            _check_types(facts, where)
        return cls(
            target=target,
            draft=draft,
            partitions=tuple(PartitionSpec.from_dict(p, f"partitions[{i}]") for i, p in enumerate(partitions)),
            tokenizer=tokenizer,
            format_version=version,
            producer=str(d.get("producer", "")),
            validation=dict(d.get("validation", {})),
        )

    def save(self, bundle_dir: str | os.PathLike) -> Path:
        path = Path(bundle_dir) / MANIFEST_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, bundle_dir: str | os.PathLike) -> Manifest:
        """Read and fully validate the manifest of `bundle_dir` (including that its files exist inside it)."""
        bundle = Path(bundle_dir)
        path = bundle / MANIFEST_NAME
        try:
            if not bundle.is_dir():
                raise ManifestError(f"bundle directory {str(bundle)!r} does not exist")
            if not path.is_file():
                raise ManifestError(f"bundle {str(bundle)!r} has no {MANIFEST_NAME}")
        except OSError as e:  # a folder this user may not read
            raise ManifestError(f"cannot read bundle {str(bundle)!r}: {e.strerror or e}") from None
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(f"cannot read {path}: {e}") from None
        try:
            manifest = cls.from_dict(raw)
            manifest.validate(bundle)
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:  # a field of the wrong type
            raise ManifestError(f"{path}: malformed: {first_line(e)}") from None
        return manifest

    # -- validation ------------------------------------------------------------------------------------------
    def validate(self, bundle_dir: str | os.PathLike | None = None) -> None:
        """Raise ManifestError on the first inconsistency. With `bundle_dir`, also check every file is inside it."""
        t, dr = self.target, self.draft
        roles = [p.role for p in self.partitions]
        if sorted(roles) != sorted(ROLES):
            raise ManifestError(f"manifest must hold exactly one partition per role {ROLES}, found {roles}")
        if t.vocab_size != dr.vocab_size:
            raise ManifestError(f"target vocabulary ({t.vocab_size}) and draft vocabulary ({dr.vocab_size}) differ")
        if not 1 <= t.exit_layer <= t.num_layers - 1:
            raise ManifestError(f"exit layer {t.exit_layer} is outside [1, {t.num_layers - 1}]")
        if not 1 <= t.top_k <= t.vocab_size:
            raise ManifestError(f"top_k {t.top_k} is outside [1, {t.vocab_size}]")
        if t.exit_vocab_size and not t.top_k <= t.exit_vocab_size <= t.vocab_size:
            raise ManifestError(f"the exit head's vocabulary ({t.exit_vocab_size}) must lie in [top_k, {t.vocab_size}]")

        prefix, suffix, exit_head, draft = (self.partition(r) for r in ROLES)
        # The target partitions must tile [0, N) with no gap or overlap, split at the exit layer.
        if prefix.layers[0] != 0 or prefix.layers[1] != suffix.layers[0] or suffix.layers[1] != t.num_layers:
            raise ManifestError(
                f"target partitions {list(prefix.layers)} + {list(suffix.layers)} do not tile [0, {t.num_layers})"
            )
        if prefix.layers[1] != t.exit_layer:
            raise ManifestError(f"prefix ends at layer {prefix.layers[1]} but the exit layer is {t.exit_layer}")
        if prefix.kv != "shared-buffer" or suffix.kv != "shared-buffer" or draft.kv != "split-past":
            raise ManifestError("the target partitions must keep their KV in shared buffers and the draft a split past "
                                f"(found {prefix.kv!r}, {suffix.kv!r}, {draft.kv!r})")
        if draft.layers != (0, dr.num_layers):
            raise ManifestError(f"draft partition layers {list(draft.layers)} != [0, {dr.num_layers})")
        if draft.tokens_per_forward != dr.tokens_per_forward or dr.tokens_per_forward != 1 + dr.streams:
            raise ManifestError("draft tokens_per_forward is inconsistent (it must be 1 + streams)")
        if dr.dtype not in TARGET_DTYPES:  # its KV buffers and activations are made in it
            raise ManifestError(f"draft dtype {dr.dtype!r} is not one of {TARGET_DTYPES}")
        if dr.weight_format not in DRAFT_WEIGHT_FORMATS:
            raise ManifestError(f"draft weight_format {dr.weight_format!r} is not one of {DRAFT_WEIGHT_FORMATS}")
        if dr.streams and draft.output(STREAM_IDS).shape[-1] != dr.streams:
            raise ManifestError(f"draft {STREAM_IDS} last axis is not its {dr.streams} streams")
        if bool(dr.output_vocab_size) != bool(dr.output_vocab_file):
            raise ManifestError("a reduced draft vocabulary needs both output_vocab_size and output_vocab_file")
        if not isinstance(dr.attention_window, int) or isinstance(dr.attention_window, bool) \
                or dr.attention_window < 0:
            raise ManifestError(f"draft attention_window must be a whole number >= 0 (0: the whole context), "
                                f"not {dr.attention_window!r}")

        if t.dtype not in TARGET_DTYPES:
            raise ManifestError(f"target dtype {t.dtype!r} is not one of {TARGET_DTYPES}")
        if t.weight_format not in TARGET_WEIGHT_FORMATS:
            raise ManifestError(f"target weight_format {t.weight_format!r} is not one of {TARGET_WEIGHT_FORMATS}")
        if t.matmul_activations not in MATMUL_ACTIVATIONS or (t.matmul_activations == "int8"
                                                               and t.weight_format not in WEIGHT_BITS):
            raise ManifestError(f"target matmul_activations {t.matmul_activations!r} must be one of "
                                f"{MATMUL_ACTIVATIONS}, and int8 only for compressed weights")
        if out_of_dtype := [f"{p.role} {x.name}" for p in (prefix, suffix) for x in p.inputs + p.outputs
                            if x.name.startswith(("past_key_values.", "present.")) and x.dtype != t.dtype]:
            raise ManifestError(f"the target's KV must be its dtype {t.dtype}: {', '.join(out_of_dtype[:3])}")
        if suffix.output(LOGITS).dtype != "float32" or any(o.name == TAPS and o.dtype != "float32"
                                                           for o in prefix.outputs):
            raise ManifestError("the target's logits and taps reach the host as float32")
        out = prefix.output(BOUNDARY)
        if out.dtype != t.dtype:
            raise ManifestError(f"the boundary tensor is {out.dtype}, the target's dtype {t.dtype}")
        for reader in (suffix, exit_head):
            inp = reader.input(BOUNDARY)
            if (out.dtype, out.shape) != (inp.dtype, inp.shape) or out.shape[-1] != t.hidden_size:
                raise ManifestError(
                    f"boundary tensor mismatch: prefix gives {out.dtype}{list(out.shape)}, "
                    f"{reader.role} takes {inp.dtype}{list(inp.shape)}, hidden size {t.hidden_size}"
                )
        for name in (EXIT_IDS, EXIT_LOGPROBS):
            if exit_head.output(name).shape[-1] != t.top_k:
                raise ManifestError(f"target_exit output {name} has last axis {exit_head.output(name).shape[-1]}, "
                                    f"top_k is {t.top_k}")
        if exit_head.layers != (t.exit_layer, t.exit_layer) or exit_head.kv:
            raise ManifestError("target_exit must read the exit layer's state and keep no KV cache")
        for part, facts in ((prefix, t), (suffix, t), (draft, dr)):
            _check_kv(part, facts)
        if suffix.output(LOGITS).shape[-1] != t.vocab_size:
            raise ManifestError(f"target_suffix logits last axis is not the vocabulary size {t.vocab_size}")
        if draft.output(LOGITS).shape[-1] != (dr.output_vocab_size or t.vocab_size):
            raise ManifestError(f"draft logits last axis is not its output vocabulary size "
                                f"{dr.output_vocab_size or t.vocab_size}")
        if not self.tokenizer.eos_token_ids:
            raise ManifestError("manifest lists no EOS token id")
        _check_feature_channel(self, prefix, draft)

        if bundle_dir is not None:
            bundle = Path(bundle_dir).resolve()
            files = [f for p in self.partitions for f in (p.file, *p.data_files)] + list(self.tokenizer.files)
            files += [dr.output_vocab_file] if dr.output_vocab_file else []
            for rel in files:
                resolve_inside(bundle, rel)


def resolve_inside(bundle: Path, rel: str) -> Path:
    """The path of `rel` inside `bundle`; ManifestError if it is absolute, escapes the bundle, or is missing."""
    if PurePosixPath(rel).is_absolute() or Path(rel).is_absolute() or ".." in PurePosixPath(rel).parts:
        raise ManifestError(f"manifest path {rel!r} leads outside the bundle directory")
    path = (bundle / rel).resolve()
    if bundle.resolve() not in path.parents:
        raise ManifestError(f"manifest path {rel!r} leads outside the bundle directory")
    if not path.is_file():
        raise ManifestError(f"bundle file {rel!r} named in the manifest is missing")
    return path


def _check_feature_channel(m: Manifest, prefix: PartitionSpec, draft: PartitionSpec) -> None:
    """A feature draft's taps lie in [1, exit layer], the prefix gives them and the draft graph reads them; a token
    draft has none of the channel's tensors."""
    taps, t = m.draft.feature_taps, m.target
    prefix_out = {o.name for o in prefix.outputs}
    draft_io = {x.name for x in draft.inputs + draft.outputs}
    channel = {FEATURES, SURROGATE, USE_SURROGATE, DRAFT_HIDDEN}
    if not taps:
        if TAPS in prefix_out or channel & draft_io:
            raise ManifestError("the graphs carry the feature channel but the draft lists no feature_taps")
        return
    if list(taps) != sorted(set(taps)) or not all(1 <= i <= t.exit_layer for i in taps):
        raise ManifestError(f"draft feature_taps {list(taps)} must be distinct, ascending and in [1, exit layer "
                            f"{t.exit_layer}]")
    if m.draft.hidden_size != t.hidden_size:
        raise ManifestError(f"a feature draft works at the target's width {t.hidden_size}, not {m.draft.hidden_size}")
    wanted = [(prefix, "output", TAPS, (len(taps), t.hidden_size)),
              (draft, "input", FEATURES, (len(taps), t.hidden_size)),
              (draft, "input", SURROGATE, (t.hidden_size,)), (draft, "input", USE_SURROGATE, ()),
              (draft, "output", DRAFT_HIDDEN, (t.hidden_size,))]
    for part, kind, name, tail in wanted:
        spec = part.output(name) if kind == "output" else part.input(name)
        if len(spec.shape) != len(tail) + 2 or tuple(spec.shape[2:]) != tail:
            raise ManifestError(f"{part.role} {kind} {name} has shape {list(spec.shape)}, expected "
                                f"[batch, sequence{''.join(f', {d}' for d in tail)}]")


def _check_kv(part: PartitionSpec, facts: ModelFacts) -> None:
    """Every layer of the partition has its past inputs and a present output, named with its global number: a
    shared-buffer graph past_key_values.{i}.*, a split-past graph shared_key_values.{i}.* as well."""
    wanted = KV_INTERFACES.get(part.kv)
    if wanted is None:
        raise ManifestError(f"{part.role} must keep a KV cache (kv: shared-buffer or split-past), not {part.kv!r}")
    want_in = {n(i) for i in part.kv_layers for n in wanted}
    want_out = {n(i) for i in part.kv_layers for n in (present_key_name, present_value_name)}
    have_in = {t.name for t in part.inputs if t.name.startswith(("past_key_values.", "shared_key_values."))}
    have_out = {t.name for t in part.outputs if t.name.startswith("present.")}
    if have_in != want_in or have_out != want_out:
        raise ManifestError(
            f"{part.role} KV tensors do not match its layers {list(part.layers)}: "
            f"missing {sorted((want_in - have_in) | (want_out - have_out))[:4]}, "
            f"unexpected {sorted((have_in - want_in) | (have_out - want_out))[:4]}"
        )
    for t in part.inputs + part.outputs:
        if (t.name.startswith(("past_key_values.", "shared_key_values.", "present."))
                and (t.shape[1], t.shape[3]) != (facts.num_kv_heads, facts.head_dim)):
            raise ManifestError(f"{part.role} {t.name} shape {list(t.shape)} does not match the KV layout")


def _check_types(facts, where: str) -> None:
    """ManifestError for a field whose value is not of its declared type (a hand-edited or damaged manifest), before
    anything computes with it."""
    hints = typing.get_type_hints(type(facts))
    for f in fields(facts):
        value = getattr(facts, f.name)
        if not _of_type(value, hints[f.name]):
            hint = hints[f.name]
            raise ManifestError(f"manifest: malformed: {where}.{f.name} is {value!r}, not "
                                f"{hint.__name__ if isinstance(hint, type) else hint}")


def _of_type(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_of_type(value, h) for h in typing.get_args(hint))
    if origin is tuple:
        return isinstance(value, tuple) and all(_of_type(v, typing.get_args(hint)[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint in (int, float):  # JSON has no bool among numbers here
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    return hint is Any or isinstance(value, hint)
