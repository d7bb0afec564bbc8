"""The feature draft (models/feature_draft.py) and its training (models/train_feature_draft.py) on tiny targets."""

from __future__ import annotations

import gzip
import itertools
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import scripted_gate

import mirror_sd.runtime.draft as draft_module
import mirror_sd.runtime.speculation_policy as speculation_policy
from mirror_sd.models.feature_draft import FeatureDraft, FeatureDraftConfig
from mirror_sd.models.training import train_feature_draft as tfd


def _tiny_target(vocab: int = 300, layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def _draft(target, taps=(1, 2)) -> FeatureDraft:
    config = FeatureDraftConfig.for_target(target.config, list(range(0, target.config.vocab_size, 2)), list(taps))
    draft = FeatureDraft(config)
    draft.init_from_target(target)
    with torch.no_grad():  # move off the copied layer so every weight matters
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return draft.eval()


@pytest.mark.parametrize("base", [0, 5, 11])
def test_training_time_test_equals_the_sequential_rollout(base):
    """Step k of forward_ttt at position base + k is what the cached rollout drafts k tokens after `base`, when
    the tokens fed are the drafted ones: training optimises exactly what inference runs."""
    target = _tiny_target()
    draft = _draft(target)
    gamma, length = 4, 20
    ids = torch.randint(0, 300, (1, length))
    taps = torch.randn(1, length, 2, 64) * 3
    tokens, logits = draft.rollout(taps[0, : base + 1], ids[0, : base + 2], gamma)
    assert len(tokens) == gamma and all(t % 2 == 0 for t in tokens)  # only the draft vocabulary is proposed
    fed = ids.clone()
    fed[0, base + 2: base + 2 + gamma] = torch.tensor(tokens)
    with torch.no_grad():
        hs = draft.forward_ttt(taps, fed, gamma)
    for k in range(gamma):
        torch.testing.assert_close(draft.logits(hs[k][0, base + k]), logits[k], atol=1e-4, rtol=1e-4)


def test_save_load_keeps_the_draft_and_leaves_the_embedding_out(tmp_path):
    target = _tiny_target()
    draft = _draft(target)
    draft.save(tmp_path, dtype=torch.float32)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "feature_draft.safetensors"), "pt") as f:
        assert "embed.weight" not in set(f.keys())
    loaded = FeatureDraft.load(tmp_path, target.get_input_embeddings().weight)
    assert FeatureDraft.is_feature_draft(tmp_path)
    ids, taps = torch.randint(0, 300, (12,)), torch.randn(11, 2, 64)
    assert draft.rollout(taps, ids, 3)[0] == loaded.rollout(taps, ids, 3)[0]


def _answers_file(path, target, n: int = 24):
    """Greedy answers of the tiny target to random prompts, in models/answers.py's record format."""
    rng = np.random.default_rng(0)
    records = []
    for i in range(n):
        prompt = rng.integers(3, 300, size=int(rng.integers(6, 20))).tolist()
        with torch.no_grad():
            out = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0)
        ids = out[0].tolist()
        records.append({"index": i, "kind": "chat", "ids": ids, "answers": [[len(prompt), len(ids)]]})
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def _quiet(_line: str) -> None:
    pass


# a few seconds of training on a tiny target's answers
TINY = tfd.FeatureDraftTraining(taps=(1, 2), vocab_size=300, max_len=64, epochs=3, steps=2, lr=3e-3,
                                tokens_per_batch=256, noise=0.0, eval_records=10)


def _target_with_answers(tmp_path, n: int = 24):
    """A tiny 3-layer target saved with a tokenizer, and its greedy answers to n random prompts."""
    from mirror_sd.models.tiny import make_tokenizer

    target = _tiny_target(layers=3)
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    make_tokenizer(target_dir, vocab_size=300)
    data = tmp_path / "answers.jsonl.gz"
    _answers_file(data, target, n=n)
    return target, target_dir, data


def test_training_smoke_learns_the_targets_answers_and_resumes(tmp_path):
    """A few passes over a tiny target's greedy answers: features come from the target (the tap layers only), the
    held-out acceptance rises above the untrained draft's, a stopped run resumes from its checkpoint, and the
    saved draft loads."""
    target, target_dir, data = _target_with_answers(tmp_path)
    records = tfd.load_records([data], max_len=64)
    train, held = tfd.split(records)
    assert held and all(r.index % tfd.HOLD_OUT == 0 for r in held) and len(train) + len(held) == len(records)
    config = replace(TINY, epochs=30, steps=3)

    # features are the residual stream after each tap layer, as the target computes it
    work = tmp_path / "work"
    stopped = tfd.run(target_dir, [data], work, None, config, max_minutes=0.0, report=_quiet)
    assert stopped["finished"] is False and (work / "checkpoint.pt").exists()
    store = tfd.FeatureStore(work, train + held, [1, 2], 64)
    assert store.done == len(records)
    with torch.no_grad():
        hidden = target(torch.from_numpy(train[0].ids)[None], output_hidden_states=True).hidden_states
    np.testing.assert_allclose(store.get(0)[:, 1], hidden[2][0].numpy(), atol=2e-2, rtol=1e-2)

    out = tmp_path / "draft"
    summary = tfd.run(target_dir, [data], work, out, config, report=_quiet)
    written = json.loads((out / "training.json").read_text())["config"]  # the settings it was trained with
    assert written["taps"] == [1, 2] and written["epochs"] == 30
    assert summary["train"]["finished"] and summary["train"]["batches"] > stopped["batches"]
    untrained = FeatureDraft(FeatureDraftConfig.for_target(target.config, json.loads(
        (work / "vocab.json").read_text())["ids"], [1, 2]))
    untrained.init_from_target(target)
    before = tfd.evaluate(untrained, train + held, store, list(range(len(train), len(records))), 4, "cpu")
    assert summary["held_out"]["tokens_per_step"] > before["tokens_per_step"]
    assert 1.0 <= summary["held_out"]["tokens_per_step"] <= 5.0
    assert 1.0 <= summary["held_out"]["walked_tokens_per_step"] <= summary["held_out"]["tokens_per_step"] + 0.5
    loaded = FeatureDraft.load(out, target.get_input_embeddings().weight)
    assert loaded.config.taps == [1, 2] and (out / "training.json").exists()

    # training goes on from the saved draft (its vocabulary and taps), with checkpoints of its own
    more = tfd.run(target_dir, [data], tmp_path / "work2", tmp_path / "draft2",
                   replace(config, epochs=2, taps=None, refresh_vocab=4), init_from=out, report=_quiet)
    assert more["continued_from"] == str(out) and more["taps"] == [1, 2] and more["vocab_refreshed"] == 4
    assert more["held_out"]["tokens_per_step"] >= 1.0
    # or on other layers, as many as it reads (a deeper exit layer): its weights and vocabulary, the new taps
    retapped = tfd.run(target_dir, [data], tmp_path / "work3", tmp_path / "draft3",
                       replace(config, epochs=1, taps=(2, 3)), init_from=out, report=_quiet)
    assert retapped["taps"] == [2, 3]
    draft3 = FeatureDraft.load(tmp_path / "draft3", target.get_input_embeddings().weight)
    assert draft3.config.taps == [2, 3] and draft3.config.vocab_ids == loaded.config.vocab_ids
    with pytest.raises(SystemExit, match="reads 2 taps"):
        tfd.run(target_dir, [data], tmp_path / "work4", None, replace(config, taps=(3,)), init_from=out,
                report=_quiet)

    # two saved drafts side by side on the same held-out records: the figure training reported for each
    side = tfd.compare(target_dir, [out, tmp_path / "draft2"], [data], tmp_path / "work5", max_len=64,
                       eval_records=10, report=lambda _line: None)["by_file"][str(data)]
    assert side[str(out)]["tokens_per_step"] == pytest.approx(summary["held_out"]["tokens_per_step"], abs=0.02)
    assert side[str(tmp_path / "draft2")]["tokens_per_step"] == pytest.approx(
        more["held_out"]["tokens_per_step"], abs=0.02)


