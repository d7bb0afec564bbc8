"""`mirror-sd run-batch` (serve/batch_file.py): an OpenAI Batch API file answered through the server's app, batched,
on a tiny bundle."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mirror_sd.cli import main
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.serve.app import ServerSettings, create_app
from mirror_sd.serve.batch_file import read_batch, run_batch

MODEL = "tiny"
QUESTIONS = ["hello there", "the cat sat on", "a b c d", "once upon a time", "tell me more", "why is the sky",
             "one two three", "the end"]
MODES = ["ar", "sd", "mirror", "lookup"]


def _request(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _write(path: Path, requests: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in requests))
    return path


@pytest.fixture(scope="module")
def bundle(bundle_factory) -> Path:
    return bundle_factory("llama")


@pytest.fixture(scope="module")
def pipe(engine_pipelines) -> Pipeline:
    return engine_pipelines("llama")  # the bundle fixture's: 4 slots


def test_a_batch_is_answered_in_order_each_line_as_the_library_answers_it(bundle, pipe, tmp_path, capsys):
    chats = [_request(f"chat-{i}", "/v1/chat/completions",
                      {"model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": 4 + i,
                       "temperature": 0, "mirror": {"mode": MODES[i % len(MODES)]}})
             for i, q in enumerate(QUESTIONS)]
    others = [_request("completion", "/v1/completions", {"model": MODEL, "prompt": "the cat", "max_tokens": 10,
                                                         "temperature": 0}),
              _request("response", "/v1/responses", {"model": MODEL, "input": "hello there", "max_output_tokens": 6,
                                                     "temperature": 0}),
              _request("no-messages", "/v1/chat/completions", {"model": MODEL, "messages": [], "max_tokens": 4}),
              _request("streamed", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                                                          "content": "hi"}],
                                                            "stream": True}),
              _request("no-model", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
              # a response repeats its metadata: half a surrogate pair in it is refused, not a failure to write it
              _request("half-surrogate", "/v1/responses", {"model": MODEL, "input": "hi", "metadata": {"k": "\ud800"}})]
    requests = [chats[0], others[0], *chats[1:5], others[1], others[2], *chats[5:], *others[3:]]
    inp, out = _write(tmp_path / "in.jsonl", ["", *requests, "  "]), tmp_path / "out.jsonl"  # blank lines skipped
    assert main(["run-batch", str(bundle), "-i", str(inp), "-o", str(out), "--served-model-name", MODEL,
                 "--max-num-seqs", "4"]) == 0
    outputs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [o["custom_id"] for o in outputs] == [r["custom_id"] for r in requests]
    assert len({o["id"] for o in outputs}) == len(outputs) and all(o["error"] is None for o in outputs)
    got = {o["custom_id"]: o["response"] for o in outputs}
    for i, q in enumerate(QUESTIONS):  # every mode, batched with the others, equals the prompt's solo greedy output
        solo = pipe.generate([{"role": "user", "content": q}], mode="ar", max_new_tokens=4 + i)
        answer = got[f"chat-{i}"]
        assert answer["status_code"] == 200
        assert answer["body"]["choices"][0]["message"]["content"] == solo.text
        assert answer["body"]["usage"]["completion_tokens"] == len(solo.token_ids)
    assert got["completion"]["body"]["choices"][0]["text"] == pipe.generate("the cat", mode="ar",
                                                                             max_new_tokens=10).text
    response = got["response"]["body"]
    assert got["response"]["status_code"] == 200 and response["object"] == "response"
    assert response["output"][0]["content"][0]["text"] == pipe.generate(
        [{"role": "user", "content": "hello there"}], mode="ar", max_new_tokens=6).text
    assert got["no-messages"]["status_code"] == 400 and got["no-messages"]["body"]["error"]["param"] == "messages"
    assert got["streamed"]["status_code"] == 400 and got["streamed"]["body"]["error"]["param"] == "stream"
    assert got["no-model"]["status_code"] == 400 and got["no-model"]["body"]["error"]["param"] == "model"
    error = got["half-surrogate"]["body"]["error"]
    assert got["half-surrogate"]["status_code"] == 400 and error["param"] == "metadata.k"
    assert error["message"].startswith("metadata.k: holds half of a surrogate pair")
    err = capsys.readouterr().err
    assert f"{len(requests)} requests" in err and "requests answered: 14/14" in err
    assert "10 of 14 requests succeeded, 4 answered with an error (4 x 400)" in err
    most = int(re.search(r"generations at once: (\d+) at most\)", err).group(1))
    assert 1 < most <= 4  # the lines ran together, never past --max-num-seqs


@pytest.mark.parametrize("line, why", [
    ("{not json", "in.jsonl:2: not JSON"),
    ('["a list"]', "in.jsonl:2: a request is a JSON object"),
    ('{"custom_id": "b", "method": "POST", "url": "/v1/completions"}', "in.jsonl:2: missing body"),
    ('{"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {}, "extra": 1}',
     "in.jsonl:2: unknown field extra"),
    ('{"custom_id": 7, "method": "POST", "url": "/v1/completions", "body": {}}', "custom_id must be a non-empty"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}',
     "in.jsonl:2: custom_id 'a' was given on line 1 too"),
    ('{"custom_id": "b", "method": "GET", "url": "/v1/completions", "body": {}}', "method 'GET'"),
    ('{"custom_id": "b", "method": "POST", "url": "/v1/embeddings", "body": {}}', "url '/v1/embeddings'"),
    ('{"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": "hi"}', "body must be a JSON object"),
    ('{"custom_id": "b\\ud800", "method": "POST", "url": "/v1/completions", "body": {}}',
     "in.jsonl:2: custom_id holds half of a surrogate pair"),
    ('{"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"model": "gpt-4o-mini"}}',
     "in.jsonl:2: model 'gpt-4o-mini' is not served here ('tiny'): name it with --served-model-name"),
])
def test_a_file_the_batch_api_would_refuse_is_refused_whole_before_the_load(tmp_path, capsys, line, why):
    first = _request("a", "/v1/completions", {"model": MODEL, "prompt": "hi"})
    inp, out = _write(tmp_path / "in.jsonl", [first, line]), tmp_path / "out.jsonl"
    # the bundle is not even read: a file's fault is found first
    assert main(["run-batch", str(tmp_path / "no-bundle"), "-i", str(inp), "-o", str(out),
                 "--served-model-name", MODEL]) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err
    assert not out.exists()


def test_outputs_that_cannot_be_written_or_would_replace_an_input_are_refused(bundle, tmp_path, capsys):
    inp = _write(tmp_path / "in.jsonl", [_request("a", "/v1/completions", {"model": MODEL, "prompt": "hi"})])
    (tmp_path / "empty.jsonl").write_text("\n\n")
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)  # replacing a pipe (or a device) with a file would lose what reads it
    for args, why in [(["-i", str(inp), "-o", str(inp)], "holds an input"),
                      (["-i", str(inp), "-o", str(tmp_path)], "is a directory"),
                      (["-i", str(inp), "-o", str(fifo)], "is no regular file"),
                      (["-i", str(inp), "-o", str(tmp_path / "no" / "out.jsonl")], "does not exist"),
                      (["-i", str(inp), "-o", str(bundle / "out.jsonl")], "lies inside an input"),
                      (["-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl")], "cannot read"),
                      (["-i", str(tmp_path / "empty.jsonl"), "-o", str(tmp_path / "o.jsonl")], "holds no requests")]:
        assert main(["run-batch", str(bundle), *args, "--served-model-name", MODEL]) == 2
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err, (args, err)
    assert inp.read_text().startswith('{"custom_id": "a"') and not (bundle / "out.jsonl").exists()
    for flags, why in [(["--served-model-name", ""], "--model-name: a served model name cannot be empty"),
                       (["--max-new-tokens", "0"], "max_new_tokens")]:  # as serve's: before the (missing) bundle
        assert main(["run-batch", str(tmp_path / "no-bundle"), "-i", str(inp), "-o", str(tmp_path / "o.jsonl"),
                     *flags]) == 2
        assert why in capsys.readouterr().err


def test_an_interrupted_run_leaves_the_earlier_output_whole_and_nothing_half_written(pipe, tmp_path):
    requests = [_request(f"r{i}", "/v1/completions", {"model": MODEL, "prompt": q, "max_tokens": 6})
                for i, q in enumerate(QUESTIONS)]
    lines = read_batch(_write(tmp_path / "in.jsonl", requests))
    out = tmp_path / "out.jsonl"
    out.write_text("an earlier run's answers\n")
    out.chmod(0o640)
    app = create_app(pipe, ServerSettings(model_name=MODEL, max_queue=64))

    def interrupt(done: int, _total: int) -> None:
        if done == 3:  # Ctrl-C, as asyncio.run takes it: the run is cancelled, then KeyboardInterrupt is raised
            os.kill(os.getpid(), signal.SIGINT)

    # Ctrl-C reaches a run started from a terminal; a test run started in the background (`make test &`) inherits
    # SIGINT ignored, and asyncio.run then leaves it ignored: the handler a terminal gives, for this run
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(run_batch(app, lines, out, 4, interrupt))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert out.read_text() == "an earlier run's answers\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]
    deadline = time.monotonic() + 10
    while pipe.engine().running and time.monotonic() < deadline:  # the engine stops them at its next step
        time.sleep(0.05)
    assert pipe.engine().running == 0  # the interrupted lines' generations stopped with the run
    summary = asyncio.run(run_batch(create_app(pipe, ServerSettings(model_name=MODEL, max_queue=64)), lines, out, 4))
    assert summary.statuses == {200: len(QUESTIONS)} and len(out.read_text().splitlines()) == len(QUESTIONS)
    assert out.stat().st_mode & 0o777 == 0o640  # the file replaced keeps its permissions


def test_lines_end_at_a_newline_alone_after_an_optional_byte_order_mark(tmp_path):
    body = {"model": MODEL, "prompt": "a\u2028b\u0085c\u2029d"}  # separators splitlines() would split at
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(json.dumps(_request(f"r{i}", "/v1/completions", body),
                                                              ensure_ascii=False) for i in range(3)).encode())
    lines = read_batch(path)
    assert [(line.number, line.custom_id) for line in lines] == [(1, "r0"), (2, "r1"), (3, "r2")]
    assert lines[2].body == body


def test_an_output_that_cannot_be_written_is_one_error_line_and_the_earlier_file_stays(bundle, tmp_path):
    requests = [_request(f"r{i}", "/v1/completions", {"model": MODEL, "prompt": q, "max_tokens": 8})
                for i, q in enumerate(QUESTIONS)]
    inp, out = _write(tmp_path / "in.jsonl", requests), tmp_path / "out.jsonl"
    out.write_text("earlier\n")
    # a file-size limit of 1 KiB stands in for a full disk: the answers (about 0.5 KiB a line) do not fit
    command = (f"trap '' XFSZ; ulimit -f 1; exec {sys.executable} -m mirror_sd.cli run-batch {bundle} -i {inp} "
               f"-o {out} --served-model-name {MODEL}")
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert f"mirror-sd: error: cannot write --output-file '{out}'" in done.stderr and "Traceback" not in done.stderr
    assert out.read_text() == "earlier\n" and sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]
