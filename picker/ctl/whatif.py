"""``python -m picker.ctl whatif -f candidate.yaml --baseline current.yaml``: what would each
tenant get if the candidate had served the picker's last minutes of traffic?

The workstation's side of a dry run (the cluster's is a TenantPolicy with the operator's
``fairway.dev/dry-run`` annotation): the running picker's recent requests are read from its
admin API (``RecentRequests``; read-only, as every admin call) and replayed here, under the
baseline (the picker's config: a file, or the ConfigMap the operator renders, as
``kubectl get configmap -o yaml`` prints it) and the candidate (a config, or TenantPolicy YAML
applied to the baseline as the operator would apply it), by ``picker.whatif.recent``. Nothing
reaches the live picker but one read.

Exit status: 0 a prediction; 1 the picker could not be reached; 2 a config is refused;
3 the window is too short to say anything (the message says what it held); 4 the replay ran
out of ``--timeout``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TextIO

import grpc

from picker.admin.v1 import admin_pb2, admin_pb2_grpc
from picker.errors import ConfigError
from picker.whatif.__main__ import (
    _config_data,
    _load,
    _read_yaml,
    load_candidate,
    tenant_policies,
)
from picker.whatif.recent import (
    PREDICTED,
    Bounds,
    Prediction,
    arrow,
    milliseconds,
    percent,
    predict,
    record_of,
)

MAX_ANSWER_BYTES = 64 * 1024 * 1024
"""A RecentRequests answer may be larger than gRPC's default 4 MB receive limit."""


def fetch(address: str, bounds: Bounds, *, timeout: float, token: str | None
          ) -> admin_pb2.RecentRequestsResponse:
    """The picker's requests of the last ``bounds.minutes``. Raises ``grpc.RpcError``."""
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", MAX_ANSWER_BYTES)]) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        answer: admin_pb2.RecentRequestsResponse = stub.RecentRequests(
            admin_pb2.RecentRequestsRequest(since_seconds=bounds.minutes * 60,
                                            limit=bounds.max_records),
            timeout=timeout, metadata=metadata)
        return answer


def rows_table(prediction: Prediction) -> str:
    """One line per tenant: share, TTFT p95 and 429s, baseline → candidate."""
    head = f"{'TENANT':<24} {'SHARE':>17} {'TTFT p95':>21} {'429s':>13} {'REQUESTS':>9}"
    lines = [head]
    for row in prediction.rows:
        lines.append(
            f"{row.tenant[:24]:<24} "
            f"{arrow(percent(row.share[0]), percent(row.share[1])):>17} "
            f"{arrow(milliseconds(row.ttft_p95_s[0]), milliseconds(row.ttft_p95_s[1])):>21} "
            f"{arrow(str(row.refused_429[0]), str(row.refused_429[1])):>13} "
            f"{row.requests:>9,}")
    return "\n".join(lines)


def as_json(prediction: Prediction, held: admin_pb2.RecentRequestsResponse) -> dict[str, Any]:
    return {
        "verdict": prediction.verdict, "message": prediction.message,
        "window": prediction.window, "pool": prediction.pool,
        "picker": {"held": held.held, "capacity": held.capacity,
                   "oldest_arrived_at": held.oldest_arrived_at or None},
        "tenants": [{"tenant": r.tenant, "share": list(r.share),
                     "ttft_p95_s": list(r.ttft_p95_s), "refused_429": list(r.refused_429),
                     "requests": r.requests} for r in prediction.rows],
    }


def run(address: str, candidate: Path, baseline: Path, bounds: Bounds, *, timeout: float,
        token: str | None, json_out: bool, out: TextIO, err: TextIO) -> int:
    """Load the configs, read the picker's window, replay, print; the exit status."""
    try:
        base_data = _config_data(_read_yaml(baseline), baseline)
        base_config = _load(base_data, baseline)
    except ConfigError as exc:
        print(f"whatif: the baseline config is refused: {exc}", file=err)
        return 2
    try:
        cand_config = load_candidate(candidate, base_data)
        tenants = _policy_tenants(candidate)
    except ConfigError as exc:
        print(f"whatif: the candidate is refused: {exc}", file=err)
        return 2
    try:
        answer = fetch(address, bounds, timeout=timeout, token=token)
    except grpc.RpcError as exc:
        code = exc.code().name if hasattr(exc, "code") else "?"
        details = exc.details() if hasattr(exc, "details") else str(exc)
        print(f"whatif: the picker's admin API at {address}: {code}: {details}", file=err)
        return 1
    deadline = time.monotonic() + bounds.timeout_s
    try:
        prediction = predict((record_of(r) for r in answer.records), base_config, cand_config,
                             bounds=bounds, now=answer.taken_at_unix, truncated=answer.truncated,
                             first=tenants, expired=lambda: time.monotonic() > deadline)
    except TimeoutError as exc:
        print(f"whatif: {exc} (--timeout {bounds.timeout_s:g}; fewer --minutes or "
              "--max-records replay faster)", file=err)
        return 4
    if json_out:
        print(json.dumps(as_json(prediction, answer), indent=2), file=out)
    else:
        print(prediction.message, file=out)
        if prediction.verdict == PREDICTED:
            print("pool: " + "; ".join(prediction.pool), file=out)
            print(f"baseline {baseline} → candidate {candidate}", file=out)
            print(rows_table(prediction), file=out)
    return 0 if prediction.verdict == PREDICTED else 3


def _policy_tenants(path: Path) -> list[str]:
    """The tenants a TenantPolicy candidate names (listed first); none for a config file."""
    policies = tenant_policies(_read_yaml(path)) or []
    out: list[str] = []
    for policy in policies:
        spec = policy.get("spec") or {}
        out.extend(t for t in spec.get("tenants") or () if isinstance(t, str))
    return out
