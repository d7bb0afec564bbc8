"""One log line and one count (/metrics) per HTTP request (method, route, status, duration), and the request's
arrival time.

A plain ASGI middleware rather than Starlette's BaseHTTPMiddleware, which would run the endpoint in a task of its
own and so change how a streamed response learns that its client went away. The line is written when the response
has ended (a stream: at its last event), so its duration is the request's whole time; it names the route's template
(bounded, and free of whatever a client put in a path), or "unmatched".
"""

from __future__ import annotations

import logging
import time
from typing import Any

from mirror_sd.serve.metrics import route_label

log = logging.getLogger("mirror_sd.serve.access")

ARRIVAL = "arrival"  # request.state.arrival: time.monotonic() when the request came in (TTFT is measured from it)
STREAM_STATUS = "stream_status"  # request.state.stream_status: the status a stream's error event carried


class AccessLog:
    """metrics: counts every request answered (its `requests`), by route and status; a stream that ends on an error
    event after its 200 started is counted with that error's status (scope["state"][STREAM_STATUS])."""

    def __init__(self, app: Any, metrics: Any = None) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        scope.setdefault("state", {})[ARRIVAL] = start
        status = 500  # what the server answers if the app ends without starting a response

        async def send_and_note(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            client = scope.get("client") or ("-", 0)
            log.info("%s %s %s %d %.1f ms", client[0], scope["method"], route_label(scope), status,
                     (time.monotonic() - start) * 1000)
            if self.metrics is not None:
                answered = scope["state"].get(STREAM_STATUS, status)
                self.metrics.requests.labels(route_label(scope), str(answered)).inc()
