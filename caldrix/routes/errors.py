"""The one error type routes/ raises, and its OpenAI-shaped body.

Everything that refuses a request raises `ApiError`; the HTTP layer turns it into a response
with `status` and `body()`, or, once a stream's 200 has gone out, into a server-sent event
carrying the same body (http-api.md "Errors").
"""

from __future__ import annotations

from typing import Any

# OpenAI-like `type` per status. OpenAI itself sends invalid_request_error for every 4xx
# about the request, and server_error for a 500; the rest follow the names its clients know.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",  # the body is too large: still a problem with the request
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


def clip(s: str, limit: int = 64) -> str:
    """`s` as an error message may quote it: cut to `limit` characters, the cut marked with an
    ellipsis, so that a client's megabyte of text is not echoed back."""
    return s if len(s) <= limit else s[: limit - 1] + "…"


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code for a prompt past the context


class ApiError(Exception):
    """A refusal or failure the client is told about.

    `param` names the field at fault, as a path into the request body ("messages[0].role",
    "stop"); it is None when the fault is not any one field's (a malformed body, a full queue).
    `type` defaults from the status (see `_TYPE_BY_STATUS`); `code` is None unless a caller
    has a machine-readable code worth sending.
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        *,
        type: str | None = None,  # noqa: A002 - the field's name in the OpenAI body
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type if type is not None else _TYPE_BY_STATUS.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
        self.code = code
        self.headers = headers or {}  # extra response headers (Retry-After on a 429)

    def body(self) -> dict[str, Any]:
        """The OpenAI error body: {"error": {"message", "type", "param", "code"}}."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, param={self.param!r})"

    # The refusals http-api.md spells out, so every route words them the same way.

    @classmethod
    def invalid(cls, message: str, param: str | None = None) -> ApiError:
        """A 400 about the request: the common case."""
        return cls(400, message, param)

    @classmethod
    def past_context(cls, message: str, param: str | None) -> ApiError:
        """A 400 for a prompt that leaves the context no row: OpenAI's code for it, which clients
        (LangChain, litellm) read to tell a context overflow from other bad requests."""
        return cls(400, message, param, code=CONTEXT_LENGTH_EXCEEDED)

    @classmethod
    def body_too_large(cls, limit_bytes: int, headers: dict[str, str] | None = None) -> ApiError:
        return cls(413, f"the request body is over {limit_bytes // (1 << 20)} MiB", headers=headers)

    @classmethod
    def queue_full(cls, headers: dict[str, str] | None = None) -> ApiError:
        return cls(429, "the request queue is full", headers=headers)

    @classmethod
    def image_queue_full(cls, headers: dict[str, str] | None = None) -> ApiError:
        return cls(429, "the image decode queue is full", headers=headers)

    @classmethod
    def engine_failed(cls, detail: str | None = None) -> ApiError:
        message = "the engine failed during the request"
        return cls(500, f"{message}: {detail}" if detail else message)

    @classmethod
    def engine_unavailable(cls) -> ApiError:
        return cls(503, "the engine is unavailable")
