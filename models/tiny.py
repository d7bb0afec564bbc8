"""Tiny random-weight model pairs built from configs, for tests and the offline demo. Nothing is downloaded.

`make_tokenizer` trains a small byte-level BPE on text this machine has (Python's own sources), so the pair has a
real tokenizer with a chat template; `make_model` builds a causal LM of a supported architecture around it.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Small but not degenerate: 2 query heads per KV head (grouped-query attention) and several layers to split.
TINY_SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512)
# Gemma 2's and 3's defaults are a 2B / 1B model's: heads of 256 and their scale, a window of 4,096 (here shorter
# than the tests' sequences, so that the sliding layers' mask matters). A tied head over an embedding scaled by
# sqrt(hidden_size) makes a tiny random model repeat one token, which would make every mode agree trivially: untied
# here (the tied case is exported in tests/test_export.py)
_GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4, tie_word_embeddings=False)
ARCHITECTURE_SIZES = {"gemma2": _GEMMA, "gemma3_text": _GEMMA}


def _training_text() -> list[str]:
    import json as json_module  # any stdlib module with enough prose and code will do

    return [Path(inspect.getfile(json_module)).parent.joinpath(f).read_text() for f in ("decoder.py", "encoder.py")]


def make_tokenizer(out_dir: str | Path, vocab_size: int = 384):
    """Train a byte-level BPE tokenizer, save it with a chat template to `out_dir`, and return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_training_text(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def make_model(out_dir: str | Path, architecture: str = "llama", num_layers: int = 6, seed: int = 0,
               tokenizer_dir: str | Path | None = None, vocab_size: int | None = None, **overrides) -> Path:
    """Write a random-weight causal LM (and a tokenizer) to `out_dir`; returns the directory.

    The vocabulary size is the tokenizer's, so a target and a draft made over the same tokenizer share it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else make_tokenizer(out)
    if tokenizer_dir:
        tokenizer.save_pretrained(out)
    sizes = {**TINY_SIZES, **ARCHITECTURE_SIZES.get(architecture, {}), **overrides}
    config = AutoConfig.for_model(
        architecture, num_hidden_layers=num_layers, vocab_size=vocab_size or len(tokenizer),
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id, **sizes,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Random init is near-uniform over the vocabulary; a larger spread makes greedy choices clear-cut, so
    # that near-ties cannot flip a token between runtimes in exactness tests.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
            elif name.endswith(".bias"):  # transformers starts them at 0: a graph that dropped one would pass parity
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    return out


def make_image_text_model(text_dir: str | Path, out_dir: str | Path) -> Path:
    """Gemma 3's image-text checkpoint (model type gemma3, as 4B and up ship) around the gemma3_text model at
    `text_dir`: its language model holds that model's weights, beside a tiny random vision tower; the tokenizer is
    copied. Returns `out_dir`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Gemma3Config

    text = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=AutoConfig.from_pretrained(text_dir).to_dict(), vision_config=vision,
                          mm_tokens_per_image=4, tie_word_embeddings=text.config.tie_word_embeddings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    model.generation_config = text.generation_config
    out = Path(out_dir)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(text_dir).save_pretrained(out)
    return out


def make_pair(root: str | Path, architecture: str = "llama", target_layers: int = 6, draft_layers: int = 2,
              seed: int = 0, tokenizer_dir: str | Path | None = None, **config_overrides) -> tuple[Path, Path]:
    """A target and a smaller draft of the same architecture sharing one tokenizer: (target_dir, draft_dir).

    tokenizer_dir: copy that directory's tokenizer instead of training one. config_overrides (e.g.
    tie_word_embeddings=True, sliding_window=4) apply to both models.
    """
    root = Path(root)
    target = make_model(root / "target", architecture, target_layers, seed=seed, tokenizer_dir=tokenizer_dir,
                        **config_overrides)
    draft_sizes = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    draft = make_model(root / "draft", architecture, draft_layers, seed=seed + 1, tokenizer_dir=target,
                       **{**config_overrides, **draft_sizes})
    (root / "pair.json").write_text(json.dumps({"architecture": architecture, "target": str(target),
                                                "draft": str(draft)}))
    return target, draft


def make_streaming_draft(out_dir: str | Path, tokenizer_dir: str | Path, seed: int = 0, streams: int = 3,
                         keep_every: int = 2) -> Path:
    """A random-weight streaming draft (models/streaming_draft.py) over every `keep_every`-th target id, with the
    target's tokenizer copied in; returns its directory."""
    from transformers import AutoTokenizer

    from mirror_sd.models.streaming_draft import StreamingDraft, StreamingDraftConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = len(tokenizer)
    config = StreamingDraftConfig(target_vocab_size=vocab, vocab_ids=list(range(0, vocab, keep_every)),
                                  streams=streams, stream_rank=16, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                                  max_position_embeddings=TINY_SIZES["max_position_embeddings"])
    torch.manual_seed(seed)
    model = StreamingDraft(config)
    with torch.no_grad():  # the same clear-cut spread as make_model
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.save(out_dir)
    tokenizer.save_pretrained(out_dir)
    return Path(out_dir)


def make_feature_draft(out_dir: str | Path, target_dir: str | Path, taps: tuple[int, ...] = (1, 3), seed: int = 0,
                       keep_every: int = 2, streams: int = 0) -> Path:
    """A feature draft (models/feature_draft.py) for the tiny target at `target_dir`, over every `keep_every`-th
    target id (the special tokens always), its layer copied from the target's and its weights spread so that its
    choices are clear-cut, with `streams` random stream heads over the first half of its vocabulary; saved in fp32.
    Returns its directory."""
    from transformers import AutoModelForCausalLM

    from mirror_sd.models.feature_draft import FeatureDraft, FeatureDraftConfig

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    vocab = target.config.vocab_size
    ids = list(dict.fromkeys(list(range(len(SPECIAL_TOKENS))) + list(range(0, vocab, keep_every))))
    config = FeatureDraftConfig.for_target(target.config, ids, list(taps))
    config.streams, config.stream_vocab = streams, len(ids) // 2 if streams else 0
    model = FeatureDraft(config)
    model.init_from_target(target)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and name != "embed.weight":
                p.normal_(0.0, 0.15)
    return model.save(out_dir, dtype=torch.float32)
