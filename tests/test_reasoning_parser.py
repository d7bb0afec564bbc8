"""`--reasoning-parser` (serve/reasoning.py): a reasoning model's think block as the chat message's `reasoning`, the
rest its content, streamed or not, through the real server and the openai client on a tiny bundle (a regex makes the
tiny random model write a block; a prefilled assistant turn leaves one open as a template's generation prompt does)."""

from __future__ import annotations

import random
import re

import openai
import pytest
from conftest import openai_client

from mirror_sd.errors import BadInputError
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.serve.app import ServerSettings
from mirror_sd.serve.reasoning import Reading, generation_prompt, reading

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "hello there"}]
THOUGHT = r"<think>\nfirst, the greeting\.\n</think>\n\nSure\."
TOOLS = [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def pipe(bundle_factory) -> Pipeline:
    return Pipeline.load(bundle_factory("llama"))


def _thought(message) -> str | None:
    """The message's reasoning, checked to be under both names."""
    extra = message.model_extra or {}
    assert extra.get("reasoning") == extra.get("reasoning_content")
    return extra.get("reasoning")


def _streamed(chunks) -> tuple[str, str]:
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    return "".join(_thought(d) or "" for d in deltas), "".join(d.content or "" for d in deltas)


@pytest.mark.parametrize("text", ["<think>abc</think>Sure.", "  <think>\nx</think>\n\nAnswer", "abc</think>Sure",
                                  "plain", "", "  ", "<th", "<think>", "<think>abc", "a</thi", "</think>",
                                  "x<think>y</think>z", "<think></think>", "<think>a</think>b</think>c",
                                  "hm\n<tool_call>\n<function=f>\n</function>\n</tool_call>",
                                  "a <tool_call> b</think>c", "a<tool_call>\n <function", "<tool_call>x</think>y",
                                  "q<tool_call><function=f></function></tool_call></think>z"])
@pytest.mark.parametrize("opened", [True, False])
@pytest.mark.parametrize("calls_close", [False, True])
def test_a_streamed_answer_splits_as_the_whole_one_however_it_is_cut(text, opened, calls_close):
    reading_ = Reading(opened, calls_close)
    want = reading_.split(text)
    rng = random.Random(text)
    for _ in range(60):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 4))))
        stream, said, content = reading_.stream(), "", ""
        for part in [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]:
            r, c = stream.feed(part, last=False)
            said, content = said + r, content + c
        r, c = stream.feed("", last=True)
        said, content = said + r, content + c
        assert (said if want[0] is not None else None, content or None) == want
        assert want[0] is not None or not said


def test_what_reads_as_reasoning():
    assert Reading(True).split("a</think>b") == ("a", "b") and Reading(True).split("cut short") == ("cut short", None)
    assert Reading(False).split("a</think>b") == (None, "a</think>b")  # only a block the answer opens itself
    assert Reading(False).split("<think>a</think>b") == ("a", "b")
    assert reading("qwen3", "<|im_end|>\n<|im_start|>assistant\n", False, None, grammar=False) == Reading(True, True)
    assert reading("deepseek_r1", "<｜Assistant｜><think>\n", False, None, grammar=True) == Reading(False)
    # a template that turned thinking off closed the block in the generation prompt; qwen3's switch says so as well
    closed = "assistant\n<think>\n\n</think>\n\n"
    assert reading("deepseek_r1", closed, False, None, grammar=False) == Reading(False)
    assert not reading("qwen3", "assistant\n", False, {"enable_thinking": False}, grammar=False).opened
    assert reading("deepseek_r1", "assistant\n", False, {"enable_thinking": False}, grammar=False) == Reading(True)
    # a prefilled assistant turn goes on inside a block only where it opened one
    assert not reading("qwen3", "The answer is", True, None, grammar=False).opened
    assert reading("qwen3", "<think>\nHm", True, None, grammar=False).opened
    # qwen3: a tool call opened in the block ends it (Qwen3.5 may leave </think> out), the call the content's
    call = "<tool_call>\n<function=f>\n</function>\n</tool_call>"
    assert Reading(True, True).split("hm\n" + call) == ("hm\n", call)
    assert Reading(True).split("hm\n" + call) == ("hm\n" + call, None)
    assert Reading(True, True).split("a <tool_call> tag</think>b") == ("a <tool_call> tag", "b")
    # reasoning_tokens: the tokens that spell the block through its </think>; a call that ends it is the content's
    pieces = ["<think>", "hm", "\n", "<tool_call>", "\n", "<function", "=f", ">"]
    assert Reading(False, True).tokens(list(range(len(pieces))), lambda ids: "".join(pieces[i] for i in ids)) == 3
    pieces = ["hm", "</th", "ink>\n", "ok"]
    assert Reading(True).tokens(list(range(len(pieces))), lambda ids: "".join(pieces[i] for i in ids)) == 3
    # the generation prompt is what the template adds after the last message: a tag in a message is no template's
    before = "<|user|>what does </think> do?<|end|>\n"
    assert generation_prompt(before + "<|assistant|>", before, "x") == "<|assistant|>"
    # a template that renders the messages otherwise with a generation prompt: after the last message's text
    assert generation_prompt("<|user|>Hi?<|end|>\n<|assistant|>", "<|user|>hi?<|end|>\n", " Hi? ") == (
        "<|end|>\n<|assistant|>")
    assert generation_prompt("<|user|>Hi<|assistant|>", "<|user|>hi", "") == ""
    with pytest.raises(BadInputError, match="reasoning_parser"):
        ServerSettings("m", reasoning_parser="granite")


