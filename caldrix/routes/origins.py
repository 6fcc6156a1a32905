"""Browser origins (CORS), as Ollama treats them: pages served from this machine may call the API,
pages from anywhere else may not, unless `--allowed-origins` names them.

The server has no API key, so what stops any web page a user opens from making the browser
post requests to localhost:8425 is the browser's same-origin rule, and a "simple" POST (a
text/plain body, which the routes parse as JSON all the same) gets past that rule without a
preflight. So:

- a request without an Origin header (curl, the openai client, any SDK) is served as before;
- one whose Origin is a loopback page (http or https on localhost, 127.0.0.1 or [::1], any
  port), or one `--allowed-origins` lists (`*` for every origin, as vLLM's default), gets
  `Access-Control-Allow-Origin` naming it, and its preflight (OPTIONS with
  Access-Control-Request-Method) is answered 204 with the methods and headers it may use;
- any other Origin is a 403 in the OpenAI error shape, before the route runs.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from caldrix.routes.errors import ApiError

LOOPBACK = ("localhost", "127.0.0.1", "::1")
ALLOW_METHODS = "GET, POST, OPTIONS"
ALLOW_HEADERS = "authorization, content-type"  # what OpenAI clients send, when a preflight names none
MAX_AGE_S = "600"  # how long a browser may reuse a preflight's answer


def allowed(origin: str, extra: tuple[str, ...]) -> bool:
    """Whether a page of `origin` may call the API: a loopback page, or one `extra` names."""
    if "*" in extra or origin in extra:
        return True
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and parts.hostname in LOOPBACK


def refusal(origin: str) -> ApiError:
    shown = origin if len(origin) <= 100 else origin[:99] + "…"
    return ApiError(403, f"requests from the origin {shown} are not allowed; pages served from this machine are, "
                         "and --allowed-origins adds others", None)


def preflight_headers(origin: str, asked_headers: str | None) -> dict[str, str]:
    return {
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": ALLOW_METHODS,
        "Access-Control-Allow-Headers": asked_headers or ALLOW_HEADERS,
        "Access-Control-Max-Age": MAX_AGE_S,
        "Vary": "Origin",
    }
