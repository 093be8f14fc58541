"""A request a front end refuses: the HTTP status, OpenAI's error type and one line naming the
request's own field. The scheduler thread, the OpenAI server, Ray Serve and the Triton models all
raise and answer it, so it stands apart from any one transport."""
from __future__ import annotations


class RequestError(Exception):
    """A request the server refuses: its HTTP status, OpenAI error type and one-line message."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}
