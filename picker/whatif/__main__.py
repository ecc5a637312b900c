"""``python -m picker.whatif``: replay a metering log under the current config and candidates.

It answers an operator's question before a change: *if this config had served the traffic the
log recorded, what would each tenant and lane have got?* Nothing live is touched: the log is read,
the configs are loaded as the picker loads them (a config file, the ConfigMap the operator
renders, or for a candidate TenantPolicy YAML as ``kubectl apply`` takes it, applied to the
baseline as the operator would), and the picker's own gate runs in the pool
simulator (``picker.whatif.replay``). Printed per tenant and lane, baseline beside each candidate:
share of service, tokens served, queue wait and TTFT p50/p95, 429s, demotions and when the budget
ran out; for the pool, output tokens/s and utilisation. ``--json`` for CI, ``--plot`` a PNG.
First comes the log's own figures beside the baseline's replay: how far the replay is from what
was measured (a TTFT far below the log's asks for ``--prefill-ms-per-1k-tokens``).

The pool is what the log shows unless given: the endpoints that served (count), the engines'
step from the streamed requests' time per output token (median), the KV budget from the config
(``capacity.kvBudgetTokens``), or when that is ``auto`` (the picker learned it from the engines)
estimated from the log: what an engine held (prompt + output so far of its running requests)
while requests waited in the picker's queue for room (``KvOccupancy``). ``--fast``: events per
request instead of steps per token, for days of traffic (``picker.whatif.fast``: what it gives up
is measured in bench/results/whatif.md); ``--coarse K``: engine steps of K tokens
(``picker.whatif.coarse``). Exit status: 0; 1 when a candidate was refused (the others are
still replayed); 2 when the log or the baseline cannot be used.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import math
import operator
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from picker.config.schema import PickerConfig, load_config
from picker.config.strict import safe_load
from picker.errors import ConfigError
from picker.sim.pool import PoolSpec
from picker.whatif.coarse import step_scale
from picker.whatif.fast import replay_fast, unmodelled
from picker.whatif.log import (
    BadField,
    Row,
    Skips,
    Spool,
    decode,
    open_lines,
    parse_record,
    parse_time,
    quiet_gc,
    read_arrival_chunks,
)
from picker.whatif.replay import (
    _LOG_RATIO,
    OVER_BUDGET_REASONS,
    LaneStats,
    Quantiles,
    ReplayResult,
    _floor,
    _log,
    replay,
)
from picker.whatif.report import plot, table

CONFIGMAP_KEY = "picker.yaml"
DEFAULT_KV_BUDGET = 8192
DEFAULT_STEP_S = 0.01
MAX_ENDPOINTS = 4096
"""Distinct endpoints remembered while scanning (memory stays bounded on a hostile log)."""
MAX_OUTPUT_LENGTHS = 65_536
"""Distinct output lengths counted (``LogFigures.outputs``), likewise."""


TENANT_POLICY_KEYS = ("weight", "lane", "allowedLanes", "budgets", "overBudget", "limits")
"""What a TenantPolicy's spec sets on each of its tenants, as the operator renders it
(``fairway_operator.render.TENANT_KEYS``; a unit test keeps the two equal)."""


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("", f"{path}: cannot read: {exc.strerror}") from exc
    try:
        return safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("", f"{path}: not valid YAML: {exc}") from exc
    except ConfigError as exc:
        raise ConfigError(exc.path, f"{exc.message} ({path})") from exc


def _config_data(data: Any, path: Path) -> dict[str, Any]:
    """The config's sections: ``data`` itself, or the config a ConfigMap holds under
    ``picker.yaml`` (as the operator renders it)."""
    if isinstance(data, dict) and data.get("kind") == "ConfigMap":
        inner = (data.get("data") or {}).get(CONFIGMAP_KEY)
        if not isinstance(inner, str):
            raise ConfigError("data", f"the ConfigMap has no {CONFIGMAP_KEY!r} key ({path})")
        try:
            data = safe_load(inner)
        except yaml.YAMLError as exc:
            raise ConfigError(f"data.{CONFIGMAP_KEY}", f"not valid YAML: {exc} ({path})") from exc
    if not isinstance(data, dict):
        raise ConfigError("", f"{path}: must be a mapping of config sections")
    return data


def _load(data: dict[str, Any], path: Path) -> PickerConfig:
    try:
        return load_config(data)
    except ConfigError as exc:
        raise ConfigError(exc.path, f"{exc.message} ({path})") from exc


def load_config_file(path: Path) -> PickerConfig:
    """A picker config from a file: the config itself, or a ConfigMap holding it under
    ``picker.yaml``. ConfigError names the field and the file."""
    return _load(_config_data(_read_yaml(path), path), path)


def tenant_policies(data: Any) -> list[dict[str, Any]] | None:
    """The TenantPolicies ``data`` holds (one, or a ``kind: List`` of them); None when it is
    not TenantPolicies."""
    if isinstance(data, dict) and data.get("kind") == "TenantPolicy":
        return [data]
    if isinstance(data, dict) and data.get("kind") == "List" and isinstance(
            data.get("items"), list) and data["items"] and all(
            isinstance(item, dict) and item.get("kind") == "TenantPolicy"
            for item in data["items"]):
        return list(data["items"])
    return None


def apply_policies(base: dict[str, Any], policies: list[dict[str, Any]]) -> dict[str, Any]:
    """``base`` with each policy applied as ``kubectl apply`` and the operator would: each of
    its tenants' entries becomes ``{id, **the spec's rules}`` (replacing the base's entry for
    that id, or added after the others)."""
    tenants = [dict(t) for t in base.get("tenants") or [] if isinstance(t, dict)]
    for i, policy in enumerate(policies):
        where = f"items[{i}].spec" if len(policies) > 1 else "spec"
        spec = policy.get("spec")
        if not isinstance(spec, dict):
            raise ConfigError(where, "must be a mapping")
        ids = spec.get("tenants")
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, str) and t for t in ids):
            raise ConfigError(f"{where}.tenants", "must list at least one tenant id")
        rules = {key: spec[key] for key in TENANT_POLICY_KEYS if spec.get(key) is not None}
        for tenant in ids:
            entry = {"id": tenant, **rules}
            index = next((k for k, t in enumerate(tenants) if t.get("id") == tenant), None)
            if index is None:
                tenants.append(entry)
            else:
                tenants[index] = entry
    return {**base, "tenants": tenants}


def load_candidate(path: Path, base: dict[str, Any]) -> PickerConfig:
    """A candidate: a config (or ConfigMap) file, or TenantPolicy YAML applied to ``base``."""
    data = _read_yaml(path)
    policies = tenant_policies(data)
    if policies is None:
        return _load(_config_data(data, path), path)
    try:
        merged = apply_policies(base, policies)
    except ConfigError as exc:
        raise ConfigError(exc.path, f"{exc.message} ({path})") from exc
    return _load(merged, path)


SATURATED_QUEUE_MS = 100.0
"""A served request that waited this long in the picker's queue shows the pool out of room."""
MIN_SATURATED = 10
"""Requests that must show it before the log's peak in-flight tokens is taken as the budget."""


