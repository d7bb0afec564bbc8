"""`make models RETRAIN=1`: how the committed weights were made, as data, and the loop that makes them again.

Each stage is a record: its name, which trainer, the trainer's config (a stage that goes on from another is that
stage's config with dataclasses.replace), the answers it reads (file and prompt range), and what it starts from and
what it commits. `run` takes a list of them in order. Two lists: `streaming_stages` (the streaming draft and the
exit adapters of the exit-layer sweep, from transformers-generated answers) and FEATURE_STAGES (the committed
answers files, the feature draft, its stream heads and the bundles' exit adapter); between them models/smollm2.py
exports the streaming bundle, whose tokenizer and chat template render the answers. Every seed is 0.

Paths come in as a PairPaths (models/smollm2.py builds it): nothing here knows the repository's layout.
docs/training.md tells what each stage was for, where it ran and the evidence for adopting it.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from mirror_sd.models.training.train_draft import StreamingDraftTraining
from mirror_sd.models.training.train_exit import ExitAdapterTraining
from mirror_sd.models.training.train_feature_draft import FeatureDraftTraining
from mirror_sd.models.training.train_stream_heads import StreamHeadsTraining

Report = Callable[[str], object]

# The streaming draft's data: transformers-generated answers (models/training/datagen.py), not committed.
DATAGEN_FILES = {"datagen-base": "target_answers.jsonl", "datagen-broad": "target_answers_broad.jsonl",
                 "datagen-held-out": "held_out_answers.jsonl"}


@dataclass(frozen=True)
class PairPaths:
    """Where the recipe reads and writes."""

    target: Path  # the target, a transformers directory (fp32)
    bundle: Path  # a bundle of the target: its tokenizer and chat template render the answers
    data: Path  # the committed answers files, answers-<pool>.jsonl.gz
    build: Path  # scratch: datagen files, feature stores, checkpoints and every stage's own output
    streaming_draft: Path  # the committed weights the recipe writes
    feature_draft: Path
    adapters: Mapping[int, Path]  # the committed exit adapter per exit layer

    def file(self, name: str) -> Path:
        """A data file by name: a DATAGEN_FILES key, else the answers file of that pool."""
        if name in DATAGEN_FILES:
            return self.build / "data" / DATAGEN_FILES[name]
        return self.data / f"answers-{name}.jsonl.gz"


@dataclass(frozen=True)
class Slice:
    """The records of prompts [lo, hi) of one data file (hi None: to the end)."""

    file: str  # PairPaths.file's name
    lo: int = 0
    hi: int | None = None


def whole(*files: str) -> tuple[Slice, ...]:
    return tuple(Slice(f) for f in files)


def _files_and_ranges(data: Sequence[Slice], paths: PairPaths) -> tuple[list[Path], list[tuple[int, int | None]]]:
    return [paths.file(s.file) for s in data], [(s.lo, s.hi) for s in data]


# -- data -----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Datagen:
    """The target's answers to `prompts` prompts of a pool, with transformers (the streaming draft's data)."""

    name: str  # a DATAGEN_FILES key: the file written
    pool: str  # models/training/datagen.py POOLS
    prompts: int
    batch: int = 32

    def run(self, paths: PairPaths, report: Report) -> None:
        from mirror_sd.models.training import datagen

        datagen.generate(paths.target, paths.file(self.name), self.prompts, batch=self.batch, pool=self.pool)


@functools.cache
def _openvino_target(target: Path, cache: Path) -> Path:
    from mirror_sd.export.openvino_genai import convert, fingerprint

    return convert(target, cache / f"ov-genai-target-{fingerprint(target)}", fingerprint=fingerprint(target))


@dataclass(frozen=True)
class Answers:
    """The answers to prompts [0, prompts) of a pool that its committed file lacks, with OpenVINO GenAI."""

    pool: str  # and so the file, answers-<pool>.jsonl.gz
    prompts: int
    texts_from: str | None = None  # the pool whose answers this one's prompts are written on (everyday, dialogue)

    @property
    def name(self) -> str:
        return f"answers-{self.pool}:{self.prompts}"

    def run(self, paths: PairPaths, report: Report) -> None:
        from mirror_sd.models.training import answers

        more = {"texts_from": paths.file(self.texts_from)} if self.texts_from else {}
        answers.generate(paths.bundle, _openvino_target(paths.target, paths.build / "bench-cache"),
                         paths.file(self.pool), self.pool, self.prompts, report=report, **more)


@dataclass(frozen=True)
class SelfQueries:
    """Records [0, prompts) of prompts the target writes itself (models/training/self_queries.py) that the file lacks.
    Sampled text is not bit-reproducible across devices: the committed records are what the stages read."""

    pool: str
    prompts: int

    @property
    def name(self) -> str:
        return f"answers-{self.pool}:{self.prompts}"

    def run(self, paths: PairPaths, report: Report) -> None:
        from mirror_sd.models.training import self_queries

        self_queries.generate(paths.target, paths.file(self.pool), self.prompts, report=report)


@dataclass(frozen=True)
class TaskQueries:
    """Records [0, prompts) of the task-kind turns the target writes (models/training/task_queries.py), as
    SelfQueries."""

    pool: str
    prompts: int
    self_answers: str = "self"  # the self-written answers whose first exchanges the follow-ups continue

    @property
    def name(self) -> str:
        return f"answers-{self.pool}:{self.prompts}"

    def run(self, paths: PairPaths, report: Report) -> None:
        from mirror_sd.models.training import task_queries

        task_queries.generate(paths.target, paths.file(self.pool), self.prompts,
                              self_answers=paths.file(self.self_answers), report=report)


# -- training -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StreamingDraftStage:
    name: str
    config: StreamingDraftTraining
    data: tuple[str, ...]  # datagen files, read whole
    continues: bool = False  # go on from the committed streaming draft
    eval: str | None = None  # answers to held-out-topic prompts: extra figures

    def run(self, paths: PairPaths, report: Report) -> None:
        from mirror_sd.models.training import train_draft

        train_draft.train(paths.target, [paths.file(f) for f in self.data], paths.streaming_draft, self.config,
                          init_from=paths.streaming_draft if self.continues else None,
                          eval_file=paths.file(self.eval) if self.eval else None, report=report)


@dataclass(frozen=True)
class FeatureDraftStage:
    """Trains the committed feature draft further (or a new one) and commits it; with `average`, trains a copy under
    build/feature-draft-<name>-stage and commits the weighted mean of that and the draft it started from."""

    name: str
    config: FeatureDraftTraining
    data: tuple[Slice, ...]
    work: str  # under build: the feature store and checkpoint, shared by stages that read the same records
    continues: bool = True  # from the committed draft (False: a new draft)
    average: float | None = None  # this stage's weight in the committed mean (None: commit the stage itself)

    def run(self, paths: PairPaths, report: Report) -> None:
        from mirror_sd.models.training import train_feature_draft

        work = paths.build / self.work
        if self.continues:  # a checkpoint there is a stage before's, with other batches: not this stage's to resume
            (work / "checkpoint.pt").unlink(missing_ok=True)
        out = paths.build / f"feature-draft-{self.name}-stage" if self.average is not None else paths.feature_draft
        files, ranges = _files_and_ranges(self.data, paths)
        summary = train_feature_draft.run(paths.target, files, work, out, self.config, prompt_ranges=ranges,
                                          init_from=paths.feature_draft if self.continues else None, report=report)
        if self.average is not None:
            train_feature_draft.average_drafts([paths.feature_draft, out], paths.feature_draft,
                                               [1 - self.average, self.average])
            summary["averaged"] = {"with": "the committed draft this stage started from",
                                   "weight_of_this_stage": self.average,
                                   "held_out_above_is_of": "this stage alone, before the averaging"}
            (paths.feature_draft / "training.json").write_text(json.dumps(summary, indent=1) + "\n")


@dataclass(frozen=True)
class StreamHeadsStage:
    """The committed feature draft's stream heads, trained on its own hidden states and saved into it."""

    name: str
    config: StreamHeadsTraining
    data: tuple[Slice, ...]
    work: str  # under build: its checkpoint

    def run(self, paths: PairPaths, report: Report) -> None:
        from mirror_sd.models.training import train_stream_heads

        files, ranges = _files_and_ranges(self.data, paths)
        train_stream_heads.run(paths.target, paths.feature_draft, files, paths.build / self.work, paths.feature_draft,
                               self.config, prompt_ranges=ranges, report=report)


