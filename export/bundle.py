"""`make export`: a Hugging Face target + draft -> a validated Mirror-SD bundle directory.

Everything is checked before any graph is written; the bundle is built in a temporary directory beside OUT and
moved into place only after the manifest validates and every parity check passed, so a failure never leaves a
half-written bundle (and never touches what was at OUT).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from mirror_sd.errors import BadInputError, ExportError, first_line
from mirror_sd.export import parity
from mirror_sd.export.architectures import IMAGE_TEXT, Architecture, architecture_of
from mirror_sd.export.draft_weights import (
    BLOCK_SIZE,
    DEFAULT_WEIGHT_FORMAT,
    INT8,
    MIN_TOP1_AGREEMENT,
    check_weight_format,
    quantize_draft,
)
from mirror_sd.export.drafts import UNREADABLE, Draft, load_draft
from mirror_sd.export.onnx_export import draft_spec, exit_spec, export_segment
from mirror_sd.export.segments import ExitTopK, LogitLens
from mirror_sd.export.target_graphs import check_attention, check_rotary, graph_facts, write_target_graph
from mirror_sd.export.target_precision import MIN_TARGET_AGREEMENT, check_target_dtype, retype_target
from mirror_sd.export.target_weights import BLOCK_SIZE as TARGET_BLOCK_SIZE
from mirror_sd.export.target_weights import (
    FLOAT32,
    MIN_KERNEL_AGREEMENT,
    check_target_weights,
    compress_target,
    on_block_grid,
)
from mirror_sd.models.exit_adapter import CONFIG_NAME, ExitAdapter
from mirror_sd.outputs import check_out, staged
from mirror_sd.partitions.manifest import MANIFEST_NAME, Manifest, TargetFacts, TokenizerFacts
from mirror_sd.version import __version__

DEFAULT_TOP_K = 8
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class ExportOptions:
    model: str  # HF id or local directory of the target
    draft: str  # HF id or local directory of the draft (same vocabulary)
    out: Path
    exit_layer: int | None = None  # l_e; default N // 2 (the paper's default)
    top_k: int = DEFAULT_TOP_K  # k early-exit candidates per position
    force: bool = False  # replace a non-empty OUT
    validate: bool = True  # parity checks in both runtimes (always on from the CLI)
    exit_adapter: str | None = None  # a trained exit adapter directory (models/exit_adapter.py); None: logit lens
    # the early-exit head's vocabulary: "draft" - the draft's own output vocabulary where it has one (the head then
    # streams those rows of the LM head only), else the whole; "full" - always the whole
    exit_vocab: str = "draft"
    # the draft graph's MatMul weights: "int8" (8-bit blocks, export/draft_weights.py) or "float32"
    draft_weights: str = DEFAULT_WEIGHT_FORMAT
    # what the target graphs compute in: "float32", or "float16" for the CUDA execution provider
    # (export/target_precision.py)
    target_dtype: str = "float32"
    # the target prefix's and suffix's MatMul weights: "float32", or "int8" / "int4" blocks
    # (export/target_weights.py)
    target_weights: str = FLOAT32


@dataclass
class LoadedModel:
    source: str
    model: torch.nn.Module
    arch: Architecture


def load_causal_lm(source: str, what: str, check: Callable[[Architecture], None] | None = None) -> LoadedModel:
    """Load `source` as an fp32 causal LM of a supported architecture, with clear errors for everything else.
    check: raises for an architecture the caller cannot use, before the weights load."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    local = Path(source).expanduser()
    if not local.exists() and not _HUB_ID.match(source):
        raise BadInputError(f"{what} path {source!r} does not exist")
    location = str(local) if local.exists() else source
    try:
        config = AutoConfig.from_pretrained(location)
    except Exception as e:  # a missing or unreadable file, or a field of the wrong type (huggingface_hub's own error)
        hint = "" if local.exists() else " (not a local directory, and not loadable as a hub id)"
        raise BadInputError(f"{what} {source!r} is not a Hugging Face model{hint}: {first_line(e)}") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise BadInputError(f"{what} {source!r} is a {config.model_type!r} model, not a causal language model")
    arch = architecture_of(config)  # raises UnsupportedArchitectureError naming the supported ones
    if check is not None:
        check(arch)
    try:
        # eager attention: the exported mask is the explicit additive one, and parity is checked against this model
        model = AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32, attn_implementation="eager")
    except UNREADABLE as e:
        raise BadInputError(f"cannot load {what} {source!r}: {first_line(e)}") from None
    if config.model_type in IMAGE_TEXT:
        model = language_model_alone(model)
    return LoadedModel(source, model.eval(), arch)


