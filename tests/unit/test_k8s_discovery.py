"""Which pods of an InferencePool are endpoints (``endpoints_of``), and how discovered endpoints
combine with the picker config (``with_endpoints``, ``LiveConfig``)."""

from __future__ import annotations

from typing import Any

import pytest

from picker.config.schema import load_config
from picker.errors import ConfigError
from picker.k8s import LiveConfig, endpoints_of, with_endpoints
from picker.k8s.discovery import is_serving

SELECTOR = {"app": "vllm", "pool": "a"}


def _pool(selector: Any = None, ports: tuple[int, ...] = (8000,)) -> dict[str, Any]:
    return {"metadata": {"name": "pool", "namespace": "ns"},
            "spec": {"selector": {"matchLabels": SELECTOR} if selector is None else selector,
                     "targetPorts": [{"number": p} for p in ports]}}


def _pod(name: str, ip: str | None = "10.0.0.1", *, ready: str | None = "True",
         labels: dict[str, str] | None = None, terminating: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": SELECTOR if labels is None else labels}
    if terminating:
        metadata["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": "Running", "conditions": [
        {"type": "PodScheduled", "status": "True"}]}
    if ready is not None:
        status["conditions"].append({"type": "Ready", "status": ready})
    if ip is not None:
        status["podIP"] = ip
    return {"metadata": metadata, "status": status}


def test_ready_pods_are_endpoints_on_the_target_port() -> None:
    pods = [_pod("a", "10.0.0.1"), _pod("b", "10.0.0.2")]
    assert endpoints_of(_pool(), pods) == ["10.0.0.1:8000", "10.0.0.2:8000"]


@pytest.mark.parametrize("pod", [
    _pod("unready", ready="False"),
    _pod("unknown", ready="Unknown"),
    _pod("no-ready-condition", ready=None),
    _pod("terminating", terminating=True),
    _pod("no-ip", ip=None),
    _pod("empty-ip", ip=""),
    _pod("other-pool", labels={"app": "vllm", "pool": "b"}),
    _pod("missing-label", labels={"app": "vllm"}),
    _pod("no-labels", labels={}),
])
def test_a_pod_that_cannot_serve_or_is_not_selected_is_no_endpoint(pod: dict[str, Any]) -> None:
    assert endpoints_of(_pool(), [_pod("good", "10.0.0.9"), pod]) == ["10.0.0.9:8000"]


def test_extra_pod_labels_do_not_matter() -> None:
    pod = _pod("a", labels={**SELECTOR, "version": "2"})
    assert endpoints_of(_pool(), [pod]) == ["10.0.0.1:8000"]


def test_every_target_port_of_every_pod() -> None:
    pods = [_pod("a", "10.0.0.1"), _pod("b", "10.0.0.2"), _pod("c", "10.0.0.3", ready="False")]
    assert endpoints_of(_pool(ports=(8000, 8001)), pods) == [
        "10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.2:8000", "10.0.0.2:8001"]


def test_ipv6_pod_addresses_are_bracketed_and_valid_endpoints() -> None:
    [address] = endpoints_of(_pool(), [_pod("a", "fd00::1")])
    assert address == "[fd00::1]:8000"
    assert with_endpoints(load_config({}), [address]).endpoints[0].address == address


@pytest.mark.parametrize("pool", [
    None,
    {"spec": {}},
    _pool(selector={"matchLabels": {}}),
    _pool(selector={}),
    _pool(ports=()),
    {"spec": {"selector": {"matchLabels": SELECTOR}, "targetPorts": [{"number": 0}]}},
    {"spec": {"selector": {"matchLabels": SELECTOR}, "targetPorts": [{"number": "8000"}]}},
])
def test_no_pool_no_selector_or_no_valid_port_means_no_endpoints(pool: Any) -> None:
    assert endpoints_of(pool, [_pod("a")]) == []


def test_v1alpha2_pool_shape_is_understood() -> None:
    pool = {"spec": {"selector": SELECTOR, "targetPortNumber": 9000}}
    assert endpoints_of(pool, [_pod("a")]) == ["10.0.0.1:9000"]


def test_is_serving_needs_ready_true_an_ip_and_no_deletion() -> None:
    assert is_serving(_pod("a"))
    assert not is_serving(_pod("a", ready="False"))
    assert not is_serving(_pod("a", terminating=True))
    assert not is_serving(_pod("a", ip=None))
    assert not is_serving({})


# -- combining with the config --

def _config(**data: Any):
    return load_config({"capacity": {"kvBudgetTokens": 1000}, **data})


def test_discovered_endpoints_replace_the_static_list() -> None:
    config = _config(endpoints=[{"address": "127.0.0.1:9"}])
    combined = with_endpoints(config, ["10.0.0.1:8000", "10.0.0.2:8000"])
    assert [e.address for e in combined.endpoints] == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert all(e.kv_budget_tokens is None for e in combined.endpoints)
    assert combined.capacity == config.capacity and combined.tenants == config.tenants
    assert [e.address for e in config.endpoints] == ["127.0.0.1:9"]  # the input is untouched


def test_per_endpoint_overrides_are_kept_for_matching_addresses() -> None:
    config = _config(endpoints=[{"address": "10.0.0.1:8000", "kvBudgetTokens": 123},
                                {"address": "10.0.0.7:8000", "kvBudgetTokens": 456}])
    combined = with_endpoints(config, ["10.0.0.2:8000", "10.0.0.1:8000"])
    assert [(e.address, e.kv_budget_tokens) for e in combined.endpoints] == [
        ("10.0.0.2:8000", None), ("10.0.0.1:8000", 123)]


def test_no_endpoints_and_repeats() -> None:
    config = _config(endpoints=[{"address": "127.0.0.1:9"}])
    assert with_endpoints(config, []).endpoints == ()
    assert len(with_endpoints(config, ["10.0.0.1:1", "10.0.0.1:1"]).endpoints) == 1


def test_a_bad_address_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="address"):
        with_endpoints(_config(), ["not an address"])


def test_live_config_combines_the_latest_of_both() -> None:
    applied = []
    static = _config(endpoints=[{"address": "127.0.0.1:9"}])
    live = LiveConfig(applied.append, static)
    assert live.combined() is static  # nothing discovered yet: the static list serves
    live.set_endpoints(["10.0.0.1:8000"])
    assert [e.address for e in applied[-1].endpoints] == ["10.0.0.1:8000"]
    newer = _config(endpoints=[{"address": "10.0.0.1:8000", "kvBudgetTokens": 77}],
                    tenants=[{"id": "t", "weight": 2}])
    live.set_config(newer)
    assert applied[-1].tenants == newer.tenants
    assert [(e.address, e.kv_budget_tokens) for e in applied[-1].endpoints] == [
        ("10.0.0.1:8000", 77)]
    live.set_endpoints([])
    assert applied[-1].endpoints == () and applied[-1].tenants == newer.tenants


def test_live_config_keeps_the_old_config_when_apply_refuses() -> None:
    def refuse(config: Any) -> None:
        raise ValueError("not now")

    static = _config()
    live = LiveConfig(refuse, static)
    with pytest.raises(ValueError):
        live.set_config(_config(tenants=[{"id": "t"}]))
    assert live.config is static
