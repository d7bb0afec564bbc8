"""The streaming draft: a small Llama over a reduced vocabulary that proposes several tokens per forward pass.

Design (README, "The streaming draft"): a Llama decoder whose embedding and LM head cover only the `vocab_ids`
most frequent target tokens (index i <-> target id vocab_ids[i]; every other target id embeds as one shared
"other" row and is never predicted), plus `streams` small recurrent stream heads. At each position the main
stream predicts the next token y1 as any LM would; stream head j takes the previous stream's hidden state and the
embedding of its argmax token and predicts one token further (y_{j+1}), so one forward proposes y1..y_{S}.

The runtime never trusts the proposals blindly: the next forward feeds them, and the main stream's own
prediction at each fed position accepts the longest matching run (the draft verifies itself, as in Speculative
Streaming). The window is therefore exactly what the same draft would give one token per forward; only the number
of forwards changes. Stream heads are trained with the Speculative Streaming loss: CE(next) + sum_j alpha_j
CE(t + 1 + j), teacher-forced.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

CONFIG_NAME = "streaming_draft.json"
WEIGHTS_NAME = "streaming_draft.safetensors"


@dataclass
class StreamingDraftConfig:
    target_vocab_size: int
    vocab_ids: list[int]  # target ids of the draft's output vocabulary, most frequent first
    streams: int = 3  # extra tokens proposed per forward (tokens per forward = streams + 1 at most)
    stream_rank: int = 128  # width of each stream head's bottleneck
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 768
    max_position_embeddings: int = 4096
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    stream_weights: list[float] = field(default_factory=lambda: [0.6, 0.4, 0.3, 0.2, 0.1])  # alpha_j
    # The window of recent tokens the draft was trained on (train_draft's seq_len); 0: not recorded. The runtime
    # keeps the draft's attention to that window (partitions/manifest.py DraftFacts.attention_window).
    attention_window: int = 0

    @property
    def draft_vocab(self) -> int:
        return len(self.vocab_ids)

    def llama_config(self):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.draft_vocab + 1,  # + the shared "other" row
            hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size, max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps, tie_word_embeddings=True,
            bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id,
        )


class StreamHead(nn.Module):
    """h' = h + up(silu(down([norm(h); emb(y)]))): one more token ahead, given the token just predicted."""

    def __init__(self, hidden: int, rank: int, eps: float) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.norm = LlamaRMSNorm(hidden, eps=eps)
        self.down = nn.Linear(2 * hidden, rank, bias=False)
        self.up = nn.Linear(rank, hidden, bias=False)
        nn.init.zeros_(self.up.weight)  # starts as the identity: the stream begins as a copy of the main stream

    def forward(self, hidden: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        return hidden + self.up(nn.functional.silu(self.down(torch.cat([self.norm(hidden), token_embedding], -1))))


class StreamingDraft(nn.Module):
    def __init__(self, config: StreamingDraftConfig) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.config = config
        self.lm = LlamaForCausalLM(config.llama_config())
        self.heads = nn.ModuleList(StreamHead(config.hidden_size, config.stream_rank, config.rms_norm_eps)
                                   for _ in range(config.streams))
        id_map = torch.full((config.target_vocab_size,), config.draft_vocab, dtype=torch.long)
        id_map[torch.tensor(config.vocab_ids)] = torch.arange(config.draft_vocab)
        self.register_buffer("id_map", id_map, persistent=False)  # target id -> draft index ("other" = last)
        self.register_buffer("vocab_ids", torch.tensor(config.vocab_ids, dtype=torch.long), persistent=False)

    # -- pieces shared by training, the torch reference and the export segment ----------------------------------
    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[.., draft_vocab] logits of a pre-norm hidden state; the "other" row is never a prediction."""
        return self.lm.lm_head(self.lm.model.norm(hidden))[..., : self.config.draft_vocab]

    def stream_logits(self, hidden: torch.Tensor, first_tokens: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced or greedy stream chain. first_tokens [B,T]: draft indices of the token the main stream
        predicts (ground truth in training). Stream j is fed the token stream j-1 predicts (its argmax) unless
        `first_tokens` carries more columns (training passes [B,T,S] ground-truth indices)."""
        embed = self.lm.model.embed_tokens
        out = []
        tokens = first_tokens if first_tokens.dim() == 3 else first_tokens[..., None]
        for j, head in enumerate(self.heads):
            y = tokens[..., j] if j < tokens.shape[-1] else out[-1].argmax(-1)
            hidden = head(hidden, embed(y))
            out.append(self.draft_logits(hidden))
        return out

    def forward_train(self, target_ids: torch.Tensor, stream_stride: int = 1):
        """Teacher-forced on the sequence itself. Returns (main logits [B,T-1,Vd], their labels [B,T-1], per
        stream j logits [B,T',Vd], stream labels [B,T',S], positions [T']) where stream j at position t is fed
        the true tokens t+1..t+1+j and predicts t+2+j, over positions t < T - S - 1 (every stream has a label).
        Labels outside the draft vocabulary are -100 (ignored): the draft cannot propose them. stream_stride > 1
        trains the streams on every stride-th of those positions only (from a random offset): each stream costs a
        full LM head per position, more than the body."""
        ids = self.id_map[target_ids]  # [B,T]
        labels = ids.masked_fill(ids == self.config.draft_vocab, -100)
        hidden = self.prenorm_hidden(ids)
        logits = self.draft_logits(hidden)
        s, t = self.config.streams, ids.shape[1]
        span = t - s - 1
        pos = torch.arange(int(torch.randint(stream_stride, ())) if stream_stride > 1 else 0, span, stream_stride)
        fed = torch.stack([ids[:, 1 + j + pos] for j in range(s)], -1)  # [B,T',S]
        stream_labels = torch.stack([labels[:, 2 + j + pos] for j in range(s)], -1)
        streams = self.stream_logits(hidden[:, pos], fed)
        return logits[:, :-1], labels[:, 1:], streams, stream_labels, pos

    @torch.no_grad()
    def reference(self, target_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The torch oracle of the exported graph on a whole sequence: logits [B,T,Vd] and stream_ids [B,T,S]."""
        hidden = self.prenorm_hidden(self.id_map[target_ids])
        logits = self.draft_logits(hidden)
        streams = self.stream_logits(hidden, logits.argmax(-1))
        return {"logits": logits, "stream_ids": self.vocab_ids[torch.stack([s.argmax(-1) for s in streams], -1)]}

    def prenorm_hidden(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """The last decoder layer's output before the final norm, for a whole sequence (no cache)."""
        model = self.lm.model
        hidden = model.embed_tokens(draft_ids)
        positions = torch.arange(draft_ids.shape[1])[None].expand(draft_ids.shape[0], -1)
        cos_sin = model.rotary_emb(hidden, positions)
        t = draft_ids.shape[1]
        causal = torch.full((t, t), torch.finfo(hidden.dtype).min).triu(1)[None, None]
        for layer in model.layers:
            hidden = layer(hidden, attention_mask=causal, position_ids=positions, position_embeddings=cos_sin)
        return hidden

    # -- files ----------------------------------------------------------------------------------------------------
    def save(self, out_dir: str | Path) -> Path:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_NAME).write_text(json.dumps(asdict(self.config)) + "\n")
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items() if k != "lm.lm_head.weight"}
        save_file(state, str(out / WEIGHTS_NAME))
        return out

    @classmethod
    def load(cls, directory: str | Path) -> StreamingDraft:
        from safetensors.torch import load_file

        directory = Path(directory)
        model = cls(StreamingDraftConfig(**json.loads((directory / CONFIG_NAME).read_text())))
        missing, unexpected = model.load_state_dict(load_file(str(directory / WEIGHTS_NAME)), strict=False)
        if unexpected or [k for k in missing if k != "lm.lm_head.weight"]:
            raise ValueError(f"streaming draft weights do not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
        model.lm.tie_weights()
        return model.eval()

    @staticmethod
    def is_streaming_draft(directory: str | Path) -> bool:
        return (Path(directory) / CONFIG_NAME).is_file()
