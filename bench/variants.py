"""Bundles the benchmark compares against the one under test: other exit layers, and the logit lens instead of
the trained exit adapter. Each is exported once from the bundle's source models into the cache and reused.

Only the real pair's sources are known (models/smollm2.py: the fp32 target directory, the streaming draft's
weights, the trained adapters per layer); a bundle whose facts do not match them gets no variants, and the
reason is reported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mirror_sd.errors import MirrorSDError
from mirror_sd.partitions.manifest import Manifest

CACHE = Path("build") / "bench-cache" / "bundles"


@dataclass(frozen=True)
class Sources:
    target: Path  # HF directory of the target
    draft: Path  # the draft's weights (HF directory, streaming-draft or feature-draft weights)
    adapters: Path  # trained exit adapters as adapters/layer-N
    more_adapters: tuple[Path, ...] = ()  # single adapter directories (the committed one): their config names the layer
    # the draft the external baselines load (transformers, GenAI: one token per forward over the full vocabulary,
    # reading token ids only); None: `draft` itself. A feature draft reads the target's hidden states, which no
    # library can give it, so they get the best token draft there is.
    baseline_draft: Path | None = None

    @classmethod
    def real_pair(cls, bundle: Path | None = None) -> Sources:
        """The real pair's sources (models/smollm2.py); the draft is the feature draft where `bundle` holds one."""
        from mirror_sd.models.smollm2 import (
            ADAPTER_15_WEIGHTS,
            ADAPTER_LAYERS,
            ADAPTER_WEIGHTS,
            DRAFT_WEIGHTS,
            TARGET_DIR,
            draft_weights,
        )

        kind = "streaming"
        if bundle is not None and (Path(bundle) / "manifest.json").is_file():
            try:
                kind = "feature" if Manifest.load(bundle).draft.feature_taps else kind
            except MirrorSDError:
                pass
        return cls(TARGET_DIR, draft_weights(kind), ADAPTER_LAYERS, (ADAPTER_WEIGHTS, ADAPTER_15_WEIGHTS),
                   baseline_draft=DRAFT_WEIGHTS)

    def adapter(self, layer: int) -> Path | None:
        for path in (self.adapters / f"layer-{layer}", *self.more_adapters):
            config = path / "exit_adapter.json"
            if config.is_file() and json.loads(config.read_text()).get("exit_layer") == layer:
                return path
        return None

    def unusable_for(self, manifest: Manifest) -> str | None:
        """Why these sources cannot re-export the bundle's pair (None: they can)."""
        config = self.target / "config.json"
        if not config.is_file():
            return f"the target's source directory {self.target} is missing (make models)"
        if not self.draft.is_dir():
            return f"the draft's weights {self.draft} are missing (make models)"
        facts = json.loads(config.read_text())
        mine = (facts.get("num_hidden_layers"), facts.get("hidden_size"), facts.get("vocab_size"))
        theirs = (manifest.target.num_layers, manifest.target.hidden_size, manifest.target.vocab_size)
        if mine != theirs:
            return f"the bundle's target (layers, hidden, vocab) {theirs} is not the source target's {mine}"
        return None


@dataclass(frozen=True)
class Variant:
    exit_layer: int
    exit_head: str  # "adapter" or "logit_lens"
    path: Path | None  # None: not available
    reason: str = ""  # why not


def variant(sources: Sources | None, manifest: Manifest, bundle: Path, exit_layer: int, exit_head: str, *,
            export: bool, cache: Path = CACHE, report: Callable[[str], None] = print) -> Variant:
    """The bundle at `exit_layer` with `exit_head` ("adapter": the trained one if it exists, else the logit lens;
    "logit_lens"): the bundle itself when it already is that, else a cached export; exported now when `export`."""
    if exit_head == "adapter" and (sources is None or sources.adapter(exit_layer) is None):
        exit_head = "logit_lens"  # no trained adapter for this layer
    if manifest.target.exit_layer == exit_layer and manifest.target.exit_head == exit_head:
        return Variant(exit_layer, exit_head, bundle)
    from mirror_sd.export.openvino_genai import fingerprint

    # a variant of this draft: another draft (or the same one retrained) is exported anew, never read stale
    drafted = f"-{fingerprint(sources.draft)[:10]}" if sources is not None and sources.draft.is_dir() else ""
    out = cache / f"exit{exit_layer}-{exit_head}-{manifest.draft.architecture}{drafted}"
    try:
        Manifest.load(out)
        return Variant(exit_layer, exit_head, out)
    except MirrorSDError:
        pass
    if sources is None:
        return Variant(exit_layer, exit_head, None, "no source models to export from")
    why = sources.unusable_for(manifest)
    if why:
        return Variant(exit_layer, exit_head, None, why)
    if not 1 <= exit_layer < manifest.target.num_layers:
        return Variant(exit_layer, exit_head, None, f"exit layer outside [1, {manifest.target.num_layers - 1}]")
    taps = manifest.draft.feature_taps
    if taps and exit_layer < max(taps):
        return Variant(exit_layer, exit_head, None, f"the feature draft reads layer {max(taps)}, past this exit layer")
    if not export:
        return Variant(exit_layer, exit_head, None, f"not exported yet ({out}); the quick size does not export")
    from mirror_sd.export.bundle import ExportOptions, export_bundle

    report(f"exporting the bundle at exit layer {exit_layer} ({exit_head}) into {out} (once; about 2 minutes)")
    adapter = sources.adapter(exit_layer) if exit_head == "adapter" else None
    export_bundle(ExportOptions(str(sources.target), str(sources.draft), out, exit_layer=exit_layer,
                                top_k=manifest.target.top_k, force=True,
                                exit_adapter=str(adapter) if adapter else None),
                  report=lambda line: None)
    return Variant(exit_layer, exit_head, out)