def test_a_think_block_is_the_messages_reasoning_streamed_or_not(pipe):
    """The block's text is `reasoning` (and `reasoning_content`), the rest `content`; streamed, reasoning deltas come
    first and every token's logprob goes out; without the parser the answer is all content."""
    want = pipe.generate(pipe.prompt_ids(MESSAGES), mode="ar", max_new_tokens=60, regex=THOUGHT)
    assert want.text == "<think>\nfirst, the greeting.\n</think>\n\nSure." and want.finish_reason == "eos"
    forced = {"structured_outputs": {"regex": THOUGHT}}
    with openai_client(pipe, MODEL, reasoning_parser="qwen3") as c:
        for mode in ("ar", "mirror"):
            r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                          extra_body={**forced, "mirror": {"mode": mode}})
            message = r.choices[0].message
            assert (_thought(message), message.content) == ("\nfirst, the greeting.\n", "\n\nSure.")
            # usage counts the tokens through the one that closes the block, as OpenAI's reasoning_tokens
            closing = next(k for k in range(len(want.token_ids) + 1)
                           if "</think>" in pipe.codec.decode(want.token_ids[:k]))
            assert r.usage.completion_tokens_details.reasoning_tokens == closing < len(want.token_ids)
        chunks = list(c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                                stream=True, logprobs=True, extra_body=forced,
                                                stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == closing
        chunks = chunks[:-1]
        assert _streamed(chunks) == ("\nfirst, the greeting.\n", "\n\nSure.")
        kinds = [("r" if _thought(ch.choices[0].delta) else "") + ("c" if ch.choices[0].delta.content else "")
                 for ch in chunks if ch.choices]
        assert re.fullmatch("r+c+", "".join(kinds))  # reasoning, then content
        assert sum(len(ch.choices[0].logprobs.content) for ch in chunks if ch.choices and ch.choices[0].logprobs) \
            == len(want.token_ids)
        assert chunks[-1].choices[0].finish_reason == "stop"
        # a tag in the last message is not the template's: the answer still starts in a block
        asked = [{"role": "user", "content": "what does </think> do?"}]
        r = c.chat.completions.create(model=MODEL, messages=asked, max_tokens=60, temperature=0, extra_body=forced)
        assert (_thought(r.choices[0].message), r.choices[0].message.content) == ("\nfirst, the greeting.\n",
                                                                                  "\n\nSure.")
        # a JSON grammar holds the answer from its first token: content, whatever the template left open
        r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                      response_format={"type": "json_object"})
        assert _thought(r.choices[0].message) is None and r.choices[0].message.content.startswith("{")
    with openai_client(pipe, MODEL) as c:
        r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0, extra_body=forced)
        assert r.choices[0].message.content == want.text and _thought(r.choices[0].message) is None


