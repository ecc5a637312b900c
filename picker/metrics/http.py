"""Serving ``/metrics``: prometheus_client's page, behind a bearer token when one is given.

The page carries every tenant's name in its labels, so with ``--metrics-token-file`` a scrape
must send ``Authorization: Bearer <token>`` (the chart's ServiceMonitor sends it from the Secret
it mounts into the picker); anything else gets 401 and no page. Without a token file the page is
served as prometheus_client's ``start_http_server`` serves it.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app, start_http_server

from picker.tokens import TokenFile


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """One line per scrape would be noise: nothing."""


def _guarded(app: Callable[..., Iterable[bytes]], token: TokenFile
             ) -> Callable[..., Iterable[bytes]]:
    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if token.accepts(environ.get("HTTP_AUTHORIZATION")):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                            ("WWW-Authenticate", 'Bearer realm="metrics"')])
        return [b"the metrics page needs Authorization: Bearer <token>\n"]
    return guarded


def serve_metrics(port: int, addr: str, registry: CollectorRegistry,
                  token_file: Path | None = None) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``registry`` on ``addr:port`` (0: any free port) on a daemon thread; with
    ``token_file``, only to a scrape that sends its token."""
    if token_file is None:
        return start_http_server(port, addr=addr, registry=registry)
    app = _guarded(make_wsgi_app(registry), TokenFile(token_file))
    server = make_server(addr, port, app, _Server6 if ":" in addr else _Server,
                         handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread
