"""External baselines for the side-by-side benchmark, behind the harness's Method interface (bench/methods.py).

- "hf-generate":  transformers generate, the fp32 target alone              (bench/hf_baselines.py)
- "hf-assisted":  transformers assisted generation, assistant = plain draft (bench/hf_baselines.py)
- "ov-genai-ar":  OpenVINO GenAI LLMPipeline, the target alone              (bench/ov_genai.py)
- "ov-genai-sd":  OpenVINO GenAI speculative decoding, target + plain draft (bench/ov_genai.py)
- "ov-genai-pld": OpenVINO GenAI prompt-lookup decoding, the target alone   (bench/ov_genai.py)

What is compared: the same fp32 target and the same trained draft network as the bundle. The streaming draft
goes in its plain form (bench/plain_draft.py: full 49152-token vocabulary, one token per forward, stream heads
dropped), because neither library takes a reduced-vocabulary or multi-token draft.

The bundle holds ONNX graphs only, so the baselines start from the bundle's *sources* (bench/variants.Sources;
by default the real pair's: models/smollm2.py). Sources that do not match the bundle are refused. Everything
converted is cached under `cache` (build/bench-cache/ by default), each piece finished only when its marker file
is written and rebuilt when its source's fingerprint (file sizes and modification times) changes.
"""

from __future__ import annotations

import json
from pathlib import Path

from mirror_sd.bench.methods import Method
from mirror_sd.bench.variants import Sources
from mirror_sd.errors import BadInputError, MirrorSDError
from mirror_sd.export.openvino_genai import fingerprint
from mirror_sd.partitions.manifest import DRAFT_VOCAB_FILE, Manifest

NAMES = ("hf-generate", "hf-assisted", "ov-genai-sd", "ov-genai-ar", "ov-genai-pld")
CACHE = Path("build") / "bench-cache"
DEFAULT_GAMMA = 4  # the harness's default window; every speculative baseline proposes exactly this many


class BaselineError(MirrorSDError):
    """A baseline cannot be prepared or opened (missing sources, failed conversion, a library refusing)."""


def check_sources(bundle: Path, manifest: Manifest, sources: Sources) -> None:
    """Raise BaselineError unless `sources` are the bundle's target and draft."""
    why = sources.unusable_for(manifest)
    if why:
        raise BaselineError(f"baselines need the bundle's source models: {why}")
    from mirror_sd.models import feature_draft, streaming_draft

    for module in (streaming_draft, feature_draft):
        config = sources.draft / module.CONFIG_NAME
        if config.is_file():
            bundled = bundle / DRAFT_VOCAB_FILE
            if not bundled.is_file() or json.loads(bundled.read_text()) != json.loads(config.read_text())["vocab_ids"]:
                raise BaselineError(f"the draft {sources.draft} is not the bundle's draft (its vocabulary differs from "
                                    f"{bundled.name})")
            break
    else:
        if not (sources.draft / "config.json").is_file():
            raise BaselineError(f"the draft {sources.draft} is neither a streaming or feature draft nor an HF model "
                                "directory")
    loaded = _baseline_draft(sources)
    if feature_draft.FeatureDraft.is_feature_draft(loaded) or not (
            streaming_draft.StreamingDraft.is_streaming_draft(loaded) or (loaded / "config.json").is_file()):
        raise BaselineError(f"the baselines' draft {loaded} must be a streaming draft or an HF model directory")


def _baseline_draft(sources: Sources) -> Path:
    return sources.baseline_draft or sources.draft


def plain_draft_dir(sources: Sources, cache: Path) -> Path:
    """The draft as an HF directory over the full vocabulary: converted (cached) from a streaming draft, or the
    draft itself when it already is a plain HF model."""
    from mirror_sd.bench import plain_draft
    from mirror_sd.models.streaming_draft import StreamingDraft

    draft = _baseline_draft(sources)
    if not StreamingDraft.is_streaming_draft(draft):
        return draft
    out = cache / f"plain-draft-{fingerprint(draft)}"
    return plain_draft.convert(draft, sources.target, out)


def genai_dir(model_dir: Path, cache: Path, what: str, weights: str = "float32") -> Path:
    """model_dir converted for OpenVINO GenAI (cached); weights "int8": its MatMul weights compressed to int8, as
    the bundle's own draft is (the speculative baseline drafts with the same weights as ours)."""
    from mirror_sd.export import openvino_genai as ov_convert

    key = fingerprint(model_dir) + ("" if weights == "float32" else f"-{weights}")
    return ov_convert.convert(model_dir, cache / f"ov-genai-{what}-{key}", fingerprint=key, weights=weights)


def open_baselines(bundle: Path, *, names: list[str] | None = None, threads: int = 1, gamma: int = DEFAULT_GAMMA,
                   sources: Sources | None = None, cache: Path = CACHE, genai_defaults: bool = False,
                   genai_weights: str = "float32") -> list[Method]:
    """Open the named baselines (all of NAMES by default) for `bundle`, converting what they need on first use.
    genai_defaults: GenAI at its own defaults (bench/ov_genai.py), not pinned to f32; genai_weights: GenAI's target
    with its MatMul weights compressed by NNCF (int8, int4).

    Raises BadInputError for an unknown name or a bad option, BaselineError when a baseline cannot be prepared or
    opened (the ones opened before it are closed again)."""
    names = list(NAMES if names is None else names)
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise BadInputError(f"unknown baseline(s) {', '.join(unknown)}; known: {', '.join(NAMES)}")
    if threads < 1 or gamma < 1:
        raise BadInputError(f"threads and gamma must be >= 1 (got threads={threads}, gamma={gamma})")
    bundle = Path(bundle)
    manifest = Manifest.load(bundle)
    sources = sources or Sources.real_pair(bundle)
    check_sources(bundle, manifest, sources)
    eos, pad = list(manifest.tokenizer.eos_token_ids), manifest.tokenizer.pad_token_id
    pad = eos[0] if pad is None else pad
    cache = Path(cache)
    opened: list[Method] = []
    try:
        for name in names:
            opened.append(_open(name, sources, cache, threads=threads, gamma=gamma, eos=eos, pad=pad,
                                draft_weights=manifest.draft.weight_format, genai_defaults=genai_defaults,
                                genai_weights=genai_weights))
    except MirrorSDError:
        _close_all(opened)
        raise
    except (OSError, RuntimeError, ValueError) as e:  # library refusals (transformers, OpenVINO) become typed
        _close_all(opened)
        raise BaselineError(f"baseline {name} cannot be opened: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    return opened


def _open(name: str, sources: Sources, cache: Path, *, threads: int, gamma: int, eos: list[int], pad: int,
          draft_weights: str = "float32", genai_defaults: bool = False, genai_weights: str = "float32") -> Method:
    if name.startswith("hf-"):
        from mirror_sd.bench.hf_baselines import HFMethod

        assistant = plain_draft_dir(sources, cache) if name == "hf-assisted" else None
        return HFMethod(name, sources.target, threads=threads, eos_token_ids=eos, pad_token_id=pad,
                        assistant_dir=assistant, gamma=gamma)
    from mirror_sd.bench.ov_genai import GenAIMethod

    target = genai_dir(sources.target, cache, "target", genai_weights)
    draft = (genai_dir(plain_draft_dir(sources, cache), cache, "draft", draft_weights) if name == "ov-genai-sd"
             else None)
    return GenAIMethod(name, target, threads=threads, eos_token_ids=eos, draft_dir=draft, gamma=gamma,
                       prompt_lookup=name == "ov-genai-pld", defaults=genai_defaults)


def _close_all(methods: list[Method]) -> None:
    for m in methods:
        m.close()