def test_an_answer_in_a_block_the_prompt_left_open_is_reasoning_until_it_closes(pipe):
    """An assistant turn left open after <think> (as a template's generation prompt leaves it) starts the answer
    inside the block: cut before </think>, all of it is reasoning; a prompt that closed the block, or qwen3's
    enable_thinking false, leaves it content."""
    opened = [*MESSAGES, {"role": "assistant", "content": "<think>\n"}]
    closed = [*MESSAGES, {"role": "assistant", "content": "<think>\n\n</think>\n\n"}]
    prefill = {"continue_final_message": True, "add_generation_prompt": False}
    with openai_client(pipe, MODEL, reasoning_parser="qwen3") as c:
        def ask(messages, stream=False, **extra):
            args = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0, extra_body={**prefill, **extra})
            if stream:
                return _streamed(list(c.chat.completions.create(stream=True, **args)))
            message = c.chat.completions.create(**args).choices[0].message
            return _thought(message), message.content

        text = pipe.generate(pipe.prompt_ids(opened, **_rendering(prefill)), mode="ar", max_new_tokens=10).text
        assert "</think>" not in text
        assert ask(opened) == (text, None) and ask(opened, stream=True) == (text, "")
        after = pipe.generate(pipe.prompt_ids(closed, **_rendering(prefill)), mode="ar", max_new_tokens=10).text
        assert ask(closed) == (None, after) and ask(closed, stream=True) == ("", after)
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        assert ask(opened, **off) == (None, text) and ask(opened, stream=True, **off) == ("", text)
    with openai_client(pipe, MODEL, reasoning_parser="deepseek_r1") as c:
        r = c.chat.completions.create(model=MODEL, messages=opened, max_tokens=10, temperature=0,
                                      extra_body={**prefill, "chat_template_kwargs": {"enable_thinking": False}})
        assert _thought(r.choices[0].message) == text  # deepseek_r1 has no such switch


def _rendering(prefill: dict) -> dict:
    return {"add_generation_prompt": prefill["add_generation_prompt"],
            "continue_final_message": prefill["continue_final_message"]}


def test_tool_calls_are_read_from_the_content_after_the_block(pipe):
    """With a tool-call parser too, the calls are read in the content: the block is reasoning, the text before the
    call the content; streamed, the calls come in one delta at the end. Under qwen3 a call opened in the block ends
    it."""
    pattern = THOUGHT + r"\n<tool_call>\n\{\"name\": \"ping\", \"arguments\": \{\}\}\n</tool_call>"
    with openai_client(pipe, MODEL, reasoning_parser="deepseek_r1", tool_call_parser="hermes") as c:
        args = dict(model=MODEL, messages=MESSAGES, max_tokens=90, temperature=0, tools=TOOLS,
                    extra_body={"structured_outputs": {"regex": pattern}})
        r = c.chat.completions.create(**args)
        message = r.choices[0].message
        assert (_thought(message), message.content) == ("\nfirst, the greeting.\n", "\n\nSure.\n")
        assert [t.function.name for t in message.tool_calls] == ["ping"] and r.choices[0].finish_reason == "tool_calls"
        chunks = list(c.chat.completions.create(stream=True, **args))
        assert _streamed(chunks) == ("\nfirst, the greeting.\n", "\n\nSure.\n")
        (calls,) = [ch.choices[0].delta.tool_calls for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls]
        assert [t.function.name for t in calls] == ["ping"]
    # qwen3: a call opened inside the block (Qwen3.5 may leave </think> out) ends it, and is read as a call
    unclosed = r"<think>\nhm\n<tool_call>\n<function=ping>\n</function>\n</tool_call>"
    with openai_client(pipe, MODEL, reasoning_parser="qwen3", tool_call_parser="qwen3_coder") as c:
        args = dict(model=MODEL, messages=MESSAGES, max_tokens=90, temperature=0, tools=TOOLS,
                    extra_body={"structured_outputs": {"regex": unclosed}})
        message = c.chat.completions.create(**args).choices[0].message
        assert (_thought(message), message.content, [t.function.name for t in message.tool_calls]) == (
            "\nhm\n", None, ["ping"])
        chunks = list(c.chat.completions.create(stream=True, **args))
        assert _streamed(chunks) == ("\nhm\n", "")
        assert [t.function.name for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or ()] == [
            "ping"]


