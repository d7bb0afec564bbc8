"""`make package`: a bundle -> a package for static-shape devices (NPU), as a directory or a .tar.

The draft becomes static OpenVINO IR (package/static_graph.py) in three fixed shapes (docs/design.md: Static shapes
for NPU packages), its weights optionally compressed by NNCF (package/compress.py); the target graphs, tokenizer
and draft vocabulary are the bundle's own files. Everything is checked before anything is written; the package is
built in a staging directory beside OUT and moved into place (or archived to a temporary .tar renamed onto OUT)
only when it validates, so a failure leaves nothing half-written. A non-empty OUT is refused unless `force`. No
torch here.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from mirror_sd.errors import BadInputError, PackageError
from mirror_sd.outputs import check_apart, check_out, staged
from mirror_sd.package.compress import DEFAULT_GROUP_SIZE, compress_weights
from mirror_sd.package.static_graph import make_static
from mirror_sd.partitions.manifest import (
    FEATURES,
    GENERATION_CONFIG,
    PARITY_ATOL,
    PARITY_RTOL,
    SURROGATE,
    USE_SURROGATE,
    Manifest,
    resolve_inside,
)
from mirror_sd.partitions.package_format import (
    BRANCH,
    DECODE,
    DEVICES,
    PACKAGE_FILE,
    PREFILL,
    DraftGraph,
    PackageInfo,
    StaticBounds,
    graph_sha256,
    is_package,
    normalize_weights,
    sha256_of,
)
from mirror_sd.partitions.plan_file import PLAN_FILE
from mirror_sd.partitions.spec import KEEP, PartitionSpec, TensorSpec
from mirror_sd.version import __version__

DRAFT_DIR = "draft"
# Defaults in the spirit of OpenVINO GenAI's NPU pipeline (MAX_PROMPT_LEN 1024), capped by the models' own limit.
DEFAULT_MAX_PROMPT, DEFAULT_MAX_CONTEXT = 1024, 2048
DEFAULT_BATCH = 8  # one row of kappa = 8 early-exit candidates per branch forward
DEFAULT_MAX_GAMMA = 8  # the planner's windows go up to 6; the default window is 4
DEFAULT_PREFILL_CHUNK = 32


@dataclass(frozen=True)
class PackageOptions:
    bundle: Path
    out: Path  # a directory, or a file ending in .tar
    device: str = "NPU"  # intended draft device (the runtime still falls back to CPU where it is absent)
    # fp32, fp16, int8 (= int8_sym), int8_asym, int4 (= int4_sym); None: the bundle's own (package_weights)
    weights: str | None = None
    group_size: int = DEFAULT_GROUP_SIZE  # int4 only
    max_prompt: int | None = None  # None: min(1024, max_context)
    max_context: int | None = None  # None: min(2048, the models' position limit, the draft's sliding window)
    max_gamma: int = DEFAULT_MAX_GAMMA
    batch: int = DEFAULT_BATCH
    tokens_per_forward: int | None = None  # None: the inputs the draft feeds per forward (1 + a token draft's streams)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    force: bool = False


def package_weights(manifest: Manifest, asked: str | None) -> str:
    """The package's draft weights: `asked` (normalised), or by default fp16 for a bundle whose draft has fp32
    weights and int8_sym for one whose draft has int8 weights already (the export's default). NNCF compresses fp32
    weights only, so an int8 draft cannot become fp16, fp32, int8_asym or int4: that is refused, not ignored."""
    bundled = manifest.draft.weight_format
    weights = normalize_weights(asked) if asked is not None else ("int8_sym" if bundled == "int8" else "fp16")
    if bundled == "int8" and weights != "int8_sym":
        raise PackageError(f"the bundle's draft has int8 weights already: its package keeps them (weights int8), "
                           f"not {weights}; export the bundle with --draft-weights float32 (DRAFT_WEIGHTS=float32) "
                           "to package other weights")
    return weights


def build_package(opts: PackageOptions, report: Callable[[str], None] = print) -> PackageInfo:
    """Write a validated package to `opts.out`; returns its description."""
    bundle = Path(opts.bundle).expanduser()
    if is_package(bundle):
        raise BadInputError(f"{str(bundle)!r} is a package already: package its bundle")
    manifest = Manifest.load(bundle)  # ManifestError: not a bundle
    weights = package_weights(manifest, opts.weights)
    device = opts.device.upper()
    if device not in DEVICES:
        raise BadInputError(f"unknown device {opts.device!r}; a package targets one of {', '.join(DEVICES)}",
                            option="device")
    if weights == "int4_sym" and opts.group_size < 1 and opts.group_size != -1:
        raise BadInputError(f"group size must be >= 1 (or -1: per channel), got {opts.group_size}",
                            option="group_size")
    bounds = _bounds(opts, manifest)
    out = Path(opts.out).expanduser()
    _check_out(out, opts.force, bundle)

    with staged(out, _archive if out.suffix == ".tar" else None) as staging:
        info = _write_package(staging, bundle, manifest, bounds, weights, opts.group_size, device, report)
    report(f"package written to {out} ({weights} draft, {_describe(bounds)})")
    return info


def _bounds(opts: PackageOptions, manifest: Manifest) -> StaticBounds:
    limit = min(manifest.target.max_position_embeddings, manifest.draft.max_position_embeddings)
    # a draft's sliding window: the static graphs place its slots otherwise than the bundle's draft past it
    window = (manifest.partition("draft").extra or {}).get("sliding_window")
    default = min(DEFAULT_MAX_CONTEXT, limit, window or limit)
    max_context = opts.max_context if opts.max_context is not None else default
    if window and max_context > window:
        raise BadInputError(f"MAX_CONTEXT {max_context} exceeds the draft's sliding window of {window} tokens: a "
                            "package's static draft graphs hold its window only within it (MAX_CONTEXT <= "
                            f"{window})")
    max_prompt = opts.max_prompt if opts.max_prompt is not None else min(DEFAULT_MAX_PROMPT, max_context)
    own = manifest.draft.inputs_per_forward
    tpf = opts.tokens_per_forward if opts.tokens_per_forward is not None else own
    bounds = StaticBounds(max_prompt=max_prompt, max_context=max_context, max_gamma=opts.max_gamma, batch=opts.batch,
                          tokens_per_forward=tpf, prefill_chunk=opts.prefill_chunk)
    try:
        bounds.check()
    except PackageError as e:
        raise BadInputError(str(e)) from None
    if max_context > limit:
        raise BadInputError(f"MAX_CONTEXT {max_context} exceeds the models' position limit {limit}")
    if tpf < own:
        raise BadInputError(f"tokens per forward {tpf} is below the draft's own {own} "
                            f"(1 + its streams): every forward feeds a token and its stream proposals")
    if opts.prefill_chunk < tpf:
        raise BadInputError(f"prefill chunk {opts.prefill_chunk} is below the tokens per forward {tpf}")
    return bounds


def _is_package_archive(path: Path) -> bool:
    """Whether `path` is a tar archive holding a package.json (what `_archive` writes)."""
    try:
        with tarfile.open(path) as tar:
            return any(Path(name).name == PACKAGE_FILE for name in tar.getnames())
    except (tarfile.TarError, OSError):
        return False


def _check_out(out: Path, force: bool, bundle: Path) -> None:
    if out.suffix == ".tar":
        if out.exists() and not out.is_file():
            raise BadInputError(f"OUT {str(out)!r} exists and is not a file")
        if out.exists() and not force:
            raise BadInputError(f"OUT {str(out)!r} exists (use --force to replace it)")
        if out.exists() and not _is_package_archive(out):
            raise BadInputError(f"OUT {str(out)!r} is not a package archive: --force replaces an earlier package only")
        check_apart(out, "package", [bundle])
        return
    if out.exists() and not out.is_dir():
        raise BadInputError(f"OUT {str(out)!r} exists and is not a directory (a .tar name makes an archive)")
    check_out(out, force, PACKAGE_FILE, "package", [bundle])


def _write_package(root: Path, bundle: Path, manifest: Manifest, bounds: StaticBounds, weights: str,
                   group_size: int, device: str, report: Callable[[str], None]) -> PackageInfo:
    # 1. the target graphs, tokenizer and draft vocabulary, as the bundle has them
    draft_spec = manifest.partition("draft")
    copied = [f for p in manifest.partitions if p is not draft_spec for f in (p.file, *p.data_files)]
    copied += list(manifest.tokenizer.files)
    copied += [manifest.draft.output_vocab_file] if manifest.draft.output_vocab_file else []
    copied += [f for f in (PLAN_FILE, GENERATION_CONFIG) if (bundle / f).is_file()]
    for rel in copied:
        _link_or_copy(resolve_inside(bundle.resolve(), rel), root / rel)

    # 2. the draft: compressed once, then cut to each static shape
    import openvino as ov

    report(f"draft: {weights} weights, static graphs for {_describe(bounds)}")
    model = compress_weights(ov.Core().read_model(str(resolve_inside(bundle.resolve(), draft_spec.file))),
                             weights, group_size)
    shapes = {DECODE: (1, bounds.tokens_per_forward), BRANCH: (bounds.batch, bounds.tokens_per_forward),
              PREFILL: (1, bounds.prefill_chunk)}
    (root / DRAFT_DIR).mkdir()
    graphs: dict[str, DraftGraph] = {}
    bins: dict[str, str] = {}  # sha256 -> the first .bin with that content: identical weights are stored once
    for name, (batch, tokens) in shapes.items():
        xml = f"{DRAFT_DIR}/{name}.xml"
        static = make_static(model.clone(), batch, tokens, bounds.kv_length, bounds.own_slots)
        ov.save_model(static, str(root / xml), compress_to_fp16=weights != "fp32")
        bin_rel = f"{DRAFT_DIR}/{name}.bin"
        digest = sha256_of(root / bin_rel)
        if digest in bins:
            (root / bin_rel).unlink()
            bin_rel = bins[digest]
        bins.setdefault(digest, bin_rel)
        graphs[name] = DraftGraph(xml=xml, bin=bin_rel, batch=batch, tokens=tokens)
    _check_static_draft(root, bundle, draft_spec.file, graphs[PREFILL], bounds, weights, report)

    # 3. the manifest: the bundle's, its draft partition now the static decode graph
    manifest = replace(manifest, partitions=tuple(
        _static_spec(p, graphs[DECODE], bounds, device) if p is draft_spec else p for p in manifest.partitions))
    manifest.validate(root)
    manifest.save(root)

    # 4. package.json: bounds, devices, weights and the sha256 of every file
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        files[path.relative_to(root).as_posix()] = sha256_of(path)
    devices = (device,) if device == "CPU" else (device, "CPU")
    info = PackageInfo(bounds=bounds, weights=weights, group_size=group_size if weights == "int4_sym" else 0,
                       devices=devices, draft_graphs=graphs, files=files, producer=f"mirror-sd {__version__}",
                       source_bundle=manifest.producer,
                       source_draft_sha256=graph_sha256(bundle, (draft_spec.file, *draft_spec.data_files)))
    info.validate()
    info.save(root)
    PackageInfo.load(root)  # what a reader will see: every checksum again
    return info


def _static_spec(spec: PartitionSpec, graph: DraftGraph, bounds: StaticBounds, device: str) -> PartitionSpec:
    """The draft partition as the static decode graph has it: every axis fixed."""
    b, t, own = graph.batch, graph.tokens, bounds.own_slots
    fixed = {"batch": b, "sequence": t, "shared_sequence": bounds.kv_length, "past_sequence": own,
             "total_sequence": own + t}

    fixed["kept"] = t  # a static graph runs its heads on every new token

    def static(ts: TensorSpec) -> TensorSpec:
        return TensorSpec(ts.name, ts.dtype, tuple(fixed[d] if isinstance(d, str) else d for d in ts.shape))

    return replace(spec, file=graph.xml, data_files=(graph.bin,), backend="openvino", device=device,
                   inputs=tuple(static(i) for i in spec.inputs if i.name != KEEP),
                   outputs=tuple(static(o) for o in spec.outputs), extra={**spec.extra, "static": True})


def _check_static_draft(root: Path, bundle: Path, draft_file: str, graph: DraftGraph, bounds: StaticBounds,
                        weights: str, report: Callable[[str], None]) -> None:
    """Run the static prefill graph and the bundle's dynamic draft on the same tokens (OpenVINO CPU), after an empty
    context and after a context lane filled near its end (where the static graph's padded slots sit between the
    lane and the new tokens: a sliding window that measures by slot index sees another context there): with fp32
    weights the logits must agree within the export's tolerance; compressed weights are reported, not judged."""
    import openvino as ov

    core = ov.Core()
    config = {"INFERENCE_PRECISION_HINT": "f32"}
    static = core.compile_model(core.read_model(str(root / graph.xml), str(root / graph.bin)), "CPU", config)
    dynamic = core.compile_model(str(bundle / draft_file), "CPU", config)
    n = graph.tokens
    ids = (np.arange(n, dtype=np.int64) * 7 + 3)[None] % 200  # small ids: inside any vocabulary here
    feed_d = {"input_ids": ids, "position_ids": np.arange(n, dtype=np.int64)[None],
              "shared_mask": np.zeros((1, 0), np.int64), "attention_mask": np.ones((1, n), np.int64)}
    feed_s = dict(feed_d, shared_mask=np.zeros((1, bounds.kv_length), np.int64),
                  attention_mask=np.concatenate([np.zeros((1, bounds.own_slots), np.int64),
                                                 np.ones((1, n), np.int64)], 1))
    for port in dynamic.inputs:
        name = port.get_any_name()
        if name.startswith(("past_key_values.", "shared_key_values.")):
            shape = port.get_partial_shape()
            heads, head_dim = shape[1].get_length(), shape[3].get_length()
            slots = bounds.kv_length if name.startswith("shared_") else bounds.own_slots
            feed_d[name] = np.zeros((1, heads, 0, head_dim), np.float32)
            feed_s[name] = np.zeros((1, heads, slots, head_dim), np.float32)
    taps = manifest_taps(bundle)
    if taps:  # a feature draft: random features, the last token on a surrogate
        width = next(p.get_partial_shape()[2].get_length() for p in dynamic.inputs if p.get_any_name() == SURROGATE)
        rng = np.random.default_rng(0)
        channel = {FEATURES: rng.standard_normal((1, n, taps, width)).astype(np.float32),
                   SURROGATE: rng.standard_normal((1, n, width)).astype(np.float32),
                   USE_SURROGATE: (np.arange(n) == n - 1).astype(np.int64)[None]}
        feed_d.update(channel)
        feed_s.update(channel)
    feed_d[KEEP] = np.array([n], np.int64)  # the dynamic graph's heads on every token, as the static graph's
    first = dynamic(feed_d)
    runs = [(np.array(first[dynamic.output("logits")]), np.array(static(feed_s)[static.output("logits")]))]
    # the lane filled with the context a prompt of kv_length - n tokens leaves, then the same n tokens after it
    m = bounds.kv_length - n
    if m > 0 and not taps:
        lane = dict(feed_d, input_ids=(np.arange(m, dtype=np.int64)[None] * 5 + 1) % 200,
                    position_ids=np.arange(m, dtype=np.int64)[None], attention_mask=np.ones((1, m), np.int64),
                    **{KEEP: np.array([1], np.int64)})
        out = dynamic(lane)
        after_d = dict(feed_d, position_ids=np.arange(m, m + n, dtype=np.int64)[None],
                       shared_mask=np.ones((1, m), np.int64))
        after_s = dict(feed_s, position_ids=after_d["position_ids"],
                       shared_mask=np.concatenate([np.ones((1, m), np.int64), np.zeros((1, n), np.int64)], 1))
        for port in dynamic.inputs:
            name = port.get_any_name()
            if name.startswith("shared_key_values."):  # shared_key_values.{i}.key <- present.{i}.key
                kv = np.array(out[dynamic.output(name.replace("shared_key_values.", "present."))])
                after_d[name] = kv
                after_s[name] = np.concatenate([kv, np.zeros(kv.shape[:2] + (n,) + kv.shape[3:], kv.dtype)], 2)
        runs.append((np.array(dynamic(after_d)[dynamic.output("logits")]),
                     np.array(static(after_s)[static.output("logits")])))
    for (want, got), where in zip(runs, ("an empty context", f"{m} tokens of context")):
        diff = float(np.abs(got - want).max())
        agree = float((got.argmax(-1) == want.argmax(-1)).mean())
        if not np.isfinite(got).all():
            raise PackageError("the static draft graph gives non-finite logits")
        if weights == "fp32" and diff > PARITY_ATOL + PARITY_RTOL * float(np.abs(want).max()):
            raise PackageError(f"the static draft graph differs from the bundle's draft by {diff:.2e} after {where} "
                               "(fp32 weights; a sliding window shorter than the package's context is not supported)")
        report(f"draft check: static {weights} vs bundle fp32 on {n} tokens after {where}: max |logit diff| "
               f"{diff:.2e}, argmax agreement {agree:.2f}")


def manifest_taps(bundle: Path) -> int:
    """How many taps the bundle's draft reads (0: a token draft)."""
    return len(Manifest.load(bundle).draft.feature_taps)


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link where the filesystem allows (the target graphs are hundreds of MB; a bundle is never written in
    place - export replaces it by rename - so a link cannot change under the package), else a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        try:
            shutil.copy2(src, dst)
        except OSError as e:  # a graph this user may not read
            raise PackageError(f"cannot copy {src.name} into the package: {e.strerror or e}") from None


def _archive(staging: Path, out: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.partial-", dir=out.parent)
    os.close(fd)
    try:
        with tarfile.open(tmp, "w") as tar:
            tar.add(staging / PACKAGE_FILE, arcname=PACKAGE_FILE)
            for path in sorted(p for p in staging.rglob("*") if p.is_file() and p.name != PACKAGE_FILE):
                tar.add(path, arcname=path.relative_to(staging).as_posix())
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _describe(b: StaticBounds) -> str:
    return (f"max prompt {b.max_prompt}, max context {b.max_context}, gamma <= {b.max_gamma}, batch {b.batch}, "
            f"{b.tokens_per_forward} tokens per forward, prefill chunk {b.prefill_chunk}, KV buffer {b.kv_length}")
