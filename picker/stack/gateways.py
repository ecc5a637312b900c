"""Envoy configured the way each Gateway API implementation configures it for an InferencePool.

It answers: *what does the Envoy in front of fairway look like when a user runs Envoy AI Gateway,
kgateway or Istio instead of the Envoy of ``picker.stack.envoy``?* Each function returns an Envoy
bootstrap (a dict; ``yaml.safe_dump`` it) whose ext_proc filter, picker cluster and pool cluster
reproduce what that implementation's control plane generates, field by field, as far as a static
bootstrap allows. Where the control plane resolves names through Kubernetes (the picker Service,
the pool's pods) the bootstrap lists addresses instead (``STATIC`` clusters); everything that
decides how the picker is called (processing modes, timeouts, metadata namespaces, TLS without
verification, failure mode) and how the request is routed (``ORIGINAL_DST`` on the destination
header, ``override_host`` on the ``envoy.lb`` metadata, subset load balancing) is kept. The
sources each flavour was read from are in docs/gateways.md.

The flavours differ in what the picker can see of the response, which decides what it can meter:

* ``envoy-ai-gateway``, ``envoy-ai-gateway-fail-open``, ``kgateway``, ``istio``: the response
  headers and body come inline, ``FULL_DUPLEX_STREAMED`` (each chunk round-trips the picker).
* ``envoy-ai-gateway-buffered`` (the ``aigateway.envoyproxy.io/processing-body-mode: buffered``
  annotation): request and response bodies ``BUFFERED``, so the picker gets the whole response
  once, at its end.
* ``kgateway-v2.0``: request body ``BUFFERED``, response headers and body not sent at all; the
  picker never sees output tokens and can at most settle a request on what admission reserved.

Every flavour removes the client's copies of the tenant, lane and objective headers before any
filter runs (the HttpConnectionManager's ``early_header_mutation_extensions``), which is what each
implementation generates from the early-header policy in its sample (manifests/gateway/): Envoy
Gateway's ClientTrafficPolicy ``headers.earlyRequestHeaders``, kgateway's ListenerPolicy
``earlyRequestHeaderModifier``, an Istio EnvoyFilter. An HTTPRoute ``RequestHeaderModifier``
alone is not enough: Envoy applies it in the router, after the picker's ext_proc filter has read
the headers. ``Wiring.trusted_client_identity`` (tests only) leaves them in.

Every flavour but kgateway 2.0 carries the retry policy its gateway generates from the samples'
HTTPRoute ``retry`` stanza (Istio's also by default). Only an ``override_host`` pool lets a
retry reach another endpoint (``Flavour.retries_elsewhere``): Envoy AI Gateway's FailOpen pool,
its FailClose pool once patched, and Istio's. Behind ``ORIGINAL_DST`` and kgateway's one-address
subset a retry dials the same host again.

None of the gateways sets the ext_proc filter's ``status_on_error`` or a local reply mapper, so
with a fail-closed pool a dead picker is Envoy's bare 500. The ``-patched`` flavours
(``Flavour.patched_by``) apply the gateway-specific patch objects of their sample in
manifests/gateway/, read from the very file a user applies, the way that gateway applies them
(``apply_sample_patches``): an Envoy Gateway ``EnvoyPatchPolicy`` as a JSON Patch on the named
Listener and Cluster, an Istio ``EnvoyFilter`` as a proto merge into the HttpConnectionManager,
a kgateway ``ListenerPolicy``'s ``localReplies`` translated to the HCM's ``local_reply_config``.
Each gives fairway's local reply mapping (``gateway_local_reply_config``: the picker's failure a
503 with an OpenAI body and ``Retry-After``); Envoy AI Gateway's also turns its FailClose pool
cluster into ``override_host`` over the pool's pods, so retries reach another endpoint there too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from picker.stack.envoy import (
    ACCESS_LOG_FORMAT,
    CLIENT_CONTROLLED_HEADERS,
    DESTINATION_HEADER,
    PICKER_UNAVAILABLE_BODY,
    _address,
    _ext_proc,
    early_header_removal,
    local_reply_config,
)

LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
POOL = "llm-pool"
NAMESPACE = "inference"
GATEWAY = "inference-gateway"
"""The samples' Gateway (manifests/gateway/), with its one listener ``http`` on port 80."""
ENVOY_GATEWAY_LISTENER = f"{NAMESPACE}/{GATEWAY}/http"
"""Envoy Gateway's name for that listener's xDS Listener (and RouteConfiguration):
``<namespace>/<gateway>/<listener>``. With ``XDSNameSchemeV2`` (off by default from v1.5, on
from v1.10) it is ``tcp-80``; an EnvoyPatchPolicy must name the one its Envoy Gateway uses."""
POOL_PODS_HOST = f"llm-pool-pods.{NAMESPACE}.svc.cluster.local"
"""The headless Service of the pool's pods (manifests/gateway/envoy-pool-pods.yaml)."""
PICKER_SERVICE = "fairway-picker"
"""The chart's picker Service (release ``fairway``) and port, as an InferencePool names them."""
PICKER_PORT = 9002
HCM_FILTER = "envoy.filters.network.http_connection_manager"
ROUTE_TIMEOUT = "300s"
"""The HTTPRoute's ``timeouts.request`` in manifests/gateway/ (the fair queue holds requests)."""

