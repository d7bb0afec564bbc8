"""The perplexity of a text under the target (runtime/perplexity.py, Pipeline.perplexity, `mirror-sd perplexity`):
every token after the first scored once, in overlapping windows, each from the row before it as the reference forward
over its window gives it; bad input is a one-line error with exit code 2."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from mirror_sd.cli import main
from mirror_sd.errors import BadInputError
from mirror_sd.runtime.perplexity import windows
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.reference import reference_prompt_logprobs

TEXT = "The quick brown fox jumps over the lazy dog. " * 12 + "Then it sleeps under the old oak tree."


@pytest.fixture(scope="module")
def bundle(bundle_factory):
    return bundle_factory("qwen3")


@pytest.fixture(scope="module")
def pipe(bundle):
    pipe = Pipeline.load(bundle, huge_pages=False)
    yield pipe
    pipe.close()


def test_the_windows_score_every_token_but_the_first_once():
    for n, window, stride in itertools.product(range(2, 40), range(2, 12), range(1, 11)):
        if stride >= window:
            continue
        spans = windows(n, window, stride)
        assert [p for _, end, first in spans for p in range(first, end)] == list(range(1, n)), (n, window, stride)
        # each scored token has at least window - stride tokens before it in its window, or all there are
        assert all(begin < first and end - begin <= window for begin, end, first in spans)
        assert all(first - begin >= min(window - stride, first) for begin, _, first in spans[1:])


@pytest.mark.parametrize("window, stride", [(None, None), (16, 8), (9, 1)])
def test_perplexity_is_the_reference_forwards_per_window(pipe, window, stride):
    ids = pipe.prompt_ids(TEXT)
    got = pipe.perplexity(TEXT, window=window, stride=stride)
    window = window or pipe.context_limit - 1  # the tiny models' context is 512: the default window does not fit
    total = 0.0
    for begin, end, first in windows(len(ids), window, stride or window // 2):
        want = reference_prompt_logprobs(pipe.target, ids[begin:end])
        total -= sum(s.logprob for s in want[first - begin:])
    assert got.tokens == len(ids) - 1 and got.windows == len(windows(len(ids), window, stride or window // 2))
    assert got.nll == pytest.approx(total / got.tokens, abs=1e-5)
    assert got.perplexity == pytest.approx(math.exp(got.nll))


def test_the_command_prints_what_the_library_gives(bundle, pipe, tmp_path, capsys):
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    assert main(["perplexity", str(bundle), "--file", str(path), "--window", "32", "--stride", "16", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    want = pipe.perplexity(TEXT, window=32, stride=16)
    assert printed == pytest.approx(want.as_dict())
    assert main(["perplexity", str(bundle), "--file", str(path), "--window", "32"]) == 0
    assert capsys.readouterr().out.startswith(f"perplexity {pipe.perplexity(TEXT, window=32).perplexity:.4f} ")


@pytest.mark.parametrize("args, words", [
    (["--file", "missing.txt"], "cannot read --file"),
    (["--file", "{text}", "--window", "1"], "window"),
    (["--file", "{text}", "--window", "8", "--stride", "8"], "stride"),
    (["--file", "{one}"], "at least 2 tokens"),
])
def test_bad_input_is_one_line_and_exit_code_2(bundle, tmp_path, capsys, args, words):
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    (tmp_path / "one.txt").write_text("A", encoding="utf-8")
    args = [a.format(text=tmp_path / "text.txt", one=tmp_path / "one.txt") for a in args]
    assert main(["perplexity", str(bundle), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("mirror-sd: error:") and words in err


def test_a_window_past_the_context_is_refused(pipe):
    with pytest.raises(BadInputError, match="does not fit") as caught:
        pipe.perplexity(TEXT, window=pipe.context_limit)
    assert caught.value.option == "window"
    assert pipe.perplexity(TEXT * 5, window=pipe.context_limit - 1).tokens == len(pipe.prompt_ids(TEXT * 5)) - 1
