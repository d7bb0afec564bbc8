"""A trained early-exit head: a light residual MLP on the layer-l_e hidden state, then the target's own final
norm and LM head.

The paper's logit lens (final norm + LM head on the raw layer-l_e state) is untrained; on a model as small as
SmolLM2 it rarely contains the target's final token (top-8: 27% at layer 15). The adapter learns the missing
layers' average effect, distilled from the target's final distribution, and costs one small MLP per position on
top of the LM head the logit lens already pays. It plugs into the prefix graph in place of the logit lens.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

CONFIG_NAME = "exit_adapter.json"
WEIGHTS_NAME = "exit_adapter.safetensors"


@dataclass
class ExitAdapterConfig:
    hidden_size: int
    exit_layer: int  # the target layer whose output it reads (the prefix's last layer is exit_layer - 1)
    rank: int = 1024  # MLP width
    rms_norm_eps: float = 1e-5


class ExitAdapter(nn.Module):
    """forward(hidden [B,T,H]) -> logits [B,T,V] through the target's frozen final norm and LM head."""

    kind = "adapter"

    def __init__(self, config: ExitAdapterConfig, final_norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.config = config
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.down = nn.Linear(config.hidden_size, config.rank, bias=False)
        self.up = nn.Linear(config.rank, config.hidden_size, bias=False)
        nn.init.zeros_(self.up.weight)  # starts as the logit lens
        # the target's own modules: registered so that export traces them, but never saved with the adapter
        self.final_norm, self.lm_head = final_norm, lm_head

    def adapted(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.up(nn.functional.silu(self.down(self.norm(hidden))))

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head reads (ExitTopK can run the head on some of its rows)."""
        return self.final_norm(self.adapted(hidden))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.head_input(hidden))

    def own_state(self) -> dict[str, torch.Tensor]:
        """The adapter's weights only (not the target's norm and LM head)."""
        return {k: v for k, v in self.state_dict().items() if k.split(".")[0] in ("norm", "down", "up")}

    def save(self, out_dir: str | Path) -> Path:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_NAME).write_text(json.dumps(asdict(self.config)) + "\n")
        save_file({k: v.detach().cpu().contiguous() for k, v in self.own_state().items()}, str(out / WEIGHTS_NAME))
        return out

    @classmethod
    def load(cls, directory: str | Path, final_norm: nn.Module, lm_head: nn.Module) -> ExitAdapter:
        from safetensors.torch import load_file

        directory = Path(directory)
        adapter = cls(ExitAdapterConfig(**json.loads((directory / CONFIG_NAME).read_text())), final_norm, lm_head)
        state = load_file(str(directory / WEIGHTS_NAME))
        if set(state) != set(adapter.own_state()):
            raise ValueError(f"exit adapter weights in {directory} do not fit its config")
        adapter.load_state_dict(state, strict=False)
        return adapter.eval()

    @staticmethod
    def is_exit_adapter(directory: str | Path) -> bool:
        return (Path(directory) / CONFIG_NAME).is_file()