def test_soft_targets_are_the_targets_next_token_distribution_and_train(tmp_path):
    """--soft-targets: the whole target's top-K draft-vocabulary rows at every position, row p predicting ids[p + 1]
    (on greedy answers its top row is the answer's next token), probabilities summing to at most 1; a run with them
    trains and records them in its summary."""
    _, target_dir, data = _target_with_answers(tmp_path, n=12)
    summary = tfd.run(target_dir, [data], tmp_path / "work", tmp_path / "draft",
                      replace(TINY, soft_targets=4, soft_weight=0.5), report=_quiet)
    assert summary["soft_targets"] == 4 and summary["train"]["finished"]
    assert summary["held_out"]["tokens_per_step"] >= 1.0
    records = tfd.load_records([data], max_len=64)
    train, held = tfd.split(records)
    records = train + held
    vocab = json.loads((tmp_path / "work" / "vocab.json").read_text())["ids"]
    soft = tfd.SoftTargets(tmp_path / "work", records, vocab, 4)
    assert soft.done == len(records)
    hits = total = 0
    for i, r in enumerate(records):
        rows, probs = soft.get(i)
        assert (probs.astype(np.float32).sum(-1) <= 1.001).all() and (probs >= 0).all()
        top = np.asarray(vocab)[rows[np.arange(len(rows)), probs.argmax(-1)]]
        answer = np.flatnonzero(r.labels[1:])  # positions p whose next token the target generated
        hits += int((top[answer] == r.ids[answer + 1]).sum())
        total += len(answer)
    assert hits >= 0.95 * total


def test_online_features_are_the_stored_ones_and_train(tmp_path):
    """features="online" (the GPU way: the target's tap layers rerun per batch, nothing stored) gives the draft the
    features the stored path does, up to their fp16 storage, and a run with them trains and evaluates; the summary
    says which it used."""
    target, target_dir, data = _target_with_answers(tmp_path, n=12)
    stored = tfd.run(target_dir, [data], tmp_path / "work", tmp_path / "stored", replace(TINY, features="stored"),
                     report=_quiet)
    online = tfd.run(target_dir, [data], tmp_path / "work-online", tmp_path / "online",
                     replace(TINY, features="online"), report=_quiet)
    assert online["features"].startswith("online") and stored["features"] == "stored fp16"
    assert not (tmp_path / "work-online" / "features.f16").exists()
    assert online["train"]["finished"] and online["held_out"]["tokens_per_step"] >= 1.0
    assert online["held_out"]["bases"] == stored["held_out"]["bases"]
    records = tfd.load_records([data], max_len=64)
    train, held = tfd.split(records)
    store = tfd.FeatureStore(tmp_path / "work", train + held, [1, 2], 64)
    live = tfd.OnlineFeatures(_tiny_target(layers=3), [1, 2])
    for i in (0, len(train)):  # a padded batch of two records of different lengths: padding changes nothing
        ids, _, taps = tfd._tensors([i, 1], train + held, live, "cpu")
        n = len((train + held)[i].ids)
        np.testing.assert_allclose(taps[0, :n].numpy(), store.get(i).astype(np.float32), atol=2e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="one of"):
        replace(TINY, features="cached")


def test_an_extended_vocabulary_keeps_every_trained_row_and_adds_the_most_frequent_missing_tokens(tmp_path):
    """--extend-vocab N: the draft's vocabulary, then the N most frequent answer tokens it lacks; a continued run
    starts with every trained head row in place and the new rows from the target's LM head."""
    target = _tiny_target()
    old = list(range(0, 300, 2))
    rec = tfd.Record(1, np.array([7, 7, 7, 9, 9, 3, 2], np.int64), np.array([1, 1, 1, 1, 1, 1, 0], bool))
    assert tfd.extended_vocab(old, [rec], 2) == old + [7, 9]
    assert tfd.extended_vocab(old, [rec], 10) == old + [7, 9, 3]  # no more than the data has
    _, target_dir, data = _target_with_answers(tmp_path, n=12)
    config = replace(TINY, epochs=1)
    draft = _draft(target)
    draft.save(tmp_path / "start")
    more = tfd.run(target_dir, [data], tmp_path / "work", tmp_path / "more",
                   replace(config, taps=None, extend_vocab=20), init_from=tmp_path / "start", report=_quiet)
    grown = FeatureDraft.load(tmp_path / "more", target.get_input_embeddings().weight)
    assert grown.config.vocab_ids[: len(old)] == old and len(old) < len(grown.config.vocab_ids) <= len(old) + 20
    assert more["vocab_size"] == len(grown.config.vocab_ids) and more["vocab_extended"] == 20
    with pytest.raises(SystemExit, match="need --init-from"):
        tfd.run(target_dir, [data], tmp_path / "work2", None, replace(config, extend_vocab=4), report=_quiet)


def test_the_walk_takes_the_steps_sd_takes():
    """From a base sd commits the accepted tokens and the target's own, and its next step starts after them: an easy
    stretch counts once, not once per position (the mean over every base counts it at each)."""
    assert tfd._walk([True] * 6, [2, 0, 0, 1, 0, 0]) == (3, 6)  # bases 0, 3, 5
    # half the bases easy: the mean over bases is 2.5 tokens per step, sd walks 8 tokens in 5 steps (1.6)
    assert tfd._walk([True] * 8, [3, 3, 3, 3, 0, 0, 0, 0]) == (5, 8)
    assert tfd._walk([False, True, False, True], [4, 1, 4, 0]) == (2, 3)  # only bases whose window is all answer
    assert tfd._walk([], []) == (0, 0)


def test_exit_adapter_trains_on_an_answers_file(tmp_path):
    """The exit adapter learns from the committed answers (token ids, answer spans) as from a datagen file: the
    answer spans are the weighted positions, max_prompts keeps to a prefix of the prompts."""
    from mirror_sd.models.exit_adapter import ExitAdapter
    from mirror_sd.models.training import train_exit
    from mirror_sd.models.training.train_draft import ANSWER_WEIGHT

    target, target_dir, data = _target_with_answers(tmp_path, n=60)
    examples = train_exit.answer_examples(data, max_prompts=10)
    assert len(examples) == 10
    record = json.loads(gzip.open(data, "rt").readline())
    start, end = record["answers"][0]
    assert (examples[0].weights == ANSWER_WEIGHT).nonzero()[0].tolist() == list(range(start, end))
    config = train_exit.ExitAdapterTraining(layers=(1,), conversations=50, rank=64, steps=60, batch=64,
                                            minutes_per_layer=1)
    results = train_exit.train(target_dir, data, tmp_path / "adapters", config, report=_quiet)
    assert json.loads((tmp_path / "adapters" / "coverage.json").read_text())["config"]["layers"] == [1]
    row = results["layers"][1]
    assert row["adapter"][8] >= row["logit_lens"][8]
    assert ExitAdapter.is_exit_adapter(tmp_path / "adapters" / "layer-1")

    # continued on several answers files (here two prompt ranges of one), each with its own held-out conversations
    # and coverage; the adapter starts from the saved one, whose coverage is reported beside it
    more = train_exit.train(target_dir, [data, data], tmp_path / "mixed", replace(config, conversations=20, steps=30),
                            prompt_ranges=[(0, 30), (30, None)], init_from=tmp_path / "adapters" / "layer-1",
                            device="cpu", report=_quiet)
    assert more["device"].startswith("cpu (")  # where it ran, in its coverage.json (a GPU by its name)
    assert json.loads((tmp_path / "mixed" / "coverage.json").read_text())["device"] == more["device"]
    rows = more["layers"][1]
    assert set(rows) == {f"{data.name} 0:30", f"{data.name} 30:"}
    assert all(r["positions"] > 0 and {"adapter", "initial", "logit_lens"} <= set(r) for r in rows.values())
    assert more["init_from"] == str(tmp_path / "adapters" / "layer-1")
    assert more["positions"]["train"] > 0
    with pytest.raises(ValueError, match="not 2"):
        train_exit.train(target_dir, data, tmp_path / "bad", replace(config, layers=(2,), conversations=5, steps=1),
                         init_from=tmp_path / "adapters" / "layer-1", report=_quiet)