@dataclass(frozen=True)
class Snapshot:
    """A copy of the committed feature draft as it is now, under build/<name>, for a later stage to read."""

    name: str

    def run(self, paths: PairPaths, report: Report) -> None:
        shutil.rmtree(paths.build / self.name, ignore_errors=True)
        shutil.copytree(paths.feature_draft, paths.build / self.name)


@dataclass(frozen=True)
class ExitAdapterStage:
    """Exit adapters trained into build/<out>/layer-<l>; with `commit`, the one at that layer (and the coverage
    table) replaces the committed adapter at that layer."""

    name: str
    config: ExitAdapterTraining
    data: tuple[Slice, ...]
    out: str  # under build
    continues: str | None = None  # the adapter it goes on from: an earlier stage's `out`, or "committed"
    hard_draft: str | None = None  # the draft whose misses are drawn more often: "committed" or a Snapshot's name
    teacher_cache: str | None = None  # under build: the teacher pass, kept for a next stage with the same inputs
    commit: int | None = None

    def run(self, paths: PairPaths, report: Report) -> None:
        from mirror_sd.models.training import train_exit

        layer = self.config.layers[0]
        init_from = None
        if self.continues == "committed":
            init_from = paths.adapters[layer]
        elif self.continues is not None:
            init_from = paths.build / self.continues / f"layer-{layer}"
        hard = None
        if self.hard_draft is not None:
            hard = paths.feature_draft if self.hard_draft == "committed" else paths.build / self.hard_draft
        out = paths.build / self.out
        cache = paths.build / self.teacher_cache if self.teacher_cache else None
        files, ranges = _files_and_ranges(self.data, paths)
        train_exit.train(paths.target, files, out, self.config, prompt_ranges=ranges, init_from=init_from,
                         hard_draft=hard, teacher_cache=cache, report=report)
        if self.commit is not None:
            dest = paths.adapters[self.commit]
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(out / f"layer-{self.commit}", dest)
            shutil.copy(out / "coverage.json", dest / "coverage.json")


