"""GGUF -> Hugging Face conversion (models/gguf.py) on a tiny GGUF file written here; nothing is downloaded.

The GGUF is written the way llama.cpp's convert_hf_to_gguf.py writes a Llama: its tensor names, its metadata keys,
q and k projections permuted into llama.cpp's rotary layout, and a byte-level ("gpt2") BPE tokenizer in the
metadata. Its weights come from a random transformers model kept in memory, so the converted directory can be
checked against that model: same logits, a plain (unquantised) config, the same tokenizer.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mirror_sd.errors import BadInputError

SIZES = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-5)
TEXT = 'def encode(self, o):\n    return {"key": [1, 2.5, None]}  # <|im_start|>user\nhello<|im_end|>'


def _permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's q/k permutation (convert_hf_to_gguf.py, LlamaModel.permute): HF's rotate-half layout to
    interleaved pairs. transformers' LlamaTensorProcessor._reverse_permute_weights undoes it on load."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _gguf_tensors(model) -> dict[str, np.ndarray]:
    """The model's state under llama.cpp's tensor names, fp32, q and k permuted."""
    cfg = model.config
    sd = {k: v.detach().to(torch.float32).numpy().copy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out.update({
            f"blk.{i}.attn_q.weight": _permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads,
                                               cfg.num_attention_heads),
            f"blk.{i}.attn_k.weight": _permute(sd[p + "self_attn.k_proj.weight"], cfg.num_attention_heads,
                                               cfg.num_key_value_heads),
            f"blk.{i}.attn_v.weight": sd[p + "self_attn.v_proj.weight"],
            f"blk.{i}.attn_output.weight": sd[p + "self_attn.o_proj.weight"],
            f"blk.{i}.ffn_gate.weight": sd[p + "mlp.gate_proj.weight"],
            f"blk.{i}.ffn_up.weight": sd[p + "mlp.up_proj.weight"],
            f"blk.{i}.ffn_down.weight": sd[p + "mlp.down_proj.weight"],
            f"blk.{i}.attn_norm.weight": sd[p + "input_layernorm.weight"],
            f"blk.{i}.ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
        })
    return out


def _write_gguf(path, model, tokenizer) -> None:
    """A llama GGUF of `model` (F32 tensors) with `tokenizer` (a byte-level BPE) in its metadata."""
    import gguf

    cfg = model.config
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    assert backend["model"]["type"] == "BPE"
    vocab = backend["model"]["vocab"]
    special = {t["content"]: t["id"] for t in backend["added_tokens"] if t["special"]}
    vocab.update(special)
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    assert None not in tokens and len(tokens) == cfg.vocab_size
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]]
    token_types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(SIZES["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_chat_template(tokenizer.chat_template)
    for name, array in _gguf_tensors(model).items():
        w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from mirror_sd.models.tiny import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_convert_gguf_matches_source_model(tmp_path, tokenizer, tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from mirror_sd.models.gguf import convert_gguf

    config = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=tied, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **SIZES)
    torch.manual_seed(0)
    source = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # a spread well above init's, so a wrong q/k layout could not hide in small logits
        for p in source.parameters():
            p.normal_(0.0, 0.15) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    gguf_path = tmp_path / "tiny.gguf"
    _write_gguf(gguf_path, source, tokenizer)

    out = convert_gguf(gguf_path, tmp_path / "hf")
    assert out == tmp_path / "hf"

    saved_config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in saved_config
    assert saved_config["model_type"] == "llama"
    assert saved_config["tie_word_embeddings"] is tied
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "max_position_embeddings", "vocab_size"):
        assert saved_config[key] == getattr(config, key), key
    assert not any(f.suffix == ".gguf" for f in out.iterdir())

    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert getattr(converted.config, "quantization_config", None) is None
    assert not getattr(converted, "is_gguf", False) and getattr(converted, "hf_quantizer", None) is None
    text_ids = tokenizer.encode(TEXT)[:32]
    assert len(text_ids) == 32
    ids = torch.tensor([text_ids, list(range(0, len(tokenizer), len(tokenizer) // 32))[:32]])  # text, spread vocab
    with torch.no_grad():
        expected = source(ids).logits
        got = converted(ids).logits
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-5

    saved_tok = AutoTokenizer.from_pretrained(out)
    assert saved_tok.encode(TEXT) == tokenizer.encode(TEXT)
    assert saved_tok.decode(saved_tok.encode(TEXT)) == TEXT
    assert len(saved_tok) == len(tokenizer)
    assert (saved_tok.bos_token, saved_tok.eos_token) == (tokenizer.bos_token, tokenizer.eos_token)
    assert saved_tok.chat_template == tokenizer.chat_template


def test_convert_gguf_missing_file(tmp_path):
    from mirror_sd.models.gguf import convert_gguf

    with pytest.raises(BadInputError, match="does not exist"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_converts_and_prints_the_weights_digest(tmp_path, tokenizer, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    from mirror_sd.models.gguf import main, state_digest

    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **SIZES)
    torch.manual_seed(0)
    _write_gguf(tmp_path / "tiny.gguf", LlamaForCausalLM(config).eval(), tokenizer)
    assert main([str(tmp_path / "tiny.gguf"), str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out.split()[-1]
    assert printed == state_digest(tmp_path / "a")
    assert main([str(tmp_path / "tiny.gguf"), str(tmp_path / "b")]) == 0 and state_digest(tmp_path / "b") == printed
    assert main([str(tmp_path / "absent.gguf"), str(tmp_path / "c")]) == 2 and not (tmp_path / "c").exists()
