"""Write ``docs/tenantpolicy-reference.md``: every field of the TenantPolicy CRD, from its schema.

The fields, types, defaults, rules and descriptions come from the CRD's ``openAPIV3Schema`` in
``manifests/crd/fairway.dev_tenantpolicies.yaml`` (the chart's copy under ``charts/fairway/crds``
is the same file), the CEL rules from its
``x-kubernetes-validations`` and the columns of ``kubectl get tp`` from its printer columns.
``tests/unit/test_docs_site.py`` fails when the committed page and the CRD disagree;
``python scripts/crd_reference.py`` rewrites it (``make docs`` does both references).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
CRD = ROOT / "manifests" / "crd" / "fairway.dev_tenantpolicies.yaml"
OUT = ROOT / "docs" / "tenantpolicy-reference.md"
# Patterns longer than this are named, not printed: a regex of 200 characters says less than
# "a duration" to the reader, and the CRD itself is one click away.
PATTERN_NAMES = {
    "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$": "a DNS label (lowercase letters, digits, `-`)",
    "^[A-Za-z0-9][A-Za-z0-9._:@/-]*$":
        "starts with a letter or digit; then `A-Z a-z 0-9 . _ : @ / -`",
}


def _rules(node: dict[str, Any]) -> list[str]:
    rules: list[str] = []
    for key, text in (("minimum", ">= {}"), ("maximum", "<= {}"),
                      ("minLength", "at least {} characters"),
                      ("maxLength", "at most {} characters"), ("minItems", "at least {} items"),
                      ("maxItems", "at most {} items")):
        if key in node:
            rules.append(text.format(node[key]))
    if "enum" in node:
        rules.append("one of " + ", ".join(f"`{v}`" for v in node["enum"]))
    if "pattern" in node:
        pattern = node["pattern"]
        if pattern in PATTERN_NAMES:
            rules.append(PATTERN_NAMES[pattern])
        elif "(ms|s|m|h|d)" in pattern:
            rules.append("a duration (`60s`, `5m`, `1h30m`, `1d`; units ms, s, m, h, d)")
        else:
            rules.append("a pattern (see the CRD)")
    if node.get("x-kubernetes-list-type") == "set":
        rules.append("no duplicates")
    if node.get("format") == "date-time":
        rules.append("RFC 3339 time")
    return rules


def _type(node: dict[str, Any]) -> str:
    kind = node.get("type", "any")
    if kind == "array":
        return f"list of {_type(node.get('items', {}))}"
    return str(kind)


def _rows(node: dict[str, Any], path: str, required: bool) -> list[list[str]]:
    rows: list[list[str]] = []
    if path:
        default = f"`{node['default']}`" if "default" in node else \
            ("required" if required else "unset")
        is_list = node.get("type") == "array" and "items" in node
        item_rules = _rules(node["items"]) if is_list else []
        rules = _rules(node) + [f"each: {rule}" for rule in item_rules]
        rows.append([f"`{path}`", _type(node), default, "; ".join(rules),
                     " ".join(str(node.get("description", "")).split())])
    children = node.get("properties") or (node.get("items") or {}).get("properties") or {}
    needed = set(node.get("required") or (node.get("items") or {}).get("required") or ())
    prefix = f"{path}[]." if node.get("type") == "array" else (f"{path}." if path else "")
    for name, child in children.items():
        rows += _rows(child, f"{prefix}{name}", name in needed)
    return rows


def _cel(node: dict[str, Any], path: str) -> list[str]:
    found = [f"- on `{path or 'the object'}`: {' '.join(v['message'].split())}"
             for v in node.get("x-kubernetes-validations", ())]
    for name, child in (node.get("properties") or {}).items():
        found += _cel(child, f"{path}.{name}" if path else name)
    return found


def _table(rows: list[list[str]]) -> str:
    lines = ["| field | type | default | rules | meaning |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def render() -> str:
    """The whole page."""
    crd = yaml.safe_load(CRD.read_text())
    spec = crd["spec"]
    version = spec["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    api = f"{spec['group']}/{version['name']}"
    columns = ", ".join(f"{c['name']} (`{c['jsonPath']}`)"
                        for c in version["additionalPrinterColumns"])
    props = schema["properties"]
    head = (
        "# TenantPolicy reference\n\n"
        "Generated from the CRD's schema (`manifests/crd/fairway.dev_tenantpolicies.yaml`, the "
        "chart installs the same file) by `python scripts/crd_reference.py`; a test keeps the two "
        "in step. The API server refuses a value outside these rules at `kubectl apply`; the "
        "operator refuses what the schema cannot express (an unknown lane, a tenant another "
        "policy claims) with `Ready=False` and the reason. What each setting does: "
        "[Tenants and policy](tenants.md).\n\n"
        f"`apiVersion: {api}`, `kind: {spec['names']['kind']}`, namespaced, short name "
        f"`{', '.join(spec['names'].get('shortNames', ()))}`. "
        f"{' '.join(schema.get('description', '').split())}\n\n"
        f"`kubectl get tp` prints: {columns}.\n\n"
    )
    cel = _cel(props["spec"], "spec")
    return (head
            + "## spec\n\n" + _table(_rows(props["spec"], "", True)) + "\n\n"
            + "Rules across fields (CEL, checked by the API server):\n\n" + "\n".join(cel) + "\n\n"
            + "## status\n\nWritten by the operator and the picker, never by you.\n\n"
            + _table(_rows(props["status"], "", False)) + "\n")


def main() -> int:
    OUT.write_text(render())
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
