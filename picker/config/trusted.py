"""Which request headers does this picker trust, so which must the gateway in front remove from
what clients send, and does a given gateway form remove them?

In trusted-header mode (``tenancy.mode: header``) the picker takes a request's tenant from
``tenancy.header`` (then ``alsoAccept``), its lane from ``tenancy.laneHeader`` and an
InferenceObjective from ``x-gateway-inference-objective``. Those names are configurable, so the
gateway's early removal list must follow the config: ``strip_list`` is that list, from which
fairway's Envoy configs are generated (``picker.stack.envoy``, ``scripts/gen_gateway_envoy.py
--picker-config``). A gateway form that is static (the Kubernetes samples of manifests/gateway/,
an Envoy bootstrap written by hand) is checked with ``check_stripped``: a trusted header it does
not remove is refused, naming the config field, since behind it any client picks its tenant or
lane. In API-key mode the picker authenticates the key itself and ignores tenant headers, and the
lane header chooses only among the tenant's ``allowedLanes``: nothing is trusted, nothing checked.

A reload that turns API-key mode into header mode (``reload_refusal``) is refused: it would start
trusting headers that the gateway in front may pass through from clients, so it takes a restart,
a deliberate act, and the refusal is logged (``picker.dispatch``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from picker.config.schema import PickerConfig, Tenancy
from picker.errors import ConfigError
from picker.identity import OBJECTIVE_HEADER


def trusted_headers(tenancy: Tenancy) -> tuple[tuple[str, str], ...]:
    """``(config field, header name)`` of every header the picker reads a tenant, lane or
    objective from, names lower-cased, first occurrence only."""
    named = [("tenancy.header", tenancy.header),
             *((f"tenancy.alsoAccept[{i}]", h) for i, h in enumerate(tenancy.also_accept)),
             ("tenancy.laneHeader", tenancy.lane_header),
             # Not configurable: the Gateway API Inference Extension's name.
             ("lanes[].objectives", OBJECTIVE_HEADER)]
    seen: set[str] = set()
    found = []
    for path, name in named:
        header = name.strip().lower()
        if header and header not in seen:
            seen.add(header)
            found.append((path, header))
    return tuple(found)


def strip_list(tenancy: Tenancy | None = None) -> tuple[str, ...]:
    """The headers a gateway must remove from clients' requests before the picker sees them (the
    default config's: the four names the shipped configs remove). Generated in both modes: in
    API-key mode the picker ignores client tenant headers anyway, and removing them keeps them
    from reaching the engine."""
    return tuple(header for _, header in trusted_headers(tenancy or Tenancy()))


def check_stripped(config: PickerConfig, removed: Iterable[str], form: str) -> None:
    """Raise ConfigError, naming the field, for a header the picker trusts that the gateway form
    ``form`` (its name, for the message) does not remove before the picker. Header mode only."""
    if config.tenancy.mode != "header":
        return
    gone = {name.strip().lower() for name in removed}
    for path, header in trusted_headers(config.tenancy):
        if header not in gone:
            raise ConfigError(path, (
                f"the picker trusts header {header!r}, but {form} does not remove it from "
                "clients' requests before the picker: any client could set it and choose its "
                "tenant or lane. Add it to that gateway's early header removal (or generate the "
                "config: scripts/gen_gateway_envoy.py --picker-config), name a header the gateway "
                "removes, or use tenancy.mode: apiKey"))


def early_removed(documents: Iterable[Mapping[str, Any]]) -> tuple[str, ...]:
    """The headers a gateway form removes before any HTTP filter, read from its documents: the
    Kubernetes objects of a sample (Envoy Gateway's ClientTrafficPolicy
    ``headers.earlyRequestHeaders.remove``, kgateway's ListenerPolicy
    ``earlyRequestHeaderModifier.remove``, an Istio EnvoyFilter's
    ``early_header_mutation_extensions``) or an Envoy bootstrap (each HttpConnectionManager's
    ``early_header_mutation_extensions``). An HTTPRoute's RequestHeaderModifier is not counted:
    the router applies it after the picker read the headers."""
    found: list[str] = []
    for doc in documents:
        kind = doc.get("kind")
        if kind == "ClientTrafficPolicy":
            early = doc.get("spec", {}).get("headers", {}).get("earlyRequestHeaders", {})
            found += early.get("remove", [])
        elif kind == "ListenerPolicy":
            settings = doc.get("spec", {}).get("default", {}).get("httpSettings", {})
            found += settings.get("earlyRequestHeaderModifier", {}).get("remove", [])
        elif kind == "EnvoyFilter":
            for patch in doc.get("spec", {}).get("configPatches", []):
                typed = patch.get("patch", {}).get("value", {}).get("typed_config", {})
                found += _mutation_removals(typed)
        elif "static_resources" in doc:
            for listener in doc["static_resources"].get("listeners", []):
                chains = [*listener.get("filter_chains", []),
                          *([listener["default_filter_chain"]]
                            if "default_filter_chain" in listener else [])]
                for chain in chains:
                    for network_filter in chain.get("filters", []):
                        found += _mutation_removals(network_filter.get("typed_config", {}))
    return tuple(found)


def _mutation_removals(manager: Mapping[str, Any]) -> list[str]:
    return [mutation["remove"]
            for extension in manager.get("early_header_mutation_extensions", [])
            for mutation in extension.get("typed_config", {}).get("mutations", [])
            if "remove" in mutation]


def reload_refusal(old: Tenancy, new: Tenancy) -> ConfigError | None:
    """Why a live reload from ``old`` to ``new`` is refused, or None: switching API-key mode to
    header mode takes a restart (see the module's docstring)."""
    if old.mode == "apiKey" and new.mode == "header":
        return ConfigError("tenancy.mode", (
            "a reload may not switch apiKey to header mode: from then on the tenant would come "
            f"from client-visible headers ({', '.join([new.header, *new.also_accept])}), "
            "trusted only if "
            "the gateway removes them. Check that it does (python -m picker.config check FILE "
            "--gateway SAMPLE), then restart the picker with this config"))
    return None
