"""The docs site: it builds strictly, its links and README's resolve, its generated pages are
current, and every command block of the getting-started page is either run by a test or marked.

``mkdocs build --strict`` (``mkdocs.yml``) fails on any warning: a link to a page or an anchor
that is not there, a page left out of the navigation. README.md is not part of the site, so its
links are checked here, anchors included (with the slugs the site gives its headings). The
commands themselves run in ``tests/integration/test_getting_started.py``; the blocks it cannot
afford (a cluster, the 75-second demo) are held to what can be checked without their cost.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from markdown.extensions.toc import slugify

from scripts.crd_reference import render as crd_reference
from tests.docs_blocks import GETTING_STARTED, KINDS, ROOT, blocks

README = ROOT / "README.md"
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {slugify(re.sub(r"[`*]", "", h), "-")
            for h in re.findall(r"^#{1,6} (.+?)\s*$", text, re.M)}


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    for page in ("index", "getting-started", "gateways", "tenants", "operating", "results",
                 "architecture", "contributing", "tenantpolicy-reference", "configuration",
                 "runbooks"):
        assert (tmp_path / "site" / page / "index.html").is_file() or page == "index", page
    assert (tmp_path / "site" / "index.html").is_file()


def test_every_link_of_the_readme_resolves() -> None:
    links = _LINK.findall(README.read_text(encoding="utf-8"))
    assert len(links) >= 10, links  # the front door links to the task pages
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue  # an outside address
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else README
        assert target.exists(), f"README.md links to {link}: no such file"
        if anchor:
            assert anchor in _anchors(target), f"README.md links to {link}: no such heading"


def test_the_readme_is_a_front_door() -> None:
    """At most about 250 lines, the two commands first, the cluster install within 80 lines."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move detail to docs/"
    assert lines[:3] == ["# fairway", "", "```sh"] and lines[5] == "```", lines[:6]
    assert lines[3].startswith("make demo ") and lines[4].startswith("make test "), lines[3:5]
    assert "## Install in a cluster" in lines[:80]


def test_the_tenantpolicy_reference_is_current() -> None:
    committed = (ROOT / "docs" / "tenantpolicy-reference.md").read_text(encoding="utf-8")
    assert committed == crd_reference(), \
        "docs/tenantpolicy-reference.md is stale: run `python scripts/crd_reference.py`"


def test_every_field_of_the_crd_is_in_its_reference() -> None:
    text = crd_reference()
    for field in ("poolRef.name", "tenants", "weight", "lane", "allowedLanes",
                  "budgets.burst.tokens", "budgets.sustained.per", "overBudget.action",
                  "limits.maxConcurrent", "limits.outputLimit", "apiKeySecretRef.name"):
        assert f"| `{field}` |" in text, field
    assert "`kubectl get tp` prints: Tenants" in text


def test_every_command_block_of_getting_started_is_run_or_marked() -> None:
    page = blocks()
    assert page, "docs/getting-started.md has no ```sh block"
    for block in page:
        assert block.kind in KINDS, f"unknown marker docs-check: {block.kind}"
    kinds = [block.kind for block in page]
    # Most of the page runs: only the clone, the demo and the cluster are taken on trust here.
    assert kinds.count("run") >= 3 and "stack" in kinds and "stack-client" in kinds, kinds


def test_the_slow_blocks_are_make_targets_that_run_what_the_page_says() -> None:
    for block in blocks():
        if block.kind != "slow":
            continue
        for line in block.lines():
            assert line.startswith("make "), line
            target = line.split()[1]
            recipe = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True,
                                    text=True, timeout=60)
            assert recipe.returncode == 0, recipe.stderr
            assert f"-m picker.{target}" in recipe.stdout, recipe.stdout


def test_the_cluster_install_of_getting_started_is_the_readmes() -> None:
    # tests/cluster/test_chart_on_server.py runs the README's block against a real API server.
    readme = re.search(r"## Install in a cluster\s+```sh\n(.*?)```", README.read_text(), re.S)
    assert readme, "README.md: no ```sh block under '## Install in a cluster'"
    (cluster,) = [block for block in blocks() if block.kind == "cluster"]
    assert cluster.body == readme.group(1)


def test_every_benchmark_result_is_on_the_results_page() -> None:
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    missing = [p.name for p in sorted((ROOT / "bench" / "results").glob("*.md"))
               if f"`{p.name}`" not in results]
    assert not missing, f"docs/results.md does not say where these come from: {missing}"


def test_the_getting_started_page_says_what_is_checked() -> None:
    text = GETTING_STARTED.read_text(encoding="utf-8")
    assert "tests/integration/test_getting_started.py" in text