Stage = (Datagen | Answers | SelfQueries | TaskQueries | StreamingDraftStage | FeatureDraftStage | StreamHeadsStage
         | Snapshot | ExitAdapterStage)


def run(stages: Sequence[Stage], paths: PairPaths, report: Report = print) -> None:
    """Each stage in turn. Every trainer resumes a stage stopped part-way where its checkpoint allows."""
    for n, stage in enumerate(stages, 1):
        report(f"== {n}/{len(stages)} {type(stage).__name__} {stage.name}")
        stage.run(paths, report)


# -- the streaming draft and the exit-layer sweep's adapters ----------------------------------------------------------
STREAMING_DRAFT = StreamingDraftTraining(vocab_size=8192, steps=2000, budget_minutes=25.0, seq_len=128, batch=16,
                                         lr=3e-3, seed=0)
EXIT_SWEEP = ExitAdapterTraining(layers=(15, 20, 24), conversations=300, skip=0, held_out=300, rank=512, steps=800,
                                 batch=256, lr=2e-3, minutes_per_layer=5.0, hard_weight=0.0, top_k=8, seed=0)


def streaming_stages(prompts: int = 2400, broad_prompts: int = 3000, draft_minutes: float = 25.0,
                     broad_minutes: float = 40.0) -> list[Stage]:
    """The streaming draft in two stages, the base pool's answers, then both pools' continuing from it (breadth is
    what the first lacked), and the exit adapters at layers 15, 20 and 24; the one at 15 is committed for the
    benchmark's exit-layer sweep (the bundles' own, at 24, comes from the committed answers: FEATURE_STAGES)."""
    return [
        Datagen("datagen-base", "base", prompts),
        Datagen("datagen-broad", "broad", broad_prompts, batch=64),
        Datagen("datagen-held-out", "held-out", 64),
        StreamingDraftStage("streaming-base", replace(STREAMING_DRAFT, budget_minutes=draft_minutes),
                            ("datagen-base",)),
        StreamingDraftStage("streaming-broad", replace(STREAMING_DRAFT, steps=3000, budget_minutes=broad_minutes,
                                                       lr=1.5e-3),
                            ("datagen-base", "datagen-broad"), continues=True, eval="datagen-held-out"),
        ExitAdapterStage("exit-sweep", EXIT_SWEEP, whole("datagen-base"), out="exit-adapters", commit=15),
    ]


