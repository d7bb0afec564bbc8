"""Supported decoder architectures: one thin class each, registered by transformers `model_type`.

All four share the Llama layout (`model.model.{embed_tokens, layers, norm, rotary_emb}`, `model.lm_head`); they
differ in which layers use a sliding attention window. Attribute names come from optimum's normalized configs so
the facts we record do not depend on each config's spelling.
"""

from __future__ import annotations

from typing import Callable

from optimum.utils.normalized_config import NormalizedConfigManager

from mirror_sd.errors import UnsupportedArchitectureError
from mirror_sd.partitions.manifest import ModelFacts

_REGISTRY: dict[str, type[Architecture]] = {}


def register(model_type: str) -> Callable[[type[Architecture]], type[Architecture]]:
    def wrap(cls: type[Architecture]) -> type[Architecture]:
        cls.model_type = model_type
        _REGISTRY[model_type] = cls
        return cls

    return wrap


def supported() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def architecture_of(config) -> Architecture:
    model_type = getattr(config, "model_type", None)
    if model_type not in _REGISTRY:
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} is not supported; supported: {', '.join(supported())}"
        )
    return _REGISTRY[model_type](config)


class Architecture:
    model_type = ""

    def __init__(self, config) -> None:
        self.config = config
        self.normalized = NormalizedConfigManager.get_normalized_config_class(self.model_type)(config)

    # -- modules -------------------------------------------------------------------------------------------------
    @staticmethod
    def backbone(model):
        return model.model  # embed_tokens, layers, norm, rotary_emb

    @staticmethod
    def lm_head(model):
        return model.lm_head

    # -- facts ---------------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.normalized.num_layers

    def facts(self) -> dict:
        n, c = self.normalized, self.config
        heads = n.num_attention_heads
        return dict(
            architecture=self.model_type,
            num_layers=n.num_layers,
            hidden_size=n.hidden_size,
            vocab_size=n.vocab_size,
            num_attention_heads=heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or n.hidden_size // heads,
            max_position_embeddings=getattr(c, "max_position_embeddings", 0) or 0,
        )

    def model_facts(self) -> ModelFacts:
        return ModelFacts(**self.facts())

    def sliding_windows(self) -> list[int | None]:
        """Per layer: the attention window in tokens, or None for full causal attention."""
        types = getattr(self.config, "layer_types", None)
        window = getattr(self.config, "sliding_window", None)
        if not types or window is None:
            return [None] * self.num_layers
        return [window if t == "sliding_attention" else None for t in types]


@register("llama")
class Llama(Architecture):
    pass


@register("qwen2")
class Qwen2(Architecture):
    pass  # sliding layers come from config.layer_types (use_sliding_window / max_window_layers)


@register("qwen3")
class Qwen3(Architecture):
    pass  # q_norm / k_norm live inside the attention module; nothing to do here


@register("mistral")
class Mistral(Architecture):
    def sliding_windows(self) -> list[int | None]:
        # Mistral has no layer_types: its sliding_window (if set) applies to every layer.
        return [getattr(self.config, "sliding_window", None)] * self.num_layers
