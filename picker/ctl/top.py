"""``python -m picker.ctl top``: who is the picker serving right now, who waits, and how full is
each endpoint?

One table of tenants, busiest first by their share of the weighted service over the picker's
window, and one of endpoints, read from the admin API (``fairway.v1.Admin``) and redrawn every
``--interval`` seconds with ANSI escapes (stdlib only: no curses, so it also works piped).
``--once`` prints the tables once, without escapes, and exits.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Sequence
from typing import TextIO

import grpc

from picker.admin.v1 import admin_pb2, admin_pb2_grpc

DEFAULT_ADMIN = "127.0.0.1:9004"
TOP_LIMIT = 200
"""Tenants asked for: the busiest page only (a screen shows fewer; the rest are counted)."""
CLEAR = "\x1b[H\x1b[2J"
"""Cursor home, then erase the screen."""

TENANT_COLUMNS = ("TENANT", "LANE", "WEIGHT", "SHARE", "QUEUED", "RUNNING", "TOK RUN", "DEBT",
                  "BUDGET burst/sust")
ENDPOINT_COLUMNS = ("ENDPOINT", "IN-FLIGHT TOK/BUDGET", "RUNNING", "WAITING", "KV USE", "")
_LEFT = {"TENANT", "LANE", "ENDPOINT", ""}
"""Columns aligned left; numbers are aligned right."""


class Unreachable(Exception):
    """The admin API did not answer; the message names the address and why."""


def tokens(value: float) -> str:
    """A token count for a narrow column: ``950``, ``12.3k``, ``4.1M``."""
    size = abs(value)
    if size >= 999_950:
        return f"{value / 1e6:.1f}M"
    if size >= 9_999.5:
        return f"{value / 1e3:.1f}k"
    return f"{value:.0f}"


def budget_cell(budgets: Sequence[admin_pb2.BudgetWindow]) -> str:
    """``burst/sustained``: the burst bucket's tokens left and the sustained bucket's percentage
    left, e.g. ``12.3k/80%``; ``-`` for a bucket the tenant does not have."""
    by_window = {b.window: b for b in budgets}
    if not by_window:
        return "-"
    burst = by_window.get("burst")
    sustained = by_window.get("sustained")
    left = "-" if burst is None else tokens(burst.remaining_tokens)
    right = "-" if sustained is None or sustained.capacity_tokens <= 0 else \
        f"{100 * sustained.remaining_tokens / sustained.capacity_tokens:.0f}%"
    return f"{left}/{right}"


def _table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(w) if name in _LEFT else cell.rjust(w)
                         for name, cell, w in zip(columns, cells, widths, strict=True)).rstrip()

    return [line(columns), *(line(row) for row in rows)]


def tenant_rows(answer: admin_pb2.ListTenantsResponse) -> list[list[str]]:
    """One row per tenant, the largest share of the window first (then by name)."""
    ordered = sorted(answer.tenants, key=lambda t: (-t.service_share, t.tenant))
    return [[t.tenant, t.lane, f"{t.weight:g}", f"{100 * t.service_share:.1f}%",
             str(t.queued_requests), str(t.running_requests), tokens(t.running_tokens),
             tokens(t.fairness_debt), budget_cell(t.budgets)] for t in ordered]


def endpoint_rows(answer: admin_pb2.ListEndpointsResponse) -> list[list[str]]:
    """One row per endpoint, in the picker's order."""
    rows = []
    for e in answer.endpoints:
        use = f"{tokens(e.inflight_tokens)}/{tokens(e.budget_tokens)}"
        if e.budget_tokens > 0:
            use += f" ({100 * e.inflight_tokens / e.budget_tokens:.0f}%)"
        rows.append([e.address, use, str(e.inflight_requests),
                     "-" if e.waiting < 0 else f"{e.waiting:g}",
                     "-" if e.kv_usage < 0 else f"{100 * e.kv_usage:.0f}%",
                     "draining" if e.draining else ""])
    return rows


def render(address: str, tenants: admin_pb2.ListTenantsResponse,
           endpoints: admin_pb2.ListEndpointsResponse, max_lines: int | None = None,
           max_columns: int | None = None) -> str:
    """The screen: a title line, the tenant table, the endpoint table.

    ``max_lines``: cut the tenant table (the least served go first) so the screen fits;
    ``max_columns``: cut each line, so that none wraps and shifts the rows below.
    """
    taken = time.strftime("%H:%M:%S", time.localtime(tenants.taken_at_unix))
    # The answer is one page: the tenants beyond it are counted, not listed.
    total = max(tenants.total_tenants, len(tenants.tenants))
    title = (f"fairway top  {address}  {taken}  share of weighted service over the last "
             f"{tenants.window_seconds:g}s  ({total} tenants)")
    rows = tenant_rows(tenants)
    bottom = ["", *_table(ENDPOINT_COLUMNS, endpoint_rows(endpoints))]
    hidden = total - len(rows)
    if max_lines is not None:
        room = max(1, max_lines - 2 - len(bottom) - 1)  # title, header, a "more" line
        if len(rows) > room:
            hidden += len(rows) - room
            rows = rows[:room]
    lines = [title, *_table(TENANT_COLUMNS, rows)]
    if hidden:
        lines.append(f"... and {hidden} more")
    lines += bottom
    if max_columns is not None:
        lines = [line[:max_columns] for line in lines]
    return "\n".join(lines) + "\n"


def fetch(stub: admin_pb2_grpc.AdminStub, address: str, timeout: float,
          token: str | None = None
          ) -> tuple[admin_pb2.ListTenantsResponse, admin_pb2.ListEndpointsResponse]:
    """Both answers (``token``: the admin API's bearer token); raises Unreachable with a
    message naming ``address``."""
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    try:
        return (stub.ListTenants(admin_pb2.ListTenantsRequest(limit=TOP_LIMIT), timeout=timeout,
                                 metadata=metadata),
                stub.ListEndpoints(admin_pb2.ListEndpointsRequest(), timeout=timeout,
                                   metadata=metadata))
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            reason = f"no answer within {timeout:g}s"
        elif code == grpc.StatusCode.UNAUTHENTICATED:
            reason = ("it asks for the admin token: --token-file FILE or $FAIRWAY_ADMIN_TOKEN "
                      "(the chart's Secret <release>-fairway-picker-admin-token, key token)")
        elif code == grpc.StatusCode.UNIMPLEMENTED:
            reason = "it does not serve fairway.v1.Admin (is it the picker's --admin-port?)"
        else:
            reason = f"{code.name if code else 'error'}: {details}"
        raise Unreachable(f"picker.ctl: cannot reach the picker's admin API at {address}: "
                          f"{reason}") from None


def run(address: str, *, interval: float = 1.0, once: bool = False, timeout: float = 5.0,
        out: TextIO | None = None, token: str | None = None) -> int:
    """Show the tables until interrupted (``once``: one time); returns the exit code.

    Any failure to get an answer ends it with exit code 1 and a message on stderr.
    """
    out = out if out is not None else sys.stdout
    with grpc.insecure_channel(address) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        while True:
            try:
                tenants, endpoints = fetch(stub, address, timeout, token)
            except Unreachable as exc:
                print(exc, file=sys.stderr)
                return 1
            if once:
                out.write(render(address, tenants, endpoints))
                out.flush()
                return 0
            size = shutil.get_terminal_size()
            out.write(CLEAR + render(address, tenants, endpoints, max_lines=size.lines - 1,
                                     max_columns=size.columns))
            out.flush()
            time.sleep(interval)
