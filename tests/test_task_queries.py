"""models.task_queries: steered user turns of the benchmark's kinds, kept or dropped by their rules, and records of
the target's own greedy answers on a tiny random target (resumable, bad input refused)."""

from pathlib import Path

import pytest

from mirror_sd.models.tiny import make_model
from mirror_sd.models.training import answers, self_queries, task_queries


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("target") / "t", num_layers=2)


def test_cut_to_sentences_keeps_whole_sentences_only():
    cut = task_queries.cut_to_sentences
    assert cut("One. Two! Three? Four") == "One. Two! Three?"
    assert cut("One. Two. Three.", 2) == "One. Two."
    assert cut("no sentence ends here") == ""


def test_turns_are_kept_only_when_usable():
    keep = task_queries.TaskQueries(None, [], 1.0, 1.0)._keep
    words = " ".join(["word"] * 40)
    # a short turn must end its turn; a passage may be cut at its last full sentence
    assert keep("qa", [], "Why do", " cats purr?", 6, True) == ([], "Why do cats purr?")
    assert keep("qa", [], "Why do", " cats purr and", 96, False) is None
    assert keep("qa", [], "Why do", " x?", 2, True) is None
    opening = task_queries.OPENINGS["summarisation"][0]
    assert keep("summarisation", [], opening, f"{words}. Cut off he", 200, False) == ([], f"{opening}{words}.")
    assert keep("summarisation", [], opening, "Too short. Cut", 200, False) is None
    # a passage with the target's own question, and one without (the second pass asks)
    rag = task_queries.OPENINGS["rag"][0]
    assert keep("rag", [], rag, f" {words}.\n\nQuestion: Why?", 90, True) == (
        [], f"{rag} {words}.{task_queries.QUESTION} Why?")
    assert keep("rag", [], rag, f" {words}.", 60, True) == ([], f"{rag} {words}.")


def test_records_are_greedy_answers_to_steered_turns_and_a_run_resumes(target, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    first_turns = tmp_path / "answers-self.jsonl.gz"
    self_queries.generate(target, first_turns, 25, batch=25, temperature=3.0, max_new_tokens=12, device="cpu")
    out = tmp_path / "answers-tasks.jsonl.gz"
    summary = task_queries.generate(target, out, 10, self_answers=first_turns, batch=12, temperature=3.0,
                                    max_new_tokens=8, device="cpu")
    records = answers.read(out)
    assert summary["records"] == 10 and [r["index"] for r in records] == list(range(10))
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    eot = self_queries.end_of_turn(tok)
    kinds = {r["kind"] for r in records}
    assert kinds <= {f"task-{k}" for k in task_queries.KINDS} and len(kinds) >= 2
    for r in records:
        kind = r["kind"].removeprefix("task-")
        if kind != "multi_turn":  # the turn opens as its kind does
            assert any(r["query"].startswith(o.strip()) for o in task_queries.OPENINGS[kind])
        (start, end), = r["answers"]
        assert end == len(r["ids"]) and 0 < end - start <= 8
        with torch.no_grad():  # alone and unpadded, the target says the same
            alone = model.generate(torch.tensor([r["ids"][:start]]), max_new_tokens=8, do_sample=False,
                                   eos_token_id=eot, pad_token_id=eot)[0, start:].tolist()
        assert r["ids"][start:] == self_queries.cut_at_stop(alone, [eot])
        # the user turn is the conversation's last, rendered by the chat template
        assert tok.decode(r["ids"][:start]).endswith(r["query"] + "<|im_end|>\n<|im_start|>assistant\n")
    follow_ups = [r for r in records if r["kind"] == "task-multi_turn"]
    assert all(tok.decode(r["ids"]).count("<|im_start|>user") == 2 for r in follow_ups)
    task_queries.generate(target, out, 13, self_answers=first_turns, batch=12, temperature=3.0, max_new_tokens=8,
                          device="cpu")
    grown = answers.read(out)
    assert grown[:10] == records and [r["index"] for r in grown] == list(range(13))


def test_cli_refuses_bad_input_and_writes_nothing(target, tmp_path, capsys):
    out = tmp_path / "a.jsonl.gz"
    assert task_queries.main(["--target", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert task_queries.main(["--target", str(target), "--out", str(out), "--self-answers",
                              str(tmp_path / "none.jsonl.gz")]) == 2
    assert "error:" in capsys.readouterr().err and not out.exists()