def language_model_alone(model) -> torch.nn.Module:
    """An image-text model's language model (`model.model.language_model` and `model.lm_head`, transformers' layout
    for them) as the causal LM of its text config: what every later step reads, the vision tower left behind."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # no weights of its own: the image-text model's modules are moved in
        text = AutoModelForCausalLM.from_config(model.config.text_config, dtype=torch.float32,
                                                attn_implementation="eager")
    text.model, text.lm_head = model.model.language_model, model.lm_head
    text.generation_config = model.generation_config
    return text



def check_options(opts: ExportOptions, target: LoadedModel, draft: Draft) -> tuple[int, int]:
    """Validate the options against the models; returns (exit_layer, top_k)."""
    n = target.arch.num_layers
    exit_layer = n // 2 if opts.exit_layer is None else opts.exit_layer
    if opts.exit_adapter is not None:
        adapter_layer = _adapter_config(opts.exit_adapter)["exit_layer"]
        if opts.exit_layer is not None and opts.exit_layer != adapter_layer:
            raise BadInputError(f"the exit adapter was trained for layer {adapter_layer}, "
                                f"not EXIT_LAYER {opts.exit_layer}")
        exit_layer = adapter_layer
    if not 1 <= exit_layer <= n - 1:
        raise BadInputError(f"EXIT_LAYER {exit_layer} is outside [1, {n - 1}] for a {n}-layer target")
    vocab = target.arch.facts()["vocab_size"]
    if not 1 <= opts.top_k <= vocab:
        raise BadInputError(f"TOPK {opts.top_k} is outside [1, {vocab}] (the vocabulary size)")
    draft_vocab = draft.facts().vocab_size
    if draft_vocab != vocab:
        raise BadInputError(f"the draft's vocabulary ({draft_vocab}) differs from the target's ({vocab})")
    taps = draft.facts().feature_taps
    if taps and max(taps) > exit_layer:
        raise BadInputError(f"the feature draft reads layer {max(taps)}, past the exit layer {exit_layer}: the prefix "
                            "must give it before the suffix runs (export at EXIT_LAYER >= its deepest tap)")
    return exit_layer, opts.top_k


def _adapter_config(path: str) -> dict:

    config = Path(path).expanduser() / CONFIG_NAME
    try:
        doc = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise BadInputError(f"exit adapter {path!r} is not readable ({CONFIG_NAME}): {first_line(e)}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("exit_layer"), int):
        raise BadInputError(f"exit adapter {path!r}: its {CONFIG_NAME} names no exit_layer")
    return doc


def _exit_head(opts: ExportOptions, target: LoadedModel) -> torch.nn.Module:
    backbone = target.arch.backbone(target.model)
    lm_head = target.arch.lm_head(target.model)
    if opts.exit_adapter is None:
        return LogitLens(backbone.norm, lm_head, target.arch.softcaps()[1])

    try:
        return ExitAdapter.load(Path(opts.exit_adapter).expanduser(), backbone.norm, lm_head)
    except UNREADABLE as e:
        raise BadInputError(f"cannot load exit adapter {opts.exit_adapter!r}: {first_line(e)}") from None




def load_tokenizer(source: str, draft_source: str):
    """The target's tokenizer, checked against the draft's (before any graph is written: a model that will be refused
    for it costs no export)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as e:  # missing files, or a tokenizer_config.json of another shape (AttributeError, TypeError)
        raise BadInputError(f"target {source!r} has no usable tokenizer: {first_line(e)}") from None
    _check_draft_tokenizer(tokenizer, draft_source)
    return tokenizer


