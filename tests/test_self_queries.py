"""models.self_queries on a tiny random target: records an answers file's trainers read, the target's own greedy
answers, resumable, and bad input refused."""

from pathlib import Path

import pytest

from mirror_sd.models.tiny import make_model
from mirror_sd.models.training import answers, self_queries
from mirror_sd.models.training import train_feature_draft as tfd


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("target") / "t", num_layers=2)


def test_end_of_turn_is_the_templates_and_answers_stop_there(target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    eot = self_queries.end_of_turn(tok)
    assert eot == tok.convert_tokens_to_ids("<|im_end|>")
    assert self_queries.cut_at_stop([5, 6, eot, 7, eot], [eot]) == [5, 6, eot]
    assert self_queries.cut_at_stop([5, 6, 7], [eot]) == [5, 6, 7]


def test_records_are_the_targets_greedy_answers_and_a_run_resumes(target, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "answers-self.jsonl.gz"
    first = self_queries.generate(target, out, 5, batch=4, temperature=3.0, max_new_tokens=10, device="cpu")
    records = answers.read(out)
    assert first["records"] == 5 and [r["index"] for r in records] == list(range(5))
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    eot = self_queries.end_of_turn(tok)
    for r in records:
        assert r["kind"] == self_queries.KIND and r["query"]
        (start, end), = r["answers"]
        prompt = tok.apply_chat_template([{"role": "user", "content": r["query"]}], tokenize=False,
                                         add_generation_prompt=True)
        assert r["ids"][:start] == tok(prompt, add_special_tokens=False).input_ids
        assert end == len(r["ids"]) and 0 < end - start <= 10
        # alone and unpadded, the target says the same
        with torch.no_grad():
            alone = model.generate(torch.tensor([r["ids"][:start]]), max_new_tokens=10, do_sample=False,
                                   eos_token_id=eot, pad_token_id=eot)[0, start:].tolist()
        assert r["ids"][start:] == self_queries.cut_at_stop(alone, [eot])
    assert len({r["query"] for r in records}) == 5  # no repeats
    again = self_queries.generate(target, out, 7, batch=4, temperature=3.0, max_new_tokens=10, device="cpu")
    grown = answers.read(out)
    assert again["records"] == 7 and grown[:5] == records and [r["index"] for r in grown] == list(range(7))
    _, held = tfd.split(tfd.load_records([out], 64))
    assert [r.index for r in held] == [0]  # every 20th record is held out, as in every answers file


def test_no_training_query_is_a_held_out_or_benchmark_prompt():
    from mirror_sd.models.benchmark_prompts import PROMPTS
    from mirror_sd.models.training.prompts import build

    excluded = self_queries.excluded_queries()
    assert PROMPTS[0].messages[0]["content"].strip() in excluded
    assert build(3, 0, held_out=True)[0].messages[0]["content"].strip() in excluded


def test_cli_refuses_bad_input_and_writes_nothing(target, tmp_path, capsys):
    out = tmp_path / "a.jsonl.gz"
    assert self_queries.main(["--target", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "error:" in capsys.readouterr().err and not out.exists()
    assert self_queries.main(["--target", str(target), "--out", str(out), "--top-p", "0"]) == 2
    assert not out.exists()