def test_draft_misses_are_the_rollouts_misses_at_each_depth():
    """The teacher pass's hard-position record: at exit position e and depth k, the draft's k-th token from base
    e-1-k (the cached rollout the runtime runs, the k tokens before it the text's own) is compared with the
    target's greedy token after e."""
    from mirror_sd.models.training import train_exit

    target = _tiny_target()
    draft = _draft(target)
    ids = torch.randint(0, 300, (14,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = target(ids[None], output_hidden_states=True)
    final = out.logits[0, :-1].argmax(-1)
    share, first = train_exit.draft_misses(draft, out.hidden_states, ids, final)
    taps = torch.stack([out.hidden_states[t][0] for t in draft.config.taps], 1)
    for e in range(len(ids) - 1):
        misses = []
        for k in range(train_exit.HARD_DEPTHS):
            base = e - 1 - k
            if base < 0:
                continue
            tokens, _ = draft.rollout(taps[: base + 1], ids[: base + 2], k + 1, fed=ids[base + 2: base + 2 + k])
            misses.append(tokens[k] != int(final[e]))
        expected = sum(misses) / len(misses) if misses else 0.0
        assert share[e].item() == pytest.approx(expected), e
        assert bool(first[e]) == (bool(misses[0]) if misses else False)
    assert 0 < share.mean() < 1  # a random draft misses some, not all
    wanted = torch.arange(len(ids) - 1) % 3 != 1  # the head on some rows only: the same figures there, 0 elsewhere
    some, some_first = train_exit.draft_misses(draft, out.hidden_states, ids, final, wanted)
    torch.testing.assert_close(some[wanted], share[wanted])
    assert torch.equal(some_first[wanted], first[wanted]) and not some[~wanted].any()


def test_exit_adapter_trains_on_the_positions_the_draft_misses(tmp_path):
    """With a feature draft, the teacher pass records its misses, training draws them more often, and coverage is
    reported where the draft misses; without the draft a hard weight is refused."""
    from mirror_sd.models.training import train_exit

    target, target_dir, data = _target_with_answers(tmp_path, n=40)
    draft = _draft(target)
    draft.save(tmp_path / "draft")
    config = train_exit.ExitAdapterTraining(layers=(1,), conversations=30, rank=64, steps=40, batch=64,
                                            minutes_per_layer=1, held_out=5)
    kwargs = {"hard_draft": tmp_path / "draft", "teacher_cache": tmp_path / "teacher"}
    lines: list[str] = []
    results = train_exit.train(target_dir, data, tmp_path / "adapters", replace(config, hard_weight=3.0),
                               report=lines.append, **kwargs)
    assert results["hard"]["weight"] == 3.0 and 0 < results["hard"]["train_mean_miss_share"] < 1
    missed = results["layers"][1]["draft_misses"]
    assert missed["positions"] > 0 and 0 <= missed["adapter"][4] <= 1
    assert not any("read from" in line for line in lines)

    # the same inputs again (another weight): the teacher passes come from the cache, the figures are the same
    lines.clear()
    again = train_exit.train(target_dir, data, tmp_path / "uniform", config, report=lines.append, **kwargs)
    assert any("teacher passes read from" in line for line in lines)
    assert again["hard"]["train_mean_miss_share"] == results["hard"]["train_mean_miss_share"]
    assert again["positions"] == results["positions"]
    lines.clear()
    train_exit.train(target_dir, data, tmp_path / "fewer", replace(config, conversations=20), report=lines.append,
                     **kwargs)  # other inputs: computed again
    assert not any("read from" in line for line in lines)
    with pytest.raises(ValueError, match="--hard-draft"):
        train_exit.train(target_dir, data, tmp_path / "bad", replace(config, conversations=5, steps=1, hard_weight=1.0),
                         report=_quiet)
    assert train_exit.main(["--target", str(target_dir), "--data", str(data), "--out", str(tmp_path / "cli"),
                            "--hard-weight", "2"]) == 2
    assert not (tmp_path / "cli").exists()


# -- export: the feature channel in the graphs and the manifest --------------------------------------------------
@pytest.fixture(scope="module")
def feature_bundle(tmp_path_factory, pair_factory):
    """A tiny llama target exported at exit layer 3 with a feature draft tapping layers 1 and 3."""
    from mirror_sd.export.bundle import ExportOptions, export_bundle
    from mirror_sd.models.tiny import make_feature_draft

    root = tmp_path_factory.mktemp("feature-bundle")
    target, _ = pair_factory("llama")
    draft = make_feature_draft(root / "draft", target, taps=(1, 3))
    export_bundle(ExportOptions(model=str(target), draft=str(draft), out=root / "bundle", exit_layer=3, top_k=4),
                  report=lambda _line: None)
    return root / "bundle", target, draft


def test_feature_draft_exports_with_its_channel_checked(feature_bundle):
    from mirror_sd.partitions.manifest import (
        DRAFT_HIDDEN,
        FEATURES,
        SURROGATE,
        TAPS,
        USE_SURROGATE,
        Manifest,
    )

    bundle, _, _ = feature_bundle
    m = Manifest.load(bundle)
    assert m.draft.feature_taps == (1, 3) and m.draft.hidden_size == m.target.hidden_size
    assert m.partition("target_prefix").output(TAPS).shape[2:] == (2, m.target.hidden_size)
    draft = m.partition("draft")
    assert {FEATURES, SURROGATE, USE_SURROGATE} <= {t.name for t in draft.inputs}
    assert draft.output(DRAFT_HIDDEN).shape[-1] == m.target.hidden_size
    checked = {(c["runtime"], c["quantity"]) for c in m.validation["checks"]}
    for runtime in ("onnxruntime-cpu", "openvino-cpu"):  # taps, draft logits and hidden state in both runtimes
        assert {(runtime, TAPS), (runtime, "logits"), (runtime, DRAFT_HIDDEN)} <= checked
    assert m.validation["passed"]


def test_feature_channel_is_validated(feature_bundle, tmp_path):
    import dataclasses

    from mirror_sd.errors import ManifestError
    from mirror_sd.partitions.manifest import Manifest

    bundle, _, _ = feature_bundle
    m = Manifest.load(bundle)
    with pytest.raises(ManifestError, match="feature_taps"):  # a tap past the exit layer
        dataclasses.replace(m, draft=dataclasses.replace(m.draft, feature_taps=(1, 4))).validate()
    with pytest.raises(ManifestError, match="feature channel"):  # the graphs carry it, the facts do not
        dataclasses.replace(m, draft=dataclasses.replace(m.draft, feature_taps=())).validate()
    with pytest.raises(ManifestError, match="taps"):  # the facts say 3 taps, the graphs give 2
        dataclasses.replace(m, draft=dataclasses.replace(m.draft, feature_taps=(1, 2, 3))).validate()


def test_feature_draft_deeper_than_the_exit_layer_is_refused(feature_bundle, tmp_path):
    from mirror_sd.errors import BadInputError
    from mirror_sd.export.bundle import ExportOptions, export_bundle

    _, target, draft = feature_bundle
    with pytest.raises(BadInputError, match="past the exit layer"):
        export_bundle(ExportOptions(model=str(target), draft=str(draft), out=tmp_path / "b", exit_layer=2, top_k=4),
                      report=lambda _line: None)
    assert not (tmp_path / "b").exists()


# -- runtime: the feature channel end to end ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_feature_bundle(tmp_path_factory, pair_factory):
    """A feature draft trained for a few seconds on the tiny llama target's own greedy answers, exported at exit
    layer 3, and prompts: two it was trained on (the random target's answers are only learnt by heart, so there the
    target accepts most of what it drafts) and one it was not (mostly rejected)."""
    from transformers import AutoModelForCausalLM

    from mirror_sd.export.bundle import ExportOptions, export_bundle

    root = tmp_path_factory.mktemp("trained-feature-bundle")
    target_dir, _ = pair_factory("llama")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    data = root / "answers.jsonl.gz"
    _answers_file(data, target, n=40)
    tfd.run(target_dir, [data], root / "work", root / "draft",
            replace(TINY, taps=(1, 3), vocab_size=384, epochs=80, steps=3, tokens_per_batch=512, eval_records=4),
            report=_quiet)
    export_bundle(ExportOptions(model=str(target_dir), draft=str(root / "draft"), out=root / "bundle", exit_layer=3,
                                top_k=8), report=lambda _line: None)
    learnt = [r.ids[~r.labels].tolist() for r in tfd.split(tfd.load_records([data], 64))[0][:2]]
    return root / "bundle", learnt + [[1, 200, 64, 9, 9, 120, 3]]


def test_feature_draft_sd_and_mirror_equal_ar_and_the_reference(trained_feature_bundle):
    from mirror_sd.runtime.pipeline import Pipeline
    from mirror_sd.runtime.reference import reference_generate

    bundle, prompts = trained_feature_bundle
    pipe = Pipeline.load(bundle)
    acceptance, stores = [], set()
    for prompt in prompts:
        ar = pipe.generate(prompt, mode="ar", max_new_tokens=24)
        assert reference_generate(pipe.target, pipe.draft, prompt, 24, gamma=3) == ar.token_ids[:24]
        for mode, gamma, kappa, overlap in [("sd", 1, None, True), ("sd", 4, None, False), ("sd", 3, None, True),
                                            ("mirror", 1, 1, True), ("mirror", 3, 4, True), ("mirror", 4, 8, False),
                                            ("mirror", 4, 8, True)]:
            out = pipe.generate(prompt, mode=mode, max_new_tokens=24, gamma=gamma, kappa=kappa, overlap=overlap)
            assert out.token_ids == ar.token_ids, f"{mode} gamma={gamma} kappa={kappa} overlap={overlap}"
            assert out.stats["fallbacks"] == 0 and out.stats["draft_failures"] == 0
            acceptance.append(out.stats["acceptance_rate"])
            stores.add(pipe._feature_store)
    assert max(acceptance) > 0.5 and min(acceptance) < 0.5  # both paths ran: long acceptances and rejections
    assert len(stores) == 1 and None not in stores  # every generation's drafter used the pipeline's one store


@pytest.fixture(scope="module")
def fed(trained_feature_bundle):
    """(pipeline, block, prompts) on the trained bundle; block(seq, start) is the FeatureBlock of the taps the
    target's prefix gives for positions start.. of seq."""
    from mirror_sd.runtime.messages import FeatureBlock
    from mirror_sd.runtime.pipeline import Pipeline

    bundle, prompts = trained_feature_bundle
    pipe = Pipeline.load(bundle)

    def block(seq, start):
        taps = pipe.target.run_prefix(list(seq), pipe.target.empty_cache()).taps
        return FeatureBlock(tuple(seq), start, taps[start:])

    return pipe, block, prompts


def test_feature_drafter_windows_equal_the_reference_after_rejections(fed):
    """The drafter's windows, with its lane kept across requests and cut back after rejections, equal the
    reference's from-scratch windows (every input with the target's taps of the position before it, drafted inputs
    on surrogates)."""
    from mirror_sd.runtime.feature_draft import FeatureDrafter, FeatureGapError
    from mirror_sd.runtime.reference import reference_feature_window
    from mirror_sd.runtime.sampling import SamplingParams

    pipe, block, prompts = fed
    target = pipe.target
    drafter = FeatureDrafter(pipe.draft, SamplingParams())
    prompt = prompts[0]
    assert drafter.warm(tuple(prompt), (block(prompt, 0),)) == len(prompt) - 1
    ctx = prompt + [int(target.prefill(prompt, target.empty_cache())[0].argmax())]
    rng = np.random.default_rng(0)
    sent = len(prompt)  # positions whose taps the drafter has
    for _ in range(6):
        window = drafter.rollout(tuple(ctx), 4, (block(ctx, sent),)).tokens  # as verification sends them
        sent = len(ctx) - 1
        assert list(window) == reference_feature_window(target, pipe.draft, ctx, 4)[0]
        # a rejection at a random slot with another token: the lane must drop the surrogate-fed inputs
        assert drafter.lane.length == len(ctx) - 1  # every input of ctx, with real taps; none drafted
        cut = int(rng.integers(0, 4))
        ctx = ctx + list(window[:cut]) + [int(rng.integers(3, 300))]
    with pytest.raises(FeatureGapError):  # taps that skip positions are refused, not guessed
        drafter.rollout(tuple(ctx + [5, 6, 7]), 2, ())


def test_a_drafter_on_an_earlier_drafters_store_drafts_as_a_fresh_one(fed):
    """A pipeline hands one taps store from each generation's drafter to the next (its pages stay mapped): the next
    drafter empties it, so what an earlier prompt left there never stands in for this prompt's taps. A store of
    another shape is refused."""
    from mirror_sd.runtime.feature_draft import FeatureDrafter, FeatureStore
    from mirror_sd.runtime.reference import reference_feature_window
    from mirror_sd.runtime.sampling import SamplingParams

    pipe, block, prompts = fed
    target = pipe.target
    first = FeatureDrafter(pipe.draft, SamplingParams())
    first.warm(tuple(prompts[1]), (block(prompts[1], 0),))
    for prompt in (prompts[0], prompts[2]):
        drafter = FeatureDrafter(pipe.draft, SamplingParams(), store=first.store)
        assert drafter.store is first.store and drafter.store.length == 0
        drafter.warm(tuple(prompt), (block(prompt, 0),))
        ctx = prompt + [int(target.prefill(prompt, target.empty_cache())[0].argmax())]
        window = drafter.rollout(tuple(ctx), 4, (block(ctx, len(prompt)),)).tokens
        assert list(window) == reference_feature_window(target, pipe.draft, ctx, 4)[0]
    shape = first.store.taps.shape
    with pytest.raises(ValueError, match="does not fit"):
        FeatureDrafter(pipe.draft, SamplingParams(), store=FeatureStore(shape[0] - 1, shape[1], shape[2], "float32"))


def test_feature_drafter_confidence_threshold_ends_windows_as_the_reference_does(fed):
    """With a confidence threshold (on each token's probability, or on the window's: "window"), rollouts and branch
    rows (which leave the batch as they end) are the reference's windows with the same threshold, and sd/mirror stay
    exact."""
    from mirror_sd.runtime.feature_draft import FeatureDrafter
    from mirror_sd.runtime.messages import ExitCandidates
    from mirror_sd.runtime.reference import reference_feature_window, reference_generate
    from mirror_sd.runtime.sampling import SamplingParams

    pipe, block, prompts = fed
    target = pipe.target
    lengths = set()
    for prompt in prompts:
        for rule, threshold in (("token", 0.3), ("token", 0.6), ("token", 0.9), ("window", 0.3), ("window", 0.6)):
            drafter = FeatureDrafter(pipe.draft, SamplingParams(), confidence=threshold, confidence_rule=rule)
            drafter.warm(tuple(prompt), (block(prompt, 0),))
            ctx = prompt + [int(target.prefill(prompt, target.empty_cache())[0].argmax())]
            window = drafter.rollout(tuple(ctx), 4, (block(ctx, len(prompt)),)).tokens
            assert list(window) == reference_feature_window(target, pipe.draft, ctx, 4, threshold, rule=rule)[0]
            lengths.add(len(window))
            # branches over the verification window [pending] + window, whose taps come with the request
            verified = ctx + list(window)
            plan = tuple((r, v) for r in range(len(window) + 1) for v in (7, 11))
            candidates = ExitCandidates(tuple(ctx), tuple(window), np.array([[7, 11]] * (len(window) + 1)),
                                        np.log(np.full((len(window) + 1, 2), 0.5)))
            branches = drafter.branches(candidates, plan, 4, features=(block(verified, len(ctx) - 1),))
            for r, v in plan:
                base = ctx + list(window[:r]) + [v]
                got = branches.windows[(r, v)].tokens
                want = reference_feature_window(target, pipe.draft, base, 4, threshold, rule=rule)[0]
                assert list(got) == want, (r, v)
                lengths.add(len(got))
        ar = pipe.generate(prompt, mode="ar", max_new_tokens=24)
        assert reference_generate(target, pipe.draft, prompt, 24, gamma=4, confidence=0.6) == ar.token_ids[:24]
        for (mode, overlap), rule in itertools.product((("sd", True), ("sd", False), ("mirror", True),
                                                         ("mirror", False)), ("token", "window")):
            out = pipe.generate(prompt, mode=mode, max_new_tokens=24, gamma=4, overlap=overlap,
                                draft_confidence_threshold=0.6, draft_confidence_rule=rule)
            assert out.token_ids == ar.token_ids, f"{mode} overlap={overlap} rule={rule}"
            assert out.stats["fallbacks"] == 0 and out.stats["draft_failures"] == 0
    assert len(lengths) > 2  # windows ended at several places


def test_an_inline_feature_draft_reads_the_prompt_after_the_first_token(fed):
    """A feature draft reads the prompt after the prefill (it needs the prefill's taps). Served inline (sd; mirror
    without branch sets; overlap off) that reading would hold back the first token: the first token is out before
    the draft has read anything, and the generation is still exact and speculates."""
    pipe, _, prompts = fed
    prompt = prompts[0]
    ar = pipe.generate(prompt, mode="ar", max_new_tokens=16)
    for mode, overlap in (("sd", True), ("mirror", False)):
        stream = pipe.stream(prompt, mode=mode, max_new_tokens=16, overlap=overlap, adaptive_speculation=False,
                             prompt_lookup_num_tokens=0)
        chunks = iter(stream)
        first = next(chunks)
        worker = pipe._worker
        assert not worker.threaded and worker.drafter.lane.length == 0, mode  # nothing read yet
        rest = [c.token_id for c in chunks]
        assert [first.token_id, *rest] == ar.token_ids, mode
        assert stream.result.stats["proposed_tokens"] > 0 and stream.result.stats["fallbacks"] == 0, mode


def test_feature_draft_packages_for_a_static_device(trained_feature_bundle, tmp_path, monkeypatch):
    """The static NPU package of a feature draft: the channel's inputs at fixed shapes, the static engine feeding
    them; outputs stay the target's and the package, with the bundle's own int8 weights, drafts what the bundle
    drafts."""
    from mirror_sd.package.build import PackageOptions, build_package
    from mirror_sd.runtime.pipeline import Pipeline

    bundle, prompts = trained_feature_bundle
    package = tmp_path / "package"
    info = build_package(PackageOptions(bundle=bundle, out=package, max_prompt=32, max_context=80, max_gamma=4,
                                        batch=3, prefill_chunk=8), report=lambda _line: None)
    assert info.weights == "int8_sym"
    dynamic, static = Pipeline.load(bundle), Pipeline.load(package)
    for prompt in prompts[:2]:
        ar = dynamic.generate(prompt, mode="ar", max_new_tokens=24)
        for mode in ("sd", "mirror"):
            # every step speculates in both, so that their acceptance is measured on the same windows
            want = dynamic.generate(prompt, mode=mode, max_new_tokens=24, gamma=4, adaptive_speculation=False)
            got = static.generate(prompt, mode=mode, max_new_tokens=24, gamma=4, adaptive_speculation=False)
            assert got.token_ids == ar.token_ids, mode
            assert got.stats["draft_graph"] == "static-ir" and got.stats["fallbacks"] == 0
            assert abs(got.stats["acceptance_rate"] - want.stats["acceptance_rate"]) <= 0.1
            # rows that end early leave the batch: the static graph takes the smaller batch too
            short = static.generate(prompt, mode=mode, max_new_tokens=24, gamma=4, draft_confidence_threshold=0.6)
            assert short.token_ids == ar.token_ids and short.stats["fallbacks"] == 0, mode
    # a draft that reads only a prompt's tail (its head held without KV, masked out), in the dynamic graph and the
    # static one (whose shared mask covers the whole lane buffer)
    monkeypatch.setattr(draft_module, "PROMPT_WINDOW", 4)
    for prompt in prompts:
        ar = dynamic.generate(prompt, mode="ar", max_new_tokens=24)
        for pipe in (dynamic, static):
            out = pipe.generate(prompt, mode="sd", max_new_tokens=24, gamma=4, adaptive_speculation=False,
                                prompt_lookup_num_tokens=0)
            assert out.token_ids == ar.token_ids and out.stats["fallbacks"] == 0
    monkeypatch.setattr(draft_module, "PROMPT_WINDOW", 1024)
    # runs of steps on the target alone: the draft reads what it missed into its cache before the next rollout,
    # so no row outgrows the static graphs (overlap off: the draft reads the prompt before the first step)
    # 11 steps alone, then 4
    monkeypatch.setattr(speculation_policy, "SpeculationGate", scripted_gate(lambda n: n % 16 >= 12))
    for prompt in prompts[:2]:
        ar = dynamic.generate(prompt, mode="ar", max_new_tokens=24)
        for mode in ("sd", "mirror"):
            out = static.generate(prompt, mode=mode, max_new_tokens=24, gamma=4, overlap=False)
            assert out.token_ids == ar.token_ids, mode
            s = out.stats
            assert s["gated_steps"] >= 11 and s["proposed_tokens"] > 0
            assert s["fallbacks"] == 0 and s["draft_failures"] == 0, mode


def test_plan_measures_a_feature_draft(trained_feature_bundle, tmp_path, capsys):
    """`mirror-sd plan` on a feature-draft bundle: its timings feed the draft the target's taps."""
    import json
    import shutil

    from mirror_sd.cli import main

    bundle = tmp_path / "bundle"
    shutil.copytree(trained_feature_bundle[0], bundle)
    args = ["--calibration", "2", "--max-new-tokens", "12", "--gammas", "2,3", "--kappas", "4", "--splits", "1+1",
            "--repeats", "2"]
    assert main(["plan", str(bundle), *args, "--json", "--save"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (bundle / "plan.json").is_file() and doc["runtime"]["gamma"] in (2, 3)
    assert doc["runtime"]["measured"]["tokens_per_second"] > 0
    assert doc["profile"]["splits"][0]["draft"]["branch_set_s (gamma,budget)"]


def test_averaged_drafts_are_the_weighted_mean_of_drafts_of_one_config(tmp_path):
    """average_drafts (the eighth stage's mean with the seventh): every tensor is the weighted mean, the config is
    kept, the result loads; drafts of another vocabulary, or weights that do not sum to 1, are refused and leave no
    output."""
    import copy

    target = _tiny_target()
    a = _draft(target)
    b = copy.deepcopy(a)
    with torch.no_grad():
        for p in b.parameters():
            if p is not b.embed.weight:
                p.add_(0.5)
    a.save(tmp_path / "a", dtype=torch.float32)
    b.save(tmp_path / "b", dtype=torch.float32)
    out = tfd.average_drafts([tmp_path / "a", tmp_path / "b"], tmp_path / "mean", [0.75, 0.25])
    mean = FeatureDraft.load(out, target.get_input_embeddings().weight)
    assert mean.config == a.config
    torch.testing.assert_close(mean.layer.q_proj.weight, 0.75 * a.layer.q_proj.weight + 0.25 * b.layer.q_proj.weight)
    torch.testing.assert_close(mean.head.weight, a.head.weight + 0.125)
    other = a.with_vocab(list(reversed(a.config.vocab_ids)), target.get_output_embeddings().weight)
    other.save(tmp_path / "other", dtype=torch.float32)
    with pytest.raises(ValueError, match="different configs"):
        tfd.average_drafts([tmp_path / "a", tmp_path / "other"], tmp_path / "bad", [0.5, 0.5])
    with pytest.raises(ValueError, match="summing to 1"):
        tfd.average_drafts([tmp_path / "a", tmp_path / "b"], tmp_path / "bad", [0.5, 0.6])
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.partial").exists()


def test_vocabulary_refresh_keeps_trained_rows_and_starts_new_ones_from_the_lm_head():
    """--refresh-vocab: the least frequent tokens (never a kept special one) make way for the new data's most
    frequent missing ones; kept tokens keep their trained head rows, new ones start as the target's LM head rows,
    and the rest of the draft is unchanged."""
    target = _tiny_target()
    draft = _draft(target)  # vocabulary: the even ids, most frequent first
    old = draft.config.vocab_ids
    ids = np.array([1, 3, 3, 5, 5, 5, 2, 0, old[-2]], np.int64)
    rec = tfd.Record(1, ids, np.ones(len(ids), bool))
    vocab = tfd.refreshed_vocab(old, [rec], 2, keep=[old[-1]])
    # dropped: the unused tokens latest in the list; old[-1] is kept, old[-2] is used by this data
    assert len(vocab) == len(old) and vocab[-2:] == [5, 3] and {old[-1], old[-2]} <= set(vocab)
    assert old[-3] not in vocab and old[-4] not in vocab
    tail = tfd.refreshed_vocab(old, [rec], 2, keep=[old[-1]], drop="tail")
    assert old[-2] not in tail and old[-3] not in tail and old[-4] in tail
    with pytest.raises(ValueError, match="least-used"):
        tfd.refreshed_vocab(old, [rec], 2, keep=[], drop="rarest")
    refreshed = draft.with_vocab(vocab, target.get_output_embeddings().weight)
    assert refreshed.config.vocab_ids == vocab and int(refreshed.id_map[5]) == len(vocab) - 2
    head, lm = refreshed.head.weight, target.get_output_embeddings().weight
    torch.testing.assert_close(head[vocab.index(old[0])], draft.head.weight[0])
    torch.testing.assert_close(head[-1], lm[3])
    torch.testing.assert_close(refreshed.layer.q_proj.weight, draft.layer.q_proj.weight)


def test_prompt_ranges_pick_records_per_answers_file(tmp_path):
    first, second = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.gz"
    for path, n in ((first, 6), (second, 4)):
        with gzip.open(path, "wt") as f:
            f.writelines(json.dumps({"index": i, "kind": "chat", "ids": [1, 2, 3, 4], "answers": [[2, 4]]}) + "\n"
                         for i in range(n))
    records = tfd.load_records([first, second], 64, ranges=[(2, 5), (0, None)])
    assert [r.index for r in records] == [2, 3, 4, 0, 1, 2, 3]
    assert [r.index for r in tfd.load_records([first, second], 64, max_prompts=2)] == [0, 1, 0, 1]
    assert tfd.parse_range("13632:") == (13632, None) and tfd.parse_range(":2500") == (0, 2500)
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="LO:HI"):
        tfd.parse_range("2500")
    with pytest.raises(ValueError, match="2 prompt ranges for 1"):
        tfd.load_records([first], 64, ranges=[(0, None), (0, None)])


def test_repeat_and_loop_shares_count_answer_tokens_whose_4_gram_came_before():
    """Hand-computed. The answer (positions 4-9) copies the prompt's 1 2 3 4 once, at position 8: a repeat (1 of 6
    answer tokens) but no loop. The answer 9 8 7 6 9 8 7 6 9 after 1 2 3 loops on its last two tokens (the 4-grams
    ending there came before in the answer and nowhere else); said first in the prompt, the same text is copied."""
    ids = np.array([1, 2, 3, 4, 9, 1, 2, 3, 4, 7])
    labels = np.arange(10) >= 4
    assert tfd.repeat_share(tfd.Record(0, ids, labels)) == pytest.approx(1 / 6)
    assert tfd.loop_share(tfd.Record(0, ids, labels)) == 0.0
    assert tfd.repeat_share(tfd.Record(0, ids, np.arange(10) >= 9)) == 0.0  # 2 3 4 7 is new
    looping = np.array([1, 2, 3, 9, 8, 7, 6, 9, 8, 7, 6, 9])
    answer = np.arange(12) >= 3
    assert tfd.loop_share(tfd.Record(0, looping, answer)) == pytest.approx(2 / 9)
    assert tfd.repeat_share(tfd.Record(0, looping, answer)) == pytest.approx(2 / 9)
    copied = np.array([9, 8, 7, 6, 5, 4, 9, 8, 7, 6, 5])  # the answer (6-10) ends on the prompt's 9 8 7 6 5
    assert tfd.loop_share(tfd.Record(0, copied, np.arange(11) >= 6)) == 0.0
    assert tfd.repeat_share(tfd.Record(0, copied, np.arange(11) >= 6)) == pytest.approx(2 / 5)
    assert tfd.loop_share(tfd.Record(0, ids[:3], labels[:3])) == 0.0  # shorter than one n-gram
    # token ids past 16 bits (a 128k vocabulary) count alike
    assert tfd.loop_share(tfd.Record(0, looping + 100_000, answer)) == pytest.approx(2 / 9)
    assert tfd.repeat_share(tfd.Record(0, ids + 100_000, labels)) == pytest.approx(1 / 6)


def test_max_loop_leaves_looping_training_records_out_and_every_held_out_one_in(tmp_path, capsys):
    target, target_dir, data = _target_with_answers(tmp_path, n=24)
    train, held = tfd.split(tfd.load_records([data], max_len=64))
    shares = sorted(tfd.loop_share(r) for r in train)
    limit = shares[len(shares) // 2]  # about half of them out
    expect = sum(s > limit for s in shares)
    assert 0 < expect < len(train)
    config = replace(TINY, epochs=1)
    full = tfd.run(target_dir, [data], tmp_path / "work-all", None, config, report=_quiet)
    kept = tfd.run(target_dir, [data], tmp_path / "work-kept", None, replace(config, max_loop=limit), report=_quiet)
    assert full["records"] == len(train) and full["records_left_out_as_looping"] == 0
    assert kept["records"] == len(train) - expect and kept["records_left_out_as_looping"] == expect
    assert kept["max_loop"] == limit and kept["held_out_records"] == full["held_out_records"] == len(held)
    assert kept["held_out"]["bases"] == full["held_out"]["bases"]
    assert tfd.main(["--target", str(target_dir), "--answers", str(data), "--max-loop", "1.5"]) == 2
    assert "max_loop 1.5" in capsys.readouterr().err


def test_prompt_ranges_must_match_the_answers_files(tmp_path, capsys):
    data = tmp_path / "a.jsonl.gz"
    data.write_bytes(b"")
    code = tfd.main(["--target", str(tmp_path), "--answers", str(data), "--prompt-range", "0:5", "5:"])
    assert code == 2 and "2 --prompt-range values for 1 answers files" in capsys.readouterr().err
    code = tfd.main(["--target", str(tmp_path), "--answers", str(data), "--soft-targets", "8", "--soft-weight", "2"])
    assert code == 2 and "soft_weight 2.0" in capsys.readouterr().err


def test_exit_adapter_training_refuses_bad_inputs_before_any_work(tmp_path, capsys):
    """train_exit's command checks its inputs as train_feature_draft's does (one check for both), and --init-from
    continues one adapter only."""
    from mirror_sd.models.training import train_exit

    data = tmp_path / "a.jsonl.gz"
    data.write_bytes(b"")
    base = ["--target", str(tmp_path), "--out", str(tmp_path / "out"), "--data", str(data)]
    assert train_exit.main([*base, "--prompt-range", "0:5", "5:"]) == 2
    assert "2 --prompt-range values for 1 data files" in capsys.readouterr().err
    assert train_exit.main([*base, "--init-from", str(tmp_path / "missing")]) == 2
    assert "not found: " in capsys.readouterr().err
    assert train_exit.main([*base, "--init-from", str(tmp_path), "--layers", "15,24"]) == 2
    assert "give one layer" in capsys.readouterr().err
    assert train_exit.main([*base, "--batch", "0"]) == 2
    assert "--batch 0" in capsys.readouterr().err
    if not torch.cuda.is_available():  # a GPU asked for where torch sees none: said before any work
        assert train_exit.main([*base, "--device", "cuda"]) == 2
        assert "torch sees no GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# -- stream heads: several drafted tokens per forward --------------------------------------------------------------
def test_stream_heads_read_the_draft_as_training_feeds_them():
    """with_streams keeps every weight of the draft; a rollout that trusts its streams is the plain rollout up to the
    token after which the streams fill the window, then the streams' proposals; and those proposals are what the
    training path (stream_states on forward_ttt's hidden state, fed the text's tokens) predicts where the text is the
    draft's own tokens: training optimises exactly what inference runs."""
    from mirror_sd.models.training import train_stream_heads as tsh

    target = _tiny_target()
    draft = _draft(target)
    streamed = draft.with_streams(2, stream_vocab=60)
    for name, value in draft.state_dict().items():
        assert torch.equal(streamed.state_dict()[name], value)
    with torch.no_grad():
        for p in streamed.stream_heads.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    base, gamma = 7, 4
    ids, taps = torch.randint(0, 300, (1, 20)), torch.randn(1, 20, 2, 64) * 3
    plain, _ = streamed.rollout(taps[0, : base + 1], ids[0, : base + 2], gamma)
    trusted, rows = streamed.rollout(taps[0, : base + 1], ids[0, : base + 2], gamma, trust_streams=True)
    assert trusted[:2] == plain[:2] and len(trusted) == gamma and rows.shape[0] == 2
    assert set(trusted[2:]) <= set(streamed.config.vocab_ids[:60])  # streams propose from their rows only
    fed = ids.clone()
    fed[0, base + 2: base + 2 + gamma] = torch.tensor(trusted)
    with torch.no_grad():
        h = streamed.forward_ttt(taps, fed, 2)[1][0, base + 1]  # depth 1 for base `base`
        states = streamed.stream_states(h, fed[0, base + 3: base + 5])
    got = [int(streamed.vocab_ids[streamed.stream_logits(z).argmax()]) for z in states]
    assert got == trusted[2:]
    rows = tsh._stream_rows(streamed, torch.tensor(streamed.config.vocab_ids[58:62] + [1]))
    assert rows.tolist() == [58, 59, -100, -100, -100]  # past the streams' rows, and outside the vocabulary


def test_stream_heads_are_saved_in_place_keeping_the_drafts_history(tmp_path):
    """Saving into the draft's own directory swaps the whole directory in: the draft gains its streams, its own
    training.json stays, the streams' summary is beside it, and no staging directory is left."""
    from mirror_sd.models.training import train_stream_heads as tsh

    target = _tiny_target()
    draft = _draft(target)
    where = tmp_path / "draft"
    draft.save(where, dtype=torch.float32)
    (where / "training.json").write_text('{"stages": 14}\n')
    tsh._save(draft.with_streams(2, stream_vocab=60), where, where, {"streams": 2})
    loaded = FeatureDraft.load(where, target.get_input_embeddings().weight)
    assert loaded.config.streams == 2 and len(loaded.stream_heads) == 2
    assert json.loads((where / "training.json").read_text()) == {"stages": 14}
    assert json.loads((where / tsh.STREAMS_SUMMARY).read_text()) == {"streams": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]


@pytest.fixture(scope="module")
def stream_feature_bundle(tmp_path_factory, trained_feature_bundle, pair_factory):
    """Stream heads trained on the trained feature draft's own data (the random target's answers, learnt by heart),
    exported: (bundle, prompts, training summary)."""
    from mirror_sd.export.bundle import ExportOptions, export_bundle
    from mirror_sd.models.training import train_stream_heads as tsh

    root = tmp_path_factory.mktemp("stream-feature-bundle")
    trained, prompts = trained_feature_bundle
    target_dir, _ = pair_factory("llama")
    draft_dir, data = trained.parent / "draft", trained.parent / "answers.jsonl.gz"
    config = tsh.StreamHeadsTraining(streams=2, stream_vocab=0, depths=2, batches=150, lr=5e-3, tokens_per_batch=512,
                                     max_len=64, eval_records=4)
    summary = tsh.run(target_dir, draft_dir, [data], root / "work", root / "draft", config, report=_quiet)
    export_bundle(ExportOptions(model=str(target_dir), draft=str(root / "draft"), out=root / "bundle", exit_layer=3,
                                top_k=8), report=lambda _line: None)
    return root / "bundle", prompts, summary


def test_stream_heads_train_and_export_with_their_proposals_checked(stream_feature_bundle, tmp_path):
    from mirror_sd.models.training import train_stream_heads as tsh
    from mirror_sd.partitions.manifest import STREAM_IDS, Manifest

    bundle, _, summary = stream_feature_bundle
    # accuracy over the streams' ~190 rows, averaged over the run (chance: ~0.005); the answers are learnt by heart
    assert summary["train"]["finished"] and min(summary["train"]["stream_accuracy"]) > 0.2
    held = summary["held_out"]
    assert held["trust_draft_tokens_per_forward"] == 2.0 and held["plain_draft_tokens_per_forward"] == 1.0
    assert held["bases"] > 0 and 1.0 <= held["trust_tokens_per_step"] <= 5.0
    m = Manifest.load(bundle)
    assert m.draft.streams == 2 and m.draft.tokens_per_forward == 3 and m.draft.feature_taps == (1, 3)
    assert m.partition("draft").output(STREAM_IDS).shape[-1] == 2
    checked = {(c["runtime"], c["quantity"]) for c in m.validation["checks"]}
    assert {("onnxruntime-cpu", STREAM_IDS), ("openvino-cpu", STREAM_IDS)} <= checked and m.validation["passed"]
    # bad inputs: a code and a message, nothing written
    draft_dir = bundle.parent / "draft"
    assert tsh.main(["--target", str(draft_dir), "--draft", str(tmp_path), "--answers", str(tmp_path / "none.gz"),
                     "--work", str(tmp_path / "w")]) == 2
    assert tsh.main(["--target", str(draft_dir), "--draft", str(tmp_path), "--work", str(tmp_path / "w"),
                     "--answers", str(draft_dir / "training.json")]) == 2  # not a feature draft
    assert not (tmp_path / "w").exists()


def test_stream_heads_continue_from_the_drafts_own(stream_feature_bundle, trained_feature_bundle, pair_factory,
                                                   tmp_path):
    """--continue-streams trains the heads the draft has (at lr 0 they come out as they went in; new heads would
    not), keeps the earlier summary under "before", and refuses heads of another shape with exit code 2."""
    from safetensors.torch import load_file

    from mirror_sd.models.feature_draft import WEIGHTS_NAME
    from mirror_sd.models.training import train_stream_heads as tsh

    bundle, _, summary = stream_feature_bundle
    target_dir, _ = pair_factory("llama")
    draft_dir, data = bundle.parent / "draft", trained_feature_bundle[0].parent / "answers.jsonl.gz"
    config = tsh.StreamHeadsTraining(streams=2, stream_vocab=0, depths=1, batches=2, lr=0.0, tokens_per_batch=256,
                                     max_len=64, eval_records=2, continue_streams=True)
    done = tsh.run(target_dir, draft_dir, [data], tmp_path / "work", tmp_path / "out", config, report=_quiet)
    assert done["before"] == summary

    def heads(where):
        return {k: v for k, v in load_file(str(where / WEIGHTS_NAME)).items() if k.startswith("stream_heads.")}

    before, after = heads(draft_dir), heads(tmp_path / "out")
    assert before and before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert tsh.main(["--target", str(target_dir), "--draft", str(draft_dir), "--answers", str(data), "--work",
                     str(tmp_path / "w"), "--streams", "1", "--stream-vocab", "0", "--continue-streams"]) == 2
    assert not (tmp_path / "w").exists()


def test_stream_head_training_stops_on_its_time_budget_and_resumes(trained_feature_bundle, pair_factory, tmp_path):
    """A run out of time writes its checkpoint and no draft; run again, it goes on from that batch and finishes."""
    from mirror_sd.models.training import train_stream_heads as tsh

    trained, _ = trained_feature_bundle
    target_dir, _ = pair_factory("llama")
    config = tsh.StreamHeadsTraining(streams=1, stream_vocab=0, depths=1, batches=3, tokens_per_batch=256,
                                     max_len=64, eval_records=2)
    first = tsh.run(target_dir, trained.parent / "draft", [trained.parent / "answers.jsonl.gz"], tmp_path / "work",
                    tmp_path / "out", config, max_minutes=0.0, report=_quiet)
    assert first == {"finished": False, "batches": 1, "of": 3} and not (tmp_path / "out").exists()
    done = tsh.run(target_dir, trained.parent / "draft", [trained.parent / "answers.jsonl.gz"], tmp_path / "work",
                   tmp_path / "out", config, report=_quiet)
    assert done["train"]["finished"] and done["train"]["batches"] == 3
    assert torch.load(tmp_path / "work" / "checkpoint.pt")["done"] == 3
    assert json.loads((tmp_path / "out" / tsh.STREAMS_SUMMARY).read_text())["streams"] == 1


def test_stream_feature_drafter_windows_equal_the_reference_and_sd_mirror_stay_exact(stream_feature_bundle):
    """Trusting the streams: rollouts and branch rows are the reference's windows with trust_streams (gamma - 2 main
    tokens, then the streams), "off" gives the plain windows, and sd / mirror equal ar with overlap on and off, at
    more than one draft token per forward."""
    from mirror_sd.runtime.feature_draft import FeatureDrafter
    from mirror_sd.runtime.messages import ExitCandidates, FeatureBlock
    from mirror_sd.runtime.pipeline import Pipeline
    from mirror_sd.runtime.reference import reference_feature_window, reference_generate
    from mirror_sd.runtime.sampling import SamplingParams

    bundle, prompts, _ = stream_feature_bundle
    pipe = Pipeline.load(bundle)
    target = pipe.target

    def block(seq, start):
        return FeatureBlock(tuple(seq), start, target.run_prefix(list(seq), target.empty_cache()).taps[start:])

    for prompt in prompts:
        ctx = prompt + [int(target.prefill(prompt, target.empty_cache())[0].argmax())]
        for streaming, gamma in (("trust", 4), ("trust", 3), ("trust", 2), ("off", 4)):
            drafter = FeatureDrafter(pipe.draft, SamplingParams(), streaming=streaming)
            drafter.warm(tuple(prompt), (block(prompt, 0),))
            window = drafter.rollout(tuple(ctx), gamma, (block(ctx, len(prompt)),)).tokens
            trust = streaming == "trust"
            assert list(window) == reference_feature_window(target, pipe.draft, ctx, gamma, trust_streams=trust)[0]
            verified = ctx + list(window)
            plan = tuple((r, v) for r in range(len(window) + 1) for v in (7, 11))
            candidates = ExitCandidates(tuple(ctx), tuple(window), np.array([[7, 11]] * (len(window) + 1)),
                                        np.log(np.full((len(window) + 1, 2), 0.5)))
            branches = drafter.branches(candidates, plan, gamma, features=(block(verified, len(ctx) - 1),))
            for r, v in plan:
                base = ctx + list(window[:r]) + [v]
                want = reference_feature_window(target, pipe.draft, base, gamma, trust_streams=trust)[0]
                assert list(branches.windows[(r, v)].tokens) == want, (streaming, gamma, r, v)
        ar = pipe.generate(prompt, mode="ar", max_new_tokens=24)
        assert reference_generate(target, pipe.draft, prompt, 24, gamma=4) == ar.token_ids[:24]
        for mode, gamma, overlap, streaming in (("sd", 4, True, "trust"), ("sd", 3, False, "trust"),
                                                ("sd", 4, True, "off"), ("mirror", 4, True, "trust"),
                                                ("mirror", 4, False, "trust"), ("mirror", 3, True, "verify")):
            out = pipe.generate(prompt, mode=mode, max_new_tokens=24, gamma=gamma, overlap=overlap,
                                draft_streaming=streaming, adaptive_speculation=False)
            assert out.token_ids == ar.token_ids, (mode, gamma, overlap, streaming)
            s = out.stats
            assert s["fallbacks"] == 0 and s["draft_failures"] == 0
            if mode == "sd":
                assert (s["draft_tokens_per_forward"] > 1.5) == (streaming == "trust"), (gamma, streaming)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])  # phi3: the draft's layer from packed projections
def test_a_random_stream_feature_draft_is_exact_and_packages(arch, pair_factory, tmp_path):
    """Random stream heads propose tokens the target mostly rejects: sd and mirror still equal ar, in the bundle
    and in its static package (whose graphs take the draft's tokens per forward)."""
    import onnx

    from mirror_sd.export.bundle import ExportOptions, export_bundle
    from mirror_sd.models.tiny import make_feature_draft
    from mirror_sd.package.build import PackageOptions, build_package
    from mirror_sd.runtime.pipeline import Pipeline

    target, _ = pair_factory(arch)
    draft = make_feature_draft(tmp_path / "draft", target, taps=(1, 3), streams=2)
    export_bundle(ExportOptions(model=str(target), draft=str(draft), out=tmp_path / "bundle", exit_layer=3, top_k=4),
                  report=lambda _line: None)
    graph = onnx.load(str(tmp_path / "bundle" / "draft.onnx"))
    constants = {t.name for t in graph.graph.initializer}
    # every weight int8, the stream heads' shared head rows too (the exporter shares them through an Identity)
    assert not [n.name for n in graph.graph.node if n.op_type == "MatMul" and n.input[1] in constants]
    assert sum(n.op_type == "MatMulNBits" for n in graph.graph.node) == 10 + 3 * 2
    build_package(PackageOptions(bundle=tmp_path / "bundle", out=tmp_path / "package", max_prompt=32, max_context=80,
                                 max_gamma=4, batch=3, prefill_chunk=8), report=lambda _line: None)
    prompt = [1, 200, 64, 9, 9, 120, 3]
    for pipe in (Pipeline.load(tmp_path / "bundle"), Pipeline.load(tmp_path / "package")):
        ar = pipe.generate(prompt, mode="ar", max_new_tokens=20)
        for mode in ("sd", "mirror"):
            out = pipe.generate(prompt, mode=mode, max_new_tokens=20, gamma=4, adaptive_speculation=False)
            assert out.token_ids == ar.token_ids, mode
            assert out.stats["fallbacks"] == 0 and out.stats["draft_tokens_per_forward"] > 1.0


def test_gpu_training_modules_import_without_export_or_runtime_packages():
    """The GPU machine (lab/scripts/self_data_gpu.sh) has torch, transformers and numpy only: the modules it runs
    must not reach optimum, onnxruntime or openvino, nor what they import inside (train_exit's train() imports
    export/segments.py, which once imported optimum)."""
    import subprocess
    import sys

    modules = ["mirror_sd.models.training.train_exit", "mirror_sd.models.training.train_feature_draft",
               "mirror_sd.models.training.train_stream_heads", "mirror_sd.models.training.self_queries",
               "mirror_sd.models.gguf",
               "mirror_sd.export.segments", "mirror_sd.models.exit_adapter", "mirror_sd.models.feature_draft"]
    code = ("import sys\nfor m in ('optimum', 'onnxruntime', 'openvino'):\n    sys.modules[m] = None\n"
            + "".join(f"import {m}\n" for m in modules))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _drafting_engine(bundle, monkeypatch, speculate_when):
    """A pipeline on `bundle` whose batching engine's window steps follow speculate_when(n) (a scripted gate), and
    the windows its rows' drafts proposed, as (row draft, context, window, the lane's first position with KV)."""
    import mirror_sd.runtime.batching as batching
    import mirror_sd.runtime.row_drafts as row_drafts
    from mirror_sd.runtime.pipeline import Pipeline

    monkeypatch.setattr(batching, "SpeculationGate", scripted_gate(speculate_when))
    proposed = []
    propose = row_drafts.RowDraft.propose

    def recorded(self, ctx, length):
        window = propose(self, ctx, length)
        if window is not None:
            proposed.append((self, list(ctx), list(window.tokens), self.drafter.lane.start))
        return window

    monkeypatch.setattr(row_drafts.RowDraft, "propose", recorded)
    return Pipeline.load(bundle, huge_pages=False, max_num_seqs=4), proposed


@pytest.mark.parametrize("mode", ["sd", "mirror"])
def test_batched_rows_draft_their_own_windows_as_the_reference_and_keep_their_solo_outputs(
        trained_feature_bundle, monkeypatch, mode):
    """At batch > 1 each greedy sd / mirror row drafts its windows with a feature drafter of its own, fed the taps
    its batched target steps computed (prefill chunks, plain steps, window steps): its windows are the reference's
    from-scratch windows of those contexts (up to near-ties), the rows verify them in one step, and every output is
    its solo one."""
    from mirror_sd.runtime.reference import reference_feature_window

    bundle, prompts = trained_feature_bundle
    pipe, proposed = _drafting_engine(bundle, monkeypatch, lambda n: n % 3 != 0)  # plain steps between windows
    try:
        options = {"max_new_tokens": 24, "ignore_eos": True, "gamma": 3, "draft_confidence_threshold": 0.0,
                   "prompt_lookup_num_tokens": 0, "draft_streaming": "off"}
        alone = [pipe.generate(p, mode="ar", **options).token_ids for p in prompts]
        results = pipe.generate(prompts, mode=mode, **options)
        assert [r.token_ids for r in results] == alone
        for r in results:
            assert r.stats.batched_steps == r.stats.target_steps  # never alone
            assert r.stats["fresh_rollouts"] > 0 and r.stats["lookup_steps"] == 0 and r.stats["draft_failures"] == 0
        assert max(r.stats["acceptance_rate"] for r in results) > 0.5  # the learnt prompts' windows are accepted
        assert sum(r.stats.target_steps for r in results) < sum(len(r.token_ids) for r in results)
        assert len(proposed) >= 10
        assert all(start == 0 for *_, start in proposed)  # short prompts: the drafters read all of them
        # the taps come from batched steps (prefill chunks, one-token and window steps), whose float32 rounding
        # differs in the last bits from the reference's one prefix run over the whole sequence: a near-tie in the
        # draft's logits may go the other way, rarely
        same = [window == reference_feature_window(pipe.target, pipe.draft, ctx, len(window))[0]
                for _, ctx, window, _ in proposed]
        assert sum(same) >= 0.75 * len(same)
    finally:
        pipe.close()


def test_a_batched_draft_that_fell_behind_starts_over_from_the_taps_its_row_kept(trained_feature_bundle, monkeypatch):
    """Rows keep the taps of their last TAPS_KEPT positions only (small here): a draft that missed more than that
    (steps without windows) starts over from what is kept, reading only those inputs, and drafts on. Outputs stay
    solo."""
    import mirror_sd.runtime.row_drafts as row_drafts

    monkeypatch.setattr(row_drafts, "TAPS_KEPT", 6)
    bundle, prompts = trained_feature_bundle
    pipe, proposed = _drafting_engine(bundle, monkeypatch, lambda n: n % 12 < 3)  # 9 plain steps between bursts
    try:
        options = {"max_new_tokens": 40, "ignore_eos": True, "gamma": 3, "prompt_lookup_num_tokens": 0}
        alone = [pipe.generate(p, mode="ar", **options).token_ids for p in prompts]
        results = pipe.generate(prompts, mode="sd", **options)
        assert [r.token_ids for r in results] == alone
        assert all(r.stats["fresh_rollouts"] >= 3 and r.stats["draft_failures"] == 0 for r in results)
        # after a gap the drafters started over: the context's head without KV, the inputs of the kept taps read
        # (up to 2 x TAPS_KEPT held between two moves of the buffer)
        last: dict[int, int] = {}
        restarts = []
        for row, ctx, _, start in proposed:
            if start != last.setdefault(id(row), 0):
                restarts.append(len(ctx) - 1 - start)
            last[id(row)] = start
        assert len(restarts) >= 3 and all(read <= 12 for read in restarts)
    finally:
        pipe.close()


def test_a_row_draft_reports_only_the_catch_up_of_its_last_window(trained_feature_bundle):
    """`RowDraft.catch_up_s` (what the engine's gate leaves out of a window step's time) is the last call's: a first
    window that read the prompt has some, a later call that drafts nothing (the taps of its latest positions were
    never handed over) has none, rather than the earlier call's."""
    from mirror_sd.runtime.pipeline import Pipeline
    from mirror_sd.runtime.row_drafts import RowDraft
    from mirror_sd.runtime.stats import Recorder

    bundle, prompts = trained_feature_bundle
    pipe = Pipeline.load(bundle, huge_pages=False)
    try:
        cfg, draft = pipe.generation_config.updated(mode="sd"), pipe.manifest.draft
        row = RowDraft(lambda: pipe.drafter(cfg, Recorder()), 3, (len(draft.feature_taps), draft.hidden_size),
                       draft.dtype)
        ids = list(prompts[0])
        row.ran(0, pipe.target.run_prefix(ids, pipe.target.empty_cache()).taps)
        assert row.propose([*ids, 1], 3) is not None and row.catch_up_s > 0
        assert row.propose([*ids, 1, 2, 3], 3) is None and row.catch_up_s == 0.0
    finally:
        pipe.close()