def eos_ids(model, tokenizer) -> tuple[int, ...]:
    """The tokens that end a generation: the model's generation config's and the tokenizer's EOS, the tokenizer's
    first (a chat template's `eos_token` is it: runtime/text.py)."""
    eos = model.generation_config.eos_token_id if model.generation_config else None
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    vocab = model.config.vocab_size
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab]
    if bad:  # the manifest would hold them, and no bundle would load
        raise BadInputError(f"the target's generation_config.json names eos_token_id {bad[0]!r}, not a token id in "
                            f"[0, {vocab})")
    own = tokenizer.eos_token_id
    return (own,) * (own is not None) + tuple(sorted(ids - {own}))


def _tokenizer_facts(tokenizer, model, bundle: Path) -> TokenizerFacts:
    """Save the tokenizer into the bundle; what the manifest says of it."""
    before = set(os.listdir(bundle))
    tokenizer.save_pretrained(bundle)
    files = tuple(sorted(set(os.listdir(bundle)) - before))
    if "tokenizer.json" not in files:
        raise ExportError("the target's tokenizer could not be saved as tokenizer.json (a fast tokenizer is needed)")
    return TokenizerFacts(files=files, eos_token_ids=eos_ids(model, tokenizer), bos_token_id=tokenizer.bos_token_id,
                          pad_token_id=tokenizer.pad_token_id, chat_template=tokenizer.chat_template)


def _check_draft_tokenizer(target_tokenizer, draft_source: str) -> None:
    """Same vocabulary size is not enough: the same ids must mean the same tokens. A draft without a tokenizer
    of its own is trusted on its vocabulary size."""
    from transformers import AutoTokenizer

    try:
        draft_tokenizer = AutoTokenizer.from_pretrained(draft_source)
    except (OSError, ValueError):
        return
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise BadInputError("the draft's tokenizer vocabulary differs from the target's "
                            "(same ids must be the same tokens)")


def export_bundle(opts: ExportOptions, report: Callable[[str], None] = print) -> Manifest:
    """Write a validated bundle to `opts.out`; returns its manifest."""
    out = Path(opts.out).expanduser()
    inputs = [s for s in (opts.model, opts.draft, opts.exit_adapter) if s]
    check_out(out, opts.force, MANIFEST_NAME, "bundle", inputs)
    check_weight_format(opts.draft_weights)
    check_target_dtype(opts.target_dtype)
    check_target_weights(opts.target_weights)
    if opts.target_weights != FLOAT32 and opts.target_dtype != "float32":
        raise BadInputError(f"target weights {opts.target_weights} go with target dtype float32 only",
                            option="target_weights")
    def usable(arch: Architecture) -> None:
        check_attention(arch.facts(), opts.target_dtype)
        check_rotary(arch)

    target = load_causal_lm(opts.model, "target", usable)
    draft = load_draft(opts.draft, load_causal_lm, target)
    exit_layer, top_k = check_options(opts, target, draft)
    tokenizer = load_tokenizer(target.source, draft.source)
    if not eos_ids(target.model, tokenizer):  # the manifest would refuse it, after the whole export
        raise BadInputError(f"target {target.source!r} names no EOS token (generation_config.json or the tokenizer's "
                            "eos_token): a generation could never end on its own")
    exit_head = _exit_head(opts, target)
    if opts.exit_vocab not in ("draft", "full"):
        raise BadInputError(f"exit vocabulary must be 'draft' or 'full', not {opts.exit_vocab!r}")
    vocab_ids = draft.output_vocab() if opts.exit_vocab == "draft" else None
    if vocab_ids is not None and len(vocab_ids) < top_k:
        raise BadInputError(f"TOPK {top_k} exceeds the exit vocabulary's {len(vocab_ids)} tokens")
    exit_topk = ExitTopK(exit_head, top_k, None if vocab_ids is None else torch.tensor(vocab_ids))
    float32_target = None
    if opts.target_weights != FLOAT32:  # the graphs are exported, and proved, from the weights as compressed
        float32_target = target.model
        target = replace(target, model=on_block_grid(target.model, opts.target_weights, target.arch))

    with staged(out) as staging:
        manifest = _write_bundle(staging, target, draft, tokenizer, exit_topk, exit_layer, top_k, opts.validate, report,
                                 opts.draft_weights, opts.target_dtype, opts.target_weights, float32_target)
    report(f"bundle written to {out}")
    return manifest


