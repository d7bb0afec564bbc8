"""The target's own greedy answers at scale, as token ids: OpenVINO GenAI continuous batching over many prompts.

A draft is distilled from what the target says; the more conversations it sees, the better it generalises, and
thousands of answers are not enough. On a CPU OpenVINO GenAI's ContinuousBatchingPipeline answers several times
faster than transformers `generate` on the same fp32 target (docs/training.md has the rates).

Records go to a gzip JSON-lines file, one per prompt; each batch is appended as a complete gzip member, so the file
can be read while a run goes on, and an interrupted run resumes where it stopped: a member cut short by the
interruption is cut off, and indices already in the file are skipped.
    {"index": i, "kind": "chat", "ids": [...], "answers": [[start, end], ...]}
`ids` is the whole conversation through the bundle's chat template, the target's answer(s) included; `answers`
are the spans of ids the target generated (a multi-turn prompt has two: its first answer is generated first, then
the follow-up's). Features (hidden states) are not stored: they are recomputed from ids by the target itself.

    python -m mirror_sd.models.training.answers --pool broad -n 20000 --out models/training/data/answers-broad.jsonl.gz
    python -m mirror_sd.models.training.answers --pool everyday -n 16000 \
        --out models/training/data/answers-everyday.jsonl.gz
    python -m mirror_sd.models.training.answers --pool code -n 3000 --out models/training/data/answers-code.jsonl.gz
    python -m mirror_sd.models.training.answers --pool advice -n 2400 --out models/training/data/answers-advice.jsonl.gz
    python -m mirror_sd.models.training.answers --pool dialogue -n 6000 \
        --texts-from models/training/data/answers-advice.jsonl.gz --out models/training/data/answers-dialogue.jsonl.gz
The everyday pool (translation, summarisation, QA, RAG; models/training/prompts.py build_everyday) is written on the
prose of the broad answers' training records of prompts [0, 20,000) (--texts-from); the dialogue pool (build_dialogue)
on the advice answers' training records of prompts [0, 2,400): their questions and the target's first answers, cut short
(SOURCE_PROMPTS).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

from mirror_sd.models.training.datagen import POOLS
from mirror_sd.models.training.prompts import Prompt, build_advice, build_dialogue, build_everyday
from mirror_sd.partitions import Manifest
from mirror_sd.runtime.text import TextCodec

DEFAULT_BATCH = 64
DEFAULT_MAX_NEW = 160
HOLD_OUT = 20  # records with index % HOLD_OUT == 0 are held out: no draft trains on them, no pool borrows their text
BROAD_ANSWERS = Path("models/training/data/answers-broad.jsonl.gz")
# The source records a pool written on other answers reads: the everyday pool the broad answers to prompts
# [0, 20,000), the dialogue pool the advice answers to prompts [0, 2,400). Both pools draw their passages and
# exchanges at random from what they read, so a source file answered further would change every prompt they make;
# fixed, the committed everyday and dialogue answers stay what their generators make however far those grow.
SOURCE_PROMPTS = {"everyday": 20000, "dialogue": 2400}


def _training_records(path: Path, prompts: int | None, kinds: tuple[str, ...] | None = None) -> list[dict]:
    """`path`'s training records (not held out) of prompts [0, prompts) and of `kinds` (None: all), in index order."""
    return sorted((r for r in read(path) if r["index"] % HOLD_OUT and (prompts is None or r["index"] < prompts)
                   and (kinds is None or r["kind"] in kinds)), key=lambda r: r["index"])


def answer_texts(path: Path, codec, kinds: tuple[str, ...] = ("chat", "multi_turn"),
                 prompts: int | None = SOURCE_PROMPTS["everyday"]) -> list[str]:
    """The decoded answers of `path`'s training records of `kinds` among prompts [0, prompts), in index order."""
    records = _training_records(path, prompts, kinds)
    return [codec.decode(r["ids"][start:end]) for r in records for start, end in r["answers"]]


