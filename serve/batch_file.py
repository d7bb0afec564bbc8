"""`mirror-sd run-batch`: a file of OpenAI Batch API requests answered offline, as `vllm run-batch` answers one.

    lines = read_batch(Path("requests.jsonl"))          # every line checked before the bundle loads
    summary = asyncio.run(run_batch(app, lines, out, max_in_flight))

Each input line is one request in the Batch API's shape, `{"custom_id": ..., "method": "POST", "url":
"/v1/chat/completions", "body": {...}}`, its body what the server takes on that route; each output line, in the
input's order, `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`. The requests
run through the server's own app (serve/app.py), called in this process without a socket: the same checks, defaults,
tool-call and reasoning parsers, and errors as over HTTP (a request the server would refuse gets its 4xx here, as its
line's response), and the same batching engine, kept full: up to `max_in_flight` requests are in it at once, taken
in the file's order.

A file the Batch API would not take (a line that is not such an object, a custom_id given twice, another method, route
or model) is refused whole, naming the line, before the bundle loads. A line whose request got no HTTP answer (a bug)
has its failure in `error`, and the others go on. The output is written beside its place and moved in at the end: an
interrupted run, or one that cannot write, leaves no half-written file, and an earlier output stays until the new one
is whole.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mirror_sd.errors import BadInputError, MirrorSDError
from mirror_sd.outputs import check_apart
from mirror_sd.serve import protocol as p

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")  # the routes a line may ask for
FIELDS = ("custom_id", "method", "url", "body")

log = logging.getLogger("mirror_sd.serve.batch")


@dataclass(frozen=True)
class BatchLine:
    number: int  # its line in the file, from 1 (what errors name)
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass
class BatchSummary:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)  # HTTP status -> lines answered with it
    completion_tokens: int = 0  # over the answered lines' usage
    failed: int = 0  # lines that got no HTTP answer (their output's error says why)
    most_running: int = 0  # the most generations the engine ran at once (batching at work)
    elapsed_s: float = 0.0

    @property
    def answered(self) -> int:
        return sum(self.statuses.values()) + self.failed

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


def read_batch(path: Path) -> list[BatchLine]:
    """The requests of a Batch API input file (JSON Lines, "\r\n" or "\n"; blank lines skipped). BadInputError,
    naming the line, for a file that is not one: no request has run yet."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is not a request
    except (OSError, UnicodeDecodeError) as e:
        raise BadInputError(f"cannot read the batch file {str(path)!r}: {e}", option="input_file") from None
    lines: list[BatchLine] = []
    seen: dict[str, int] = {}
    # "\n" alone ends a line: splitlines() would also split inside strings holding U+2028, U+0085, ... (JSON Lines)
    for number, raw in enumerate(text.split("\n"), 1):
        if not raw.strip():
            continue
        line = _line(path, number, raw)
        if line.custom_id in seen:
            raise _bad(path, number, f"custom_id {line.custom_id!r} was given on line {seen[line.custom_id]} too: "
                                     "each request needs its own")
        seen[line.custom_id] = number
        lines.append(line)
    if not lines:
        raise BadInputError(f"the batch file {str(path)!r} holds no requests", option="input_file")
    return lines


def _line(path: Path, number: int, raw: str) -> BatchLine:
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise _bad(path, number, f"not JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(doc, dict):
        raise _bad(path, number, f"a request is a JSON object with {', '.join(FIELDS)}")
    missing = [f for f in FIELDS if f not in doc]
    unknown = sorted(set(doc) - set(FIELDS))
    if missing or unknown:
        what = [f"missing {', '.join(missing)}"] if missing else []
        what += [f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}"] if unknown else []
        raise _bad(path, number, f"{'; '.join(what)} (a request has {', '.join(FIELDS)})")
    custom_id, method, url, body = (doc[f] for f in FIELDS)
    if not isinstance(custom_id, str) or not custom_id:
        raise _bad(path, number, "custom_id must be a non-empty string")
    if p.half_surrogate(custom_id) is not None:  # the output repeats it, and could not be written
        raise _bad(path, number, "custom_id holds half of a surrogate pair (a \\ud800-\\udfff escape alone)")
    if method != "POST":
        raise _bad(path, number, f"method {method!r}: the Batch API sends POST")
    if url not in URLS:
        raise _bad(path, number, f"url {url!r}: a request goes to one of {', '.join(URLS)}")
    if not isinstance(body, dict):
        raise _bad(path, number, "body must be a JSON object: the request the url takes")
    return BatchLine(number, custom_id, url, body)


def _bad(path: Path, number: int, why: str) -> BadInputError:
    return BadInputError(f"{path}:{number}: {why}", option="input_file")


def batch_bounds(max_num_seqs: int) -> tuple[int, int]:
    """(lines in flight, the app's max_queue) for an engine of `max_num_seqs` slots: twice its slots in flight, as
    vLLM's, so that a step that frees a slot finds the next request waiting; the lines in flight bound what waits,
    and a queue bound of the server's would only turn lines with n > 1 into 429s."""
    in_flight = 2 * max_num_seqs
    return in_flight, in_flight * p.MAX_N * p.MAX_PROMPTS


def check_output_file(out: Path, inputs: Iterable[str | Path]) -> None:
    """Refuse, before the bundle loads, an output file that could not be written or whose writing would replace
    what the user gave: a directory or another non-file (a pipe, a device), a folder that does not exist, an input
    (the batch file, the bundle)."""
    if out.exists() and not out.is_file() and not out.is_symlink():
        what = "a directory" if out.is_dir() else "no regular file (a pipe or a device would be replaced by one)"
        raise BadInputError(f"--output-file {str(out)!r} is {what}", option="output_file")
    if not out.parent.is_dir():
        raise BadInputError(f"--output-file's folder {str(out.parent)!r} does not exist", option="output_file")
    check_apart(out, "batch output", inputs, label="--output-file")


def check_models(path: Path, lines: list[BatchLine], names: Iterable[str]) -> None:
    """Refuse, before the bundle loads, a file with a line naming a model not served here (the Batch API's files
    name one model), rather than a 404 on that line after the load; a line without one gets its 400 there."""
    names = tuple(names)
    for line in lines:
        model = line.body.get("model")
        if isinstance(model, str) and model not in names:
            raise _bad(path, line.number, f"model {model!r} is not served here ({', '.join(map(repr, names))}): "
                                          "name it with --served-model-name")


async def run_batch(app, lines: list[BatchLine], out: Path, max_in_flight: int,
                    progress: Callable[[int, int], None] | None = None, running: Callable[[], int] | None = None
                    ) -> BatchSummary:
    """Answer `lines` through the server's `app` (serve/app.py create_app), at most `max_in_flight` at once in the
    file's order, and write their outputs to `out` in that order (written beside it, moved in at the end; a failure
    to write is a MirrorSDError). `progress(done, total)` after each answer; `running()` the engine's running
    generations, sampled meanwhile. When it returns or fails, the app's generations have stopped (its lifespan's
    end)."""
    summary = BatchSummary(requests=len(lines))
    start = time.monotonic()
    pending = iter(enumerate(lines))
    ready: dict[int, dict[str, Any]] = {}
    try:
        handle, staging = _staging_file(out)
    except OSError as e:
        raise _unwritable(out, e) from None
    written = 0

    async def worker() -> None:
        nonlocal written
        for index, line in pending:  # one iterator shared: each line is taken once, in order
            ready[index] = await _answer(app, line)
            _count(summary, ready[index])
            while written in ready:  # in the file's order: what has come is written at once
                handle.write(json.dumps(ready.pop(written), ensure_ascii=False) + "\n")
                written += 1
            if progress is not None:
                progress(summary.answered, summary.requests)

    async def sample() -> None:  # at the moments generations end, as many have just left: sampled apart from them
        while True:
            summary.most_running = max(summary.most_running, running())
            await asyncio.sleep(0.005)

    try:
        with handle:
            sampler = asyncio.create_task(sample()) if running is not None else None
            try:
                async with app.router.lifespan_context(app), asyncio.TaskGroup() as workers:  # one fails: all stop
                    for _ in range(max(1, min(max_in_flight, len(lines)))):
                        workers.create_task(worker())
            except BaseExceptionGroup as group:
                raise _unwrapped(group, out) from None
            finally:
                if sampler is not None:
                    sampler.cancel()
        os.replace(staging, out)
    except OSError as e:
        raise _unwritable(out, e) from None
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    summary.elapsed_s = time.monotonic() - start
    return summary


def _unwrapped(group: BaseExceptionGroup, out: Path) -> BaseException:
    """The first failure of the workers (a TaskGroup's group holds it): writing the output, a MirrorSDError;
    anything else as it came (a bug, with its traceback)."""
    first = group.exceptions[0]
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return _unwritable(out, first) if isinstance(first, OSError) else first


def _unwritable(out: Path, e: OSError) -> MirrorSDError:
    return MirrorSDError(f"cannot write --output-file {str(out)!r}: {e.strerror or e}; an earlier file there is "
                         "kept as it was")


def _count(summary: BatchSummary, output: dict[str, Any]) -> None:
    response = output["response"]
    if response is None:  # failed without an HTTP answer: its error says why
        summary.failed += 1
        return
    summary.statuses[response["status_code"]] += 1
    usage = response["body"].get("usage") if isinstance(response["body"], dict) else None
    if response["status_code"] == 200 and isinstance(usage, dict):
        # chat and completions count completion_tokens, the Responses API output_tokens
        summary.completion_tokens += int(usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0)


def _staging_file(out: Path):
    """A new file beside `out` to write into, with the permissions `out` has, or a new file would have (mkstemp's
    are the owner's alone)."""
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    if out.exists():
        mode = stat.S_IMODE(out.stat().st_mode)
    else:
        umask = os.umask(0)  # read by setting it: put back at once
        os.umask(umask)
        mode = 0o666 & ~umask
    os.chmod(fd, mode)
    return os.fdopen(fd, "w", encoding="utf-8"), name


async def _answer(app, line: BatchLine) -> dict[str, Any]:
    """The output line for `line`: the app's answer to its body on its route, or the 400 a stream gets here; a
    failure that gave no answer goes in the line's error (the Batch API's place for it), the others go on."""
    output = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": None, "error": None}
    if line.body.get("stream"):
        error = p.ApiError(400, "stream: a batch request is answered whole; leave stream out", param="stream",
                           code="invalid_value")
        status, body = error.status, error.body()
    else:
        try:
            status, raw = await call(app, line.url, json.dumps(line.body).encode())
            body = json.loads(raw)
        except Exception as e:  # a bug in the app, or an answer that is not JSON: this line's, not the batch's
            log.exception("line %d (custom_id %r) got no answer", line.number, line.custom_id)
            output["error"] = {"code": "internal_error", "message": f"{type(e).__name__}: {e}"}
            return output
    output["response"] = {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": body}
    return output


async def call(app, path: str, body: bytes) -> tuple[int, bytes]:
    """POST `body` (JSON) to `path` of the ASGI `app` in this process: (status, response body). The request reads
    as a client that stays until the answer is whole (the app's disconnect watch never fires)."""
    answered = asyncio.Event()
    sent = False
    status, chunks = 500, []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                answered.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": [(b"content-type", b"application/json"),
                                               (b"content-length", str(len(body)).encode())],
             "client": ("run-batch", 0), "server": ("run-batch", 0), "state": {}}
    try:
        await app(scope, receive, send)
    except Exception:  # the app answered its 500 before re-raising (Starlette's error middleware): that is the line's
        if not answered.is_set():
            raise
    finally:
        answered.set()
    return status, b"".join(chunks)
