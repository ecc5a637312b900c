"""Who may read the admin API: a bearer token every ``fairway.v1.Admin`` call must carry.

The admin API lists every tenant with its weight, budget and share; any pod that reaches the
port could read it. With ``--admin-token-file`` each call must send ``authorization: Bearer
<token>`` with the file's token (``picker.tokens.TokenFile``: a mounted Secret that the chart
generates, mounted also into the operator; ``picker.ctl`` reads it with ``--token-file``). A call
without it is refused UNAUTHENTICATED before the service sees it. gRPC health on the admin port
is left open: it says SERVING or not, nothing of tenants.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from picker.admin.service import ADMIN_SERVICE
from picker.tokens import TokenFile

AUTHORIZATION = "authorization"
PREFIX = f"/{ADMIN_SERVICE}/"

__all__ = ["AUTHORIZATION", "AdminAuth", "TokenFile", "bearer"]


class AdminAuth(grpc.aio.ServerInterceptor):
    """Refuses every ``fairway.v1.Admin`` call without the token; other services pass."""

    def __init__(self, token: TokenFile) -> None:
        self.token = token

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        if not details.method.startswith(PREFIX):
            return await continuation(details)
        sent = next((value for key, value in details.invocation_metadata or ()
                     if key == AUTHORIZATION), None)
        if self.token.accepts(sent):
            return await continuation(details)
        return _REFUSED


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "the admin API needs authorization: Bearer <token> (--admin-token-file)")


_REFUSED: grpc.RpcMethodHandler[Any, None] = grpc.unary_unary_rpc_method_handler(_refuse)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that carries ``token`` (for ``picker.ctl``, tests)."""
    return ((AUTHORIZATION, f"Bearer {token}"),)