def test_an_answer_with_its_reasoning_replays_as_the_next_turn(pipe):
    """The message as the openai client dumps it (reasoning and reasoning_content beside the content) is taken
    back as a turn; the template gets it as reasoning_content (Qwen3's templates show it); another role's reasoning
    is a 400."""
    with openai_client(pipe, MODEL, reasoning_parser="qwen3") as c:
        r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                      extra_body={"structured_outputs": {"regex": THOUGHT}})
        turn = r.choices[0].message.model_dump(exclude_none=True)
        assert turn["reasoning"] and turn["reasoning_content"]
        history = [*MESSAGES, turn, {"role": "user", "content": "and then?"}]
        again = c.chat.completions.create(model=MODEL, messages=history, max_tokens=4, temperature=0)
        rendered = [*MESSAGES, {"role": "assistant", "content": turn["content"], "reasoning": turn["reasoning"],
                                "reasoning_content": turn["reasoning"]}, history[-1]]
        assert again.usage.prompt_tokens == len(pipe.prompt_ids(rendered))
        # an answer cut inside its block has no content: it replays all the same
        cut = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                        extra_body={"structured_outputs": {"regex": THOUGHT}}).choices[0].message
        assert cut.content is None and _thought(cut)
        c.chat.completions.create(model=MODEL, messages=[*MESSAGES, cut.model_dump(), MESSAGES[0]], max_tokens=2)
        for bad in ([{"role": "user", "content": "x", "reasoning": "y"}],
                    [*MESSAGES, {"role": "assistant", "content": "a", "reasoning": "y", "reasoning_content": "z"}]):
            with pytest.raises(openai.BadRequestError):
                c.chat.completions.create(model=MODEL, messages=bad, max_tokens=2)


THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
                     "{% if m.reasoning_content %}[thought: {{ m.reasoning_content }}]{% endif %}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")


def test_the_responses_api_gives_the_block_as_a_reasoning_item(bundle_factory):
    """Through /v1/responses (a template whose generation prompt opens the block, as DeepSeek-R1's does): the
    answer's reasoning is a reasoning item of reasoning_text, streamed as reasoning_text deltas; cut before the block
    closes it is the answer's only item, incomplete; replayed as input, or continued by previous_response_id, it is
    the assistant turn's reasoning again (this template shows it)."""
    pipe = Pipeline.load(bundle_factory("llama"), huge_pages=False, chat_template=THINKING_TEMPLATE)
    want = pipe.generate([{"role": "user", "content": "hi"}], mode="ar", max_new_tokens=8, ignore_eos=True).text
    assert "</think>" not in want
    with openai_client(pipe, MODEL, reasoning_parser="deepseek_r1") as c:
        long = {"mirror": {"ignore_eos": True}}
        r = c.responses.create(model=MODEL, input="hi", max_output_tokens=8, temperature=0, extra_body=long)
        assert r.status == "incomplete" and [item.type for item in r.output] == ["reasoning"]
        assert r.output[0].content[0].text == want and r.output[0].status == "incomplete"
        assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 8
        events = list(c.responses.create(model=MODEL, input="hi", max_output_tokens=8, temperature=0, stream=True,
                                         extra_body=long))
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == want
        final = events[-1].response
        assert [item.type for item in final.output] == ["reasoning"] and final.output[0].content[0].text == want
        turn = [*[item.model_dump(exclude_none=True) for item in r.output], {"role": "user", "content": "more"}]
        again = c.responses.create(model=MODEL, input=[{"role": "user", "content": "hi"}, *turn],
                                   max_output_tokens=2, temperature=0)
        history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "reasoning_content": want},
                   {"role": "user", "content": "more"}]
        assert again.usage.input_tokens == len(pipe.prompt_ids(history))
        assert f"[thought: {want}]" in pipe.codec.decode(pipe.prompt_ids(history))
        chained = c.responses.create(model=MODEL, input="more", previous_response_id=r.id, max_output_tokens=2,
                                     temperature=0)
        assert chained.usage.input_tokens == again.usage.input_tokens