def _write_bundle(bundle: Path, target: LoadedModel, draft: Draft, tokenizer, exit_topk: ExitTopK, exit_layer: int,
                  top_k: int, validate: bool, report: Callable[[str], None],
                  draft_weights: str = DEFAULT_WEIGHT_FORMAT, target_dtype: str = "float32",
                  target_weights: str = FLOAT32, float32_target: torch.nn.Module | None = None) -> Manifest:
    t_model = target.model
    kind = exit_topk.exit_head.kind
    exit_vocab = 0 if exit_topk.vocab_ids is None else int(exit_topk.vocab_ids.numel())
    t_facts = TargetFacts(**graph_facts(target.arch.facts()), exit_layer=exit_layer, top_k=top_k, exit_head=kind,
                          exit_vocab_size=exit_vocab)
    # Rotary positions come from a formula, not a table: the draft reads any position the target does, and none past
    # them (a longrope target's context ends early: export/architectures.py). (How well it drafts far past the lengths
    # it was trained on is its acceptance, never the output.)
    d_facts = draft.facts()
    d_facts = replace(d_facts, max_position_embeddings=t_facts.max_position_embeddings)
    n = t_facts.num_layers

    specs = []
    for role, (start, end) in (("target_prefix", (0, exit_layer)), ("target_suffix", (exit_layer, n))):
        report(f"exporting {role}: layers [{start}, {end}) -> {role}.onnx")
        taps = d_facts.feature_taps if role == "target_prefix" else ()
        specs.append(write_target_graph(t_model, target.arch, t_facts, role, start, end, bundle, taps=taps))
    rows = f"over {exit_vocab} tokens" if exit_vocab else "over the whole vocabulary"
    report(f"exporting target_exit: {kind} top-{top_k} {rows} at layer {exit_layer} -> target_exit.onnx")
    specs.append(export_segment(exit_topk, exit_spec(t_facts, "target_exit.onnx", top_k, kind), t_facts, bundle))
    segment = draft.segment()
    report(f"exporting draft: layers [{segment.start}, {segment.end}) -> draft.onnx")
    specs.append(export_segment(segment, draft_spec(segment, d_facts, "draft.onnx"), d_facts, bundle))
    draft.write_files(bundle)

    manifest = Manifest(target=t_facts, draft=d_facts, partitions=tuple(specs),
                        tokenizer=_tokenizer_facts(tokenizer, t_model, bundle),
                        producer=f"mirror-sd {__version__}")
    manifest.validate(bundle)
    feature_draft = draft.model if d_facts.feature_taps else None
    sample = None
    if validate:  # on the fp32 graphs: parity proves the export, before any weight is compressed
        sample = parity.sample_tokens(bundle, manifest)  # the fallback, if any, is reported by check_bundle
        checks = parity.check_bundle(bundle, manifest, t_model, draft.reference, exit_topk, report, feature_draft,
                                     sample)
        manifest = replace(manifest, validation=parity.summary(checks, sample))
        on = "" if sample.source == "text" else " (on fixed vocabulary ids, not the sample text)"
        report(f"parity: all {len(checks)} checks passed in onnxruntime-cpu and openvino-cpu{on}")
    if draft_weights == INT8:
        spec = manifest.partition("draft")
        draft_file = bundle / spec.file
        count = quantize_draft(draft_file, spec.data_files)
        manifest = replace(manifest, draft=replace(manifest.draft, weight_format=INT8))
        report(f"draft weights: {count} MatMuls as 8-bit blocks of {BLOCK_SIZE} ({draft_file.name})")
        if sample is not None:
            agreement = parity.draft_top1_agreement(bundle, manifest, t_model, draft.reference, feature_draft, sample)
            report("draft weights: greedy token agrees with the fp32 reference on "
                   + ", ".join(f"{rate:.0%} of positions in {runtime}" for runtime, rate in agreement.items()))
            _require_agreement("the int8 draft", "its fp32 reference", min(agreement.values()), MIN_TOP1_AGREEMENT)
            manifest = replace(manifest, validation={
                **manifest.validation, "draft_weights": {"format": INT8, "matmuls": count, "block_size": BLOCK_SIZE,
                                                         "top1_agreement": agreement}})
    if target_dtype != t_facts.dtype:
        manifest = retype_target(bundle, manifest, t_model, target.arch, target_dtype)
        report(f"target graphs rewritten in {target_dtype}")
        if sample is not None:
            agreement = parity.target_top1_agreement(bundle, manifest, t_model, sample)
            report(f"{target_dtype} target: greedy token agrees with the float32 reference on "
                   f"{agreement['top1']:.0%} of positions (logits within {agreement['max_abs_logits_diff']:.3g})")
            _require_agreement(f"the {target_dtype} target", "its float32 reference", agreement["top1"],
                               MIN_TARGET_AGREEMENT)
            manifest = replace(manifest, validation={**manifest.validation,
                                                     "target_dtype": {"dtype": target_dtype, **agreement}})
    if target_weights != FLOAT32:
        manifest = _compress_target(bundle, manifest, target_weights, t_model, float32_target, sample, report)
    manifest.validate(bundle)
    manifest.save(bundle)
    return manifest