def _pool(name: str, n: int, seed: int, bundle: Path, texts_from: Path = BROAD_ANSWERS) -> list[Prompt]:

    if name == "everyday":

        if not texts_from.exists():
            raise SystemExit(f"the everyday pool is written on answer texts: {texts_from} not found")
        return build_everyday(n, answer_texts(texts_from, TextCodec(bundle, Manifest.load(bundle))), seed=seed)
    if name == "dialogue":

        if not texts_from.exists():
            raise SystemExit(f"the dialogue pool is written on the advice pool's answers: {texts_from} not found")
        return build_dialogue(n, first_exchanges(texts_from, bundle, seed), seed=seed)
    if name not in POOLS:
        raise SystemExit(f"unknown pool {name!r}; known: {', '.join([*POOLS, 'everyday', 'dialogue'])}")
    return POOLS[name](n, seed=seed)


def first_exchanges(path: Path, bundle: Path, seed: int = 0,
                    prompts: int | None = SOURCE_PROMPTS["dialogue"]) -> list[tuple[str, str]]:
    """Of an advice-pool answers file's training records among prompts [0, prompts), in index order: each prompt's
    first question and the target's first answer to it (decoded from the record's first answer span)."""

    codec = TextCodec(bundle, Manifest.load(bundle))
    records = _training_records(path, prompts)
    prompts = build_advice(max(r["index"] for r in records) + 1, seed=seed)
    return [(prompts[r["index"]].messages[0]["content"], codec.decode(r["ids"][slice(*r["answers"][0])]).strip())
            for r in records]


def _members(path: Path) -> tuple[list[bytes], int]:
    """The complete gzip members of `path` (decompressed) and the byte offset where the complete ones end."""
    import zlib

    data = path.read_bytes() if path.exists() else b""
    members, offset = [], 0
    while offset < len(data):
        d = zlib.decompressobj(wbits=31)
        try:
            chunk = d.decompress(data[offset:])
        except zlib.error:
            break
        if not d.eof:  # cut short: the rest is an interrupted write
            break
        members.append(chunk)
        offset = len(data) - len(d.unused_data)
    return members, offset


def read(path: Path) -> list[dict]:
    """Every record of an answers file's complete members."""
    return [json.loads(line) for member in _members(path)[0] for line in member.decode().splitlines() if line]


def write_member(f, records: list[dict]) -> None:
    """Append `records` to an answers file open for binary append as one complete gzip member, flushed: an
    interrupted run loses at most the member being written (_truncate_partial cuts it off)."""
    f.write(gzip.compress(("\n".join(json.dumps(r) for r in records) + "\n").encode()))
    f.flush()


def done_indices(out: Path) -> set[int]:
    return {r["index"] for r in read(out)}


def _truncate_partial(out: Path) -> None:
    """Cut an interrupted run's incomplete last member off, so new members follow complete ones."""
    if out.exists():
        _, end = _members(out)
        if end < out.stat().st_size:
            with out.open("r+b") as f:
                f.truncate(end)


class _Generator:
    def __init__(self, bundle: Path, ov_dir: Path, threads: int, batch: int, max_new_tokens: int) -> None:
        import openvino_genai as ov_genai


        manifest = Manifest.load(bundle)
        self.codec = TextCodec(bundle, manifest)
        self.eos = list(manifest.tokenizer.eos_token_ids)
        scheduler = ov_genai.SchedulerConfig()
        scheduler.cache_size, scheduler.max_num_seqs, scheduler.max_num_batched_tokens = 2, batch, 2048
        # fp32 compute and KV cache: the same target the runtime verifies with
        properties = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
                      "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
        self.pipe = ov_genai.ContinuousBatchingPipeline(str(ov_dir), scheduler, "CPU", properties)
        self.config = ov_genai.GenerationConfig()
        self.config.max_new_tokens, self.config.do_sample = max_new_tokens, False
        self.config.stop_token_ids, self.config.eos_token_id = set(self.eos), self.eos[0]

    def ids(self, messages: list[dict]) -> list[int]:
        return self.codec.encode(self.codec.render_chat(messages), special=False)

    def answer(self, prompts: list[list[int]]) -> list[list[int]]:
        import numpy as np
        import openvino as ov

        results = self.pipe.generate([ov.Tensor(np.asarray([p], np.int64)) for p in prompts],
                                     [self.config] * len(prompts))
        return [list(r.m_generation_ids[0]) for r in results]


