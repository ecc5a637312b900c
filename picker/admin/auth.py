"""Who may read the admin API: a bearer token every ``fairway.v1.Admin`` call must carry.

The admin API lists every tenant with its weight, budget and share; any pod that reaches the
port could read it. With ``--admin-token-file`` each call must send ``authorization: Bearer
<token>`` with the file's token (a mounted Secret that the chart generates, mounted also into the
operator; ``picker.ctl`` reads it with ``--token-file``). The file is looked at again when it
changes (a rotated Secret), compared in constant time, and a call without it is refused
UNAUTHENTICATED before the service sees it. gRPC health on the admin port is left open: it says
SERVING or not, nothing of tenants.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from picker.admin.service import ADMIN_SERVICE

log = logging.getLogger(__name__)

AUTHORIZATION = "authorization"
PREFIX = f"/{ADMIN_SERVICE}/"


def read_token(path: Path) -> str:
    """The token in ``path``, surrounding whitespace removed; ``ValueError`` when empty."""
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"{path}: the admin token is empty")
    return token


class TokenFile:
    """The admin token of a file, read again when the file changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._seen = self._identity()
        self.token = read_token(path)

    def _identity(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def current(self) -> str:
        with self._lock:
            try:
                seen = self._identity()
                if seen != self._seen:
                    self._seen = seen
                    self.token = read_token(self.path)
                    log.info("admin token reloaded from %s", self.path)
            except (OSError, ValueError) as error:  # mid-rotation: keep the last good one
                log.warning("admin token %s not read (%s); keeping the previous one",
                            self.path, error)
            return self.token

    def allows(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> bool:
        """Whether the call's metadata carries ``authorization: Bearer <token>``."""
        sent = next((value for key, value in metadata or () if key == AUTHORIZATION), None)
        if not isinstance(sent, str) or not sent.startswith("Bearer "):
            return False
        return hmac.compare_digest(sent[len("Bearer "):].encode(), self.current().encode())


class AdminAuth(grpc.aio.ServerInterceptor):
    """Refuses every ``fairway.v1.Admin`` call without the token; other services pass."""

    def __init__(self, token: TokenFile) -> None:
        self.token = token

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        if not details.method.startswith(PREFIX) or \
                self.token.allows(details.invocation_metadata):
            return await continuation(details)
        return _REFUSED


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "the admin API needs authorization: Bearer <token> (--admin-token-file)")


_REFUSED = grpc.unary_unary_rpc_method_handler(_refuse)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that carries ``token`` (for ``picker.ctl``, tests)."""
    return ((AUTHORIZATION, f"Bearer {token}"),)
