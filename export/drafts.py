"""The two kinds of draft the export takes, behind one small interface.

- `HFDraft`: any Hugging Face causal LM of a supported architecture with the target's vocabulary; one token per
  forward, logits over the whole vocabulary.
- `StreamingDraft` (models/streaming_draft.py, a directory with streaming_draft.json): logits over a reduced draft
  vocabulary (the bundle lists its target ids in draft_vocab.json) and `streams` more proposed tokens per forward.

Each gives its manifest facts, an export-ready module with the draft partition's I/O, and a torch reference of
that module's outputs on a whole sequence for the parity checks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mirror_sd.errors import BadInputError
from mirror_sd.export.architectures import Architecture, architecture_of
from mirror_sd.export.segments import SplitSegment, last_positions
from mirror_sd.partitions.manifest import DRAFT_VOCAB_FILE, LOGITS, STREAM_IDS, DraftFacts

__all__ = ["Draft", "HFDraft", "StreamingDraftSource", "load_draft"]


class Draft:
    source: str
    arch: Architecture

    def facts(self) -> DraftFacts:
        raise NotImplementedError

    def segment(self) -> nn.Module:
        """Export-ready with the split-past interface (export/segments.py SplitSegment): forward(input_ids,
        position_ids, shared_mask, attention_mask, num_logits_to_keep, *past) -> (logits, [stream_ids,] *new KV),
        the heads on the last num_logits_to_keep positions; has `start` and `end` (its layer range)."""
        raise NotImplementedError

    def reference(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The graph's head outputs for a whole sequence [B,T] computed in torch (no cache)."""
        raise NotImplementedError

    def write_files(self, bundle: Path) -> tuple[str, ...]:
        """Extra files the draft needs in the bundle; returns their names."""
        return ()

    def output_vocab(self) -> list[int] | None:
        """The target ids the draft predicts over, when it predicts over fewer than all (None: all)."""
        return None


@dataclass
class HFDraft(Draft):
    source: str
    model: nn.Module
    arch: Architecture

    def facts(self) -> DraftFacts:
        return DraftFacts(**self.arch.facts(), tokens_per_forward=1)

    def segment(self) -> nn.Module:
        return SplitSegment(self.model, self.arch, 0, self.arch.num_layers, embed=True, head="final")

    def reference(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {LOGITS: self.model(ids).logits}


class _StreamingSegment(nn.Module):
    def __init__(self, draft, arch: Architecture) -> None:
        super().__init__()
        self.draft = draft
        self.body = SplitSegment(draft.lm, arch, 0, arch.num_layers, embed=True, head=None)
        self.start, self.end = 0, arch.num_layers

    def forward(self, input_ids, position_ids, shared_mask, attention_mask, keep, *past):
        hidden, *present = self.body(self.draft.id_map[input_ids], position_ids, shared_mask, attention_mask, keep,
                                     *past)
        hidden = last_positions(hidden, keep)  # the heads (main and streams) only where they are read
        logits = self.draft.draft_logits(hidden)  # [B,keep,Vd]
        streams = self.draft.stream_logits(hidden, logits.argmax(-1))
        stream_ids = self.draft.vocab_ids[torch.stack([s.argmax(-1) for s in streams], -1)]  # [B,T,S] target ids
        return (logits, stream_ids, *present)


@dataclass
class StreamingDraftSource(Draft):
    source: str
    model: nn.Module  # models.streaming_draft.StreamingDraft
    arch: Architecture

    def facts(self) -> DraftFacts:
        cfg = self.model.config
        base = self.arch.facts()
        return DraftFacts(**{**base, "architecture": "streaming-llama", "vocab_size": cfg.target_vocab_size},
                          tokens_per_forward=cfg.streams + 1, output_vocab_size=cfg.draft_vocab,
                          output_vocab_file=DRAFT_VOCAB_FILE, streams=cfg.streams)

    def segment(self) -> nn.Module:
        return _StreamingSegment(self.model, self.arch)

    def reference(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.model.reference(ids)
        return {LOGITS: out["logits"], STREAM_IDS: out["stream_ids"]}

    def write_files(self, bundle: Path) -> tuple[str, ...]:
        (bundle / DRAFT_VOCAB_FILE).write_text(json.dumps(list(self.model.config.vocab_ids)) + "\n")
        return (DRAFT_VOCAB_FILE,)

    def output_vocab(self) -> list[int] | None:
        return list(self.model.config.vocab_ids)


def load_draft(source: str, load_hf) -> Draft:
    """A streaming draft directory, or (through `load_hf`, which raises the export's typed errors) an HF model."""
    from mirror_sd.models.streaming_draft import StreamingDraft

    path = Path(source).expanduser()
    if path.is_dir() and StreamingDraft.is_streaming_draft(path):
        try:
            model = StreamingDraft.load(path)
        except (OSError, ValueError, TypeError, RuntimeError) as e:  # unreadable config or weights that do not fit
            raise BadInputError(f"cannot load streaming draft {source!r}: {type(e).__name__}: {e}") from None
        return StreamingDraftSource(source, model, architecture_of(model.lm.config))
    loaded = load_hf(source, "draft")
    return HFDraft(loaded.source, loaded.model, loaded.arch)
