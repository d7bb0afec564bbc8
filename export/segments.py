"""Export-ready torch modules: a contiguous run of decoder layers with plain-tensor KV in and out.

A `Segment` wraps layers [start, end) of a Hugging Face decoder. It takes its past KV as plain tensors (an HF
cache object cannot be an export input) and returns the new ("present") KV as plain tensors. The attention mask is
built inside the graph from the 2-D padding mask as an explicit 4-D additive mask: with a past and
`attention_mask=None`, sdpa silently crops keys. It returns past + new (the layout OpenVINO GenAI's stateful
models want: export/openvino_genai.py).

A `SplitSegment` is the draft's graph ("split-past", partitions/spec.py): its past comes as one shared row that
every batch row reads up to its own shared_mask, plus each row's own short past, and only the new positions' KV
goes out. Attention scores against the shared part are one broadcast matmul for all rows, so branch rows over one
context never copy it, and nothing is concatenated onto it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:  # an annotation only: the exit heads import without optimum (the GPU training machine has none)
    from mirror_sd.export.architectures import Architecture


class ExitHead(Protocol):
    """Maps a hidden state [B,T,H] at the exit layer to vocabulary logits [B,T,V]. Pluggable (nn.Module)."""

    kind: str

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor: ...


class LogitLens(nn.Module):
    """The paper's untrained early-exit head: the target's own final norm + LM head on the layer-l_e state (and its
    final soft cap, Gemma 2's `cap`)."""

    kind = "logit_lens"

    def __init__(self, norm: nn.Module, lm_head: nn.Module, cap: float | None = None) -> None:
        super().__init__()
        self.norm, self.lm_head, self.cap = norm, lm_head, cap

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head reads (exit heads share it: ExitTopK can run the head on some of its rows)."""
        return self.norm(hidden)

    def head_output(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's rows as the target's head ends them (capped where it caps)."""
        return _capped(logits, self.cap)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head_output(self.lm_head(self.head_input(hidden)))


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


def additive_mask(attention_mask: torch.Tensor, new_tokens: int, window: int | None,
                  dtype: torch.dtype) -> torch.Tensor:
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


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B,heads,T,hd] with its first cos.shape[-1] values of each head turned (all of them, or Phi-4-mini's part;
    transformers' rotate_half layout); cos/sin [B,T,r]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    turned, kept = x[..., :r], x[..., r:]
    half = torch.cat([-turned[..., r // 2:], turned[..., :r // 2]], dim=-1)
    return torch.cat([turned * cos + half * sin, kept], dim=-1)


def _capped(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's soft cap c tanh(x / c) (None: x)."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def _split_attention(layer, hidden, cos, sin, shared_k, shared_v, past_k, past_v, shared_bias, own_bias,
                     qkv=None):
    """One attention block over a split past. hidden [B,T,H]; shared_k/v [1,kv,P,hd]; past_k/v [B,kv,S,hd];
    shared_bias [B,1,1,P] (every query alike) or [B,1,T,P], and own_bias [B,1,T,S+T], additive; qkv: the layer's
    architecture's `qkv` (default: q_proj, k_proj and v_proj). Returns (attention output [B,T,H], new k, new v)."""
    from mirror_sd.export.architectures import Architecture

    attn = layer.self_attn
    batch, new = hidden.shape[:2]
    hd = attn.head_dim
    q, k, v = (nn.functional.linear(hidden, w, b).view(batch, new, -1, hd)
               for w, b in (qkv or Architecture.qkv)(attn))
    v = v.transpose(1, 2)
    if getattr(attn, "q_norm", None) is not None:  # Qwen3: per-head norms before the rotary embedding
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    if getattr(attn, "use_rope", True):  # SmolLM3's NoPE layers turn nothing
        q, k = _rotated(q, cos, sin), _rotated(k, cos, sin)
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    # query head h reads kv head h // group: the group's queries become rows of one matmul per kv head
    rows = q.reshape(batch, kv_heads, group * new, hd)
    keys, values = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
    cap = getattr(attn, "attn_logit_softcapping", None)  # Gemma 2's
    scores_shared = _capped(torch.matmul(rows, shared_k.transpose(-1, -2)) * attn.scaling, cap)  # [B,kv,gT,P]
    scores_own = _capped(torch.matmul(rows, keys.transpose(-1, -2)) * attn.scaling, cap)  # [B,kv,gT,S+T]
    shared_len = shared_k.shape[2]
    if shared_bias.shape[2] != 1:  # a per-query mask (a sliding window) follows the rows' (group, query) order
        shared_bias = shared_bias.repeat(1, 1, group, 1)
    scores = torch.cat([scores_shared + shared_bias, scores_own + own_bias.repeat(1, 1, group, 1)], -1)
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs[..., :shared_len], shared_v) + torch.matmul(probs[..., shared_len:], values)
    out = out.reshape(batch, heads, new, hd).transpose(1, 2).reshape(batch, new, heads * hd)
    return attn.o_proj(out), k, v


class _FixedRotary(nn.Module):
    """A rotary module at the angles it is built with: transformers' forward without its update by sequence length
    (longrope's switch to its long factors past original_max_position_embeddings, dynamic NTK's rescaling past
    max_position_embeddings), a Python branch on a tensor's value that does not trace. Within those lengths the
    angles are the model's own."""

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        inv_freq = getattr(rotary, "original_inv_freq", None)
        self.register_buffer("inv_freq", (rotary.inv_freq if inv_freq is None else inv_freq).detach().clone(),
                             persistent=False)
        self.scaling = float(getattr(rotary, "attention_scaling", 1.0))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * self.scaling).to(x.dtype), (angles.sin() * self.scaling).to(x.dtype)


def _traceable(rotary: nn.Module) -> nn.Module:
    """`rotary`, or a _FixedRotary where its angles change with the sequence's length."""
    kind = getattr(rotary, "rope_type", "default")  # Gemma 3's holds one per layer type: a dict, kept as it is
    return _FixedRotary(rotary) if isinstance(kind, str) and (kind == "longrope" or "dynamic" in kind) else rotary


class _Layers(nn.Module):
    """Layers [start, end) of a decoder, with the token embedding in front if `embed` and, for head="final", the
    final norm + LM head behind (None: the hidden state is the output)."""

    def __init__(self, model, arch: Architecture, start: int, end: int, *, embed: bool, head: str | None) -> None:
        super().__init__()
        backbone = arch.backbone(model)
        self.start, self.end = start, end
        self.embed_tokens = backbone.embed_tokens if embed else None
        self.layers = nn.ModuleList(backbone.layers[start:end])
        self.arch = arch
        self.rotary_emb = _traceable(backbone.rotary_emb)
        self.windows = arch.sliding_windows()[start:end]
        self.head = head
        if head == "final":
            self.norm, self.lm_head = backbone.norm, arch.lm_head(model)
        elif head is not None:
            raise ValueError("a segment's head is 'final' or None")

    def angles(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) for each of the segment's layers."""
        return self.arch.rotary_angles(self.rotary_emb, hidden, position_ids)[self.start:self.end]


def last_positions(hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """hidden[:, -keep:] with keep a 1-element tensor (a graph input, so the exported slice stays dynamic)."""
    total = hidden.shape[1]
    return hidden.index_select(1, torch.arange(total - keep[0], total))


class SplitSegment(_Layers):
    """Layers [start, end) of a decoder with a split past (every layer the same way), optionally with the
    embedding in front and a head behind (as `Segment`).

    forward(x, position_ids, shared_mask, attention_mask, keep, *past) with x input_ids [B,T] (or hidden [B,T,H]),
    position_ids [B,T], shared_mask [B,P] (1: the row reads that shared slot), attention_mask [B,S+T] (the row's own
    past and the new tokens; 0 = a hole), keep [1] (the head runs on the last keep positions only: a prompt read
    needs none of its heads, a rollout step its last few columns), past = per layer shared key, shared value
    [1,kv,P,hd], own key, own value [B,kv,S,hd]; returns (head output [B,keep,...] - or the whole hidden state
    [B,T,H] without a head, `keep` unused -, *new key/value per layer [B,kv,T,hd]).
    The mask is positional over the slots shared ++ own ++ new, as `additive_mask` builds it for a plain past."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, shared_mask: torch.Tensor,
                attention_mask: torch.Tensor, keep: torch.Tensor, *past: torch.Tensor):
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        new = hidden.shape[1]
        angles = self.angles(hidden, position_ids)
        shared_len = shared_mask.shape[1]
        biases = {}
        for w in set(self.windows):
            if w is None:
                # every shared slot precedes every query: one row of bias per batch row, broadcast over the queries
                # (a long context's [T, P] mask would cost more than the attention it masks)
                zero = torch.zeros((), dtype=hidden.dtype)
                low = torch.tensor(torch.finfo(hidden.dtype).min, dtype=hidden.dtype)
                biases[w] = (torch.where(shared_mask.bool(), zero, low)[:, None, None, :],
                             additive_mask(attention_mask, new, None, hidden.dtype))
            else:  # a window reaches into the shared part per query: the whole positional mask
                full = additive_mask(torch.cat([shared_mask, attention_mask], 1), new, w, hidden.dtype)
                biases[w] = (full[..., :shared_len], full[..., shared_len:])
        present = []
        for j, (layer, window) in enumerate(zip(self.layers, self.windows)):
            shared_k, shared_v, own_k, own_v = past[4 * j: 4 * j + 4]
            before_attention, after_attention, before_mlp, after_mlp = self.arch.layer_norms(layer)
            attn_out, k, v = _split_attention(layer, before_attention(hidden), *angles[j], shared_k, shared_v,
                                              own_k, own_v, *biases[window], qkv=self.arch.qkv)
            hidden = hidden + (attn_out if after_attention is None else after_attention(attn_out))
            out = layer.mlp(before_mlp(hidden))
            hidden = hidden + (out if after_mlp is None else after_mlp(out))
            present += [k, v]
        if self.head == "final":
            logits = _capped(self.lm_head(self.norm(last_positions(hidden, keep))), self.arch.softcaps()[1])
            return (logits, *present)
        return (hidden, *present)


class Segment(_Layers):
    """Layers [start, end) of a decoder with a plain past (past + new out), optionally with the token embedding in
    front and the final norm + LM head behind (head="final"; None: the hidden state).

    forward(x, attention_mask, position_ids, *past) with x = input_ids [B,T] if `embed` else hidden [B,T,H];
    past = key, value for each layer in order; returns (head output, *present key/value per layer).
    """

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor):
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x  # [B,T,H]
        new_tokens = hidden.shape[1]
        angles = self.angles(hidden, position_ids)
        masks = {w: additive_mask(attention_mask, new_tokens, w, hidden.dtype) for w in set(self.windows)}
        kv = _PlainKV({self.start + i: (past[2 * i], past[2 * i + 1]) for i in range(len(self.layers))})
        for j, (layer, window) in enumerate(zip(self.layers, self.windows)):
            hidden = layer(hidden, attention_mask=masks[window], position_ids=position_ids, past_key_values=kv,
                           position_embeddings=angles[j])
        present = [t for i in range(self.start, self.end) for t in kv.present[i]]
        if self.head == "final":
            return (_capped(self.lm_head(self.norm(hidden)), self.arch.softcaps()[1]), *present)
        return (hidden, *present)


class ExitTopK(nn.Module):
    """The early-exit partition: an exit head on the layer-l_e hidden state [B,T,H] -> its top-k ids and log-probs
    [B,T,k], most probable first. Only k numbers per position leave the device.

    vocab_ids: run the LM head on these rows only (target ids, e.g. the draft's vocabulary): the head streams its
    weights for those rows alone, and the log-probs are normalised over them. Candidates are then always among them;
    None: the whole vocabulary."""

    def __init__(self, exit_head: nn.Module, top_k: int, vocab_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        if top_k < 1:
            raise ValueError("the exit head needs top_k >= 1")
        self.exit_head, self.top_k = exit_head, top_k
        self.vocab_ids = None
        if vocab_ids is not None:
            self.vocab_ids = vocab_ids.to(torch.long)
            lm_head = exit_head.lm_head
            self.rows = nn.Parameter(lm_head.weight.detach()[self.vocab_ids].clone(), requires_grad=False)
            bias = getattr(lm_head, "bias", None)
            self.row_bias = None if bias is None else nn.Parameter(bias.detach()[self.vocab_ids].clone(),
                                                                  requires_grad=False)

    def logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B,T,V'] log-probs over the head's vocabulary (V' = V, or the rows of vocab_ids in their order)."""
        if self.vocab_ids is None:
            logits = self.exit_head(hidden)
        else:
            logits = nn.functional.linear(self.exit_head.head_input(hidden), self.rows, self.row_bias)
            end = getattr(self.exit_head, "head_output", None)
            logits = logits if end is None else end(logits)
        return torch.log_softmax(logits.float(), dim=-1)

    def forward(self, hidden: torch.Tensor):
        top_lp, top = torch.topk(self.logprobs(hidden), self.top_k, dim=-1)
        return (top if self.vocab_ids is None else self.vocab_ids[top]), top_lp
