"""Bearer tokens from mounted Secrets: the admin API's and the metrics page's credentials.

``TokenFile`` holds a token read from a file (a Kubernetes Secret mounted in the pod), reads it
again when the file changes (a rotated Secret is an atomic swap of the mount's symlinks) and
compares what a caller sent in constant time. A file that cannot be read mid-rotation keeps the
last good token.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

BEARER = "Bearer "


def read_token(path: Path) -> str:
    """The token in ``path``, surrounding whitespace removed; ``ValueError`` when empty."""
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"{path}: the token is empty")
    return token


class TokenFile:
    """The token of a file, read again when the file changes; thread-safe (the metrics page is
    served on its own threads)."""

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
                    log.info("token reloaded from %s", self.path)
            except (OSError, ValueError) as error:  # mid-rotation: keep the last good one
                log.warning("token %s not read (%s); keeping the previous one", self.path, error)
            return self.token

    def accepts(self, authorization: str | bytes | None) -> bool:
        """Whether an ``Authorization`` value is ``Bearer <the token>``."""
        if not isinstance(authorization, str) or not authorization.startswith(BEARER):
            return False
        return hmac.compare_digest(authorization[len(BEARER):].encode(),
                                   self.current().encode())
