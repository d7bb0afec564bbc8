"""The two kinds of draft the export takes, behind one small interface.

- `HFDraft`: any Hugging Face causal LM of a supported architecture with the target's vocabulary; one token per
  forward, logits over the whole vocabulary.
- `StreamingDraft` (models/streaming_draft.py, a directory with streaming_draft.json): logits over a reduced draft
  vocabulary (the bundle lists its target ids in draft_vocab.json) and `streams` more proposed tokens per forward.
- `FeatureDraft` (models/feature_draft.py, a directory with feature_draft.json): reads the target's hidden states
  after its tap layers (the feature channel, partitions/manifest.py) and the target's own embedding; a reduced
  vocabulary as above; one token per forward.

Each gives its manifest facts, an export-ready module with the draft partition's I/O, and a torch reference of
that module's outputs on a whole sequence for the parity checks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from mirror_sd.errors import BadInputError
from mirror_sd.export.architectures import Architecture, architecture_of
from mirror_sd.export.segments import SplitSegment, _split_attention, additive_mask, last_positions
from mirror_sd.models.feature_draft import FeatureDraft
from mirror_sd.models.streaming_draft import StreamingDraft
from mirror_sd.partitions.manifest import DRAFT_VOCAB_FILE, LOGITS, STREAM_IDS, DraftFacts

__all__ = ["Draft", "FeatureDraftSource", "HFDraft", "StreamingDraftSource", "load_draft"]


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
                          output_vocab_file=DRAFT_VOCAB_FILE, streams=cfg.streams,
                          attention_window=cfg.attention_window)

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


class _FeatureSegment(nn.Module):
    """The feature draft's graph: the split-past interface plus the feature channel.

    forward(input_ids, position_ids, shared_mask, attention_mask, keep, features, surrogate, use_surrogate, *past):
    input token x_q comes with the taps of position q - 1 (features [B,T,n,H]) or, where the target has not run
    q - 1 yet, the draft's own hidden state there (surrogate [B,T,H], where use_surrogate [B,T] is 1). Returns
    (logits [B,keep,Vd], draft_hidden [B,keep,H], [stream_ids [B,keep,S] of a draft with stream heads,] new key,
    new value)."""

    def __init__(self, draft) -> None:
        super().__init__()
        self.draft = draft
        self.start, self.end = 0, 1

    def forward(self, input_ids, position_ids, shared_mask, attention_mask, keep, features, surrogate, use_surrogate,
                shared_k, shared_v, own_k, own_v):

        d = self.draft
        g = torch.where(use_surrogate[..., None].bool(), surrogate, d.fused(features))
        x = d.step_input(g, input_ids)
        layer = d.layer
        cos, sin = layer.rope(position_ids)
        zero = torch.zeros((), dtype=x.dtype)
        low = torch.tensor(torch.finfo(x.dtype).min, dtype=x.dtype)
        shared_bias = torch.where(shared_mask.bool(), zero, low)[:, None, None, :]
        own_bias = additive_mask(attention_mask, x.shape[1], None, x.dtype)
        attn_out, k, v = _split_attention(_AttentionView(layer), layer.input_layernorm(x), cos[:, 0], sin[:, 0],
                                          shared_k, shared_v, own_k, own_v, shared_bias, own_bias)
        h = x + attn_out
        n = layer.post_attention_layernorm(h)
        h = h + layer.down_proj(nn.functional.silu(layer.gate_proj(n)) * layer.up_proj(n))
        h = last_positions(h, keep)
        logits = d.logits(h)
        if d.config.streams:
            return logits, h, d.stream_ids(h, logits), k, v
        return logits, h, k, v


class _AttentionView:
    """The feature draft's layer seen through the attributes `_split_attention` reads (an HF layer's)."""

    def __init__(self, layer) -> None:
        self.self_attn = self
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj
        self.head_dim = layer.head_dim
        self.scaling = layer.head_dim ** -0.5
        self.q_norm = None


@dataclass
class FeatureDraftSource(Draft):
    source: str
    model: nn.Module  # models.feature_draft.FeatureDraft
    arch: Architecture  # the target's (the draft layer has its shape)

    def facts(self) -> DraftFacts:
        cfg = self.model.config
        return DraftFacts(architecture="feature-llama", num_layers=1, hidden_size=cfg.hidden_size,
                          vocab_size=cfg.target_vocab_size, num_attention_heads=cfg.num_attention_heads,
                          num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                          max_position_embeddings=cfg.max_position_embeddings, tokens_per_forward=1 + cfg.streams,
                          output_vocab_size=cfg.draft_vocab, output_vocab_file=DRAFT_VOCAB_FILE,
                          streams=cfg.streams, feature_taps=tuple(cfg.taps))

    def segment(self) -> nn.Module:
        return _FeatureSegment(self.model)

    def reference(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError("a feature draft's reference needs the target's features: export/parity.py "
                                  "checks it with FeatureDraft.forward_cached")

    def write_files(self, bundle: Path) -> tuple[str, ...]:
        (bundle / DRAFT_VOCAB_FILE).write_text(json.dumps(list(self.model.config.vocab_ids)) + "\n")
        return (DRAFT_VOCAB_FILE,)

    def output_vocab(self) -> list[int] | None:
        return list(self.model.config.vocab_ids)


# What reading a model's files raises where they are not what they say (a truncated or corrupt weights file, an
# interrupted download: safetensors' own error is none of Python's)
UNREADABLE = (OSError, ValueError, TypeError, KeyError, RuntimeError, SafetensorError)


def load_draft(source: str, load_hf, target=None) -> Draft:
    """A streaming or feature draft directory, or (through `load_hf`, which raises the export's typed errors) an HF
    model. A feature draft takes the target's embedding from `target` (a LoadedModel)."""

    path = Path(source).expanduser()
    if path.is_dir() and FeatureDraft.is_feature_draft(path):
        if target is None:
            raise BadInputError(f"feature draft {source!r} needs its target")
        try:
            model = FeatureDraft.load(path, target.model.get_input_embeddings().weight)
        except UNREADABLE as e:
            raise BadInputError(f"cannot load feature draft {source!r}: {type(e).__name__}: {e}") from None
        if model.config.target_vocab_size != target.model.config.vocab_size or \
                model.config.hidden_size != target.model.config.hidden_size:
            raise BadInputError(f"feature draft {source!r} was trained for another target (vocabulary or width differ)")
        return FeatureDraftSource(source, model, target.arch)
    if path.is_dir() and StreamingDraft.is_streaming_draft(path):
        try:
            model = StreamingDraft.load(path)
        except UNREADABLE as e:  # unreadable config or weights that do not fit
            raise BadInputError(f"cannot load streaming draft {source!r}: {type(e).__name__}: {e}") from None
        return StreamingDraftSource(source, model, architecture_of(model.lm.config))
    loaded = load_hf(source, "draft")
    return HFDraft(loaded.source, loaded.model, loaded.arch)
