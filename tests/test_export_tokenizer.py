"""Export with a tokenizer that encodes the parity sample text to nothing.

A tiny Qwen2 pair whose tokenizer.json is WordLevel while its tokenizer_config.json names Qwen2Tokenizer: transformers
rebuilds that as a byte-level BPE over the word vocabulary (no merges, none of the bytes), which encodes ordinary
text to no ids at all, and the bundle gets that tokenizer. Export must still validate the graphs - on fixed ids
spread over the vocabulary, and say so - instead of dying with a traceback inside parity.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from mirror_sd.cli import main
from mirror_sd.errors import ExportError
from mirror_sd.export import parity
from mirror_sd.models.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, make_model
from mirror_sd.partitions import Manifest

DRAFT_SIZES = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)


def _word_level_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [*SPECIAL_TOKENS, "[UNK]", *(f"w{i}" for i in range(60)), *"the quick brown fox jumps over lazy".split()]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "bos_token": None,
        "pad_token": "<|endoftext|>", "unk_token": "[UNK]", "chat_template": CHAT_TEMPLATE}))


@pytest.fixture(scope="module")
def word_level_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("word-level")
    _word_level_tokenizer(root / "tok")
    target = make_model(root / "target", "qwen2", 4, seed=0, tokenizer_dir=root / "tok")
    draft = make_model(root / "draft", "qwen2", 2, seed=1, tokenizer_dir=root / "tok", **DRAFT_SIZES)
    for model in (target, draft):  # ship the WordLevel files themselves, as the model does
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(root / "tok" / name, model / name)
    return target, draft


@pytest.fixture(scope="module")
def word_level_export(tmp_path_factory, word_level_pair) -> tuple[int, list[str], str, Path]:
    """(exit code, stdout lines, stderr, OUT) of `mirror-sd export` on the pair."""
    target, draft = word_level_pair
    out = tmp_path_factory.mktemp("export") / "bundle"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["export", "--model", str(target), "--draft", str(draft), "--out", str(out)])
    return code, stdout.getvalue().splitlines(), stderr.getvalue(), out


def test_export_falls_back_to_vocabulary_ids_and_says_so(word_level_export):
    code, lines, err, out = word_level_export
    assert code == 0, err
    assert "Traceback" not in err
    fallback = [line for line in lines if "fixed ids spread over the vocabulary" in line]
    assert len(fallback) == 1 and "encodes the sample text to 0 ordinary token ids" in fallback[0]
    assert any(line.startswith("parity: all 24 checks passed") and "fixed vocabulary ids" in line for line in lines)
    assert not [p for p in out.parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]

    manifest = Manifest.load(out)
    validation = manifest.validation
    assert validation["passed"] is True and len(validation["checks"]) == 24
    assert validation["sample"]["source"] == "vocabulary"
    ids = validation["sample"]["ids"]
    assert len(ids) == parity.SAMPLE_TOKENS_NEEDED and len(set(ids)) == len(ids)  # distinct: small vocab, no repeats
    assert all(0 <= i < manifest.target.vocab_size for i in ids)
    specials = {0, 1, 2, 3}  # <|endoftext|> <|im_start|> <|im_end|> [UNK]
    assert not specials & set(ids)


def test_fallback_ids_are_deterministic(word_level_export):
    *_, out = word_level_export
    manifest = Manifest.load(out)
    first, second = parity.sample_tokens(out, manifest), parity.sample_tokens(out, manifest)
    assert first == second and list(first.ids) == manifest.validation["sample"]["ids"]
    rows = first.rows(2, 9)
    assert rows.shape == (2, 9) and (rows[1, :6] == rows[0, 3:]).all()  # row b starts 3 ids later


def test_unreadable_tokenizer_is_a_one_line_export_error(tmp_path, word_level_export):
    *_, out = word_level_export
    bundle = tmp_path / "bundle"
    shutil.copytree(out, bundle)
    (bundle / "tokenizer.json").write_text('{"model": {"type": "NoSuchModel"}}')
    with pytest.raises(ExportError, match="tokenizer.json cannot be read") as e:
        parity.sample_tokens(bundle, Manifest.load(bundle))
    assert "\n" not in str(e.value)


def test_a_text_tokenizer_still_runs_on_the_sample_text(bundle_factory):
    from tokenizers import Tokenizer

    bundle = bundle_factory("llama")
    manifest = Manifest.load(bundle)
    sample = parity.sample_tokens(bundle, manifest)
    assert sample.source == "text" and not sample.note
    assert list(sample.ids) == Tokenizer.from_file(str(bundle / "tokenizer.json")).encode(parity.SAMPLE_TEXT).ids
    assert manifest.validation["sample"] == {"source": "text"}