def generate(bundle: Path, ov_dir: Path, out: Path, pool: str, n: int, seed: int = 0, batch: int = DEFAULT_BATCH,
             max_new_tokens: int = DEFAULT_MAX_NEW, threads: int = 2, texts_from: Path = BROAD_ANSWERS,
             report=print) -> Path:
    """Append the answers to prompts [0, n) of `pool` not yet in `out`."""
    from tqdm import tqdm

    prompts = _pool(pool, n, seed, bundle, texts_from)
    done = done_indices(out)
    todo = [i for i in range(n) if i not in done]
    if not todo:
        report(f"{out}: all {n} answers are there")
        return out
    gen = _Generator(bundle, ov_dir, threads, batch, max_new_tokens)
    out.parent.mkdir(parents=True, exist_ok=True)
    _truncate_partial(out)
    tokens, start = 0, time.perf_counter()
    with out.open("ab") as f, tqdm(total=n, initial=n - len(todo), desc=f"target answers ({pool})",
                                   unit="prompt", file=sys.stderr) as bar:
        for lo in range(0, len(todo), batch):
            idx = todo[lo:lo + batch]
            convs = [[dict(m) for m in prompts[i].messages] for i in idx]
            spans: list[list[list[int]]] = [[] for _ in idx]
            # a multi-turn prompt's empty earlier assistant turn is the target's own first answer (the dialogue
            # pool's is written already: not the target's verbatim, so not an answer span either)
            first = [j for j, c in enumerate(convs) if len(c) == 3 and c[1]["role"] == "assistant"
                     and not c[1]["content"]]
            if first:
                heads = [gen.ids(convs[j][:1]) for j in first]
                for j, _head, ans in zip(first, heads, gen.answer(heads)):
                    convs[j][1]["content"] = gen.codec.decode(ans).strip()
            prompt_ids = [gen.ids(c) for c in convs]
            answers = gen.answer(prompt_ids)
            records = []
            for j, (i, ids, ans) in enumerate(zip(idx, prompt_ids, answers)):
                if j in first:  # where the first answer sits in the re-rendered conversation (its text re-tokenized)
                    head = gen.ids(convs[j][:1])
                    reply = gen.codec.encode(convs[j][1]["content"], special=False)
                    spans[j].append([len(head), len(head) + len(reply)])
                spans[j].append([len(ids), len(ids) + len(ans)])
                records.append({"index": i, "kind": prompts[i].kind, "ids": ids + ans, "answers": spans[j]})
                tokens += len(ans)
            write_member(f, records)  # one complete member per batch
            bar.update(len(idx))
            bar.set_postfix(answer_tok_per_s=f"{tokens / (time.perf_counter() - start):.0f}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", default="build/bundles/smollm2", help="the bundle (its tokenizer and chat template)")
    p.add_argument("--target", default="build/models/smollm2-135m-instruct", help="the target's HF directory")
    p.add_argument("--pool", default="broad",
                   help="prompt pool: base, broad, held-out, everyday, code, advice or dialogue "
                        "(models/training/prompts.py)")
    p.add_argument("--texts-from", default=str(BROAD_ANSWERS),
                   help="the answers file the everyday pool's passages and sentences come from (the dialogue pool's "
                        "exchanges: the advice answers)")
    p.add_argument("-n", type=int, default=20000, help="prompts [0, n) of the pool")
    p.add_argument("--out", required=True, help="gzip JSON-lines file (appended to; resumes)")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="sequences in flight")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache", default="build/bench-cache", help="where the OpenVINO GenAI conversion is cached")
    args = p.parse_args(argv)
    # here, not at the top: the modules that read answers files run on machines without OpenVINO
    from mirror_sd.export.openvino_genai import convert, fingerprint

    target = Path(args.target)
    ov_dir = convert(target, Path(args.cache) / f"ov-genai-target-{fingerprint(target)}",
                     fingerprint=fingerprint(target))
    generate(Path(args.bundle), ov_dir, Path(args.out), args.pool, args.n, batch=args.batch,
             max_new_tokens=args.max_new_tokens, threads=args.threads, texts_from=Path(args.texts_from))
    return 0


if __name__ == "__main__":
    sys.exit(main())
