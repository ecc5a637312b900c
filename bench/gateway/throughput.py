"""Goal 3: does fair queueing cost the pool throughput?

The pool's output tokens/s (the servers' ``vllm:generation_tokens_total``) with vtc must be at
least 97 % of fcfs under the same saturating traffic: goals 1's and 2's floods, compared from
their runs' pool numbers (no runs of its own).
"""

from __future__ import annotations

from typing import Any


def throughput(fair: dict[str, Any] | None, light: dict[str, Any] | None) -> dict[str, Any]:
    rows = []
    pairs = []
    if fair is not None:
        pairs.append(("weighted backlog (goal 1 traffic)", fair["runs"]["vtc"]["pool"],
                      fair["runs"]["fcfs"]["pool"]))
    if light is not None:
        pairs.append(("flood + light (goal 2 traffic)", light["runs"]["flood_vtc"]["pool"],
                      light["runs"]["flood_fcfs"]["pool"]))
    other = light["runs"].get("flood_vtc_other") if light is not None else None
    comparison = None
    if other is not None:
        comparison = ratio_of(other["pool"], light["runs"]["flood_fcfs"]["pool"])
    for name, vtc, fcfs in pairs:
        client = (vtc["client_output_tokens_per_s"] / fcfs["client_output_tokens_per_s"]
                  if fcfs["client_output_tokens_per_s"] else None)
        rows.append({"workload": name, "vtc": vtc, "fcfs": fcfs, "ratio": ratio_of(vtc, fcfs),
                     "client_ratio": client})
    return {"rows": rows, "other_reserve_ratio": comparison,
            "other_reserve": light.get("other_reserve") if light is not None else None}


def ratio_of(vtc: dict[str, Any], fcfs: dict[str, Any]) -> float | None:
    """Pool output tokens/s of a vtc run over the fcfs run's."""
    return (vtc["server_output_tokens_per_s"] / fcfs["server_output_tokens_per_s"]
            if fcfs["server_output_tokens_per_s"] else None)
