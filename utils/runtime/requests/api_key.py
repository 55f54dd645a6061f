"""The server's API key: `--api-key KEY` or, kept out of shell history and `ps`, `--api-key-env NAME`.

Clients send it as OpenAI's do: `Authorization: Bearer KEY`. The key is held as its SHA-256 only and
compared digest to digest with hmac.compare_digest (constant time, whatever the lengths); an ApiKey
prints as `<hidden>`, so neither a log line, a settings dump nor an error message can show it.
"""
from __future__ import annotations

import hashlib
import hmac
import re
from typing import Optional

from utils.runtime.requests.errors import FieldError

KEY_CHARS = re.compile(r"[!-~]{1,4096}\Z")        # visible ASCII: what an HTTP header carries unchanged
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}\Z")
LAUNCHER_ENV = "HUNYUAN_API_KEY"                   # where run.sh hands a YAML model_args.api-key to the ranks


class ApiKey:
    __slots__ = ("_digest",)

    def __init__(self, key: str):
        self._digest = hashlib.sha256(key.encode("ascii")).digest()

    def matches(self, offered: Optional[str]) -> bool:
        if offered is None:
            return False
        return hmac.compare_digest(self._digest, hashlib.sha256(offered.encode("latin-1", "replace")).digest())

    def __repr__(self) -> str:
        return "<hidden>"

    __str__ = __repr__


def bearer(authorization: Optional[str]) -> Optional[str]:
    """The token of an `Authorization: Bearer TOKEN` header, else None."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def key_problem(value) -> Optional[str]:
    """Why `value` cannot be a key (never quoting it), else None."""
    if not isinstance(value, str) or not KEY_CHARS.match(value):
        return "is not 1 to 4096 visible ASCII characters without spaces (the value is not shown)"
    return None


def from_args(args, environ) -> Optional[ApiKey]:
    """The job's key from --api-key / --api-key-env (read from `environ`), or None; FieldError naming the flag."""
    key, env_name = getattr(args, "api_key", None), getattr(args, "api_key_env", None)
    if key is None and env_name is None:
        return None
    flag = "api-key" if key is not None else "api-key-env"
    if not args.serve:
        raise FieldError(flag, "only with --serve", "there is no server to protect, drop it")
    if key is not None and env_name is not None:
        raise FieldError("api-key", "given twice (--api-key and --api-key-env)", "keep --api-key-env")
    if env_name is not None:
        key = environ.get(env_name)
        if not key:
            raise FieldError("api-key-env", f"{env_name} is not set or empty",
                             f"export {env_name}=<key> first, or drop --api-key-env")
    problem = key_problem(key)
    if problem:
        raise FieldError(flag, f"the key {problem}", "use e.g. a random hex string (python -c 'import secrets; "
                                                     "print(secrets.token_hex(24))')")
    return ApiKey(key)
