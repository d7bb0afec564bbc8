"""User turns in the benchmark's task kinds, written by the target itself: Magpie steered by the turn's opening.

models/training/self_queries.py lets the target write whole user turns; what it writes are mostly chat questions, while
the benchmark (models/benchmark_prompts.py) and the held-out set ask for translations, summaries, answers from a
passage, word problems, explanations and follow-ups, the kinds where the draft is accepted least (docs/training.md).
Here the user turn starts with an opening of one of those kinds, written here ("Translate to Dutch:", "Summarize the
following text in two sentences.", "Answer the question using only the passage. Passage:", "Why does"), and the target,
sampled, writes the rest: the sentence to translate, the passage, the question. A passage that runs long is cut at its
last full sentence; a passage without a question gets one written in a second pass. A follow-up turn continues a
self-written conversation (answers-self.jsonl.gz's training records: its query and the target's first answer, cut to its
first sentences, as the benchmark's earlier turns are short). Each conversation is then answered greedily by the fp32
target, as every pool is.

    python -m mirror_sd.models.training.task_queries --target build/models/smollm2-135m-instruct -n 20000 \\
        --self-answers models/training/data/answers-self.jsonl.gz --out models/training/data/answers-tasks.jsonl.gz

Records are models/training/answers.py's (kind "task-<kind>", one gzip member per batch, resumable; a follow-up's
record has one answer span, its last turn's: the first answer is in answers-self already). No user turn is a held-out or
benchmark prompt (self_queries.excluded_queries). Sampled text is not bit-reproducible across devices: the token
ids are what is committed. Runs on CUDA when torch sees a GPU.
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

from mirror_sd.errors import BadInputError
from mirror_sd.models.training import answers as answers_file
from mirror_sd.models.training import self_queries
from mirror_sd.models.training.self_queries import MARK, MIN_QUERY_TOKENS, SelfQueries

KINDS = ("qa", "translation", "summarisation", "math", "rag", "multi_turn")
LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Dutch")
# Openings end without a space: the tokenizer joins a word's leading space to the word, which the target writes.
OPENINGS: dict[str, tuple[str, ...]] = {
    "qa": ("Why", "Why do", "Why does", "Why is", "How does", "How do", "How can", "What causes",
           "What is the difference between", "What happens when", "What makes", "How did", "Where do", "When did",
           "Who was", "What is", "Can you explain why", "Is it true that"),
    "translation": tuple(form.format(lang) for lang in LANGUAGES
                         for form in ("Translate to {}:", "Translate into {}:", "Translate this sentence to {}:")),
    "summarisation": ("Summarize the following text in two sentences.\n\n",
                      "Summarize the following text in one sentence.\n\n", "Summarize this article.\n\n",
                      "Give a short summary of this passage:\n\n",
                      "What is the main idea of the following text?\n\n",
                      "Summarize the following paragraph in a few words.\n\n"),
    "math": ("Solve this problem and show your steps:", "Solve:", "A", "There are", "If", "Calculate",
             "John has", "Sara buys", "A train travels", "A shop sells", "How many", "A recipe needs",
             "The price of", "What is"),
    "rag": ("Answer the question using only the passage.\n\nPassage:",
            "Read the text and answer the question.\n\nText:",
            "Use the context below to answer the question.\n\nContext:"),
}
QUESTION = "\n\nQuestion:"
PASSAGE_KINDS = ("summarisation", "rag")
PASSAGE_TOKENS = 200  # a passage the target writes (the benchmark's are ~100 tokens)
TURN_TOKENS = 96
MIN_PASSAGE_WORDS = 30
FIRST_ANSWER_SENTENCES = 2
FIRST_ANSWER_WORDS = 40
# Below self_queries' 1.0: the turn's kind is set by its opening, and at 1.0 the 135M target's sentences and
# passages drift into word salad within a line.
TEMPERATURE = 0.8
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def kind_of(index: int) -> str:
    """The kind of prompt `index`: the kinds in turn, so every batch and every prefix of a file holds all of them."""
    return KINDS[index % len(KINDS)]


def cut_to_sentences(text: str, most: int | None = None) -> str:
    """`text` up to its last full sentence (its first `most` sentences where given); "" where none ends."""
    ends = [m.start() for m in _SENTENCE_END.finditer(text.rstrip() + " ")]
    if not ends:
        return ""
    return text[: ends[min(len(ends), most or len(ends)) - 1]].strip()


def first_exchanges(path: Path, tokenizer) -> list[tuple[str, str]]:
    """Of a self-written answers file's training records: the query and the target's answer, cut short."""
    out = []
    for r in answers_file.read(path):
        if r["index"] % answers_file.HOLD_OUT == 0 or not r.get("query"):
            continue
        start, end = r["answers"][0]
        text = tokenizer.decode(r["ids"][start:end], skip_special_tokens=True)
        # an answer with no sentence end (cut off at its length cap) keeps its first words
        reply = cut_to_sentences(text, FIRST_ANSWER_SENTENCES) or " ".join(text.split()[:FIRST_ANSWER_WORDS])
        if reply:
            out.append((r["query"], reply))
    return out


class TaskQueries:
    """Steered user turns of one batch: openings sampled per prompt index, the target's continuations kept or
    dropped."""

    def __init__(self, gen: SelfQueries, exchanges: list[tuple[str, str]], temperature: float, top_p: float) -> None:
        self.gen, self.exchanges = gen, exchanges
        self.temperature, self.top_p = temperature, top_p

    def _prefix(self, messages_before: list[dict], opening: str) -> list[int]:
        """The conversation rendered up to where the user's text begins, then the opening."""
        rendered = self.gen.render([*messages_before, {"role": "user", "content": MARK}])
        return self.gen.encode(rendered.split(MARK)[0] + opening)

    def turns(self, indices: list[int], seed: int) -> list[tuple[list[dict], str] | None]:
        """For each index, the conversation before its user turn and that turn, or None where the target did not
        write a usable one."""
        rng = random.Random(seed)
        plans = []  # (history, opening, max tokens)
        for i in indices:
            kind = kind_of(i)
            if kind == "multi_turn":
                query, reply = rng.choice(self.exchanges)
                plans.append(([{"role": "user", "content": query}, {"role": "assistant", "content": reply}], "",
                              TURN_TOKENS))
            else:
                plans.append(([], rng.choice(OPENINGS[kind]),
                               PASSAGE_TOKENS if kind in PASSAGE_KINDS else TURN_TOKENS))
        out: list[tuple[list[dict], str] | None] = [None] * len(indices)
        # one sampling pass per length cap: short turns do not wait on the passages
        for cap in sorted({p[2] for p in plans}):
            rows = [j for j, p in enumerate(plans) if p[2] == cap]
            sampled = self.gen.sample([self._prefix(plans[j][0], plans[j][1]) for j in rows], seed + cap,
                                      self.temperature, self.top_p, cap)
            for j, (text, tokens, finished) in zip(rows, sampled):
                out[j] = self._keep(kind_of(indices[j]), plans[j][0], plans[j][1], text, tokens, finished)
        self._ask(indices, out, seed)
        return out

    def _keep(self, kind: str, history: list[dict], opening: str, text: str, tokens: int,
              finished: bool) -> tuple[list[dict], str] | None:
        if tokens <= MIN_QUERY_TOKENS or not text.strip():
            return None
        if kind in PASSAGE_KINDS:
            if kind == "rag" and QUESTION.strip() in text:  # the target wrote the question itself
                passage, _, question = text.partition(QUESTION.strip())
                passage, question = cut_to_sentences(passage), question.strip()
                if not question or len(passage.split()) < MIN_PASSAGE_WORDS or not finished:
                    return None
                return history, f"{opening} {passage}{QUESTION} {question}"
            passage = text.strip() if finished else cut_to_sentences(text)
            if len(passage.split()) < MIN_PASSAGE_WORDS:
                return None
            return history, (opening + passage if opening.endswith("\n") else f"{opening} {passage}")
        if not finished:
            return None
        return history, (opening + text).strip()

    def _ask(self, indices: list[int], out: list, seed: int) -> None:
        """A passage-and-question turn whose passage came without a question: the target writes one."""
        rows = [j for j, t in enumerate(out) if t is not None and kind_of(indices[j]) == "rag"
                and QUESTION not in t[1]]
        if not rows:
            return
        sampled = self.gen.sample([self._prefix([], out[j][1] + QUESTION) for j in rows], seed + 1, self.temperature,
                                  self.top_p, TURN_TOKENS // 2)
        for j, (text, tokens, finished) in zip(rows, sampled):
            question = text.strip()
            out[j] = (out[j][0], f"{out[j][1]}{QUESTION} {question}") if finished and question.endswith("?") \
                and tokens > MIN_QUERY_TOKENS else None


def generate(target: Path, out: Path, n: int, *, self_answers: Path, batch: int = 256, seed: int = 0,
             temperature: float = TEMPERATURE, top_p: float = 0.95, max_new_tokens: int = answers_file.DEFAULT_MAX_NEW,
             max_minutes: float | None = None, device: str | None = None, report=print) -> dict:
    """Append records [done, n) to `out`, a batch at a time; prompts whose turn the target did not write usably are
    drawn again at the next indices (each index's kind is fixed: kind_of). Stops resumably after max_minutes."""
    if n <= 0 or batch <= 0:
        raise BadInputError("-n and --batch must be positive")
    if not self_answers.is_file():
        raise BadInputError(f"{self_answers}: not found")
    gen = SelfQueries(target, device)
    exchanges = first_exchanges(self_answers, gen.tokenizer)
    if not exchanges:
        raise BadInputError(f"{self_answers}: no training record whose conversation a follow-up turn can continue")
    tasks = TaskQueries(gen, exchanges, temperature, top_p)

    def draw(index: int, want: int, salt: int) -> list[tuple[str, list[dict] | None]]:
        # a batch's indices fix its kinds (kind_of): every batch holds them all in turn; records are numbered as
        # they are kept, so a record's kind is in the record, not in its index
        indices = list(range(index, index + want))
        return [(f"task-{kind_of(i)}", None if planned is None else [*planned[0], {"role": "user",
                                                                                     "content": planned[1]}])
                for i, planned in zip(indices, tasks.turns(indices, seed + index + salt))]

    summary = self_queries.append_answers(gen, out, n, batch, draw, desc="task queries",
                                          max_new_tokens=max_new_tokens, max_minutes=max_minutes, report=report,
                                          no_turn=f"{target} wrote none its kind's rules keep")
    summary["dropped_turns"] = summary.pop("dropped")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = self_queries.cli(__doc__.splitlines()[0], TEMPERATURE)
    p.add_argument("--self-answers", type=Path, default=Path("models/training/data/answers-self.jsonl.gz"),
                   help="self-written answers (models.self_queries) whose first exchanges the follow-ups continue")
    args = p.parse_args(argv)
    return self_queries.run_cli(args, generate, self_answers=args.self_answers)


if __name__ == "__main__":
    sys.exit(main())
