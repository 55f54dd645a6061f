"""The images API's refusals: OpenAI's error shape {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations


class ClientLeft(Exception):
    """The client closed its connection while its request waited or ran."""


class ApiError(Exception):
    """A refusal rendered as OpenAI's error shape; `refusal` (a schema FieldError) adds its problem and fix apart."""

    def __init__(self, code: int, message: str, param=None, kind="invalid_request_error", headers=(),
                 refusal=None, close=False):
        super().__init__(message)
        self.code, self.message, self.param, self.kind = code, message, param, kind
        self.headers, self.refusal, self.close = list(headers), refusal, close

    @classmethod
    def bad_request(cls, refusal) -> "ApiError":
        return cls(400, str(refusal), refusal.param, refusal=refusal)

    def body(self) -> dict:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        if self.refusal is not None:
            error.update(problem=self.refusal.problem, fix=self.refusal.fix)
        return {"error": error}
