"""The API key: with one set, every /v1 route wants `Authorization: Bearer <key>`, as OpenAI's API does.

/health and /metrics stay open: a load balancer's health check and a Prometheus scrape carry no key, and neither
shows a request's content (keep the port off the public network, or scrape through a proxy, where the counts
themselves are private). A wrong or missing key is a 401 in OpenAI's shape (code "invalid_api_key") before the body
is read.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import Request

from mirror_sd.serve.protocol import ApiError

PROTECTED = "/v1"  # the path prefix that wants the key


def require_key(key: str) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency (for the whole app) that refuses a /v1 request without `key`."""
    expected = key.encode()

    async def check(request: Request) -> None:
        if not request.url.path.startswith(PROTECTED):
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken does not tell how much of a guessed key was right
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            what = "no API key was given" if not given else "the API key is not this server's"
            raise ApiError(401, f"{what}: send it as the header 'Authorization: Bearer <key>'",
                           param=None, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check
