"""Dialling the picker's ext_proc port as the gateways do: TLS, the certificate not verified.

gRPC clients always verify, so "not verified" is done by trusting exactly the certificate the
server presents (fetched first, off the event loop: the picker under test may share the loop).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import yaml

from picker.stack.envoy import GATEWAY_NAME, with_client_cert
from picker.tls import KeyPair, certificate_authority, issue, unverified_channel_credentials


async def tls_credentials(port: int, host: str = "127.0.0.1",
                          client: KeyPair | None = None) -> grpc.ChannelCredentials:
    return await asyncio.to_thread(unverified_channel_credentials, host, port, 5.0, client)


def gateway_pair(cert: Path, key: Path) -> KeyPair:
    """The gateway's client certificate (``Stack.gateway_client_cert``) as a ``KeyPair``."""
    return KeyPair(cert.read_bytes(), key.read_bytes(), None)  # type: ignore[arg-type]


def sample_with_client_cert(sample: Path, workdir: Path) -> Path:
    """An Envoy bootstrap of manifests/gateway/ written into ``workdir`` with the client
    certificate it mounts (``GATEWAY_CERT``, absent here) replaced by one made here: Envoy loads
    the files at start, and ``--mode validate`` too."""
    cert, key = issue(certificate_authority(), [GATEWAY_NAME]).write(
        workdir, "gateway.crt", "gateway.key")
    config = with_client_cert(yaml.safe_load(sample.read_text()), cert, key)
    out = workdir / sample.name
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out


async def tls_channel(port: int, host: str = "127.0.0.1",
                      client: KeyPair | None = None) -> grpc.aio.Channel:
    """An aio channel to ``host:port`` over TLS (``async with await tls_channel(port)``);
    ``client``: the certificate to present (a picker run with ``--client-ca`` needs one)."""
    return grpc.aio.secure_channel(f"{host}:{port}", await tls_credentials(port, host, client))