def _compress_target(bundle: Path, manifest: Manifest, weights: str, model: torch.nn.Module,
                     float32_model: torch.nn.Module, sample, report: Callable[[str], None]) -> Manifest:
    """The target prefix's and suffix's weights stored as `weights` blocks (`model`'s weights, already on their
    grid), and how often the result agrees with the same weights in float32 (the kernel's rounding) and with the
    float32 model (what the compression costs), recorded in the manifest."""
    manifest, count = compress_target(bundle, manifest, weights)
    report(f"target weights: {count} MatMuls as {weights} blocks of {TARGET_BLOCK_SIZE}, each weight as exported")
    if sample is None:
        return manifest
    kernel = parity.target_top1_agreement(bundle, manifest, model, sample)
    versus = parity.target_top1_agreement(bundle, manifest, float32_model, sample)
    report(f"{weights} target: greedy token agrees with its float32 form on {kernel['top1']:.0%} of positions, with "
           f"the float32 model on {versus['top1']:.0%}")
    _require_agreement(f"the {weights} target", "the same weights in float32", kernel["top1"], MIN_KERNEL_AGREEMENT)
    return replace(manifest, validation={**manifest.validation, "target_weights": {
        "format": weights, "matmuls": count, "block_size": TARGET_BLOCK_SIZE,
        "top1_vs_same_weights_float32": kernel["top1"],
        "max_abs_logits_diff_vs_same_weights_float32": kernel["max_abs_logits_diff"],
        "top1_vs_float32_model": versus["top1"],
        "max_abs_logits_diff_vs_float32_model": versus["max_abs_logits_diff"]}})


def _require_agreement(what: str, reference: str, rate: float, floor: float) -> None:
    """ExportError where `what`'s greedy token agrees with `reference`'s on fewer positions than `floor`: below it a
    rewrite or a compression is broken, not merely rounded."""
    if rate < floor:
        raise ExportError(f"{what} agrees with {reference} on only {rate:.0%} of greedy tokens (at least {floor:.0%} "
                          "expected)")