_TYPE = "type.googleapis.com/"
_HTTP2 = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
    "@type": _TYPE + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
    "explicit_http_config": {"http2_protocol_options": {}}}}
_HTTP1 = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
    "@type": _TYPE + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
    "explicit_http_config": {"http_protocol_options": {}}}}
_UNVERIFIED_TLS = {
    "name": "envoy.transport_sockets.tls",
    "typed_config": {
        "@type": _TYPE + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        # An empty validation context: the gateways encrypt the picker's channel without
        # authenticating the picker (no CA, no SAN match), which is why the picker can serve a
        # self-signed certificate.
        "common_tls_context": {"validation_context": {}},
    },
}


@dataclass(frozen=True)
class Wiring:
    """What a flavour needs to be started: ports and where the processes are."""

    listen_port: int
    admin_port: int
    picker_port: int
    endpoints: list[str]
    """``host:port`` of the model servers (the pool's pods)."""
    picker_tls: bool = True
    """Dial the picker over TLS without verification, as the gateways do; False only for a picker
    started with plaintext ext_proc."""
    access_log: Path | None = None
    client_cert: tuple[Path, Path] | None = None
    """The certificate and key files the gateway presents to the picker (mTLS, the picker's
    ``--client-ca``), as each gateway does once configured for it (docs/gateways.md, "Only the
    gateway speaks ext_proc"); None: none, each gateway's default."""
    trusted_client_identity: bool = False
    """TEST ONLY: keep the client's tenant, lane and objective headers, as if an authenticating
    gateway had written them (the flavour tests send the tenant themselves). Never deploy it."""
    strip_headers: tuple[str, ...] = CLIENT_CONTROLLED_HEADERS
    """What the gateway's early header policy removes: by default the samples' four names
    (manifests/gateway/), a static list; ``picker.config.trusted.check_stripped`` refuses a
    picker config trusting a header outside it."""


@dataclass(frozen=True)
class Flavour:
    """One gateway's way of calling the picker."""

    name: str
    build: Callable[[Wiring], dict[str, Any]]
    meters_responses: bool
    """The picker sees the response body, so it can charge output tokens as they are generated."""
    request_body_mode: str
    response_body_mode: str
    message_timeout: str
    """How long Envoy waits for any one answer from the picker: a request may not wait in the
    fair queue longer (set ``queue.maxWait`` below it, or Envoy answers for the picker)."""
    source: str
    """Where the configuration was read from (repository and file)."""
    retries_elsewhere: bool = False
    """Envoy's retry of a request that never reached an engine can reach another endpoint (the
    picker's fallback): an ``override_host`` pool with a retry policy. ``ORIGINAL_DST`` and
    kgateway's one-address subset send a retry back to the same host."""
    patched_by: str | None = None
    """The sample in manifests/gateway/ whose gateway-specific patch objects (EnvoyPatchPolicy,
    EnvoyFilter, ListenerPolicy ``localReplies``) this flavour applies to its base flavour."""


# --- pieces ------------------------------------------------------------------------------------

def _picker_cluster(name: str, wiring: Wiring, lb_policy: str) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",  # the gateways: STRICT_DNS on <service>.<namespace>.svc
        "connect_timeout": "10s",
        "lb_policy": lb_policy,
        "typed_extension_protocol_options": _HTTP2,
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _address(wiring.picker_port)},
             "health_status": "HEALTHY"}]}]},
    }
    if wiring.picker_tls:
        cluster["transport_socket"] = copy.deepcopy(_UNVERIFIED_TLS)
        if wiring.client_cert is not None:
            cert, key = wiring.client_cert
            cluster["transport_socket"]["typed_config"]["common_tls_context"][
                "tls_certificates"] = [{"certificate_chain": {"filename": str(cert)},
                                        "private_key": {"filename": str(key)}}]
    return cluster


