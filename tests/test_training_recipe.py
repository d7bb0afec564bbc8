"""The retraining recipe (models/training/recipe.py): the stages the committed weights were made with, in order,
with their trainers, settings, data and prompt ranges, pinned against the values models/smollm2.py's constants
held before the recipe was data; and the loop's glue (what each stage starts from, writes and commits) on stand-in
trainers, so nothing trains here."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from mirror_sd.models.training import recipe

GPU_FILES = ["advice", "broad", "code", "dialogue", "everyday"]  # the order the GPU runs read them in


def whole(*files):
    return [(f, 0, None) for f in files]


def feature(name, work, data, continues=True, average=None, **config):
    return name, "FeatureDraftStage", {"work": work, "continues": continues, "average": average}, config, data


def streams(name, work, data, **config):
    return name, "StreamHeadsStage", {"work": work}, config, data


def exit_stage(name, out, data, continues=None, hard_draft=None, teacher_cache=None, commit=None, **config):
    return (name, "ExitAdapterStage", {"out": out, "continues": continues, "hard_draft": hard_draft,
                                       "teacher_cache": teacher_cache, "commit": commit}, config, data)


def data_step(kind, pool, prompts, **more):
    return f"answers-{pool}:{prompts}", kind, {"pool": pool, "prompts": prompts, **more}, {}, None


CONTINUED = {"epochs": 1, "lr": 5e-4, "tokens_per_batch": 4096}
REPLAY = {"epochs": 1, "lr": 3e-4, "eval_records": 300, "refresh_vocab": 0}
GPU = {"lr": 3e-4, "tokens_per_batch": 16384, "budget_minutes": None, "extend_vocab": 0, "eval_records": 600}
STREAMS_CONTINUED = {"batches": 1200, "lr": 1e-3, "tokens_per_batch": 8192, "max_len": 1024, "eval_records": 64,
                     "continue_streams": True}
EXIT_HARD = {"conversations": 400, "skip": 800, "held_out": 100, "steps": 2400, "batch": 256, "lr": 1e-3,
             "minutes_per_layer": 60, "rank": 512}
EXIT_FILES = [("broad", 0, 13632), ("everyday", 0, 6000), ("code", 0, 3000), ("advice", 0, 2400),
              ("dialogue", 0, 2400)]
SELF = [*whole(*GPU_FILES), ("self", 0, 5573)]

# (name, stage type, the stage's own fields, its config's fields, data as (file, lo, hi)), from the constants
# FEATURE_TRAINING ... EXIT_TASKS and retrain_feature_draft() of models/smollm2.py before the recipe
EXPECTED_FEATURE_STAGES = [
    data_step("Answers", "broad", 20000, texts_from=None),
    data_step("Answers", "everyday", 16000, texts_from="broad"),
    data_step("Answers", "code", 3000, texts_from=None),
    data_step("Answers", "advice", 2400, texts_from=None),
    data_step("Answers", "dialogue", 6000, texts_from="advice"),
    feature("broad-first", "feature-draft", [("broad", 0, 5632)], continues=False, epochs=3, lr=1e-3,
            budget_minutes=50, eval_records=400),
    feature("broad-continued", "feature-draft", [("broad", 0, 5632)], budget_minutes=22, eval_records=400,
            **CONTINUED),
    feature("broad-all", "feature-draft", [("broad", 0, 13632)], budget_minutes=75, **CONTINUED),
    feature("broad-second-pass", "feature-draft", [("broad", 0, 13632)], budget_minutes=42, **CONTINUED),
    feature("everyday", "feature-draft", [("broad", 13632, 20000), ("everyday", 0, 6000)], budget_minutes=60,
            refresh_vocab=1024, refresh_drop="tail", **CONTINUED),
    feature("code", "feature-draft", [("code", 0, 3000), ("everyday", 0, 1500), ("broad", 13632, 15632)],
            budget_minutes=15, refresh_vocab=512, refresh_drop="least-used", eval_records=300, **CONTINUED),
    feature("advice", "feature-draft", [("advice", 0, 2400), ("everyday", 1500, 2500), ("broad", 15632, 16632),
                                        ("code", 0, 800)],
            budget_minutes=12, refresh_vocab=256, eval_records=300, **CONTINUED),
    feature("dialogue", "feature-draft", [("dialogue", 0, 2400), ("everyday", 3500, 4000), ("broad", 19000, 19500),
                                          ("code", 2200, 2600)],
            average=0.5, budget_minutes=12, eval_records=300, refresh_vocab=0, lr=5e-4),
    feature("mixed", "feature-draft", [("dialogue", 0, 1200), ("advice", 1200, 2400), ("everyday", 4000, 5200),
                                       ("broad", 16632, 17832), ("code", 2600, 3000)],
            average=0.5, budget_minutes=22, **REPLAY),
    feature("new-data", "feature-draft", [("dialogue", 2400, 4800), ("everyday", 6000, 8400), ("advice", 1800, 2400),
                                          ("broad", 5000, 6000), ("code", 0, 500)],
            average=0.5, budget_minutes=20, **REPLAY),
    feature("more-data", "feature-draft", [("dialogue", 4800, 6000), ("everyday", 8400, 12000), ("advice", 0, 600),
                                           ("broad", 6000, 7000), ("code", 500, 1000)],
            average=0.5, budget_minutes=20, **REPLAY),
    feature("latest-data", "feature-draft", [("dialogue", 0, 1200), ("everyday", 12000, 16000), ("advice", 600, 1200),
                                             ("broad", 7000, 8000), ("code", 1000, 1500)],
            average=0.5, budget_minutes=18, **REPLAY),
    feature("gpu-all", "feature-draft-gpu", whole(*GPU_FILES), epochs=1965 / 707, lr=6e-4, tokens_per_batch=16384,
            budget_minutes=None, extend_vocab=8192, eval_records=600),
    feature("gpu-more", "feature-draft-gpu", whole(*GPU_FILES), epochs=2567 / 707, **GPU),
    streams("streams", "feature-draft-streams", [("broad", 0, 3000), ("everyday", 0, 1500), ("code", 0, 800),
                                                 ("advice", 0, 600), ("dialogue", 0, 600)],
            streams=2, stream_vocab=4096, stream_width=576, depths=2, batches=400, lr=2e-3, tokens_per_batch=4096,
            max_len=512, eval_records=100, continue_streams=False),
    data_step("SelfQueries", "self", 10783),
    feature("self", "feature-draft-gpu-self", SELF, epochs=2472 / 789, **GPU),
    streams("self-streams", "feature-draft-streams-self", SELF, **STREAMS_CONTINUED),
    ("feature-draft-stage15", "Snapshot", {}, {}, None),
    feature("self-all", "feature-draft-gpu-self", whole(*GPU_FILES, "self"), epochs=2889 / 866, **GPU),
    streams("self-all-streams", "feature-draft-streams-self-all", whole(*GPU_FILES, "self"), **STREAMS_CONTINUED),
    exit_stage("exit-answers", "exit-adapters-answers", [("broad", 0, 13632)], layers=(24,), conversations=1000,
               rank=512, steps=800, batch=256, lr=2e-3, minutes_per_layer=5, hard_weight=0, skip=0, held_out=300),
    exit_stage("exit-mixed", "exit-adapters-mixed", EXIT_FILES[:3], continues="exit-adapters-answers", layers=(24,),
               conversations=800, rank=512, steps=2400, batch=256, lr=1e-3, minutes_per_layer=20, hard_weight=0),
    exit_stage("exit-hard", "exit-adapters-hard", EXIT_FILES, continues="exit-adapters-mixed",
               hard_draft="committed", teacher_cache="exit-adapters-hard-teacher", hard_weight=3.0, **EXIT_HARD),
    exit_stage("exit-hard-more", "exit-adapters-hard-more", EXIT_FILES, continues="exit-adapters-hard",
               hard_draft="committed", teacher_cache="exit-adapters-hard-teacher", hard_weight=8.0, **EXIT_HARD),
    exit_stage("exit-gpu", "exit-adapters-gpu", whole(*GPU_FILES, "self"), continues="exit-adapters-hard-more",
               hard_draft="feature-draft-stage15", commit=24, conversations=300, skip=1200, held_out=60,
               steps=4000, batch=1024, lr=1e-3, minutes_per_layer=600, hard_weight=8.0),
    data_step("TaskQueries", "tasks", 9040, self_answers="self"),
    feature("tasks", "feature-draft-gpu-tasks", [*whole(*GPU_FILES, "self"), ("tasks", 0, 3296), ("tasks", 0, 3296)],
            epochs=3072 / 965, **GPU),
    streams("tasks-streams", "feature-draft-streams-tasks",
            [*whole(*GPU_FILES, "self"), ("tasks", 0, 3296), ("tasks", 0, 3296)], **{**STREAMS_CONTINUED,
                                                                                      "batches": 900}),
    feature("tasks-all", "feature-draft-gpu-tasks-all",
            [*whole(*GPU_FILES, "self"), ("tasks", 0, 9040), ("tasks", 0, 9040)], epochs=2391 / 1136, **GPU),
    streams("tasks-all-streams", "feature-draft-streams-tasks-all",
            [*whole(*GPU_FILES, "self"), ("tasks", 0, 9040), ("tasks", 0, 9040)], **{**STREAMS_CONTINUED,
                                                                                      "batches": 900}),
    data_step("TaskQueries", "tasks", 13045, self_answers="self"),
    exit_stage("exit-tasks", "exit-adapters-tasks", [("tasks", 0, 3000), ("tasks", 3000, 6000), ("tasks", 6000, 9040),
                                                     ("tasks", 9040, 13045), *whole(*GPU_FILES, "self")],
               continues="committed", hard_draft="committed", teacher_cache="exit-adapters-tasks-teacher", commit=24,
               conversations=180, skip=1500, held_out=40, steps=2400, batch=256, lr=1e-3, minutes_per_layer=30,
               hard_weight=8.0),
]


def _check(stages, expected):
    assert [s.name for s in stages] == [e[0] for e in expected]
    for stage, (name, kind, fields, config, data) in zip(stages, expected):
        assert type(stage).__name__ == kind, name
        for key, value in fields.items():
            assert getattr(stage, key) == value, (name, key)
        for key, value in config.items():
            assert getattr(stage.config, key) == pytest.approx(value) if isinstance(value, float) \
                else getattr(stage.config, key) == value, (name, key, getattr(stage.config, key), value)
        if data is not None:
            got = [(s.file, s.lo, s.hi) for s in stage.data]
            assert got == data, name


def test_the_feature_stages_are_the_ones_the_committed_weights_were_made_with():
    _check(recipe.FEATURE_STAGES, EXPECTED_FEATURE_STAGES)
    # what every feature-draft stage shares (FEATURE_TRAINING's), every exit stage's layer, every seed
    for stage in recipe.FEATURE_STAGES:
        config = getattr(stage, "config", None)
        if isinstance(stage, recipe.FeatureDraftStage):
            assert (config.taps, config.vocab_size, config.max_len, config.steps, config.noise) == \
                ((5, 10, 15), 8192, 768, 4, 0.05), stage.name
            assert (config.soft_targets, config.max_loop, config.features) == (0, None, "auto"), stage.name
        if isinstance(stage, recipe.ExitAdapterStage):
            assert (config.layers, config.top_k) == ((24,), 8), stage.name
        if config is not None:
            assert config.seed == 0, stage.name


def test_the_streaming_stages_are_the_ones_the_committed_weights_were_made_with():
    stages = recipe.streaming_stages()  # `make models`'s --prompts 2400 --broad-prompts 3000 and its minutes
    assert [(type(s).__name__, s.name) for s in stages] == [
        ("Datagen", "datagen-base"), ("Datagen", "datagen-broad"), ("Datagen", "datagen-held-out"),
        ("StreamingDraftStage", "streaming-base"), ("StreamingDraftStage", "streaming-broad"),
        ("ExitAdapterStage", "exit-sweep")]
    assert [(s.pool, s.prompts, s.batch) for s in stages[:3]] == [("base", 2400, 32), ("broad", 3000, 64),
                                                                   ("held-out", 64, 32)]
    base, broad, sweep = stages[3:]
    assert (base.data, base.continues, base.eval) == (("datagen-base",), False, None)
    assert (broad.data, broad.continues, broad.eval) == (("datagen-base", "datagen-broad"), True, "datagen-held-out")
    assert {k: v for k, v in asdict(base.config).items() if k != "architecture"} == {
        "vocab_size": 8192, "steps": 2000, "budget_minutes": 25.0, "seq_len": 128, "batch": 16, "lr": 3e-3, "seed": 0}
    assert (broad.config.steps, broad.config.budget_minutes, broad.config.lr) == (3000, 40.0, 1.5e-3)
    assert (sweep.config.layers, sweep.config.conversations, sweep.config.rank, sweep.config.steps,
            sweep.config.batch, sweep.config.lr, sweep.config.minutes_per_layer) == ((15, 20, 24), 300, 512, 800,
                                                                                      256, 2e-3, 5.0)
    assert ([(s.file, s.lo, s.hi) for s in sweep.data], sweep.out, sweep.commit) == \
        ([("datagen-base", 0, None)], "exit-adapters", 15)
    assert [s.config.budget_minutes for s in recipe.streaming_stages(10, 20, 1.5, 2.5)[3:5]] == [1.5, 2.5]


def test_the_real_pairs_paths_hold_what_the_recipe_reads():
    """models/smollm2.py's layout: every answers file a stage reads is committed, the adapters go where the bundles
    and the exit sweep read them, and the adapter the recipe commits sits at the bundles' exit layer."""
    from mirror_sd.models import smollm2

    paths = smollm2.pair_paths()
    pools = {s.file for stage in recipe.FEATURE_STAGES for s in getattr(stage, "data", ())}
    assert pools and all(paths.file(pool).is_file() for pool in pools), pools
    assert paths.adapters[smollm2.EXIT_LAYER] == smollm2.ADAPTER_WEIGHTS
    assert {s.commit for s in recipe.FEATURE_STAGES if getattr(s, "commit", None)} == {smollm2.EXIT_LAYER}
    sweep = recipe.streaming_stages()[-1]
    assert paths.build / sweep.out == smollm2.ADAPTER_LAYERS and paths.adapters[sweep.commit] == \
        smollm2.ADAPTER_15_WEIGHTS
    assert paths.file("datagen-base").parent == paths.build / "data"


