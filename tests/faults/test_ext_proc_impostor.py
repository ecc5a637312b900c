"""The impostor on the ext_proc port: an ext_proc client of our own, from inside the network,
naming tenant ``victim`` in header mode and feeding back a response that never came from a model
(30,000 output tokens), as the attack that had ``victim`` charged 30,012 tokens did.

Behind the stack's Envoy, whose client certificate the picker requires (``--client-ca``, the
default stack): the impostor dialling TLS without a certificate, with one of another CA naming
the gateway, or with one of the right CA under another name, never gets a stream; ``victim`` is
charged nothing and has no metering record, while the gateway's own requests are served and
metered. The same impostor against a picker run in the explicit development mode
(``--client-auth=trust-network``) does charge ``victim``: the attack is real, and this test is
what tells the two apart.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from picker.stack.envoy import GATEWAY_NAME
from picker.stack.launcher import Stack
from picker.tls import KeyPair, certificate_authority, issue, unverified_channel_credentials
from tests.e2e.conftest import metric, wait_until
from tests.faults.helpers import post, usage_records
from tests.integration.test_extproc_contract import (
    TENANT_HEADER,
    Stream,
    chat_body,
    relay_response,
    route,
)

pytestmark = pytest.mark.faults

USAGE = "usage.jsonl"
FORGED = json.dumps({"usage": {"prompt_tokens": 12, "completion_tokens": 30_000}}).encode()


def _stack(workdir: Path, client_auth: str | None) -> Stack:
    config = {"tenants": [{"id": "victim"}, {"id": "gateway-user"}],
              "metering": {"output": str(workdir / USAGE)}}
    return Stack(workdir, endpoints=1, picker_config=config, client_auth=client_auth)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with _stack(tmp_path_factory.mktemp("impostor"), None) as running:
        assert running.picker_client_auth == "mtls"
        yield running


async def _impersonate(port: int, client: KeyPair | None) -> grpc.StatusCode | None:
    """Route a request as ``victim`` and answer it with a forged usage; None when the whole
    exchange went through, else what the picker says to this peer.

    That status is read from a second stream that writes nothing: the picker refuses a stream
    before reading a message, and a client write racing that refusal reaches the client as
    INTERNAL ("Internal error from Core") now and then, whatever the picker sent."""
    credentials = await asyncio.to_thread(unverified_channel_credentials, "127.0.0.1", port,
                                          5.0, client)
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        stream = Stream(stub)
        try:
            await route(stream, chat_body(max_tokens=30_000),
                        headers={TENANT_HEADER: "victim"})
            await relay_response(stream, 200, "application/json", [FORGED])
        except (AssertionError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await stream.close()
            probe = stub.Process()
            try:
                await asyncio.wait_for(probe.read(), 15)
            except grpc.aio.AioRpcError as refused:
                return refused.code()
            raise AssertionError("the picker answered a stream it refused before") from None
        await stream.close()
        return None


def _charged(stack: Stack, tenant: str) -> float:
    return metric(stack.metrics_url, "fairway_weighted_service_total", tenant=tenant)


def test_an_impostor_on_the_ext_proc_port_charges_nobody(guarded: Stack) -> None:
    ca = certificate_authority("impostor-ca")
    own_ca = KeyPair((guarded.tls_dir / "ca.crt").read_bytes(),
                     (guarded.tls_dir / "ca.key").read_bytes(), None)  # type: ignore[arg-type]
    attempts = {"no certificate": None,
                "another CA, the gateway's name": issue(ca, [GATEWAY_NAME]),
                "the gateway CA, another name": issue(own_ca, ["impostor"])}
    codes = {what: asyncio.run(_impersonate(guarded.grpc_port, client))
             for what, client in attempts.items()}
    assert codes == {"no certificate": grpc.StatusCode.UNAVAILABLE,
                     "another CA, the gateway's name": grpc.StatusCode.UNAVAILABLE,
                     "the gateway CA, another name": grpc.StatusCode.PERMISSION_DENIED}

    # The gateway itself is served and metered: the records below would show a charge.
    status, _, answer = post(guarded, "gateway-user", chat_body(max_tokens=8))
    assert status == 200, answer
    usage = guarded.workdir / USAGE
    assert wait_until(lambda: len(usage_records(usage, "gateway-user")) == 1)
    assert usage_records(usage, "victim") == []
    assert _charged(guarded, "victim") == 0
    assert metric(guarded.metrics_url, "fairway_requests_total", tenant="victim") == 0


def test_without_client_authentication_the_same_impostor_charges_victim(
        tmp_path: Path) -> None:
    """The attack reproduced where it still works: the development mode, said explicitly."""
    with _stack(tmp_path, "trust-network") as open_stack:
        assert asyncio.run(_impersonate(open_stack.grpc_port, None)) is None
        usage = open_stack.workdir / USAGE
        assert wait_until(lambda: len(usage_records(usage, "victim")) == 1)
        (record,) = usage_records(usage, "victim")
        assert record["prompt_tokens"] + record["completion_tokens"] == 30_012  # the issue's
        assert _charged(open_stack, "victim") > 0
