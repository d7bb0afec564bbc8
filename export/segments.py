"""Export-ready torch modules: a contiguous run of decoder layers with plain-tensor KV in and out.

A `Segment` wraps layers [start, end) of a Hugging Face decoder. It takes its past KV as plain tensors (an HF
cache object cannot be an export input) and returns the new ("present") KV as plain tensors. The attention mask is
built inside the graph from the 2-D padding mask as an explicit 4-D additive mask: with a past and
`attention_mask=None`, sdpa silently crops keys.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from mirror_sd.export.architectures import Architecture


class ExitHead(Protocol):
    """Maps a hidden state [B,T,H] at the exit layer to vocabulary logits [B,T,V]. Pluggable (nn.Module)."""

    kind: str

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor: ...


class LogitLens(nn.Module):
    """The paper's untrained early-exit head: the target's own final norm + LM head on the layer-l_e state."""

    kind = "logit_lens"

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


class _PlainKV:
    """Duck-typed stand-in for transformers' Cache: attention calls `update(k, v, layer_idx)` and gets back the
    keys/values to attend over. Past tensors go in, concatenated present tensors are collected on the way out."""

    def __init__(self, past: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.past = past
        self.present: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        past_k, past_v = self.past[layer_idx]
        k, v = torch.cat([past_k, key], dim=2), torch.cat([past_v, value], dim=2)
        self.present[layer_idx] = (k, v)
        return k, v


def additive_mask(attention_mask: torch.Tensor, new_tokens: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """[B,1,T,S] additive mask: 0 where query t may see key s, the dtype's minimum elsewhere.

    attention_mask: [B, S] with S = past + T, 1 for real tokens. Query t sits at index S - T + t; it sees keys at
    indices <= its own (causal), inside the sliding window if any, and not padded. The minimum (not -inf) keeps a
    fully padded row finite, as transformers does.
    """
    total = attention_mask.shape[1]
    q_idx = torch.arange(new_tokens, device=attention_mask.device) + (total - new_tokens)  # [T]
    k_idx = torch.arange(total, device=attention_mask.device)  # [S]
    allowed = k_idx[None, :] <= q_idx[:, None]  # [T,S]
    if window is not None:
        allowed = allowed & (k_idx[None, :] > q_idx[:, None] - window)
    allowed = allowed[None, None] & attention_mask[:, None, None, :].bool()  # [B,1,T,S]
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    return torch.where(allowed, zero, torch.tensor(torch.finfo(dtype).min, dtype=dtype))


class Segment(nn.Module):
    """Layers [start, end) of a decoder, optionally with the token embedding in front and a head behind.

    head: "final" (final norm + LM head -> logits), "exit" (an ExitHead -> top-k ids and log-probs, plus the
    hidden state itself), or None (hidden state only).
    forward(x, attention_mask, position_ids, *past) with x = input_ids [B,T] if `embed` else hidden [B,T,H];
    past = key, value for each layer in order; returns (*head outputs, *present key/value per layer).
    """

    def __init__(self, model, arch: Architecture, start: int, end: int, *, embed: bool, head: str | None,
                 exit_head: nn.Module | None = None, top_k: int = 0) -> None:
        super().__init__()
        backbone = arch.backbone(model)
        self.start, self.end = start, end
        self.embed_tokens = backbone.embed_tokens if embed else None
        self.layers = nn.ModuleList(backbone.layers[start:end])
        self.rotary_emb = backbone.rotary_emb
        self.windows = arch.sliding_windows()[start:end]
        self.head = head
        if head == "final":
            self.norm, self.lm_head = backbone.norm, arch.lm_head(model)
        elif head == "exit":
            if exit_head is None or top_k < 1:
                raise ValueError("an exit segment needs an exit head and top_k >= 1")
            self.exit_head, self.top_k = exit_head, top_k

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor):
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x  # [B,T,H]
        new_tokens = hidden.shape[1]
        cos_sin = self.rotary_emb(hidden, position_ids)
        masks = {w: additive_mask(attention_mask, new_tokens, w, hidden.dtype) for w in set(self.windows)}
        kv = _PlainKV({self.start + i: (past[2 * i], past[2 * i + 1]) for i in range(len(self.layers))})
        for layer, window in zip(self.layers, self.windows):
            hidden = layer(hidden, attention_mask=masks[window], position_ids=position_ids, past_key_values=kv,
                           position_embeddings=cos_sin)
        present = [t for i in range(self.start, self.end) for t in kv.present[i]]

        if self.head == "final":
            return (self.lm_head(self.norm(hidden)), *present)
        if self.head == "exit":
            logprobs = torch.log_softmax(self.exit_head(hidden).float(), dim=-1)  # [B,T,V]
            top_lp, top_ids = torch.topk(logprobs, self.top_k, dim=-1)  # [B,T,k]: only k numbers leave the device
            return (hidden, top_ids, top_lp, *present)
        return (hidden, *present)