@pytest.fixture
def paths(tmp_path):
    weights = tmp_path / "weights"
    return recipe.PairPaths(target=tmp_path / "target", bundle=tmp_path / "bundle", data=tmp_path / "data",
                            build=tmp_path / "build", streaming_draft=weights / "streaming",
                            feature_draft=weights / "feature", adapters={24: weights / "exit-24"})


def test_a_feature_stage_continues_the_committed_draft_and_an_averaged_one_commits_the_mean(paths, monkeypatch):
    from mirror_sd.models.training import train_feature_draft

    calls = []

    def run(target, files, work, out, config, *, prompt_ranges, init_from, report):
        calls.append(("run", files, work, out, config, prompt_ranges, init_from, (work / "checkpoint.pt").exists()))
        return {"held_out": {}}

    monkeypatch.setattr(train_feature_draft, "run", run)
    monkeypatch.setattr(train_feature_draft, "average_drafts", lambda *a: calls.append(("average", *a)))
    work = paths.build / "feature-draft"
    work.mkdir(parents=True)
    paths.feature_draft.mkdir(parents=True)
    first, second, *_, averaged = [s for s in recipe.FEATURE_STAGES if isinstance(s, recipe.FeatureDraftStage)][:8]
    for stage in (first, second, averaged):
        (work / "checkpoint.pt").write_text("a stage before's")
        recipe.run([stage], paths, report=lambda _line: None)
    # a new draft resumes its own checkpoint; a continued stage starts afresh from the committed draft
    assert [c[7] for c in calls if c[0] == "run"] == [True, False, False]
    assert calls[0][1:7] == ([paths.data / "answers-broad.jsonl.gz"], work, paths.feature_draft, first.config,
                             [(0, 5632)], None)
    assert calls[1][3] == paths.feature_draft and calls[1][6] == paths.feature_draft
    stage_out = paths.build / "feature-draft-dialogue-stage"
    assert calls[2][3] == stage_out and calls[2][6] == paths.feature_draft
    assert calls[3] == ("average", [paths.feature_draft, stage_out], paths.feature_draft, [0.5, 0.5])
    assert json.loads((paths.feature_draft / "training.json").read_text())["averaged"]["weight_of_this_stage"] == 0.5


