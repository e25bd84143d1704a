"""Who may call the endpoint: an optional API key, sent as OpenAI clients send theirs
(`Authorization: Bearer <key>`), checked before a request reaches any route but `/healthz`.

The key comes from `ServeConfig.api_key` (`--api-key`, `args.api_key` in serve/config.yaml) or, unset there,
from `$JETFLOW_API_KEY` where the application is built. It is a `SecretStr` end to end: its repr, its JSON
dump and validation errors show `**********`, and no log line or error body carries it.
"""

from __future__ import annotations

import hmac
import ipaddress
import os

from pydantic import SecretStr

from jetflow.errors import JetFlowError

API_KEY_ENV = "JETFLOW_API_KEY"
OPEN_PATHS = ("/healthz",)  # what a load balancer's probe reaches without a key


class InvalidAPIKeyError(JetFlowError):
    """A request without the server's key (HTTP 401, OpenAI's `invalid_api_key`)."""


def key_from_env(cfg):
    """`cfg` (a ServeConfig) with `api_key` from $JETFLOW_API_KEY when the config sets none."""
    value = os.environ.get(API_KEY_ENV, "").strip()
    if cfg.api_key is not None or not value:
        return cfg
    return cfg.model_copy(update={"api_key": SecretStr(value)})


def check_bearer(authorization: str | None, key: SecretStr) -> None:
    """InvalidAPIKeyError unless `authorization` (the header's value) is `Bearer <key>`. The comparison takes
    the same time whatever the prefix matched; the message never repeats what the client sent."""
    scheme, _, given = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise InvalidAPIKeyError("You didn't provide an API key. Send it in an Authorization header: "
                                 "'Authorization: Bearer YOUR_KEY' (the OpenAI client does this with api_key=...)")
    if not hmac.compare_digest(given.strip().encode(), key.get_secret_value().encode()):
        raise InvalidAPIKeyError("Incorrect API key provided. Use the key this server was started with "
                                 f"(--api-key or ${API_KEY_ENV})")


# This replica's key (`set_replica_key`, by its constructor). Module state because the check runs as ASGI
# middleware, where the deployment instance is out of reach; each replica is a process of its own.
_replica_key: SecretStr | None = None


def set_replica_key(key: SecretStr | None) -> None:
    global _replica_key
    _replica_key = key


class BearerAuth:
    """Pure ASGI middleware (not BaseHTTPMiddleware: streams and client disconnects pass through untouched):
    every route but /healthz needs `Authorization: Bearer <key>` when the replica has a key; else OpenAI's 401
    error body."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        key = _replica_key
        if scope["type"] == "http" and key is not None and not is_open_path(scope.get("path", "")):
            header = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)
            try:
                check_bearer(header, key)
            except InvalidAPIKeyError as exc:
                from starlette.responses import JSONResponse

                from jetflow.serving.schema import ErrorBody, ErrorDetail

                body = ErrorBody(error=ErrorDetail(message=str(exc), code="invalid_api_key"))
                response = JSONResponse(body.model_dump(), status_code=401, headers={"www-authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def is_open_path(path: str) -> bool:
    """True for the routes that need no key (the path may carry the application's route prefix)."""
    path = path.rstrip("/")
    return any(path == p or path.endswith(p) for p in OPEN_PATHS)


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost: reachable from this machine only."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a hostname: it may resolve to anything
        return False


def exposure_warning(host: str, key: SecretStr | None) -> str | None:
    """The warning to print when the HTTP server binds an address other machines reach and no key is set."""
    if key is not None or is_loopback(host):
        return None
    return (f"binding {host} without an API key: anyone who reaches this address can use the endpoint; set "
            f"--api-key or ${API_KEY_ENV} (clients then send it as their OpenAI api_key), or bind 127.0.0.1")
