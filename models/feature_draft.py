"""The feature draft: one decoder layer that reads the target's own hidden states (EAGLE-style), fed through
Mirror-SD's token channel.

The draft's input at position t is the target's hidden state at position t after each layer in `taps` (all at or
below the exit layer l_e, so the prefix partition has them before the suffix runs) and the token x_{t+1} that
follows it; its output is the next token x_{t+2} over a reduced vocabulary, and the layer's hidden state h_t.
Where the target has not computed position t+1 yet (the draft runs ahead of it), h_t stands in for that position's
fused feature, so the draft continues on its own features, as EAGLE does.

    g_t = fuse([norm_i(tap_i,t)])              real features, or h_{t-1} past what the target has computed
    u_t = inp([feature_norm(g_t); embed_norm(E x_{t+1})])   E: the target's embedding, frozen and not saved
    h_t = decoder_layer(u_t | the draft's own KV over earlier positions)
    logits_t = head(norm(h_t))                 the head's rows start as the target's LM head rows of the vocabulary

Training (models/train_feature_draft.py) runs "training-time test": step 0 on real features, then step k feeds
every position the draft's own step k-1 output from the position before, with attention restricted to what the
draft would see at inference (real positions up to the base, then its own k drafted ones). `rollout` is the
sequential, cached form of the same computation: the torch oracle for the tests and the exported graph.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

CONFIG_NAME = "feature_draft.json"
WEIGHTS_NAME = "feature_draft.safetensors"
EMBED = "embed.weight"  # the target's embedding: loaded from the target, never saved with the draft


@dataclass
class FeatureDraftConfig:
    target_vocab_size: int
    vocab_ids: list[int]  # target ids of the draft's output vocabulary, most frequent first
    taps: list[int]  # read the target's hidden state after this many layers (each <= the exit layer)
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Stream heads (multi-token prediction, `StreamHead`): after the main token, `streams` more tokens per forward,
    # each over the first `stream_vocab` rows of the head (the most frequent tokens; 0: all of them)
    streams: int = 0
    stream_vocab: int = 0
    stream_width: int = 0  # each stream head's inner width (0: twice the hidden size)

    @property
    def draft_vocab(self) -> int:
        return len(self.vocab_ids)

    @property
    def stream_rows(self) -> int:
        return min(self.stream_vocab or self.draft_vocab, self.draft_vocab)

    @classmethod
    def for_target(cls, target_config, vocab_ids: list[int], taps: list[int]) -> FeatureDraftConfig:
        """The target's own width, heads and rope: the draft layer is one more layer of the target's shape."""
        tc = target_config
        rope = getattr(tc, "rope_parameters", None) or {}
        heads = tc.num_attention_heads
        return cls(target_vocab_size=tc.vocab_size, vocab_ids=list(vocab_ids), taps=list(taps),
                   hidden_size=tc.hidden_size, num_attention_heads=heads,
                   num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
                   head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
                   intermediate_size=tc.intermediate_size,
                   rope_theta=float(rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))),
                   rms_norm_eps=float(tc.rms_norm_eps), max_position_embeddings=tc.max_position_embeddings,
                   bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama rotary embedding (rotate-half form); x [B,H,T,D], cos/sin [B,1,T,D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class DraftLayer(nn.Module):
    """One Llama decoder layer whose attention is written out, so training can attend through the
    training-time-test pattern (real KV up to the base, then the draft's own) and inference through a cache."""

    def __init__(self, c: FeatureDraftConfig) -> None:
        super().__init__()
        d, h, kv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.heads, self.kv_heads, self.head_dim = h, kv, hd
        self.input_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, kv * hd, bias=False)
        self.v_proj = nn.Linear(d, kv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.gate_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, d, bias=False)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B,1,T,D] for positions [B,T]."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], -1)[:, None]
        return emb.cos(), emb.sin()

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """Rotated queries [B,H,T,D] and keys/values [B,KV,T,D] of the normed input."""
        b, t, _ = x.shape
        n = self.input_layernorm(x)
        q = self.q_proj(n).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(n).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(n).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rope(positions)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def expand(self, kv: torch.Tensor) -> torch.Tensor:
        return kv.repeat_interleave(self.heads // self.kv_heads, dim=1)

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual adds and the MLP after attention; attended [B,H,T,D]."""
        b, _, t, _ = attended.shape
        x = x + self.o_proj(attended.transpose(1, 2).reshape(b, t, -1))
        n = self.post_attention_layernorm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(n)) * self.up_proj(n))

    def forward_cached(self, x, positions, past_k, past_v, mask):
        """x [B,T,d] at `positions`; past keys/values [B,KV,P,D]; mask [B,1,T,P+T] additive. Returns the layer
        output and the keys/values of the new positions."""
        q, k, v = self.qkv(x, positions)
        keys, values = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
        scores = q @ self.expand(keys).transpose(-1, -2) / math.sqrt(self.head_dim) + mask
        return self.finish(x, scores.softmax(-1) @ self.expand(values)), k, v


class StreamHead(nn.Module):
    """One stream of the draft's multi-token prediction (Hydra/Medusa-style, no attention): from the hidden state
    that chose a token y (the main stream's h, or the previous stream's) and y's embedding, the hidden state that
    chooses the token after y. Its output projection starts at zero, so a new stream starts as a copy of the state
    it reads."""

    def __init__(self, c: FeatureDraftConfig) -> None:
        super().__init__()
        d = c.hidden_size
        width = c.stream_width or 2 * d
        self.state_norm = RMSNorm(d, c.rms_norm_eps)
        self.token_norm = RMSNorm(d, c.rms_norm_eps)
        self.inp = nn.Linear(2 * d, width, bias=False)
        self.out = nn.Linear(width, d, bias=False)
        nn.init.zeros_(self.out.weight)

    def forward(self, z: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        u = torch.cat([self.state_norm(z), self.token_norm(token_embedding)], -1)
        return z + self.out(nn.functional.silu(self.inp(u)))


class FeatureDraft(nn.Module):
    def __init__(self, config: FeatureDraftConfig) -> None:
        super().__init__()
        c, d = config, config.hidden_size
        self.config = c
        self.tap_norms = nn.ModuleList(RMSNorm(d, c.rms_norm_eps) for _ in c.taps)
        self.fuse = nn.Linear(len(c.taps) * d, d, bias=False)
        self.embed = nn.Embedding(c.target_vocab_size, d)
        self.embed.weight.requires_grad_(False)
        self.feature_norm = RMSNorm(d, c.rms_norm_eps)
        self.embed_norm = RMSNorm(d, c.rms_norm_eps)
        self.inp = nn.Linear(2 * d, d, bias=False)
        self.layer = DraftLayer(c)
        self.norm = RMSNorm(d, c.rms_norm_eps)
        self.head = nn.Linear(d, c.draft_vocab, bias=False)
        self.stream_heads = nn.ModuleList(StreamHead(c) for _ in range(c.streams))
        self.register_buffer("vocab_ids", torch.tensor(c.vocab_ids, dtype=torch.long), persistent=False)
        id_map = torch.full((c.target_vocab_size,), -100, dtype=torch.long)
        id_map[self.vocab_ids] = torch.arange(c.draft_vocab)
        self.register_buffer("id_map", id_map, persistent=False)  # target id -> head row (-100: not proposable)

    # -- pieces shared by training, the oracle and the exported graph ---------------------------------------------
    def fused(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [.., n_taps, d] -> the fused feature g [.., d]."""
        return self.fuse(torch.cat([norm(taps[..., i, :]) for i, norm in enumerate(self.tap_norms)], -1))

    def step_input(self, g: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        return self.inp(torch.cat([self.feature_norm(g), self.embed_norm(self.embed(next_ids))], -1))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h))

    def stream_states(self, h: torch.Tensor, fed: torch.Tensor) -> list[torch.Tensor]:
        """Stream j's hidden states [.., d] for the main stream's h [.., d], stream j fed token fed[.., j] (target ids
        [.., S]): the token the state before it chose (training feeds the text's, inference the chosen ones)."""
        states, z = [], h
        for j, stream in enumerate(self.stream_heads):
            z = stream(z, self.embed(fed[..., j]))
            states.append(z)
        return states

    def stream_logits(self, z: torch.Tensor) -> torch.Tensor:
        """A stream state's logits over the first `stream_rows` rows of the head."""
        return nn.functional.linear(self.norm(z), self.head.weight[: self.config.stream_rows])

    def stream_ids(self, h: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Greedy stream proposals [.., S] (target ids) after the main stream's h and logits [.., Vd]: each stream is
        fed the token the one before it chose."""
        token = self.vocab_ids[logits.argmax(-1)]
        z, out = h, []
        for stream in self.stream_heads:
            z = stream(z, self.embed(token))
            token = self.vocab_ids[self.stream_logits(z).argmax(-1)]
            out.append(token)
        return torch.stack(out, -1)

    def init_from_target(self, target) -> None:
        """Frozen embedding = the target's; head rows = the target's LM head rows of the draft vocabulary; the
        layer starts as a copy of the target's layer at the last tap (its nearest computation)."""
        with torch.no_grad():
            self.embed.weight.copy_(target.get_input_embeddings().weight)
            self.head.weight.copy_(target.get_output_embeddings().weight[self.vocab_ids])
            self.norm.weight.copy_(target.model.norm.weight)
            src = target.model.layers[min(self.config.taps[-1], len(target.model.layers) - 1)]
            for name in ("input_layernorm", "post_attention_layernorm"):
                getattr(self.layer, name).weight.copy_(getattr(src, name).weight)
            attn, mlp, own = src.self_attn, src.mlp, self.layer
            if hasattr(attn, "qkv_proj"):  # Phi-3 packs q, k and v (rows in that order) in one Linear
                sizes = [own.q_proj.out_features, own.k_proj.out_features, own.v_proj.out_features]
                q, k, v = attn.qkv_proj.weight.split(sizes)
            else:
                q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
            if hasattr(mlp, "gate_up_proj"):  # and gate and up (halves) in another
                gate, up = mlp.gate_up_proj.weight.chunk(2)
            else:
                gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
            for module, weight in ((own.q_proj, q), (own.k_proj, k), (own.v_proj, v), (own.o_proj, attn.o_proj.weight),
                                   (own.gate_proj, gate), (own.up_proj, up), (own.down_proj, mlp.down_proj.weight)):
                module.weight.copy_(weight)

    def with_vocab(self, vocab_ids: list[int], lm_head: torch.Tensor) -> FeatureDraft:
        """The same draft over another output vocabulary: the rows of tokens it keeps keep their trained weights,
        a new token's row starts as the target's LM head row (lm_head [target vocab, d]), as every row did in
        `init_from_target`."""
        out = FeatureDraft(replace(self.config, vocab_ids=list(vocab_ids)))
        state = self.state_dict()
        trained = {t: i for i, t in enumerate(self.config.vocab_ids)}
        head = lm_head.detach().float()[torch.tensor(vocab_ids, dtype=torch.long)].clone()
        for row, token in enumerate(vocab_ids):
            if token in trained:
                head[row] = state["head.weight"][trained[token]]
        state["head.weight"] = head
        out.load_state_dict(state, strict=True)
        return out.train(self.training)

    def with_streams(self, streams: int, stream_vocab: int = 0, stream_width: int = 0) -> FeatureDraft:
        """The same draft with `streams` new stream heads (any it had are dropped): everything else keeps its
        weights."""
        out = FeatureDraft(replace(self.config, streams=streams, stream_vocab=stream_vocab, stream_width=stream_width))
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("stream_heads.")}
        missing, unexpected = out.load_state_dict(state, strict=False)
        assert not unexpected and all(k.startswith("stream_heads.") for k in missing), (missing, unexpected)
        return out.train(self.training)

    # -- training: every position at once, `steps` draft steps deep ----------------------------------------------
    def forward_ttt(self, taps: torch.Tensor, ids: torch.Tensor, steps: int, noise: float = 0.0) -> list[torch.Tensor]:
        """taps [B,T,n,d] (the target's features of ids [B,T]). Returns, for each step k, hidden states [B,T-1,d]
        (`logits` turns them into the head's) where position t predicts ids[t+2] as the k-th token drafted from
        base t-k: positions t-k+1..t fed the draft's own hidden states as features, each attending real positions
        <= t-k and the draft's own positions since. (Positions t < k have no base and are not valid at step k; the
        last position has no label.) `noise` adds Gaussian noise of that relative size to the real features, so
        the draft learns to read features that are not quite the target's (EAGLE)."""
        b, t = ids.shape
        length = t - 1
        positions = torch.arange(length, device=ids.device)[None].expand(b, -1)
        nxt = ids[:, 1:]
        g = self.fused(taps[:, :length])
        if noise > 0:
            g = g + noise * g.detach().std(-1, keepdim=True) * torch.randn_like(g)
        keys, values, out = [], [], []
        scale = 1.0 / math.sqrt(self.layer.head_dim)
        idx = torch.arange(length, device=ids.device)
        for k in range(steps):
            x = self.step_input(g, nxt)
            q, kk, vv = self.layer.qkv(x, positions)
            kk, vv = self.layer.expand(kk), self.layer.expand(vv)
            keys.append(kk)
            values.append(vv)
            # real keys j <= t - k
            scores0 = (q @ keys[0].transpose(-1, -2)) * scale
            allowed = idx[None, :] <= (idx[:, None] - k)
            scores0 = scores0.masked_fill(~allowed, float("-inf"))
            # the draft's own keys of steps 1..k sit on the diagonal: step i's key at position t - k + i
            diag = []
            for i in range(1, k + 1):
                shifted = _shift(keys[i], k - i)
                diag.append((q * shifted).sum(-1, keepdim=True) * scale)
            # rows t < k allow no real key but always their own diagonal ones: softmax never sees an all -inf row
            p = torch.cat([scores0] + diag, -1).softmax(-1)
            attended = p[..., :length] @ values[0]
            for i in range(1, k + 1):
                attended = attended + p[..., length + i - 1: length + i] * _shift(values[i], k - i)
            h = self.layer.finish(x, attended)
            out.append(h)
            g = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)  # position t's feature: h at t - 1
        return out

    # -- inference: the cached form (the torch oracle of the exported graph) ----------------------------------------
    @torch.no_grad()
    def forward_cached(self, g, next_ids, positions, past_k, past_v, mask):
        """One forward over T positions: g [B,T,d] features (real fused or the draft's own h), next_ids [B,T],
        positions [B,T], past keys/values [B,KV,P,D], mask [B,1,T,P+T]. Returns (logits, h, new keys, values)."""
        h, k, v = self.layer.forward_cached(self.step_input(g, next_ids), positions, past_k, past_v, mask)
        return self.logits(h), h, k, v

    @torch.no_grad()
    def rollout(self, taps: torch.Tensor, ids: torch.Tensor, steps: int,
                fed: torch.Tensor | None = None, trust_streams: bool = False) -> tuple[list[int], torch.Tensor]:
        """Greedy draft tokens continuing ids [T] (a single sequence) whose features taps [T-1,n,d] are known for
        every position but the last (the target has not run it yet): the prompt is read in one forward, then one
        token per forward on the draft's own features. Returns `steps` target ids and their logits [steps, Vd].
        fed [steps-1]: the tokens fed after each step instead of the draft's own (what sd's draft has read at a
        window slot it reaches: every earlier slot accepted, so the text's own tokens). trust_streams: once the
        tokens still to draft fit in the stream heads' proposals, take them as drafted (the runtime's streaming
        "trust"); their logits rows are not returned."""
        t = ids.shape[0]
        kv, d = self.config.num_key_value_heads, self.config.head_dim
        past_k = past_v = torch.zeros(1, kv, 0, d)
        g = self.fused(taps[None, : t - 1])
        nxt, pos = ids[None, 1:], torch.arange(t - 1)[None]
        tokens, rows = [], []
        for j in range(steps):
            p, n = past_k.shape[2], nxt.shape[1]
            mask = torch.full((n, p + n), float("-inf")).triu(p + 1)[None, None]
            logits, h, k, v = self.forward_cached(g, nxt, pos, past_k, past_v, mask)
            past_k, past_v = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
            token = int(self.vocab_ids[logits[0, -1].argmax()])
            tokens.append(token)
            rows.append(logits[0, -1])
            room = steps - len(tokens)
            if trust_streams and 0 < room <= self.config.streams:
                tokens += self.stream_ids(h[0, -1], logits[0, -1])[:room].tolist()
                break
            following = token if fed is None or j >= len(fed) else int(fed[j])
            g, nxt, pos = h[:, -1:], torch.tensor([[following]]), pos[:, -1:] + 1
        return tokens, torch.stack(rows)

    # -- files ----------------------------------------------------------------------------------------------------
    def save(self, out_dir: str | Path, dtype: torch.dtype = torch.float16) -> Path:
        """Config and weights (fp16 by default: a draft's precision changes only how often it is accepted);
        the target's embedding is left out, `load` takes it from the target."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_NAME).write_text(json.dumps(asdict(self.config)) + "\n")
        state = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items() if k != EMBED}
        save_file(state, str(out / WEIGHTS_NAME))
        return out

    @classmethod
    def load(cls, directory: str | Path, target_embedding: torch.Tensor) -> FeatureDraft:
        from safetensors.torch import load_file

        directory = Path(directory)
        model = cls(FeatureDraftConfig(**json.loads((directory / CONFIG_NAME).read_text())))
        state = {k: v.float() for k, v in load_file(str(directory / WEIGHTS_NAME)).items()}
        state[EMBED] = target_embedding.detach().float()
        model.load_state_dict(state, strict=True)
        return model.eval()

    @staticmethod
    def is_feature_draft(directory: str | Path) -> bool:
        return (Path(directory) / CONFIG_NAME).is_file()


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [B,H,T,D] moved n positions later along T (position t holds x[t - n]; the first n rows are zero)."""
    if n == 0:
        return x
    return torch.cat([torch.zeros_like(x[:, :, :n]), x[:, :, :-n]], 2)
