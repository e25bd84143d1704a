"""Whether the MLflow tracking server answers at a URI, asked in seconds, before work is handed that URI.

The MLflow client retries a connection for minutes before it gives up, so a cluster whose workers cannot reach
the server (a server bound to loopback, a Host header it refuses, a firewall) would otherwise cost each sweep
trial minutes, times Tune's retries. One plain HTTP request says which of those it is. It asks an API route,
not `/health`: MLflow checks the Host header on every route but `/health` and `/version`.
"""

from __future__ import annotations

import os
import socket
import ssl
import urllib.error
import urllib.request
from urllib.parse import urlparse

from jetflow.errors import TrackingUnreachableError

PROBE_ROUTE = "/api/2.0/mlflow/experiments/get-by-name?experiment_name=Default"
INVALID_HOST = "Invalid Host header"  # MLflow 3.x's 403 body for a Host outside --allowed-hosts
TIMEOUT_S = 5.0


def check_tracking_server(uri: str, *, who: str = "this process", timeout_s: float = TIMEOUT_S) -> None:
    """TrackingUnreachableError, with what answered and the fix, unless an MLflow server at `uri` (http or
    https; other stores are not probed) answers an API request addressed to it: a success, 401 (a server that
    wants credentials, which the MLflow client has), or MLflow's own JSON error. `who` names the client in the
    message ("the Ray workers")."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        return
    url = uri.rstrip("/") + PROBE_ROUTE
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=_tls_context(parsed.scheme)):
            return
    except urllib.error.HTTPError as exc:
        body = exc.read(2000).decode(errors="replace")
        if exc.code == 403 and INVALID_HOST in body:
            raise TrackingUnreachableError(_message(uri, who, "HTTP 403 'Invalid Host header'",
                                                    _allowed_hosts_fix(parsed))) from None
        if exc.code == 401 or '"error_code"' in body:  # MLflow answered (an auth wall, or its own error)
            return
        server = exc.headers.get("Server") if exc.headers else None
        raise TrackingUnreachableError(_message(
            uri, who, f"HTTP {exc.code} from a server that is not MLflow's API{f' ({server})' if server else ''}",
            "check the host and port in MLFLOW_TRACKING_URI (the port `mlflow server --port` listens on)")) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise TrackingUnreachableError(_message(uri, who, *_network_failure(reason, parsed, timeout_s))) from None


def _tls_context(scheme: str) -> ssl.SSLContext | None:
    """The TLS settings the MLflow client itself would use (MLFLOW_TRACKING_INSECURE_TLS,
    MLFLOW_TRACKING_SERVER_CERT_PATH)."""
    if scheme != "https":
        return None
    if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
        return ssl._create_unverified_context()  # noqa: S323  (what the user asked MLflow for)
    return ssl.create_default_context(cafile=os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or None)


def _network_failure(reason: object, parsed, timeout_s: float) -> tuple[str, str]:
    """(what answered, the fix) for a request that got no HTTP answer."""
    where = f"{parsed.hostname}:{parsed.port or (443 if parsed.scheme == 'https' else 80)}"
    if isinstance(reason, ConnectionRefusedError):
        return (f"connection refused (nothing listens on {where})",
                "a server started with `mlflow server --host 127.0.0.1` (the default) listens on its node's "
                "loopback only: start it with `mlflow server --host 0.0.0.0` so that other nodes reach it, and "
                "check that it runs on that host and port")
    if isinstance(reason, (TimeoutError, socket.timeout)) or "timed out" in str(reason):
        return (f"no answer in {timeout_s:g} s (a firewall dropping packets, or an address outside the network)",
                f"open port {where.rsplit(':', 1)[1]} of {parsed.hostname} to the cluster's nodes and start the "
                "server with `mlflow server --host 0.0.0.0`")
    if isinstance(reason, socket.gaierror):
        return (f"the name {parsed.hostname} does not resolve", "set MLFLOW_TRACKING_URI to an address every "
                "node resolves (the head's IP)")
    return (f"{type(reason).__name__}: {reason}", "check that `mlflow server --host 0.0.0.0` runs there")


def _allowed_hosts_fix(parsed) -> str:
    host = parsed.netloc.rsplit("@", 1)[-1]
    return (f"MLflow 3.x accepts only loopback and private-range Host headers unless --allowed-hosts lists more; "
            f"start the server with `mlflow server --host 0.0.0.0 --allowed-hosts '{host},localhost:*,127.0.0.1:*'` "
            "(the list replaces the defaults, so keep the loopback entries the head's own clients use) or set "
            "MLFLOW_SERVER_ALLOWED_HOSTS")


def _message(uri: str, who: str, answered: str, fix: str) -> str:
    return f"the MLflow tracking server at {uri} ({who} log there) is not usable: {answered}. Fix: {fix}"