# -- the feature draft, its stream heads and the bundles' exit adapter ------------------------------------------------
# Prompt indices where the stages' ranges end. A file may hold more than its last stage read: its later records are
# the next stage's data.
BROAD_FIRST, BROAD_READ, BROAD_ALL = 5632, 13632, 20000
EVERYDAY_FIRST, EVERYDAY_10, EVERYDAY_11, EVERYDAY_ALL = 6000, 8400, 12000, 16000
CODE_ALL, ADVICE_ALL = 3000, 2400
DIALOGUE_FIRST, DIALOGUE_10, DIALOGUE_ALL = 2400, 4800, 6000
SELF_TRAINED, SELF_ALL = 5573, 10783
TASKS_TRAINED, TASKS_READ, TASKS_EXIT = 3296, 9040, 13045

FIRST = FeatureDraftTraining(taps=(5, 10, 15), vocab_size=8192, max_len=768, epochs=3.0, steps=4, lr=1e-3,
                             tokens_per_batch=4096, noise=0.05, budget_minutes=50, eval_records=400, seed=0)
CONTINUED = replace(FIRST, epochs=1.0, lr=5e-4, budget_minutes=22)  # each later stage one pass, at half the rate
REPLAY = replace(CONTINUED, lr=3e-4, eval_records=300)  # the averaged stages: a lower rate still
# GPU scale: every answers file at once in 16,384-token batches. Those runs were timed; the recipe runs the batches
# they ran, in the same order (epochs = batches / batches per pass over the stage's training records).
GPU_ALL = replace(CONTINUED, epochs=1965 / 707, lr=6e-4, tokens_per_batch=16384, budget_minutes=None,
                  extend_vocab=8192, eval_records=600)
GPU_MORE = replace(GPU_ALL, epochs=2567 / 707, lr=3e-4, extend_vocab=0)

STREAMS = StreamHeadsTraining(streams=2, stream_vocab=4096, stream_width=576, depths=2, batches=400, lr=2e-3,
                              tokens_per_batch=4096, max_len=512, eval_records=100, seed=0)
STREAMS_CONTINUED = replace(STREAMS, batches=1200, lr=1e-3, tokens_per_batch=8192, max_len=1024, eval_records=64,
                            continue_streams=True)  # the heads follow a changed draft

EXIT = ExitAdapterTraining(layers=(24,), conversations=1000, skip=0, held_out=300, rank=512, steps=800, batch=256,
                           lr=2e-3, minutes_per_layer=5.0, hard_weight=0.0, top_k=8, seed=0)
EXIT_MIXED = replace(EXIT, conversations=800, steps=2400, lr=1e-3, minutes_per_layer=20.0)
# Mirror's branches need the exit head where the draft is rejected: those positions drawn more often
EXIT_HARD = replace(EXIT_MIXED, conversations=400, skip=800, held_out=100, minutes_per_layer=60.0, hard_weight=3.0)
EXIT_HARD_MORE = replace(EXIT_HARD, hard_weight=8.0)

GPU_FILES = ("advice", "broad", "code", "dialogue", "everyday")  # the order the GPU runs read them in (by name)
EXIT_RANGES = (Slice("broad", 0, BROAD_READ), Slice("everyday", 0, EVERYDAY_FIRST), Slice("code", 0, CODE_ALL),
               Slice("advice", 0, ADVICE_ALL), Slice("dialogue", 0, DIALOGUE_FIRST))


def _continued_on_gpu(name: str, config: FeatureDraftTraining, data: tuple[Slice, ...], work: str,
                      streams: StreamHeadsTraining) -> list[Stage]:
    """A GPU-scale stage, then the stream heads on the same records (they read the changed draft's states)."""
    return [FeatureDraftStage(name, config, data, work),
            StreamHeadsStage(f"{name}-streams", streams, data, f"feature-draft-streams-{name}")]


