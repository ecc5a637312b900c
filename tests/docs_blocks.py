"""The shell blocks of a docs page, and what the page says about running each.

A ```` ```sh ```` block is commands. The line before it may be a marker,
``<!-- docs-check: KIND (why) -->``, saying how the tests treat the block; without one the
block is run as it stands (``tests/integration/test_getting_started.py``). ``KINDS`` are the
markers there are; ``tests/unit/test_docs_site.py`` refuses any other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
KINDS = {
    "run": "run as it stands, in order, in one directory (the default)",
    "slow": "too long for the suite: its make target is checked to exist and run what it says",
    "stack": "started in the background, waited for, then stopped",
    "stack-client": "run against the running stack of the block before",
    "cluster": "needs a cluster: tests/cluster runs the same lines (README's block)",
    "manual": "run by a person (the clone the tests already run inside)",
}
_BLOCK = re.compile(r"(?:<!-- docs-check: (?P<kind>[\w-]+)[^\n]*-->\n)?```sh\n(?P<body>.*?)```",
                    re.S)


@dataclass(frozen=True)
class Block:
    kind: str
    body: str

    def lines(self) -> list[str]:
        """The commands, continuations joined and comments dropped (not inside a heredoc)."""
        joined = re.sub(r"\\\n\s*", " ", self.body)
        return [line.split("  #", 1)[0].strip() for line in joined.splitlines()
                if line.split("  #", 1)[0].strip()]


def blocks(path: Path = GETTING_STARTED) -> list[Block]:
    """Every ```sh block of the page, in order, with its marker's kind (``run`` without one)."""
    text = path.read_text(encoding="utf-8")
    return [Block(m.group("kind") or "run", m.group("body")) for m in _BLOCK.finditer(text)]
