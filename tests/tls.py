"""Dialling the picker's ext_proc port as the gateways do: TLS, the certificate not verified.

gRPC clients always verify, so "not verified" is done by trusting exactly the certificate the
server presents (fetched first, off the event loop: the picker under test may share the loop).
"""

from __future__ import annotations

import asyncio

import grpc

from picker.tls import unverified_channel_credentials


async def tls_credentials(port: int, host: str = "127.0.0.1") -> grpc.ChannelCredentials:
    return await asyncio.to_thread(unverified_channel_credentials, host, port)


async def tls_channel(port: int, host: str = "127.0.0.1") -> grpc.aio.Channel:
    """An aio channel to ``host:port`` over TLS (``async with await tls_channel(port)``)."""
    return grpc.aio.secure_channel(f"{host}:{port}", await tls_credentials(port, host))