def _endpoint(address: str, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    host, port = address.rsplit(":", 1)
    lb_endpoint: dict[str, Any] = {"endpoint": {"address": {"socket_address": {
        "address": host, "port_value": int(port)}}}}
    if metadata is not None:
        lb_endpoint["metadata"] = {"filter_metadata": metadata}
    return lb_endpoint


def _original_dst_cluster(name: str, connect_timeout: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "ORIGINAL_DST",
        "connect_timeout": connect_timeout,
        "lb_policy": "CLUSTER_PROVIDED",
        "original_dst_lb_config": {"use_http_header": True,
                                   "http_header_name": DESTINATION_HEADER},
    }


def _lb_policy(name: str, message: str, **fields: Any) -> dict[str, Any]:
    return {"policies": [{"typed_extension_config": {
        "name": name, "typed_config": {"@type": _TYPE + message, **fields}}}]}


def _override_host_cluster(name: str, wiring: Wiring, fallback: str,
                           report_served: bool) -> dict[str, Any]:
    """The pool's pods as endpoints; the host is the one the picker's ``envoy.lb`` metadata names
    (primary first, then the fallbacks for retries), else the fallback policy's choice."""
    fallbacks = {
        "least_request": ("envoy.load_balancing_policies.least_request",
                          "envoy.extensions.load_balancing_policies.least_request.v3."
                          "LeastRequest"),
        "round_robin": ("envoy.load_balancing_policies.round_robin",
                        "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"),
    }
    override: dict[str, Any] = {
        "override_host_sources": [{"metadata": {
            "key": LB_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}}],
        "fallback_policy": _lb_policy(*fallbacks[fallback]),
    }
    if report_served:
        # Envoy writes the endpoint it actually chose back into envoy.lb, and the ext_proc filter
        # forwards that namespace on the response: the EPP protocol's "destination endpoint
        # served".
        override["selected_host_key"] = {"key": LB_NAMESPACE, "path": [{"key": SERVED_KEY}]}
    return {
        "name": name,
        "type": "STATIC",  # the gateways: EDS or STRICT_DNS on the pool's (shadow) Service
        "connect_timeout": "10s",
        "load_balancing_policy": _lb_policy(
            "envoy.load_balancing_policies.override_host",
            "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost", **override),
        "load_assignment": {"cluster_name": name, "endpoints": [
            {"lb_endpoints": [_endpoint(a) for a in wiring.endpoints]}]},
    }


_PREVIOUS_HOSTS = [{"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
    "@type": _TYPE + "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}]


def _gateway_api_retry(retry_on: str) -> dict[str, Any]:
    """The HTTPRoute rule's ``retry: {codes: [503], attempts: 2}`` of manifests/gateway/, as
    Envoy Gateway and Istio turn it into Envoy's retry policy: their connection-failure
    triggers plus the codes, each retry on a host not tried yet."""
    return {"retry_on": retry_on, "retriable_status_codes": [503], "num_retries": 2,
            "retry_host_predicate": _PREVIOUS_HOSTS, "host_selection_retry_max_attempts": 5}


ENVOY_GATEWAY_RETRY = _gateway_api_retry(
    "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes")
"""Envoy Gateway (``buildRetryPolicy``, internal/xds/translator/route.go): its default triggers,
the route's codes and attempts, ``previous_hosts``, 5 host selections."""
ISTIO_RETRY = _gateway_api_retry(
    "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes")
"""Istio (its route retry package: ``DefaultPolicy``, ``ConvertPolicy``): the same triggers as
its default policy, which it applies to every route even without a ``retry`` stanza."""
ENVOY_GATEWAY_MAX_PARALLEL_RETRIES = 1024
"""manifests/gateway/envoy-ai-gateway.yaml's BackendTrafficPolicy ``maxParallelRetries``; Envoy
Gateway's other circuit-breaker thresholds at their 1024 defaults."""
_ISTIO_UNLIMITED = 4294967295
KGATEWAY_RETRY = {"retry_on": "gateway-error,connect-failure,reset,retriable-status-codes",
                  "retriable_status_codes": [503], "num_retries": 2}
"""kgateway, reconstructed from its retry guide's config dump (no source read): gateway errors,
connect failures and any reset, no host predicate."""


def _bootstrap(wiring: Wiring, http_filters: list[dict[str, Any]], route: dict[str, Any],
               clusters: list[dict[str, Any]], path_options: dict[str, Any],
               listener_name: str = "gateway", default_chain: bool = False) -> dict[str, Any]:
    """``listener_name`` and ``default_chain``: the gateway's own name for the listener and
    whether its HttpConnectionManager sits in the listener's ``default_filter_chain`` (Envoy
    Gateway, for a plain HTTP listener) rather than in ``filter_chains[0]``: a patch names and
    addresses the listener that way."""
    access_log = [] if wiring.access_log is None else [{
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": _TYPE + "envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": str(wiring.access_log),
            "log_format": {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}},
        },
    }]
    http_filters = [*http_filters, {
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": _TYPE + "envoy.extensions.filters.http.router.v3.Router"},
    }]
    chain = {"filters": [{
        "name": HCM_FILTER,
        "typed_config": {
            "@type": _TYPE + "envoy.extensions.filters.network."
                             "http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "gateway",
            "access_log": access_log,
            **path_options,
            **({} if wiring.trusted_client_identity else
               {"early_header_mutation_extensions":
                early_header_removal(wiring.strip_headers)}),
            "route_config": {"virtual_hosts": [{
                "name": "inference", "domains": ["*"], "routes": [route]}]},
            "http_filters": http_filters,
        },
    }]}
    listener: dict[str, Any] = {"name": listener_name, "address": _address(wiring.listen_port)}
    if default_chain:
        listener["default_filter_chain"] = chain
    else:
        listener["filter_chains"] = [chain]
    return {
        "admin": {"address": _address(wiring.admin_port)},
        "static_resources": {"listeners": [listener], "clusters": clusters},
    }


def http_connection_manager(config: dict[str, Any]) -> dict[str, Any]:
    """The typed config of a flavour's HttpConnectionManager (in either chain form)."""
    (listener,) = config["static_resources"]["listeners"]
    chain = listener.get("default_filter_chain") or listener["filter_chains"][0]
    (manager,) = [f for f in chain["filters"] if f["name"] == HCM_FILTER]
    return manager["typed_config"]


def _route(cluster: str, action: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """The HTTPRoute's rule: ``/v1`` to the pool, with its request timeout."""
    return {"match": {"prefix": "/v1"},
            "route": {"cluster": cluster, "timeout": ROUTE_TIMEOUT, **(action or {})},
            **extra}


def _processing_mode(request_body: str, response_body: str, response_headers: str,
                     trailers: str) -> dict[str, str]:
    return {"request_header_mode": "SEND", "request_body_mode": request_body,
            "request_trailer_mode": trailers, "response_header_mode": response_headers,
            "response_body_mode": response_body, "response_trailer_mode": trailers}


# --- Envoy AI Gateway (Envoy Gateway + the AI Gateway extension server) -------------------------

def envoy_ai_gateway(wiring: Wiring, body_mode: str = "duplex", fail_open: bool = False,
                     allow_mode_override: bool = False) -> dict[str, Any]:
    """An HTTPRoute (or AIGatewayRoute) to an InferencePool, as the AI Gateway extension server
    patches Envoy Gateway's output.

    ``body_mode``: the pool's ``aigateway.envoyproxy.io/processing-body-mode`` annotation,
    ``duplex`` (default) or ``buffered``; it sets the request and the response body mode.
    ``fail_open``: ``endpointPickerRef.failureMode: FailOpen``, which switches the pool's cluster
    from ``ORIGINAL_DST`` to ``override_host`` on the picker's metadata with a least-request
    fallback. ``allow_mode_override``: the ``aigateway.envoyproxy.io/allow-mode-override``
    annotation.
    """
    if body_mode not in ("duplex", "buffered"):
        raise ValueError(f"body_mode must be duplex or buffered, got {body_mode!r}")
    mode = "FULL_DUPLEX_STREAMED" if body_mode == "duplex" else "BUFFERED"
    picker_cluster = f"envoy.clusters.endpointpicker_{POOL}_{NAMESPACE}_ext_proc"
    ext_proc = _ext_proc(
        {"envoy_grpc": {"cluster_name": picker_cluster,
                        "authority": f"{PICKER_SERVICE}.{NAMESPACE}.svc:{PICKER_PORT}"}},
        processing_mode=_processing_mode(mode, mode, "SEND", "SEND"),
        allow_mode_override=allow_mode_override,
        message_timeout="300s",
        failure_mode_allow=fail_open,
    )
    if fail_open:
        # Only a FailOpen pool receives envoy.lb: its override_host cluster reads the choice from
        # there. A FailClose pool routes on the header alone.
        ext_proc["metadata_options"] = {"receiving_namespaces": {"untyped": [LB_NAMESPACE]}}
    pool_cluster_name = f"httproute/{NAMESPACE}/llm-route/rule/0"
    if fail_open:
        pool_cluster = _override_host_cluster(pool_cluster_name, wiring, "least_request",
                                              report_served=False)
        pool_cluster["outlier_detection"] = {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 3,
            "enforcing_consecutive_local_origin_failure": 100,
            "enforcing_consecutive_gateway_failure": 0, "enforcing_consecutive_5xx": 0,
            "enforcing_success_rate": 0, "base_ejection_time": "30s",
            "max_ejection_percent": 50}
    else:
        pool_cluster = _original_dst_cluster(pool_cluster_name, "10s")
    # The sample's BackendTrafficPolicy circuitBreaker.maxParallelRetries: Envoy's default of 3
    # parallel retries turns a dead pod under load into 503s (UO), retryable or not.
    pool_cluster["circuit_breakers"] = {"thresholds": [{
        "max_connections": 1024, "max_pending_requests": 1024, "max_requests": 1024,
        "max_retries": ENVOY_GATEWAY_MAX_PARALLEL_RETRIES}]}
    pool_cluster["typed_extension_protocol_options"] = _HTTP1  # spec.appProtocol: http
    filter_name = f"envoy.filters.http.ext_proc/endpointpicker/{POOL}_{NAMESPACE}_ext_proc"
    return _bootstrap(
        wiring, [{"name": filter_name, "typed_config": ext_proc}],
        _route(pool_cluster_name, {"retry_policy": ENVOY_GATEWAY_RETRY}),
        [_picker_cluster(picker_cluster, wiring, "LEAST_REQUEST"), pool_cluster],
        # Envoy Gateway's listener defaults (ClientTrafficPolicy path settings).
        {"normalize_path": True, "merge_slashes": True,
         "path_with_escaped_slashes_action": "UNESCAPE_AND_REDIRECT"},
        # Envoy Gateway names the xDS Listener after the Gateway's listener and, for plain HTTP,
        # puts the HttpConnectionManager in its default filter chain (the EnvoyPatchPolicy guide
        # patches /default_filter_chain/filters/0/typed_config).
        listener_name=ENVOY_GATEWAY_LISTENER, default_chain=True)


# --- kgateway --------------------------------------------------------------------------------

def kgateway(wiring: Wiring) -> dict[str, Any]:
    """kgateway's inference extension (``endpointpicker`` plugin) in its duplex form: one static
    ext_proc filter before the authentication stage, re-pointed per route at the pool's picker;
    the destination header copied into ``envoy.lb`` by a header_to_metadata filter; the pool a
    static cluster whose endpoints carry their own address under ``envoy.lb`` for subset
    load balancing."""
    filter_name = "envoy.filters.http.ext_proc"
    picker_cluster = f"endpointpicker_{POOL}_{NAMESPACE}_ext_proc"
    authority = f"{PICKER_SERVICE}.{NAMESPACE}.svc:{PICKER_PORT}"
    ext_proc = _ext_proc(
        {"envoy_grpc": {"cluster_name": picker_cluster, "authority": authority}},
        processing_mode=_processing_mode("FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED", "SEND",
                                         "SEND"),
        message_timeout="5s",
        failure_mode_allow=False,
        metadata_options={"forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE]},
                          "receiving_namespaces": {"untyped": [LB_NAMESPACE]}},
    )
    header_to_metadata = {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": _TYPE + "envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "request_rules": [{"header": DESTINATION_HEADER, "remove": False,
                               "on_header_present": {"metadata_namespace": LB_NAMESPACE,
                                                     "key": DESTINATION_HEADER,
                                                     "type": "STRING"}}],
        },
    }
    pool_cluster_name = f"endpoint-picker_{POOL}_{NAMESPACE}"
    pool_cluster = {
        "name": pool_cluster_name,
        "type": "STATIC",
        "connect_timeout": "1000s",
        "lb_policy": "ROUND_ROBIN",
        # processPoolBackendObjIR (endpointpicker/backends.go): one subset per endpoint, keyed by
        # its own address; a value naming no endpoint (a list, an unknown pod) falls back to any.
        "lb_subset_config": {
            "subset_selectors": [{"keys": [DESTINATION_HEADER]}],
            "fallback_policy": "ANY_ENDPOINT",
        },
        "circuit_breakers": {"thresholds": [{"max_connections": 40000,
                                             "max_pending_requests": 40000,
                                             "max_requests": 40000}]},
        "load_assignment": {"cluster_name": pool_cluster_name, "endpoints": [{"lb_endpoints": [
            _endpoint(a, {LB_NAMESPACE: {DESTINATION_HEADER: a}}) for a in wiring.endpoints]}]},
    }
    route = _route(
        pool_cluster_name,
        action={"metadata_match": {"filter_metadata": {
            SUBSET_NAMESPACE: {SUBSET_KEY: list(wiring.endpoints)}}},
            "retry_policy": KGATEWAY_RETRY},
        typed_per_filter_config={filter_name: {
            "@type": _TYPE + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "overrides": {"failure_mode_allow": False, "grpc_service": {
                "timeout": "10s",
                "envoy_grpc": {"cluster_name": picker_cluster, "authority": authority}}},
        }})
    return _bootstrap(
        wiring, [{"name": filter_name, "typed_config": ext_proc}, header_to_metadata], route,
        [_picker_cluster(picker_cluster, wiring, "LEAST_REQUEST"), pool_cluster],
        {})  # kgateway leaves Envoy's path defaults: no normalisation


def kgateway_v2_0(wiring: Wiring) -> dict[str, Any]:
    """kgateway 2.0's first inference plugin: one ext_proc filter per pool with a ``BUFFERED``
    request body and no response processing at all, and an ``ORIGINAL_DST`` cluster on the
    destination header."""
    picker_cluster = f"endpointpicker_{POOL}_{NAMESPACE}_ext_proc"
    authority = f"{PICKER_SERVICE}.{NAMESPACE}:{PICKER_PORT}"
    filter_name = f"envoy.filters.http.ext_proc_{NAMESPACE}_{POOL}"
    ext_proc = _ext_proc(
        {"envoy_grpc": {"cluster_name": picker_cluster, "authority": authority}},
        processing_mode={"request_header_mode": "SEND", "request_body_mode": "BUFFERED",
                         "response_header_mode": "SKIP", "request_trailer_mode": "SKIP",
                         "response_trailer_mode": "SKIP"},
        message_timeout="5s",
        failure_mode_allow=False,
    )
    pool_cluster_name = f"endpointpicker_{POOL}_{NAMESPACE}_original_dst"
    pool_cluster = _original_dst_cluster(pool_cluster_name, "1000s")
    pool_cluster["circuit_breakers"] = {"thresholds": [{
        "max_connections": 40000, "max_pending_requests": 40000, "max_requests": 40000}]}
    route = _route(pool_cluster_name, typed_per_filter_config={filter_name: {
        "@type": _TYPE + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
        "overrides": {"grpc_service": {
            "timeout": "10s",
            "envoy_grpc": {"cluster_name": picker_cluster,
                           "authority": f"{PICKER_SERVICE}.{NAMESPACE}.svc:{PICKER_PORT}"}}},
    }})
    return _bootstrap(
        wiring, [{"name": filter_name, "typed_config": ext_proc}], route,
        [_picker_cluster(picker_cluster, wiring, "LEAST_REQUEST"), pool_cluster], {})


# --- Istio -------------------------------------------------------------------------------------

def istio(wiring: Wiring, fail_open: bool = False) -> dict[str, Any]:
    """Istio's gateway (pilot with ``ENABLE_GATEWAY_API_INFERENCE_EXTENSION``): one ext_proc
    filter per listener, duplex both ways, ``envoy.lb`` forwarded and received; the pool's shadow
    Service cluster load-balanced by ``override_host`` on the picker's metadata, reporting the
    endpoint that served in ``envoy.lb``; TLS to the picker from the DestinationRule the
    inference extension's guide asks for (``SIMPLE``, ``insecureSkipVerify``)."""
    picker_cluster = f"outbound|{PICKER_PORT}||{PICKER_SERVICE}.{NAMESPACE}.svc.cluster.local"
    ext_proc = _ext_proc(
        {"envoy_grpc": {"cluster_name": picker_cluster}, "timeout": "10s"},
        failure_mode_allow=fail_open,
        processing_mode=_processing_mode("FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED", "SEND",
                                         "SEND"),
        message_timeout="1000s",
        metadata_options={"receiving_namespaces": {"untyped": [LB_NAMESPACE]},
                          "forwarding_namespaces": {"untyped": [LB_NAMESPACE]}},
    )
    pool_cluster_name = f"outbound|80||{POOL}-ip-00000000.{NAMESPACE}.svc.cluster.local"
    pool_cluster = _override_host_cluster(pool_cluster_name, wiring, "round_robin",
                                          report_served=True)
    pool_cluster["lb_policy"] = "CLUSTER_PROVIDED"
    # Istio's default thresholds (no DestinationRule connectionPool): nothing bounded, so its
    # default retries never overflow.
    pool_cluster["circuit_breakers"] = {"thresholds": [{
        "max_connections": _ISTIO_UNLIMITED, "max_pending_requests": _ISTIO_UNLIMITED,
        "max_requests": _ISTIO_UNLIMITED, "max_retries": _ISTIO_UNLIMITED,
        "track_remaining": True}]}
    return _bootstrap(
        wiring, [{"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc}],
        _route(pool_cluster_name, {"retry_policy": ISTIO_RETRY}),
        [_picker_cluster(picker_cluster, wiring, "LEAST_REQUEST"), pool_cluster],
        # Istio's default path normalisation ("BASE"): RFC 3986 only.
        {"normalize_path": True})


# --- the samples' patches: what a user adds to each gateway, applied as that gateway applies it --

SAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "gateway"
"""The Kubernetes samples a user applies; the ``-patched`` flavours read their patch objects."""


def _cel(expression: str) -> dict[str, Any]:
    return {"extension_filter": {
        "name": "envoy.access_loggers.extension_filters.cel",
        "typed_config": {
            "@type": _TYPE + "envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
            "expression": expression}}}


EXT_PROC_FAILURE_EXPRESSION = ("response.code == 500 && "
                               "response.code_details.startsWith('ext_proc_error')")
"""A local reply of the ext_proc filter itself: its stream to the picker failed (refused, reset,
timed out; details ``ext_proc_error_gRPC_error_<code>{...}``) and, fail-closed, it answered with
``status_on_error``, whose default is 500. The picker's own refusals carry ``fairway_`` details
and an upstream's 500 is no local reply, so neither matches."""

EXT_PROC_FAILURE_MAPPER: dict[str, Any] = {
    "filter": _cel(EXT_PROC_FAILURE_EXPRESSION),
    # What status_on_error 503 gives fairway's own configs: a dead picker is retryable.
    "status_code": 503,
    "headers_to_add": [{"header": {"key": "retry-after", "value": "1"},
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
    "body_format_override": {"json_format": PICKER_UNAVAILABLE_BODY,
                             "content_type": "application/json"},
}
"""For a gateway whose ext_proc filter cannot be given ``status_on_error`` (Envoy AI Gateway
inserts it after every patch; kgateway has no API for it): the mapper rewrites its 500."""


def gateway_local_reply_config() -> dict[str, Any]:
    """The HttpConnectionManager ``local_reply_config`` every sample adds to its gateway:
    fairway's own (``picker.stack.envoy.local_reply_config``: a request that never reached an
    engine, a picker the stream could not reach at 503), preceded by ``EXT_PROC_FAILURE_MAPPER``
    for the 500 an ext_proc filter without ``status_on_error`` answers. Envoy applies the first
    mapper whose filter matches, testing the original status."""
    return {"mappers": [copy.deepcopy(EXT_PROC_FAILURE_MAPPER),
                        *local_reply_config()["mappers"]]}


def sample_documents(name: str) -> list[dict[str, Any]]:
    """The objects of manifests/gateway/<name>."""
    return [d for d in yaml.safe_load_all((SAMPLES / name).read_text(encoding="utf-8")) if d]


# JSON Patch (RFC 6902), as Envoy Gateway applies an EnvoyPatchPolicy's operations (evanphx
# json-patch v5 with EnsurePathExistsOnAdd, internal/xds/translator/jsonpatch.go): one operation
# at a time on one resource, in its protojson form with proto field names.

def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ValueError(f"JSON pointer must start with '/': {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _step(node: Any, token: str, create: bool) -> Any:
    if isinstance(node, list):
        return node[int(token)]
    if token not in node:
        if not create:
            raise KeyError(token)
        node[token] = {}
    return node[token]


def apply_json_patch(document: dict[str, Any], operation: dict[str, Any]) -> None:
    """Apply one RFC 6902 operation (``add``, ``remove``, ``replace``, ``test``) in place.
    ``add`` creates missing parent objects (Envoy Gateway's ``EnsurePathExistsOnAdd``) and, on
    an existing member, replaces it; ``remove`` and ``replace`` need the member to exist."""
    op, tokens = operation["op"], _pointer(operation["path"])
    if not tokens:
        raise ValueError("an operation on the whole resource is not a patch of it")
    parent: Any = document
    for token in tokens[:-1]:
        parent = _step(parent, token, create=op == "add")
    last = tokens[-1]
    if op == "test":
        if _step(parent, last, create=False) != operation["value"]:
            raise ValueError(f"test failed at {operation['path']}")
    elif op == "remove":
        if isinstance(parent, list):
            del parent[int(last)]
        else:
            del parent[last]  # KeyError when absent, as RFC 6902 requires
    elif op in ("add", "replace"):
        value = copy.deepcopy(operation["value"])
        if isinstance(parent, list):
            if op == "add":
                parent.insert(len(parent) if last == "-" else int(last), value)
            else:
                parent[int(last)] = value
        else:
            if op == "replace" and last not in parent:
                raise KeyError(last)
            parent[last] = value
    else:
        raise ValueError(f"unsupported JSON Patch operation {op!r}")


_XDS_KINDS = {_TYPE + "envoy.config.listener.v3.Listener": "listeners",
              _TYPE + "envoy.config.cluster.v3.Cluster": "clusters"}


def patch_target(config: dict[str, Any], xds_type: str, name: str) -> dict[str, Any]:
    """The bootstrap resource an EnvoyPatchPolicy's ``jsonPatches[]`` entry names (its ``type``
    and ``name``); KeyError when the flavour has no such resource, as Envoy Gateway reports
    ``ResourceNotFound``."""
    for resource in config["static_resources"][_XDS_KINDS[xds_type]]:
        if resource["name"] == name:
            return resource
    raise KeyError(f"no {xds_type} named {name!r}")


def _apply_envoy_patch_policies(config: dict[str, Any], documents: list[dict[str, Any]],
                                wiring: Wiring) -> None:
    for policy in documents:
        if policy["kind"] != "EnvoyPatchPolicy":
            continue
        if policy["spec"]["type"] != "JSONPatch":
            raise ValueError(f"{policy['metadata']['name']}: only JSONPatch is modelled")
        for patch in policy["spec"]["jsonPatches"]:
            apply_json_patch(patch_target(config, patch["type"], patch["name"]),
                             patch["operation"])
    # The pool's pods are named by their headless Service's DNS name; here they are the started
    # servers, each an address literal the STRICT_DNS cluster resolves to itself (on 127.0.0.1
    # the servers differ by port, not by IP).
    for cluster in config["static_resources"]["clusters"]:
        groups = cluster.get("load_assignment", {}).get("endpoints", [])
        named = [e["endpoint"]["address"]["socket_address"]["address"]
                 for g in groups for e in g.get("lb_endpoints", [])]
        if POOL_PODS_HOST in named:
            cluster["load_assignment"]["endpoints"] = [
                {"lb_endpoints": [_endpoint(a) for a in wiring.endpoints]}]


def proto_merge(base: dict[str, Any], patch: dict[str, Any]) -> None:
    """Protobuf merge semantics (Istio's EnvoyFilter ``MERGE``): messages merged field by field,
    repeated fields appended, scalars replaced."""
    for key, value in patch.items():
        if key == "@type":
            if base.get(key, value) != value:
                raise ValueError(f"cannot merge {value} into {base[key]}")
            base[key] = value
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            proto_merge(base[key], value)
        elif isinstance(value, list) and isinstance(base.get(key), list):
            base[key].extend(copy.deepcopy(value))
        else:
            base[key] = copy.deepcopy(value)


def _apply_istio_envoy_filters(config: dict[str, Any], documents: list[dict[str, Any]],
                               wiring: Wiring) -> None:
    for envoy_filter in documents:
        if envoy_filter["kind"] != "EnvoyFilter":
            continue
        for patch in envoy_filter["spec"]["configPatches"]:
            match = patch["match"]
            if (patch["applyTo"], match["context"], patch["patch"]["operation"],
                    match["listener"]["filterChain"]["filter"]["name"]) != \
                    ("NETWORK_FILTER", "GATEWAY", "MERGE", HCM_FILTER):
                raise ValueError(f"only a MERGE into the gateway's {HCM_FILTER} is modelled")
            value = copy.deepcopy(patch["patch"]["value"]["typed_config"])
            # The early header removal of this patch is already the flavour's own
            # (``_bootstrap``: every flavour models its sample's early removal, and
            # ``Wiring.trusted_client_identity`` leaves it out for the tests).
            value.pop("early_header_mutation_extensions", None)
            proto_merge(http_connection_manager(config), value)


def kgateway_local_replies(local_replies: dict[str, Any]) -> dict[str, Any]:
    """A kgateway ListenerPolicy's ``httpSettings.localReplies`` as the HCM's
    ``local_reply_config``, the way kgateway translates it (``translateLocalReplyBodyMapper``,
    pkg/kgateway/extensions2/plugins/listenerpolicy/local_reply_converter.go): ``filter`` as
    its access-log filter (``celFilter.match`` a CEL expression filter), ``statusCode``,
    ``headers.set`` (a Gateway API header filter: overwrite) and ``bodyFormatOverride.json``.
    Only the fields the sample uses; the body's content type is Envoy's default for a JSON
    format, ``application/json``."""
    mappers = []
    for mapper in local_replies.get("mappers", []):
        (kind, spec), = mapper["filter"].items()
        if kind != "celFilter":
            raise ValueError(f"filter {kind} is not modelled here")
        envoy: dict[str, Any] = {"filter": _cel(spec["match"])}
        if "statusCode" in mapper:
            envoy["status_code"] = mapper["statusCode"]
        if "headers" in mapper:
            envoy["headers_to_add"] = [
                {"header": {"key": h["name"], "value": h["value"]},
                 "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
                for h in mapper["headers"].get("set", [])]
        if "bodyFormatOverride" in mapper:
            envoy["body_format_override"] = {
                "json_format": copy.deepcopy(mapper["bodyFormatOverride"]["json"])}
        mappers.append(envoy)
    return {"mappers": mappers}


def _apply_kgateway_listener_policies(config: dict[str, Any], documents: list[dict[str, Any]],
                                      wiring: Wiring) -> None:
    for policy in documents:
        if policy["kind"] != "ListenerPolicy":
            continue
        settings = policy["spec"]["default"]["httpSettings"]
        # earlyRequestHeaderModifier is the flavour's own early removal (``_bootstrap``).
        if "localReplies" in settings:
            http_connection_manager(config)["local_reply_config"] = \
                kgateway_local_replies(settings["localReplies"])


_APPLY = {"envoy-ai-gateway.yaml": _apply_envoy_patch_policies,
          "istio.yaml": _apply_istio_envoy_filters,
          "kgateway.yaml": _apply_kgateway_listener_policies}


def apply_sample_patches(sample: str, config: dict[str, Any], wiring: Wiring) -> dict[str, Any]:
    """``config`` (a flavour's bootstrap) with the gateway-specific patch objects of
    manifests/gateway/<sample> applied as that gateway applies them."""
    _APPLY[sample](config, sample_documents(sample), wiring)
    return config


def _patched(sample: str, build: Callable[[Wiring], dict[str, Any]]
             ) -> Callable[[Wiring], dict[str, Any]]:
    return lambda wiring: apply_sample_patches(sample, build(wiring), wiring)


FLAVOURS: dict[str, Flavour] = {f.name: f for f in (
    Flavour("envoy-ai-gateway", envoy_ai_gateway, True, "FULL_DUPLEX_STREAMED",
            "FULL_DUPLEX_STREAMED", "300s",
            "envoyproxy/ai-gateway internal/extensionserver/inferencepool.go, "
            "post_cluster_modify.go"),
    Flavour("envoy-ai-gateway-buffered",
            lambda w: envoy_ai_gateway(w, body_mode="buffered"), True, "BUFFERED", "BUFFERED",
            "300s", "envoyproxy/ai-gateway internal/extensionserver/inferencepool.go "
                    "(processing-body-mode annotation)"),
    Flavour("envoy-ai-gateway-fail-open", lambda w: envoy_ai_gateway(w, fail_open=True), True,
            "FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED", "300s",
            "envoyproxy/ai-gateway internal/extensionserver/post_cluster_modify.go "
            "(configureFallbackClusterForInferencePool)", retries_elsewhere=True),
    Flavour("kgateway", kgateway, True, "FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED", "5s",
            "kgateway-dev/kgateway internal/kgateway/extensions2/plugins/inferenceextension/"
            "endpointpicker/plugin.go"),
    Flavour("kgateway-v2.0", kgateway_v2_0, False, "BUFFERED", "NONE", "5s",
            "kgateway-dev/kgateway internal/kgateway/extensions2/plugins/inferenceextension/"
            "endpointpicker/plugin.go (2.0)"),
    Flavour("istio", istio, True, "FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED", "1000s",
            "istio/istio pilot/pkg/xds/filters/filters.go (BuildInferencePoolExtProcFilter), "
            "cluster_builder.go (override_host)", retries_elsewhere=True),
    # The base flavours with their sample's patch objects (manifests/gateway/).
    Flavour("envoy-ai-gateway-patched", _patched("envoy-ai-gateway.yaml", envoy_ai_gateway),
            True, "FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED", "300s",
            "envoy-ai-gateway + the sample's EnvoyPatchPolicies (envoyproxy/gateway "
            "internal/xds/translator/jsonpatch.go)", retries_elsewhere=True,
            patched_by="envoy-ai-gateway.yaml"),
    Flavour("kgateway-patched", _patched("kgateway.yaml", kgateway), True,
            "FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED", "5s",
            "kgateway + the sample's ListenerPolicy localReplies (kgateway-dev/kgateway "
            "listenerpolicy/local_reply_converter.go)", patched_by="kgateway.yaml"),
    Flavour("istio-patched", _patched("istio.yaml", istio), True, "FULL_DUPLEX_STREAMED",
            "FULL_DUPLEX_STREAMED", "1000s",
            "istio + the sample's EnvoyFilter (MERGE into the gateway's HCM)",
            retries_elsewhere=True, patched_by="istio.yaml"),
)}


def gateway_config(flavour: str, wiring: Wiring) -> dict[str, Any]:
    """The bootstrap of the named flavour (one of ``FLAVOURS``)."""
    if flavour not in FLAVOURS:
        raise ValueError(f"unknown gateway flavour {flavour!r}; one of {sorted(FLAVOURS)}")
    return FLAVOURS[flavour].build(wiring)