def test_a_responses_answer_streamed_or_not_has_the_same_items_and_logprobs(pipe, monkeypatch):
    """The message's logprobs are its text's tokens' (the block's go with the reasoning item), and an empty block
    makes no reasoning item, streamed or not. (The Responses API has no field for a regex: the chat request it
    makes gets one here.)"""
    from mirror_sd.serve.responses import ResponsesRequest

    pattern = {"regex": THOUGHT}
    made = ResponsesRequest.chat_request

    def forced(self, history=()):
        chat = made(self, history)
        return type(chat).model_validate({**chat.model_dump(exclude_none=True), "structured_outputs": pattern})

    monkeypatch.setattr(ResponsesRequest, "chat_request", forced)

    def shape(response):
        return [(item.type, "".join(part.text for part in item.content or ()),
                 len(item.content[0].logprobs) if item.type == "message" else None) for item in response.output]

    with openai_client(pipe, MODEL, reasoning_parser="qwen3") as c:
        ask = dict(model=MODEL, input="hello there", max_output_tokens=60, temperature=0,
                   include=["message.output_text.logprobs"])
        whole = c.responses.create(**ask)
        streamed = list(c.responses.create(stream=True, **ask))[-1].response
        content_tokens = whole.usage.output_tokens - whole.usage.output_tokens_details.reasoning_tokens
        assert shape(whole) == shape(streamed) == [("reasoning", "\nfirst, the greeting.\n", None),
                                                   ("message", "\n\nSure.", content_tokens)]
        # with a tool-call parser: the message's logprobs are its text's, none of the calls' (nor a held first token's
        # lost): streamed or not alike
        with openai_client(pipe, MODEL, tool_call_parser="hermes") as h:
            for regex in (r"Sure\.\n<tool_call>\n\{\"name\": \"ping\", \"arguments\": \{\}\}\n</tool_call>",
                          r"<b>Hi</b> there"):
                pattern["regex"] = regex
                ask = dict(model=MODEL, input="hello there", max_output_tokens=60, temperature=0, tools=[
                    {"type": "function", "name": "ping", "parameters": {"type": "object", "properties": {}}}],
                           include=["message.output_text.logprobs"])
                got = [c.responses.create(**ask) for c in (h,)] + [
                    list(h.responses.create(stream=True, **ask))[-1].response]
                tokens = [[lp.token for item in r.output if item.type == "message" for lp in item.content[0].logprobs]
                          for r in got]
                assert tokens[0] == tokens[1] and "".join(tokens[0]).startswith(got[0].output_text)
        pattern["regex"] = THOUGHT
        for regex, text in (("<think></think>x", "x"), ("<think></think>", "")):  # an empty block: no item
            pattern["regex"] = regex
            ask = dict(model=MODEL, input="hello there", max_output_tokens=30, temperature=0)
            got = [shape(c.responses.create(**ask)), shape(list(c.responses.create(stream=True, **ask))[-1].response)]
            assert [[(kind, said) for kind, said, _ in g] for g in got] == [[("message", text)]] * 2


def test_responses_input_items_make_the_turns_they_were():
    """A reasoning item and the text and calls after it are one assistant turn; two assistant messages stay two."""
    from mirror_sd.serve.responses import ResponsesRequest

    def turns(items):
        return ResponsesRequest(model=MODEL, input=items).input_messages()

    assert turns([{"role": "user", "content": "a"}, {"role": "assistant", "content": ""},
                  {"role": "assistant", "content": "b"}])[1:] == [{"role": "assistant", "content": ""},
                                                                   {"role": "assistant", "content": "b"}]
    thought = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]}
    call = {"type": "function_call", "call_id": "c1", "name": "ping", "arguments": "{}"}
    assert turns([thought, {"role": "assistant", "content": "ok"}, call]) == [
        {"role": "assistant", "content": "ok", "reasoning": "hm",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ping", "arguments": "{}"}}]}]
    assert turns([thought, {"role": "user", "content": "q"}]) == [
        {"role": "assistant", "content": "", "reasoning": "hm"}, {"role": "user", "content": "q"}]