def test_exit_stages_continue_weigh_and_commit_the_adapters_the_recipe_names(paths, monkeypatch):
    from mirror_sd.models.training import train_exit

    calls = []

    def train(target, files, out, config, *, prompt_ranges, init_from, hard_draft, teacher_cache, report):
        calls.append((files, out, prompt_ranges, init_from, hard_draft, teacher_cache))
        (out / "layer-24").mkdir(parents=True)
        (out / "layer-24" / "exit_adapter.json").write_text(str(out))
        (out / "coverage.json").write_text("{}")

    monkeypatch.setattr(train_exit, "train", train)
    by_name = {s.name: s for s in recipe.FEATURE_STAGES}
    recipe.run([by_name[n] for n in ("exit-answers", "exit-mixed", "exit-hard", "exit-hard-more", "exit-gpu")],
               paths, report=lambda _line: None)
    build = paths.build
    assert [c[3] for c in calls] == [None, *(build / f"exit-adapters-{name}" / "layer-24"
                                             for name in ("answers", "mixed", "hard", "hard-more"))]
    assert [c[4] for c in calls] == [None, None, paths.feature_draft, paths.feature_draft,
                                     build / "feature-draft-stage15"]
    assert calls[2][5] == calls[3][5] == build / "exit-adapters-hard-teacher" and calls[4][5] is None
    assert calls[4][2] == [(0, None)] * 6 and calls[4][0][-1] == paths.data / "answers-self.jsonl.gz"
    committed = paths.adapters[24]
    assert (committed / "exit_adapter.json").read_text() == str(build / "exit-adapters-gpu")
    assert (committed / "coverage.json").is_file()
    calls.clear()
    recipe.run([by_name["exit-tasks"]], paths, report=lambda _line: None)
    assert calls[0][3] == committed and calls[0][4] == paths.feature_draft


def test_a_snapshot_keeps_the_committed_draft_as_it_is_then(paths):
    paths.feature_draft.mkdir(parents=True)
    (paths.feature_draft / "feature_draft.json").write_text("stage 15")
    recipe.run([recipe.Snapshot("feature-draft-stage15")], paths, report=lambda _line: None)
    (paths.feature_draft / "feature_draft.json").write_text("stage 16")
    assert (paths.build / "feature-draft-stage15" / "feature_draft.json").read_text() == "stage 15"

