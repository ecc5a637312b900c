"""The replays side by side: a table per candidate (baseline beside it), JSON, and a plot.

It answers: *what changes for each tenant and lane, and for the pool, if the candidate config
replaces the baseline?* Rows are (tenant, lane): the lane a request ran in, or was refused from.
"""

from __future__ import annotations

from pathlib import Path

from picker.whatif.replay import LaneStats, ReplayResult


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f}"


def _time(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:,.0f}s"


def _utilisation(result: ReplayResult) -> str:
    return f"{result.utilisation():.1%}" if result.engines else "-"  # a log does not say


def _share(result: ReplayResult, key: tuple[str, str]) -> str:
    return f"{result.share(key):.1%}" if key in result.lanes else "-"


def _pair(base: str, cand: str, width: int) -> str:
    return f"{base:>{width}} {cand:>{width}}"


def table(baseline: ReplayResult, candidate: ReplayResult, name: str, *,
          first: str = "baseline") -> str:
    """``baseline`` (called ``first``) beside ``candidate`` (called ``name``), per tenant and
    lane, then the pool."""
    keys = sorted(set(baseline.lanes) | set(candidate.lanes))
    empty = LaneStats()
    head = (f"{'tenant':<14} {'lane':<10} | {'share':>13} | {'tokens served':>23} | "
            f"{'queue p50 ms':>17} | {'queue p95 ms':>17} | {'TTFT p50 ms':>17} | "
            f"{'TTFT p95 ms':>17} | {'429s':>13} | {'demoted':>13} | {'budget out':>15}")
    lines = [f"{first} | {name}  (each column: {first}, then {name})", head,
             "-" * len(head)]
    for key in keys:
        b, c = baseline.lanes.get(key, empty), candidate.lanes.get(key, empty)
        tenant, lane = key
        cells = [
            _pair(_share(baseline, key), _share(candidate, key), 6),
            _pair(f"{b.tokens:,}", f"{c.tokens:,}", 11),
            _pair(_ms(b.queue_wait.quantile(0.5)), _ms(c.queue_wait.quantile(0.5)), 8),
            _pair(_ms(b.queue_wait.quantile(0.95)), _ms(c.queue_wait.quantile(0.95)), 8),
            _pair(_ms(b.ttft.quantile(0.5)), _ms(c.ttft.quantile(0.5)), 8),
            _pair(_ms(b.ttft.quantile(0.95)), _ms(c.ttft.quantile(0.95)), 8),
            _pair(f"{b.status_count(429):,}", f"{c.status_count(429):,}", 6),
            _pair(f"{b.demoted:,}", f"{c.demoted:,}", 6),
            _pair(_time(baseline.budget_out_s.get(tenant)),
                  _time(candidate.budget_out_s.get(tenant)), 7),
        ]
        lines.append(f"{tenant[:14]:<14} {lane[:10]:<10} | " + " | ".join(cells))
    lines.append(
        f"pool: output tokens/s {baseline.tokens_per_s():,.1f} -> {candidate.tokens_per_s():,.1f}; "
        f"utilisation {_utilisation(baseline)} -> {_utilisation(candidate)}; "
        f"over {baseline.duration_s:,.0f}s -> {candidate.duration_s:,.0f}s")
    for label, result in ((first, baseline), (name, candidate)):
        if result.unfinished:
            lines.append(f"{label}: {result.unfinished:,} requests unfinished when the replay "
                         "stopped (client timeout + queue maxWait after the last arrival)")
        for tenant, (line, count) in sorted(result.unknown_tenants.items()):
            lines.append(f"{label}: tenant {tenant!r} (first on line {line}, {count:,} requests) "
                         "is not in the config: replayed under tenantDefaults")
    return "\n".join(lines)


def plot(baseline: ReplayResult, candidates: dict[str, ReplayResult], path: Path) -> None:
    """Each tenant's service (tokens served per second, by bucket) over time: the baseline solid,
    the candidate dashed, one panel per candidate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(candidates), 1, figsize=(10, 4 * len(candidates)),
                             squeeze=False, sharex=True)
    tenants = sorted(set(baseline.series).union(*(c.series for c in candidates.values())))
    colours = plt.get_cmap("tab10")
    for row, (name, candidate) in enumerate(candidates.items()):
        ax = axes[row][0]
        for i, tenant in enumerate(tenants):
            pairs = ((baseline, "-", "baseline"), (candidate, "--", Path(name).name))
            for result, style, label in pairs:
                buckets = result.series.get(tenant, {})
                if not buckets:
                    continue
                xs = range(min(buckets), max(buckets) + 1)
                rates = [buckets.get(x, 0) / result.bucket_s for x in xs]
                # The last bucket's level is drawn to its end, not as a point.
                ax.step([x * result.bucket_s for x in (*xs, xs[-1] + 1)], [*rates, rates[-1]],
                        where="post", linestyle=style, color=colours(i % 10),
                        label=f"{tenant} ({label})")
        ax.set_title(f"service per tenant: baseline (solid) and {Path(name).name} (dashed)")
        ax.set_ylabel("tokens served / s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", ncol=2)
    axes[-1][0].set_xlabel("seconds since the first arrival")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
