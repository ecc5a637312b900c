"""The headers a gateway must remove follow the picker's config: generated for fairway's Envoy
configs, checked against the static gateway forms (manifests/gateway/), and a reload from API-key
to header mode is refused (a restart is the explicit act) and logged."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from picker.config.__main__ import main as config_cli
from picker.config.reload import ConfigWatcher
from picker.config.schema import PickerConfig, Tenancy, load_config
from picker.config.trusted import (
    check_stripped,
    early_removed,
    reload_refusal,
    strip_list,
    trusted_headers,
)
from picker.dispatch import Dispatcher
from picker.errors import ConfigError
from picker.identity import KEY_HEADERS, hash_api_key
from picker.metrics import PickerMetrics
from picker.stack.envoy import CLIENT_CONTROLLED_HEADERS, client_controlled_headers, envoy_config
from picker.stack.gateways import FLAVOURS, Wiring, gateway_config
from scripts import gen_gateway_envoy

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "manifests" / "gateway"
DEFAULT_FOUR = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id",
                "x-fairway-lane", "x-gateway-inference-objective")
KEY = "sk-trusted-test-key"
API_KEY_TENANCY = {"mode": "apiKey", "apiKeys": [{"sha256": hash_api_key(KEY), "tenant": "a"}]}


def _config(tenancy: dict[str, Any] | None = None) -> PickerConfig:
    return load_config({"endpoints": [{"address": "10.0.0.1:8000"}],
                        **({} if tenancy is None else {"tenancy": tenancy})})


def _sample(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((SAMPLES / name).read_text()) if isinstance(d, dict)]


# -- the strip list, generated --

def test_the_default_config_s_strip_list_is_the_four_shipped_names() -> None:
    assert strip_list() == DEFAULT_FOUR == CLIENT_CONTROLLED_HEADERS
    assert client_controlled_headers(Tenancy()) == DEFAULT_FOUR


def test_the_strip_list_follows_tenancy_s_header_names() -> None:
    tenancy = _config({"header": "X-Tenant-Id", "alsoAccept": ["x-org", "x-tenant-id"],
                       "laneHeader": "x-my-lane"}).tenancy
    assert strip_list(tenancy) == ("x-tenant-id", "x-org", "x-my-lane",
                                   "x-gateway-inference-objective")
    assert [path for path, _ in trusted_headers(tenancy)] == [
        "tenancy.header", "tenancy.alsoAccept[0]", "tenancy.laneHeader", "lanes[].objectives"]


def _manager(config: dict[str, Any]) -> dict[str, Any]:
    (listener,) = config["static_resources"]["listeners"]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


@pytest.mark.parametrize("identity", ["strip", "trusted-client"])
def test_envoy_config_removes_the_generated_list_early_and_the_key_headers_at_the_route(
        identity: str) -> None:
    strip = client_controlled_headers(_config({"header": "x-tenant-id"}).tenancy)
    manager = _manager(envoy_config(listen_port=1, admin_port=2, picker_port=3,
                                    identity=identity, strip_headers=strip))
    (host,) = manager["route_config"]["virtual_hosts"]
    if identity == "trusted-client":
        assert "early_header_mutation_extensions" not in manager
        assert "request_headers_to_remove" not in host
        return
    assert early_removed([{"static_resources": {"listeners": [{"filter_chains": [{"filters": [
        {"typed_config": manager}]}]}]}}]) == strip
    assert "x-tenant-id" in strip
    # After the picker read them: no client's key reaches a model server.
    assert host["request_headers_to_remove"] == list(KEY_HEADERS)


def test_a_flavour_removes_its_wiring_s_list() -> None:
    wiring = Wiring(listen_port=1, admin_port=2, picker_port=3, endpoints=["127.0.0.1:4"],
                    strip_headers=("x-tenant-id",))
    for name in FLAVOURS:
        if FLAVOURS[name].patched_by is None:
            assert early_removed([gateway_config(name, wiring)]) == ("x-tenant-id",), name


def test_gen_gateway_envoy_writes_a_picker_config_s_own_list(tmp_path: Path) -> None:
    config = tmp_path / "picker.yaml"
    config.write_text("tenancy: {header: x-tenant-id, laneHeader: x-my-lane}\n")
    out = tmp_path / "out"
    assert gen_gateway_envoy.main(["--picker-config", str(config), "--out", str(out)]) == 0
    loaded = load_config(config)
    for name in ("envoy.yaml", "envoy-jwt.yaml", "envoy-access-log.yaml"):
        documents = list(yaml.safe_load_all((out / name).read_text()))
        check_stripped(loaded, early_removed(documents), name)  # passes
        assert early_removed(documents) == strip_list(loaded.tenancy)
        # The committed sample, for the default names, would not do for this config.
        with pytest.raises(ConfigError) as caught:
            check_stripped(loaded, early_removed(_sample(name)), name)
        assert caught.value.path == "tenancy.header"


# -- the check against static forms --

IMPLEMENTATION_SAMPLES = ["envoy-ai-gateway.yaml", "kgateway.yaml", "istio.yaml", "envoy.yaml",
                          "envoy-jwt.yaml", "envoy-access-log.yaml"]


@pytest.mark.parametrize("name", IMPLEMENTATION_SAMPLES)
def test_each_sample_removes_what_the_default_config_trusts(name: str) -> None:
    assert sorted(early_removed(_sample(name))) == sorted(DEFAULT_FOUR)
    check_stripped(_config(), early_removed(_sample(name)), name)


@pytest.mark.parametrize("name", IMPLEMENTATION_SAMPLES)
@pytest.mark.parametrize(("tenancy", "path", "header"), [
    ({"header": "x-tenant-id"}, "tenancy.header", "x-tenant-id"),
    ({"alsoAccept": ["x-gateway-inference-fairness-id", "x-org"]}, "tenancy.alsoAccept[1]",
     "x-org"),
    ({"laneHeader": "x-my-lane"}, "tenancy.laneHeader", "x-my-lane"),
], ids=["header", "also-accept", "lane-header"])
def test_a_trusted_header_a_sample_does_not_remove_is_refused_naming_the_field(
        name: str, tenancy: dict[str, Any], path: str, header: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_stripped(_config(tenancy), early_removed(_sample(name)), f"manifests/gateway/{name}")
    assert caught.value.path == path
    assert repr(header) in caught.value.message and name in caught.value.message


def test_an_httproute_alone_removes_nothing_in_time() -> None:
    """gateway-api.yaml's RequestHeaderModifier runs in the router, after the picker read the
    headers: in header mode the check refuses it (its comment says to add an early removal or
    use API-key mode), and in API-key mode nothing is trusted, so nothing is checked."""
    assert early_removed(_sample("gateway-api.yaml")) == ()
    with pytest.raises(ConfigError, match="does not remove it"):
        check_stripped(_config(), (), "gateway-api.yaml")
    check_stripped(_config({"header": "x-tenant-id", **API_KEY_TENANCY}), (), "gateway-api.yaml")


def test_the_check_command_names_the_field(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "picker.yaml"
    config.write_text("tenancy: {header: x-tenant-id}\n")
    assert config_cli(["check", str(config), "--gateway", str(SAMPLES / "kgateway.yaml")]) == 1
    assert "tenancy.header: the picker trusts header 'x-tenant-id'" in capsys.readouterr().err
    config.write_text("tenancy: {header: x-llm-d-inference-fairness-id}\n")
    assert config_cli(["check", str(config), "--gateway", str(SAMPLES / "kgateway.yaml"),
                       "--gateway", str(SAMPLES / "envoy.yaml")]) == 0


# -- the reload rule --

def _dispatcher(config: PickerConfig) -> Dispatcher:
    return Dispatcher(config, clock=lambda: 0.0, metrics=PickerMetrics(CollectorRegistry()))


def test_reload_refusal_is_api_key_to_header_only() -> None:
    api_key, header = _config(API_KEY_TENANCY).tenancy, _config().tenancy
    refusal = reload_refusal(api_key, header)
    assert refusal is not None and refusal.path == "tenancy.mode"
    assert "restart the picker" in refusal.message
    assert reload_refusal(header, api_key) is None
    assert reload_refusal(header, header) is None
    assert reload_refusal(api_key, api_key) is None


async def test_a_live_switch_from_api_key_to_header_is_refused_and_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    dispatcher = _dispatcher(_config(API_KEY_TENANCY))
    with caplog.at_level(logging.WARNING, logger="picker.dispatch.dispatcher"), \
            pytest.raises(ConfigError) as caught:
        dispatcher.apply_config(_config())
    assert caught.value.path == "tenancy.mode"
    (record,) = [r for r in caplog.records if "apiKey to header" in r.getMessage()]
    assert record.levelno == logging.WARNING
    # Nothing changed: the keys still decide.
    assert dispatcher.identity.mode == "apiKey"
    assert dispatcher.config.tenancy.mode == "apiKey"
    # Tightening is live.
    header = _dispatcher(_config())
    header.apply_config(_config(API_KEY_TENANCY))
    assert header.identity.mode == "apiKey"


async def test_a_watched_file_switching_to_header_mode_is_a_failed_reload_not_retried(
        tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    document = {"endpoints": [{"address": "10.0.0.1:8000"}], "tenancy": API_KEY_TENANCY}
    path.write_text(yaml.safe_dump(document))
    dispatcher = _dispatcher(load_config(path))
    results: list[str] = []
    watcher = ConfigWatcher(path, dispatcher.apply_config, results.append)
    path.write_text(yaml.safe_dump({**document, "tenancy": {"mode": "header"}}))
    assert watcher.check() == "failure"
    assert watcher.last_error is not None and watcher.last_error.startswith("tenancy.mode:")
    assert watcher.check() is None  # not deferred: a restart, not patience, switches it
    assert results == ["failure"]
    assert dispatcher.identity.mode == "apiKey"


async def test_a_change_of_trusted_headers_in_header_mode_is_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    dispatcher = _dispatcher(_config())
    with caplog.at_level(logging.WARNING, logger="picker.dispatch.dispatcher"):
        dispatcher.apply_config(_config({"header": "x-tenant-id"}))
    assert any("now trusts headers" in r.getMessage() and "x-tenant-id" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)
    assert dispatcher.identity.tenant({"x-tenant-id": "t"}) == "t"
