"""Who may call what over HTTP and WebSocket: the API key for generation, the admin key for the routes that
change the server or show every tenant's requests (LoRA loading, the live view), nothing for monitoring.

A browser cannot put a header on a WebSocket or on the page it navigates to, so beside `Authorization: Bearer
<key>` a key may come as the WebSocket subprotocol `minivllm-key.<key>` (the live view's page uses this), or as
a `token` query parameter on a WebSocket or on GET /dashboard. The page opened with a token also gets a cookie
(HttpOnly, SameSite=Strict, a keyed hash of the key, good for the page only) so that a reload needs no token in
the address bar. Keys are compared in constant time, and a token in a URL is masked in uvicorn's access log
(RedactTokens).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from dataclasses import dataclass
from urllib.parse import parse_qsl

from starlette.types import Scope

from minivllm.entrypoints.clients import ClientKey

# Monitoring stays open, as Prometheus scrapes without a key.
OPEN_PATHS = frozenset({"/health", "/metrics", "/docs", "/openapi.json"})
# The live view (every request's id, state and prefix-cache hits) and runtime LoRA loading (opens a server-side
# directory a client names; unloads what another client uses): the admin key when one is set.
ADMIN_PATHS = frozenset({"/dashboard", "/ws/events", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
STATIC_PREFIX = "/dashboard/"  # the live view's JS and CSS: code, no data
KEY_SUBPROTOCOL = "minivllm-key."
_TOKEN_QUERY = "token"
PAGE_COOKIE = "minivllm_dashboard"


@dataclass(slots=True, frozen=True)
class KeyPolicy:
    """The keys a server was started with (None: that key is not set; clients: the named keys of
    --api-keys-file, each taken wherever the API key is)."""

    api_key: str | None = None
    admin_key: str | None = None
    clients: tuple[ClientKey, ...] = ()
    metrics_need_key: bool = False  # --metrics-need-key: /metrics takes the user keys too

    def accepted(self, path: str) -> list[tuple[str, str | None]]:
        """The (key, client name) pairs a path takes; empty: the path is open. Admin paths take the admin key
        when one is set, else the user keys; user paths take the API key and every named client's key."""
        keyed_metrics = path == "/metrics" and self.metrics_need_key
        if path.startswith(STATIC_PREFIX) or (path in OPEN_PATHS and not keyed_metrics):
            return []
        if path in ADMIN_PATHS and self.admin_key:
            return [(self.admin_key, None)]
        return ([(self.api_key, None)] if self.api_key else []) + [(c.key, c.name) for c in self.clients]

    def identify(self, scope: Scope) -> tuple[bool, str | None]:
        """(whether the request carries a key its path takes, the named client whose key it is)."""
        accepted = self.accepted(scope["path"])
        if not accepted:
            return True, None
        found = self.match(credentials(scope), accepted)
        if found[0]:
            return found
        cookie = page_cookie(scope) if scope["path"] == "/dashboard" else None
        good = page_cookie_value(accepted[0][0]).encode()
        return cookie is not None and hmac.compare_digest(cookie.encode(), good), None

    @staticmethod
    def match(presented: list[str], accepted: list[tuple[str, str | None]]) -> tuple[bool, str | None]:
        """(whether a presented key is accepted, its client's name); every key compared, each in constant time."""
        given = [p.encode() for p in presented]
        found: tuple[bool, str | None] = (False, None)
        for key, name in accepted:
            expected = key.encode()
            if any(hmac.compare_digest(g, expected) for g in given) and not found[0]:
                found = (True, name)
        return found

    def page_set_cookie(self, scope: Scope) -> bytes | None:
        """The Set-Cookie header of GET /dashboard opened with a token (None otherwise; the guard has checked it)."""
        accepted = self.accepted("/dashboard")
        if scope["path"] != "/dashboard" or not accepted or not _query_tokens(scope):
            return None
        return (f"{PAGE_COOKIE}={page_cookie_value(accepted[0][0])}; Path=/dashboard; HttpOnly; "
                "SameSite=Strict").encode()

    def denial(self, path: str) -> str:
        """What a refused request is told."""
        which = "admin key (--admin-api-key)" if path in ADMIN_PATHS and self.admin_key else "API key"
        how = "'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
        if path == "/dashboard":
            how += " or open /dashboard?token=<key>"
        return f"invalid or missing {which}: send {how}"


def credentials(scope: Scope) -> list[str]:
    """The keys a request presents: its bearer token or x-api-key header; on a WebSocket also a key subprotocol and a
    token query parameter; on GET /dashboard a token query parameter."""
    found = []
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            auth = value.decode("latin-1")
            if auth.startswith("Bearer "):
                found.append(auth[len("Bearer "):])
        elif name == b"x-api-key":  # Anthropic's clients send the key so (vLLM and llama.cpp take it too)
            found.append(value.decode("latin-1"))
    websocket = scope["type"] == "websocket"
    if websocket:
        found += [p[len(KEY_SUBPROTOCOL):] for p in scope.get("subprotocols") or () if p.startswith(KEY_SUBPROTOCOL)]
    if websocket or scope["path"] == "/dashboard":
        found += _query_tokens(scope)
    return found


def _query_tokens(scope: Scope) -> list[str]:
    query = scope.get("query_string", b"").decode("latin-1")
    return [v for k, v in parse_qsl(query) if k == _TOKEN_QUERY]


def page_cookie_value(key: str) -> str:
    """What the live view's page cookie holds: a keyed hash, so the cookie is good for the page and not the key."""
    return hmac.new(key.encode(), b"minivllm live view page", hashlib.sha256).hexdigest()


def page_cookie(scope: Scope) -> str | None:
    """The page cookie a request carries, if any."""
    for name, value in scope.get("headers") or ():
        if name == b"cookie":
            for part in value.decode("latin-1").split(";"):
                k, _, v = part.strip().partition("=")
                if k == PAGE_COOKIE:
                    return v
    return None


def key_subprotocol(scope: Scope) -> str | None:
    """The key subprotocol a WebSocket client offered: accepting the connection must name it back (a browser
    drops a connection whose answer names none of the subprotocols it asked for)."""
    return next((p for p in scope.get("subprotocols") or () if p.startswith(KEY_SUBPROTOCOL)), None)


class RedactTokens(logging.Filter):
    """Masks `token=...` in access-log lines (uvicorn logs each request's path with its query string)."""

    _pattern = re.compile(r"([?&]token=)[^&\s\"]*")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(isinstance(a, str) and "token=" in a for a in record.args):
            record.args = tuple(self._pattern.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args)
        return True


def redact_access_logs() -> None:
    """Install RedactTokens on uvicorn's loggers (once per process)."""
    for name in ("uvicorn.access", "uvicorn.error"):
        log = logging.getLogger(name)
        if not any(isinstance(f, RedactTokens) for f in log.filters):
            log.addFilter(RedactTokens())