class KvOccupancy:
    """An estimate of each endpoint's KV cache from its served requests: while a request
    streams (first token to finish; a non-streamed one from its dispatch) it holds its prompt
    and a growing output, on average prompt + half its output. Summed over an endpoint's
    requests that is its engine's occupancy over time, and while the pool was full (requests
    waited in the queue for room) an engine holds about its whole cache: the estimate is the
    occupancy each endpoint held half its non-idle time (the time-weighted median, in blocks of
    16), median over endpoints: on bench.whatif's logs (engines of 2,048 tokens) it read 1,968
    to 2,064.

    The log is in finish order: each endpoint's events (a heap) are swept in time order once no
    record still to be read can come before them (``window_s`` behind the latest finish), so
    memory is what that window holds, plus a histogram per endpoint."""

    BLOCK = 16
    QUANTILE = 0.5

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.events: dict[str, list[tuple[float, float]]] = {}
        self.state: dict[str, list[float]] = {}
        """Per endpoint: [tokens held, time of the last event]."""
        self.held_for: dict[str, dict[int, float]] = {}
        """Per endpoint: seconds spent holding each number of blocks (idle time not kept)."""
        self.saturated = 0
        """Served requests that waited ``SATURATED_QUEUE_MS`` or more."""

    def add(self, endpoint: str, start: float, finished: float, tokens: float,
            queue_ms: float) -> None:
        events = self.events.get(endpoint)
        if events is None:
            if len(self.events) >= MAX_ENDPOINTS:
                return
            events = self.events[endpoint] = []
            self.state[endpoint] = [0.0, start]
            self.held_for[endpoint] = {}
        if queue_ms >= SATURATED_QUEUE_MS:
            self.saturated += 1
        heapq.heappush(events, (start, tokens))
        heapq.heappush(events, (max(finished, start), -tokens))
        self._sweep(endpoint, finished - self.window_s)

    def _sweep(self, endpoint: str, until: float) -> None:
        events, state, held_for = self.events[endpoint], self.state[endpoint], \
            self.held_for[endpoint]
        held, last = state
        while events and events[0][0] <= until:
            at, change = heapq.heappop(events)
            blocks = round(held / self.BLOCK)
            if blocks > 0 and at > last:
                held_for[blocks] = held_for.get(blocks, 0.0) + (at - last)
            held, last = held + change, at
        state[0], state[1] = held, last

    def budget(self) -> int | None:
        """The estimate, once the queue showed the pool full; else None."""
        if self.saturated < MIN_SATURATED:
            return None
        estimates = []
        for endpoint, held_for in self.held_for.items():
            self._sweep(endpoint, math.inf)
            total = sum(held_for.values())
            if total <= 0:
                continue
            seen = 0.0
            for blocks in sorted(held_for):
                seen += held_for[blocks]
                if seen >= self.QUANTILE * total:
                    estimates.append(blocks * self.BLOCK)
                    break
        if not estimates:
            return None
        estimates.sort()
        return estimates[len(estimates) // 2]


@dataclass
class LogFigures:
    """What the log says of the pool that served it."""

    endpoints: int
    step_s: float | None
    """Median time per output token of streamed requests (their engines' step)."""
    step_samples: int
    recorded: ReplayResult
    """What the log measured, per tenant and lane (the lane each request ran in), summed as a
    replay is: set beside the baseline's replay, it shows how far the replay is from the log.
    Its ``series`` (service over time, for the plot of the replays) is not kept."""
    kv_budget_tokens: int | None = None
    """Each engine's KV cache as the log shows it, when the pool was seen full (``KvOccupancy``)."""
    saturated: int = 0
    """Served requests that waited ``SATURATED_QUEUE_MS`` or more for room."""
    outputs: dict[int, int] = field(default_factory=dict)
    """Served requests by output length (``picker.whatif.coarse.step_scale``)."""


_scan_fields = operator.itemgetter("queue_ms", "ttft_ms", "e2e_ms", "endpoint",
                                   "completion_tokens", "outcome", "priority_lane", "demoted")
"""The fields ``FigureScan.add`` reads, in one call (as ``_plain_record`` does)."""


class FigureScan:
    """The pool's figures and what the log measured, record by record (``add``: each record
    that parses, in the log's order), for arrivals in ``[since, until)``. ``estimate_kv``:
    False when the KV budget is known (given, or a number in the config): its estimate is then
    not made (it costs about a quarter of the scan)."""

    def __init__(self, *, since: float | None = None, until: float | None = None,
                 bucket_s: float = 60.0, reorder_window_s: float = 600.0,
                 estimate_kv: bool = True) -> None:
        self.since, self.until, self.estimate_kv = since, until, estimate_kv
        self.endpoints: set[str] = set()
        self.per_token = Quantiles()
        self.kv = KvOccupancy(reorder_window_s)
        self.outputs: dict[int, int] = {}
        self.recorded = ReplayResult(bucket_s=bucket_s, step_s=1.0)
        self.first: float | None = None
        self.last: float | None = None

    def add(self, number: int, data: dict[str, Any], arrival: Row) -> None:
        """One record that parsed: ``data`` decoded, ``arrival`` the ``Row`` read from it."""
        # What the record measured goes straight to the sums (no ReplayRecord), each field
        # read once: this runs for every line of a day's log.
        since, until = self.since, self.until
        _, arrived, tenant, _, _, prompt, output, _, stream, finished = arrival
        queue_ms: Any  # Any: what is a number is tested once, below
        ttft_ms: Any
        e2e_ms: Any
        try:  # the picker writes every field, None or not: one call reads them all
            queue_ms, ttft_ms, e2e_ms, endpoint, completion, outcome, lane, demoted = \
                _scan_fields(data)
        except KeyError:  # a field missing: None, as ``get`` has it
            get = data.get
            queue_ms, ttft_ms, e2e_ms = get("queue_ms"), get("ttft_ms"), get("e2e_ms")
            endpoint, completion = get("endpoint"), get("completion_tokens")
            outcome, lane, demoted = get("outcome"), get("priority_lane"), get("demoted")
        timed_ttft = isinstance(ttft_ms, (int, float))
        timed_e2e = isinstance(e2e_ms, (int, float))
        if (since is None or arrived >= since) and (until is None or arrived < until):
            first = self.first
            if first is None:
                first = self.first = since if since is not None else arrived
            last = self.last
            if last is None or finished > last:
                self.last = finished
            at = arrived - first
            served = endpoint is not None
            # ``str(lane or "")``, ``str(outcome or "ok")``; calls only for what is not already
            # so (a call costs a tenth of a microsecond, a day 4.3 M).
            lane = lane or ""
            if type(lane) is not str:
                lane = str(lane)
            ended = outcome or "ok"
            if type(ended) is not str:
                ended = str(ended)
            timed_queue = isinstance(queue_ms, (int, float))
            demoted = demoted is True
            # ``self.recorded.add_fields``, inline and without its series (tokens served over
            # time), which nothing reads of what the log recorded: this runs for every line of
            # a day's log (4.3 M), where the call and the series cost 5 % of the one pass.
            recorded = self.recorded
            stats = recorded.lanes.get((tenant, lane))
            if stats is None:
                stats = recorded.lanes[(tenant, lane)] = LaneStats()
            stats.sent += 1
            if ended == "ok":
                stats.ok += 1
            else:
                stats.refused[ended] = stats.refused.get(ended, 0) + 1
            if demoted:
                stats.demoted += 1
            if demoted or (ended != "ok" and ended in OVER_BUDGET_REASONS):
                recorded.budget_out_s.setdefault(tenant, at)
            if served and timed_queue:
                quantiles = stats.queue_wait
                value = at + queue_ms / 1000 - at  # as add_fields has it: dispatched - arrived
                quantiles.count += 1
                if value < 1e-6:
                    quantiles.zeros += 1
                else:
                    bins, key = quantiles.bins, _floor(_log(value) / _LOG_RATIO)
                    bins[key] = bins.get(key, 0) + 1
            if timed_ttft:
                quantiles = stats.ttft
                value = at + ttft_ms / 1000 - at
                quantiles.count += 1
                if value < 1e-6:
                    quantiles.zeros += 1
                else:
                    bins, key = quantiles.bins, _floor(_log(value) / _LOG_RATIO)
                    bins[key] = bins.get(key, 0) + 1
                stats.prompt_tokens += prompt
            elif ended == "ok":
                stats.prompt_tokens += prompt  # an embedding: its prompt is its service
            stats.completion_tokens += completion
            recorded.output_tokens += completion
            if isinstance(endpoint, str):
                outputs = self.outputs
                length = output or 0
                if length in outputs:
                    outputs[length] += 1
                elif len(outputs) < MAX_OUTPUT_LENGTHS:
                    outputs[length] = 1
                if self.estimate_kv and timed_queue:
                    began = ttft_ms if stream and timed_ttft else queue_ms
                    self.kv.add(endpoint, arrived + began / 1000, finished,
                                prompt + (output or 0) / 2, queue_ms)
        if isinstance(endpoint, str) and endpoint not in self.endpoints \
                and len(self.endpoints) < MAX_ENDPOINTS:
            self.endpoints.add(endpoint)
        if outcome == "ok" and stream and timed_ttft and timed_e2e and completion >= 8 \
                and e2e_ms > ttft_ms:
            # ``self.per_token.add``, inline.
            value = (e2e_ms - ttft_ms) / 1000 / (completion - 1)
            per_token = self.per_token
            per_token.count += 1
            if value < 1e-6:
                per_token.zeros += 1
            else:
                bins, key = per_token.bins, _floor(_log(value) / _LOG_RATIO)
                bins[key] = bins.get(key, 0) + 1

    def figures(self) -> LogFigures:
        first, last, recorded = self.first, self.last, self.recorded
        if first is not None and last is not None:
            recorded.ticks = max(1, math.ceil(last - first))  # seconds: its tokens/s the log's
        return LogFigures(len(self.endpoints), self.per_token.quantile(0.5),
                          self.per_token.count, recorded, self.kv.budget(), self.kv.saturated,
                          self.outputs)


def scan_figures(path: Path | Sequence[bytes], size: int | None = None, *,
                 since: float | None = None, until: float | None = None,
                 bucket_s: float = 60.0, reorder_window_s: float = 600.0,
                 estimate_kv: bool = True) -> LogFigures:
    """One streaming pass over the log (its first ``size`` bytes) for the pool's figures and
    what the log measured (``FigureScan``); bad lines are left to the replay's pass to report.
    The CLI does not call it: ``read_log`` scans and spools in one pass."""
    scan = FigureScan(since=since, until=until, bucket_s=bucket_s,
                      reorder_window_s=reorder_window_s, estimate_kv=estimate_kv)
    read = 0
    with open_lines(path) as stream:
        for number, raw in enumerate(stream, start=1):
            read += len(raw)
            if size is not None and read > size:
                break
            try:
                data = decode(raw)
                arrival, _ = parse_record(number, data)
            except (ValueError, BadField):
                continue
            scan.add(number, data, arrival)
    return scan.figures()


def read_log(path: Path | Sequence[bytes], skips: Skips, *, size: int | None = None,
             since: float | None = None, until: float | None = None, bucket_s: float = 60.0,
             reorder_window_s: float = 600.0, estimate_kv: bool = True,
             report: Callable[[str], None] | None = None) -> tuple[LogFigures, Spool]:
    """The log read once: its pool's figures (``FigureScan``) and its usable arrivals, in
    arrival order, spooled for every config's replay (``read_arrival_chunks``: ``skips`` and
    ``report`` get what it could not use). The caller closes the spool."""
    scan = FigureScan(since=since, until=until, bucket_s=bucket_s,
                      reorder_window_s=reorder_window_s, estimate_kv=estimate_kv)
    spool = Spool()
    try:
        for chunk in read_arrival_chunks(path, skips, reorder_window_s=reorder_window_s,
                                         since=since, until=until, size=size, report=report,
                                         each=scan.add):
            spool.extend(chunk)
    except BaseException:
        spool.close()
        raise
    return scan.figures(), spool


def pool_spec(args: argparse.Namespace, figures: LogFigures, baseline: PickerConfig
              ) -> tuple[PoolSpec, list[str]]:
    """The pool to replay on, and a note on where each figure came from."""
    notes = []
    if args.endpoints is not None:
        endpoints = args.endpoints
        notes.append(f"endpoints {endpoints} (given)")
    elif figures.endpoints:
        endpoints = figures.endpoints
        notes.append(f"endpoints {endpoints} (served requests in the log)")
    elif baseline.endpoints:
        endpoints = len(baseline.endpoints)
        notes.append(f"endpoints {endpoints} (the baseline config's)")
    else:
        endpoints = 2
        notes.append("endpoints 2 (assumed: none in the log or config; --endpoints)")
    configured = baseline.capacity.kv_budget_tokens
    if args.kv_budget_tokens is not None:
        kv = args.kv_budget_tokens
        notes.append(f"KV budget {kv:,} tokens (given)")
    elif isinstance(configured, int):
        kv = configured
        notes.append(f"KV budget {kv:,} tokens (capacity.kvBudgetTokens)")
    elif figures.kv_budget_tokens is not None:
        kv = figures.kv_budget_tokens
        notes.append(f"KV budget {kv:,} tokens (estimated from the log: what the endpoints held "
                     f"while {figures.saturated:,} requests waited for room; "
                     "--kv-budget-tokens)")
    else:
        kv = DEFAULT_KV_BUDGET
        notes.append(f"KV budget {kv:,} tokens (assumed: learned live; --kv-budget-tokens)")
    if args.step_ms is not None:
        step = args.step_ms / 1000
        notes.append(f"step {args.step_ms:g} ms (given)")
    elif figures.step_s is not None:
        step = figures.step_s
        notes.append(f"step {step * 1000:.2f} ms (median time per output token of "
                     f"{figures.step_samples:,} streamed requests)")
    else:
        step = DEFAULT_STEP_S
        notes.append(f"step {step * 1000:g} ms (assumed: no streamed request to infer it from; "
                     "--step-ms)")
    spec = PoolSpec(endpoints=endpoints, kv_budget_tokens=kv, step_s=step,
                    engine_policy=args.engine_policy,
                    prefill_s_per_token=args.prefill_ms_per_1k_tokens / 1e6,
                    scrape_interval_s=max(step, baseline.capacity.scrape_interval))
    return spec, notes


def _run(spool: Spool, config: PickerConfig, spec: PoolSpec, args: argparse.Namespace,
         outputs: dict[int, int] | None = None) -> ReplayResult:
    """One config's replay of the spooled arrivals."""
    first = spool.first
    if first is None:
        raise LookupError("no usable record in the log")
    start = args.since if args.since is not None else first.arrived
    if args.fast:
        return replay_fast(config, spec, spool, start=start,
                           client_timeout_s=args.client_timeout, bucket_s=args.bucket)
    return replay(config, spec, iter(spool), start=start,
                  client_timeout_s=args.client_timeout, bucket_s=args.bucket,
                  coarse=args.coarse, coarse_scale=step_scale(outputs or {}, args.coarse))


def _time_option(text: str) -> float:
    try:
        return parse_time(text)
    except ValueError as exc:  # argparse would print only "invalid value"
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m picker.whatif", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=Path, help="the picker's metering log (JSON Lines)")
    parser.add_argument("--baseline", type=Path, required=True,
                        help="the config the log was served under (a picker config file, or "
                             "the ConfigMap holding it)")
    parser.add_argument("--candidate", type=Path, action="append", required=True,
                        help="a config to compare (a config file, its ConfigMap, or "
                             "TenantPolicy YAML applied to the baseline); repeat for several")
    parser.add_argument("--since", type=_time_option,
                        help="replay arrivals from this time (unix seconds or ISO 8601)")
    parser.add_argument("--until", type=_time_option, help="... and before this one")
    parser.add_argument("--endpoints", type=int, help="engines in the pool (default: the log's)")
    parser.add_argument("--kv-budget-tokens", type=int, help="each engine's KV cache in tokens")
    parser.add_argument("--step-ms", type=float, help="an engine step (default: the log's)")
    parser.add_argument("--prefill-ms-per-1k-tokens", type=float, default=0.0)
    parser.add_argument("--engine-policy", choices=("fcfs", "priority"), default="fcfs",
                        help="the engines' --scheduling-policy")
    parser.add_argument("--client-timeout", type=float, default=120.0,
                        help="seconds after which a client gives up (default 120)")
    parser.add_argument("--reorder-window", type=float, default=600.0,
                        help="seconds a record may finish after a later arrival (default 600)")
    parser.add_argument("--bucket", type=float, default=60.0,
                        help="seconds per bucket of the service-over-time plot (default 60)")
    parser.add_argument("--coarse", type=int, default=1, metavar="K",
                        help="fast mode: engine steps K times as long, each emitting up to K "
                             "tokens a request (picker.whatif.coarse; default 1: exact)")
    parser.add_argument("--fast", action="store_true",
                        help="event-driven replay, a few operations a request instead of a "
                             "step a token (picker.whatif.fast): for days of traffic; the fair "
                             "order, budgets and caps are the gate's, the engines simplified")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--plot", type=Path, help="write a PNG of service over time here")
    args = parser.parse_args(argv)
    for name in ("endpoints", "kv_budget_tokens", "coarse"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("step_ms", "client_timeout", "reorder_window", "bucket"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            parser.error(f"--{name.replace('_', '-')} must be above 0")
    if args.fast and args.coarse > 1:
        parser.error("--fast and --coarse are two modes: give one")
    if args.prefill_ms_per_1k_tokens < 0:
        parser.error("--prefill-ms-per-1k-tokens must be at least 0")
    if not args.log.is_file():
        print(f"whatif: {args.log}: no such file", file=sys.stderr)
        return 2
    try:
        base_data = _config_data(_read_yaml(args.baseline), args.baseline)
        baseline = _load(base_data, args.baseline)
    except ConfigError as exc:
        print(f"whatif: the baseline config is refused: {exc}", file=sys.stderr)
        return 2
    candidates: dict[str, PickerConfig] = {}
    refused = 0
    for path in args.candidate:
        try:
            candidates[str(path)] = load_candidate(path, base_data)
        except ConfigError as exc:
            refused += 1
            print(f"whatif: candidate {path} is refused, not replayed: {exc}", file=sys.stderr)
    args.size = args.log.stat().st_size  # a live log grows: replay each config on these bytes
    skips = Skips()
    # The exact and coarse replays make cyclic garbage (the simulator's passages and records):
    # there the collector keeps its defaults, or memory grows (200 MB against 127 on 10 minutes).
    with quiet_gc() if args.fast else contextlib.nullcontext():
        figures, spool = read_log(
            args.log, skips, size=args.size, since=args.since, until=args.until,
            bucket_s=args.bucket, reorder_window_s=args.reorder_window,
            estimate_kv=args.kv_budget_tokens is None and not isinstance(
                baseline.capacity.kv_budget_tokens, int),
            report=lambda message: print(message, file=sys.stderr))
        with spool:
            spec, notes = pool_spec(args, figures, baseline)
            if args.fast:
                notes.append("fast mode (picker.whatif.fast)")
                for name, config in [("the baseline", baseline), *candidates.items()]:
                    missing = unmodelled(config)
                    if missing:
                        print(f"whatif: --fast does not model {', '.join(missing)} ({name}): "
                              "use the exact replay for them", file=sys.stderr)
            try:
                base = _run(spool, baseline, spec, args, outputs=figures.outputs)
            except LookupError as exc:
                print(f"whatif: {args.log}: {exc} ({skips.summary()})", file=sys.stderr)
                return 2
            except ConfigError as exc:
                print(f"whatif: the baseline config is refused: {exc}", file=sys.stderr)
                return 2
            results: dict[str, ReplayResult] = {}
            for name, config in candidates.items():
                try:
                    results[name] = _run(spool, config, spec, args, outputs=figures.outputs)
                except ConfigError as exc:
                    refused += 1
                    print(f"whatif: candidate {name} is refused, not replayed: {exc}",
                          file=sys.stderr)
    if args.plot is not None and results:
        plot(base, results, args.plot)
    if args.json:
        out: dict[str, Any] = {
            "log": skips.as_dict(), "pool": {"endpoints": spec.endpoints,
                                             "kv_budget_tokens": spec.kv_budget_tokens,
                                             "step_s": spec.step_s, "notes": notes},
            "recorded": figures.recorded.as_dict(),
            "baseline": {"config": str(args.baseline), **base.as_dict()},
            "candidates": [{"config": name, **result.as_dict()}
                           for name, result in results.items()],
            "refused_configs": refused}
        print(json.dumps(out, indent=2))
    else:
        print(skips.summary())
        print("pool: " + "; ".join(notes))
        print()
        print(table(figures.recorded, base, "the baseline's replay", first="as recorded"))
        for name, result in results.items():
            print()
            print(table(base, result, name))
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
