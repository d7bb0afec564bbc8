"""Supported decoder architectures: one thin class each, registered by transformers `model_type`.

All share the Llama layout (`model.model.{embed_tokens, layers, norm, rotary_emb}`, `model.lm_head`); they differ in
which layers use a sliding attention window, in how a layer's projections are stored (Phi-3 packs q, k and v in one
Linear and gate and up in another), in how much of each head the rotary embedding turns and by which angles, and (Gemma
2 and 3) in their norms, embedding scale, activation and soft caps. Each answers through the hooks below. Attribute
names come from optimum's normalized configs so the facts we record do not depend on each config's spelling.
"""

from __future__ import annotations

from typing import Callable

from optimum.utils.normalized_config import NormalizedConfigManager

from mirror_sd.errors import UnsupportedArchitectureError
from mirror_sd.partitions.manifest import ModelFacts

_REGISTRY: dict[str, type[Architecture]] = {}
# Image-text checkpoints whose language model is a registered architecture (Gemma 3 from 4B): the language model is
# what gets exported, as the causal LM of the checkpoint's text config (export/bundle.py drops the vision tower)
IMAGE_TEXT = ("gemma3",)


def register(model_type: str) -> Callable[[type[Architecture]], type[Architecture]]:
    def wrap(cls: type[Architecture]) -> type[Architecture]:
        cls.model_type = model_type
        _REGISTRY[model_type] = cls
        return cls

    return wrap


def supported() -> tuple[str, ...]:
    return tuple(sorted((*_REGISTRY, *IMAGE_TEXT)))


def text_config(config):
    """The config of the decoder to export: an image-text checkpoint's language model's (IMAGE_TEXT), else `config`."""
    return config.text_config if getattr(config, "model_type", None) in IMAGE_TEXT else config


def architecture_of(config) -> Architecture:
    config = text_config(config)
    model_type = getattr(config, "model_type", None)
    if model_type not in _REGISTRY:
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} is not supported; supported: {', '.join(supported())}"
        )
    return _REGISTRY[model_type](config)


class Architecture:
    model_type = ""
    window_on_every_layer = False  # config.sliding_window applies to every layer (no layer_types in the config)
    activation = "silu"  # the MLP's act(gate x) * up x: "silu", or "gelu_tanh" (Gemma's gelu_pytorch_tanh)
    config_names = ""  # optimum's model type whose config field names this one's share, where it lacks this one

    def __init__(self, config) -> None:
        self.config = config
        self.normalized = NormalizedConfigManager.get_normalized_config_class(
            self.config_names or self.model_type)(config)

    # -- modules -------------------------------------------------------------------------------------------------
    @staticmethod
    def backbone(model):
        return model.model  # embed_tokens, layers, norm, rotary_emb

    @staticmethod
    def lm_head(model):
        return model.lm_head

    @staticmethod
    def qkv(attn) -> list[tuple]:
        """The query, key and value projections of an attention module: (weight [out, in], bias or None) each."""
        return [(p.weight, p.bias) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]

    @staticmethod
    def gate_up(mlp) -> list[tuple]:
        """The MLP's gate and up projections (act(gate x) * up x): (weight [intermediate, hidden], bias or None) each
        (Llama's mlp_bias gives them biases)."""
        return [(p.weight, p.bias) for p in (mlp.gate_proj, mlp.up_proj)]

    @staticmethod
    def layer_norms(layer) -> tuple:
        """A layer's RMS norms: (before attention, on attention's output or None, before the MLP, on the MLP's output
        or None). Gemma normalises each block's output as well before the residual add."""
        return layer.input_layernorm, None, layer.post_attention_layernorm, None

    @staticmethod
    def norm_scale(norm):
        """What an RMS norm multiplies the normalised values by (Gemma's norms hold it less one)."""
        return norm.weight

    @staticmethod
    def norm_eps(norm) -> float:
        eps = getattr(norm, "variance_epsilon", None)
        return float(norm.eps if eps is None else eps)

    @staticmethod
    def embed_scale(backbone) -> float | None:
        """A factor on the token embedding (Gemma's sqrt(hidden_size)), or None."""
        return None

    def rotary_angles(self, rotary, x, position_ids) -> list[tuple]:
        """(cos, sin) per layer from the model's rotary module (`rotary`: it, or a stand-in with its call); layers
        sharing angles share the objects."""
        angles = rotary(x, position_ids)
        return [angles] * self.num_layers

    def softcaps(self) -> tuple[float | None, float | None]:
        """(attention scores', final logits') soft cap c: x -> c tanh(x / c), or None (Gemma 2 caps both)."""
        return None, None

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
            max_position_embeddings=self.max_positions(),
        )

    def max_positions(self) -> int:
        """The positions the graphs hold rotary angles for: the config's max_position_embeddings, except under
        longrope scaling (Phi-3.5, Phi-4-mini), whose angles change for every position once a sequence passes
        original_max_position_embeddings: the graphs hold the angles of a sequence within it (transformers' short
        factors), and the bundle's context ends there."""
        c = self.config
        longest = getattr(c, "max_position_embeddings", 0) or 0
        rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
        if rope.get("rope_type", rope.get("type")) == "longrope":
            original = rope.get("original_max_position_embeddings") or getattr(c, "original_max_position_embeddings", 0)
            if original:
                return min(longest, int(original)) if longest else int(original)
        return longest

    def model_facts(self) -> ModelFacts:
        return ModelFacts(**self.facts())

    def rotary_layers(self) -> list[bool]:
        """Per layer: whether its attention turns queries and keys by the rotary embedding (SmolLM3's NoPE layers do
        not)."""
        return [True] * self.num_layers

    def sliding_windows(self) -> list[int | None]:
        """Per layer: the attention window in tokens, or None for full causal attention (a window as long as the
        context sees every key: Phi-3.5's of 262,144 in a context of 4,096)."""
        limit = self.max_positions()
        return [None if w is None or (limit and w >= limit) else w for w in self.layer_windows()]

    def rotary_turned(self) -> int:
        """How many values of each head the rotary embedding turns (Phi-4-mini's partial_rotary_factor: part)."""
        c = self.config
        rope = getattr(c, "rope_parameters", None) or {}
        factor = rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", None))
        return int(self.facts()["head_dim"] * (1.0 if factor is None else factor))

    def layer_windows(self) -> list[int | None]:
        """Per layer: the config's attention window, or None."""
        types = getattr(self.config, "layer_types", None)
        window = getattr(self.config, "sliding_window", None)
        if self.window_on_every_layer:
            return [window] * self.num_layers
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
    window_on_every_layer = True


