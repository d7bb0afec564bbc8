"""The API key: with one set, every route but /health, /metrics and /version wants `Authorization: Bearer <key>`, as
OpenAI's API does (or `x-api-key: <key>`, as Anthropic's clients send it).

/health, /metrics and /version stay open: a load balancer's health check, a Prometheus scrape and a client checking what
it talks to (vLLM leaves /version open) carry no key, and none shows a request's content (keep the port off the public
network, or scrape through a proxy, where the counts themselves are private). A wrong or missing key is a 401 in
OpenAI's shape (code "invalid_api_key") before the body is read: a plain ASGI middleware, ahead of the routes. The path
it looks at is the one the routes match, without the prefix a proxy mounts the app under (Ray Serve's route_prefix: the
scope's root_path), and every path but the open ones wants the key, so that no spelling of a path reaches a route
unchecked.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Sequence
from typing import Any

from starlette.routing import BaseRoute, Match

from mirror_sd.serve.messages import shaped
from mirror_sd.serve.protocol import ApiError

OPEN = frozenset({"/health", "/metrics", "/version"})  # the paths that want no key


def route_path(scope: dict[str, Any]) -> str:
    """The request's path as the routes see it: without the root path the app is mounted under."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


class ApiKey:
    """ASGI middleware refusing every request but OPEN's without the bearer `key` (CORS preflights, answered by the
    CORS middleware outside this one, never reach it)."""

    def __init__(self, app: Any, key: str, routes: Sequence[BaseRoute] = ()) -> None:
        """routes: the app's (the list itself: routes added later count), to name a refused request's route in the
        access log and /metrics as the routing would."""
        self.app, self._expected, self.routes = app, key.encode(), routes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or route_path(scope) in OPEN:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if not scheme and headers.get(b"x-api-key"):  # Anthropic's clients send the key so
            scheme, given = "bearer", headers[b"x-api-key"].decode("latin-1")
        # compare_digest: the time taken does not tell how much of a guessed key was right
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("latin-1"), self._expected):
            await self.app(scope, receive, send)
            return
        scope["route"] = next((r for r in self.routes if r.matches(scope)[0] != Match.NONE), None)
        what = "no API key was given" if not given else "the API key is not this server's"
        error = ApiError(401, f"{what}: send it as the header 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                         param=None, code="invalid_api_key")
        body = json.dumps(shaped(route_path(scope), error)).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