FEATURE_STAGES: list[Stage] = [
    Answers("broad", BROAD_ALL),
    Answers("everyday", EVERYDAY_ALL, texts_from="broad"),
    Answers("code", CODE_ALL),
    Answers("advice", ADVICE_ALL),
    Answers("dialogue", DIALOGUE_ALL, texts_from="advice"),
    # on a CPU: the broad answers, then the kinds and pools they are thin in, each replaying earlier data
    FeatureDraftStage("broad-first", FIRST, (Slice("broad", 0, BROAD_FIRST),), "feature-draft", continues=False),
    FeatureDraftStage("broad-continued", CONTINUED, (Slice("broad", 0, BROAD_FIRST),), "feature-draft"),
    FeatureDraftStage("broad-all", replace(CONTINUED, budget_minutes=75), (Slice("broad", 0, BROAD_READ),),
                      "feature-draft"),
    FeatureDraftStage("broad-second-pass", replace(CONTINUED, budget_minutes=42), (Slice("broad", 0, BROAD_READ),),
                      "feature-draft"),
    # the vocabulary's tail swapped for the tokens translations bring
    FeatureDraftStage("everyday", replace(CONTINUED, budget_minutes=60, refresh_vocab=1024, refresh_drop="tail"),
                      (Slice("broad", BROAD_READ, BROAD_ALL), Slice("everyday", 0, EVERYDAY_FIRST)), "feature-draft"),
    FeatureDraftStage("code", replace(CONTINUED, budget_minutes=15, refresh_vocab=512, eval_records=300),
                      (Slice("code", 0, CODE_ALL), Slice("everyday", 0, 1500),
                       Slice("broad", BROAD_READ, BROAD_READ + 2000)), "feature-draft"),
    FeatureDraftStage("advice", replace(CONTINUED, budget_minutes=12, refresh_vocab=256, eval_records=300),
                      (Slice("advice", 0, ADVICE_ALL), Slice("everyday", 1500, 2500),
                       Slice("broad", BROAD_READ + 2000, BROAD_READ + 3000), Slice("code", 0, 800)), "feature-draft"),
    # each from here on committed as the mean with the draft before: it gained on its data and lost elsewhere alone
    FeatureDraftStage("dialogue", replace(CONTINUED, budget_minutes=12, eval_records=300),
                      (Slice("dialogue", 0, DIALOGUE_FIRST), Slice("everyday", 3500, 4000),
                       Slice("broad", BROAD_ALL - 1000, BROAD_ALL - 500), Slice("code", 2200, 2600)),
                      "feature-draft", average=0.5),
    FeatureDraftStage("mixed", replace(REPLAY, budget_minutes=22),
                      (Slice("dialogue", 0, 1200), Slice("advice", 1200, ADVICE_ALL), Slice("everyday", 4000, 5200),
                       Slice("broad", BROAD_READ + 3000, BROAD_READ + 4200), Slice("code", 2600, CODE_ALL)),
                      "feature-draft", average=0.5),
    FeatureDraftStage("new-data", replace(REPLAY, budget_minutes=20),
                      (Slice("dialogue", DIALOGUE_FIRST, DIALOGUE_10), Slice("everyday", EVERYDAY_FIRST, EVERYDAY_10),
                       Slice("advice", 1800, ADVICE_ALL), Slice("broad", 5000, 6000), Slice("code", 0, 500)),
                      "feature-draft", average=0.5),
    FeatureDraftStage("more-data", replace(REPLAY, budget_minutes=20),
                      (Slice("dialogue", DIALOGUE_10, DIALOGUE_ALL), Slice("everyday", EVERYDAY_10, EVERYDAY_11),
                       Slice("advice", 0, 600), Slice("broad", 6000, 7000), Slice("code", 500, 1000)),
                      "feature-draft", average=0.5),
    FeatureDraftStage("latest-data", replace(REPLAY, budget_minutes=18),
                      (Slice("dialogue", 0, 1200), Slice("everyday", EVERYDAY_11, EVERYDAY_ALL),
                       Slice("advice", 600, 1200), Slice("broad", 7000, 8000), Slice("code", 1000, 1500)),
                      "feature-draft", average=0.5),
    # GPU scale (on a CPU: stored features, about a day): every file at once; the vocabulary extended first
    FeatureDraftStage("gpu-all", GPU_ALL, whole(*GPU_FILES), "feature-draft-gpu"),
    FeatureDraftStage("gpu-more", GPU_MORE, whole(*GPU_FILES), "feature-draft-gpu"),
    StreamHeadsStage("streams", STREAMS,
                     (Slice("broad", 0, 3000), Slice("everyday", 0, 1500), Slice("code", 0, 800),
                      Slice("advice", 0, 600), Slice("dialogue", 0, 600)), "feature-draft-streams"),
    SelfQueries("self", SELF_ALL),
    *_continued_on_gpu("self", replace(GPU_MORE, epochs=2472 / 789),
                       (*whole(*GPU_FILES), Slice("self", 0, SELF_TRAINED)), "feature-draft-gpu-self",
                       STREAMS_CONTINUED),
    Snapshot("feature-draft-stage15"),  # the draft whose misses the exit adapter's GPU stage weighs
    *_continued_on_gpu("self-all", replace(GPU_MORE, epochs=2889 / 866), whole(*GPU_FILES, "self"),
                       "feature-draft-gpu-self", STREAMS_CONTINUED),
    # the bundles' exit adapter: the broad answers, then three pools, then all five where the committed draft misses
    # (two stages on one teacher pass), then every file on a GPU
    ExitAdapterStage("exit-answers", EXIT, (Slice("broad", 0, BROAD_READ),), out="exit-adapters-answers"),
    ExitAdapterStage("exit-mixed", EXIT_MIXED, EXIT_RANGES[:3], out="exit-adapters-mixed",
                     continues="exit-adapters-answers"),
    ExitAdapterStage("exit-hard", EXIT_HARD, EXIT_RANGES, out="exit-adapters-hard", continues="exit-adapters-mixed",
                     hard_draft="committed", teacher_cache="exit-adapters-hard-teacher"),
    ExitAdapterStage("exit-hard-more", EXIT_HARD_MORE, EXIT_RANGES, out="exit-adapters-hard-more",
                     continues="exit-adapters-hard", hard_draft="committed",
                     teacher_cache="exit-adapters-hard-teacher"),
    ExitAdapterStage("exit-gpu", replace(EXIT_HARD_MORE, conversations=300, skip=1200, held_out=60, steps=4000,
                                         batch=1024, minutes_per_layer=600.0),
                     whole(*GPU_FILES, "self"), out="exit-adapters-gpu", continues="exit-adapters-hard-more",
                     hard_draft="feature-draft-stage15", commit=24),
    TaskQueries("tasks", TASKS_READ),
    # the task turns listed twice: read twice as often as the other files
    *_continued_on_gpu("tasks", replace(GPU_MORE, epochs=3072 / 965),
                       (*whole(*GPU_FILES, "self"), Slice("tasks", 0, TASKS_TRAINED), Slice("tasks", 0, TASKS_TRAINED)),
                       "feature-draft-gpu-tasks", replace(STREAMS_CONTINUED, batches=900)),
    *_continued_on_gpu("tasks-all", replace(GPU_MORE, epochs=2391 / 1136),
                       (*whole(*GPU_FILES, "self"), Slice("tasks", 0, TASKS_READ), Slice("tasks", 0, TASKS_READ)),
                       "feature-draft-gpu-tasks-all", replace(STREAMS_CONTINUED, batches=900)),
    # the exit adapter on the task turns (a file in four ranges: figures per range) beside the six other files
    TaskQueries("tasks", TASKS_EXIT),
    ExitAdapterStage("exit-tasks", replace(EXIT_HARD_MORE, conversations=180, skip=1500, held_out=40,
                                           minutes_per_layer=30.0),
                     (Slice("tasks", 0, 3000), Slice("tasks", 3000, 6000), Slice("tasks", 6000, TASKS_READ),
                      Slice("tasks", TASKS_READ, TASKS_EXIT), *whole(*GPU_FILES, "self")),
                     out="exit-adapters-tasks", continues="committed", hard_draft="committed",
                     teacher_cache="exit-adapters-tasks-teacher", commit=24),
]