@register("phi3")
class Phi3(Architecture):
    """Phi-3, Phi-3.5 and Phi-4-mini: q, k and v in one Linear (qkv_proj), gate and up in another (gate_up_proj);
    Phi-4-mini turns only part of each head (partial_rotary_factor); longrope scaling (max_positions)."""

    window_on_every_layer = True

    @staticmethod
    def qkv(attn) -> list[tuple]:
        w = attn.qkv_proj.weight
        q = attn.config.num_attention_heads * attn.head_dim
        kv = attn.num_key_value_heads * attn.head_dim
        b = attn.qkv_proj.bias
        parts = (slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv))
        return [(w[p], None if b is None else b[p]) for p in parts]

    @staticmethod
    def gate_up(mlp) -> list[tuple]:
        w, b = mlp.gate_up_proj.weight, mlp.gate_up_proj.bias
        half = w.shape[0] // 2  # transformers: gate, up = gate_up_proj(x).chunk(2, dim=-1)
        return [(w[p], None if b is None else b[p]) for p in (slice(0, half), slice(half, None))]


@register("smollm3")
class SmolLM3(Architecture):
    """SmolLM3: the Llama layout with no rotary embedding in every fourth layer (config.no_rope_layers: 1 where a
    layer turns, despite its name). Its windows are layer_types' (transformers masks those layers whatever
    use_sliding_window says; the config writes sliding layers only under it)."""

    def rotary_layers(self) -> list[bool]:
        return [bool(turns) for turns in self.config.no_rope_layers]


class _Gemma(Architecture):
    """What Gemma 2 and 3 share: the token embedding times sqrt(hidden_size), RMS norms that scale by 1 + weight, each
    block's output normalised before its residual add, GELU (tanh) MLPs."""

    activation = "gelu_tanh"
    config_names = "gemma"  # optimum's normalized config of the first Gemma reads both configs' fields

    def __init__(self, config) -> None:
        super().__init__(config)
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedArchitectureError(f"{self.model_type} with bidirectional attention (an embedding model) "
                                               "is not a causal LM to decode")

    @staticmethod
    def layer_norms(layer) -> tuple:
        return (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                layer.post_feedforward_layernorm)

    @staticmethod
    def norm_scale(norm):
        return 1.0 + norm.weight.float()

    @staticmethod
    def embed_scale(backbone) -> float | None:
        return float(backbone.embed_tokens.embed_scale)


@register("gemma2")
class Gemma2(_Gemma):
    """Gemma 2: soft caps on the attention scores and the final logits."""

    def softcaps(self) -> tuple[float | None, float | None]:
        c = self.config
        return c.attn_logit_softcapping, c.final_logit_softcapping


@register("gemma3_text")
class Gemma3(_Gemma):
    """Gemma 3: the text-only checkpoints (gemma-3-270m, -1b) and the image-text ones' language model (4B up, model type
    gemma3: IMAGE_TEXT): per-head q / k norms, and other rotary angles on its sliding layers than on its full ones."""

    def __init__(self, config) -> None:
        super().__init__(config)
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(config, name, None) is not None:  # Gemma 3's attention takes no cap in transformers
                raise UnsupportedArchitectureError(f"gemma3_text with {name} is not supported")

    def rotary_angles(self, rotary, x, position_ids) -> list[tuple]:
        types = list(self.config.layer_types)
        by_type = {t: rotary(x, position_ids, t) for t in dict.fromkeys(types)}
        return [by_type[t] for t in types]
