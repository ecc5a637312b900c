"""Every alert links to its runbook, and every runbook section says what to check and do.

``manifests/alerts/fairway-rules.yaml``: each alert's ``runbook_url`` is
``docs/runbooks.md#<alert name, lower case>`` (the anchor a Markdown renderer gives the heading
``## <AlertName>``); ``docs/runbooks.md`` has exactly one section per alert, each with its
meaning, how to check and what to do. The "no picker serving" alert reads ``fairway_ready`` and
``fairway_build_info``, metrics the picker exports.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = yaml.safe_load((ROOT / "manifests" / "alerts" / "fairway-rules.yaml").read_text())
RUNBOOKS = (ROOT / "docs" / "runbooks.md").read_text(encoding="utf-8")
ALERTS = [rule for group in RULES["groups"] for rule in group["rules"]]


def _sections() -> dict[str, str]:
    parts = re.split(r"^## (\S+)\n", RUNBOOKS, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_alert_links_to_its_runbook_section() -> None:
    sections = _sections()
    for alert in ALERTS:
        name = alert["alert"]
        assert alert["annotations"]["runbook_url"] == f"docs/runbooks.md#{name.lower()}", name
        assert name in sections, f"docs/runbooks.md has no section '## {name}'"
    assert set(sections) == {alert["alert"] for alert in ALERTS}, "a runbook without an alert"


def test_every_runbook_says_what_it_means_how_to_check_and_what_to_do() -> None:
    for name, text in _sections().items():
        for part in ("**Meaning.**", "**Check.**", "**Act.**"):
            assert part in text, f"{name}: no {part}"


def test_a_picker_not_serving_is_alerted() -> None:
    (alert,) = [a for a in ALERTS if a["alert"] == "FairwayNoPickerServing"]
    assert alert["labels"]["severity"] == "critical"
    assert "fairway_ready" in alert["expr"] and "fairway_build_info" in alert["expr"]
    assert "by (namespace, job)" in alert["expr"]
