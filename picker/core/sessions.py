"""Programs and sessions: where a session's next call goes, and whether it goes before its
tenant's new work.

It answers two questions about a request that carries a session (or program) key, set by the
gateway or the application (``routing.sessions.header``, default ``x-session-id``):

* *where?* A session's earlier calls left their context (prompt and replies) in the prefix cache
  of the endpoint they ran on. Its next call goes there when that endpoint has room for it
  (``prefer``): it only reorders the endpoints the capacity rules already allow, so a call never
  goes where it does not fit; when its endpoint is full, gone or ejected, the normal choice
  (load, with prefix affinity as its bonus) decides.
* *in which order within its tenant?* A call of a session that already had a call dispatched is
  a program in progress; it goes before its tenant's new programs (``Request.resumes``: the fair
  queue keeps such requests at the front of the tenant's own queue, the oldest program first, so
  a tenant's programs finish in the order they began instead of all advancing together). Which
  tenant goes next is still the fair queue's choice, by its counters: a tenant's share of tokens
  does not grow with the number of calls it makes, only the order of its own requests changes.

The key never picks the tenant: every key is scoped by the tenant the identity resolved, so a
session id sent by one tenant names nothing of another's (it neither steers nor rides another
tenant's session). The table is bounded (``SessionRules.max_sessions``, least recently used
forgotten first) and its entries expire ``idle_timeout`` seconds after their last call: a session
forgotten costs a cache miss and its new-program order, nothing else. Each picker replica keeps
its own table (as it keeps its own prefix index).

Pure: no clock (time is passed in), no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from picker.core.request import Request

MAX_KEY_CHARS = 256
"""The longest session key kept; a longer value is ignored (the request has no session)."""


@dataclass(frozen=True, slots=True)
class SessionRules:
    """Sessions as the gate applies them (``routing.sessions``)."""

    max_sessions: int = 65_536
    """Sessions remembered per picker; the least recently used is forgotten past it."""
    idle_timeout: float = 600.0
    """Seconds after its last call a session is forgotten."""
    sticky: bool = True
    """A session's calls go to the endpoint of its previous call when it has room."""
    resume_first: bool = True
    """A tenant's calls of programs in progress go before its new programs."""


def session_key(value: str | None) -> str | None:
    """The session key a header value names, or None: empty, longer than ``MAX_KEY_CHARS`` or
    holding a control character (a value no gateway or client library sends; ignored, not
    refused: a session is a routing hint)."""
    if not value:
        return None
    value = value.strip()
    if not value or len(value) > MAX_KEY_CHARS or not value.isprintable():
        return None
    return value


class _Entry:
    __slots__ = ("address", "calls", "last", "started")

    def __init__(self, address: str, last: float, started: int) -> None:
        self.address = address
        """The endpoint its last call was dispatched to."""
        self.calls = 1
        """Its calls dispatched."""
        self.last = last
        """When its last call was dispatched."""
        self.started = started
        """The table's count of sessions begun when it began: older programs first."""


SessionId = tuple[str, str]
"""(tenant, key): the tenant the identity resolved, then the header's key."""


class SessionTable:
    """Per (tenant, key), the endpoint of the session's last call; LRU-bounded, entries expire.

    168 bytes an entry beside its key (tracemalloc, 65,536 entries: 11 MB), plus the key's tuple
    and string (about 110 bytes for a 40-character key): under 20 MB at the default bound."""

    __slots__ = ("_begun", "_entries", "rules")

    def __init__(self, rules: SessionRules) -> None:
        self.rules = rules
        self._entries: OrderedDict[SessionId, _Entry] = OrderedDict()
        self._begun = 0

    def __len__(self) -> int:
        return len(self._entries)

    def endpoint(self, session: SessionId, now: float) -> str | None:
        """The endpoint the session's last call went to, or None (unknown or expired)."""
        entry = self._live(session, now)
        return None if entry is None else entry.address

    def in_progress(self, session: SessionId, now: float) -> bool:
        """Whether the session already had a call dispatched (and has not expired)."""
        return self._live(session, now) is not None

    def started(self, session: SessionId, now: float) -> int | None:
        """When the session began, as the order of its first call's dispatch among the
        sessions this table has seen (older is smaller); None when not in progress."""
        entry = self._live(session, now)
        return None if entry is None else entry.started

    def dispatched(self, session: SessionId, address: str, now: float) -> None:
        """A call of the session went to ``address``: it is the session's endpoint now, and the
        session the most recently used; the least recently used past the bound is forgotten."""
        entries = self._entries
        entry = entries.get(session)
        if entry is None:
            self._begun += 1
            entries[session] = _Entry(address, now, self._begun)
            while len(entries) > self.rules.max_sessions:
                entries.popitem(last=False)
            return
        entry.address, entry.last = address, now
        entry.calls += 1
        entries.move_to_end(session)

    def moved(self, session: SessionId, address: str) -> None:
        """The call was served by ``address`` (the gateway retried on a fallback)."""
        entry = self._entries.get(session)
        if entry is not None:
            entry.address = address

    def forget_endpoint(self, address: str) -> None:
        """The endpoint left the pool: its sessions' contexts are gone with it. O(sessions)."""
        gone = [s for s, e in self._entries.items() if e.address == address]
        for session in gone:
            del self._entries[session]

    def prune(self, now: float) -> int:
        """Forget the sessions idle past ``idle_timeout``; returns how many. The table is in
        order of last use, so this stops at the first live one."""
        entries, limit, count = self._entries, self.rules.idle_timeout, 0
        while entries:
            session, entry = next(iter(entries.items()))
            if now - entry.last <= limit:
                break
            del entries[session]
            count += 1
        return count

    def calls(self, session: SessionId) -> int:
        """Calls of the session dispatched while it has been remembered (0: none)."""
        entry = self._entries.get(session)
        return 0 if entry is None else entry.calls

    def _live(self, session: SessionId, now: float) -> _Entry | None:
        entry = self._entries.get(session)
        if entry is None:
            return None
        if now - entry.last > self.rules.idle_timeout:
            del self._entries[session]
            return None
        return entry


class _Addressed(Protocol):
    @property
    def address(self) -> str: ...


E = TypeVar("E", bound=_Addressed)


def prefer(ranked: list[E], address: str | None) -> list[E]:
    """``ranked`` (endpoints with room, best first) with the one at ``address`` moved first,
    when it is among them; else as it was. It never adds an endpoint. In place; returned."""
    if address is None or len(ranked) < 2 or ranked[0].address == address:
        return ranked
    for i, endpoint in enumerate(ranked):
        if endpoint.address == address:
            ranked.insert(0, ranked.pop(i))
            break
    return ranked


class _Waiting(Protocol):
    @property
    def request(self) -> Request: ...


def next_parked(parked: Sequence[_Waiting]) -> int:
    """Which of a tenant's requests parked at its concurrency cap (oldest first) enters the
    fair queue next: the first call of the oldest program in progress (``Request.resumes``),
    else the oldest. O(parked)."""
    best = 0
    for i, passage in enumerate(parked):
        request = passage.request
        if request.resumes and (not parked[best].request.resumes
                                or request.program < parked[best].request.program):
            best = i
    return best
