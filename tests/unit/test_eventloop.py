"""The event loop a picker process runs on, and the settings that name it."""

from __future__ import annotations

import asyncio
import warnings
from pathlib import Path

import pytest
import uvloop

from picker import eventloop
from picker.server import ServeSettings


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_the_default_loop_is_uvloops_and_asyncio_is_the_standard_librarys() -> None:
    assert eventloop.DEFAULT_EVENT_LOOP == "uvloop"
    assert eventloop.run(_loop_type()) is uvloop.Loop
    assert not issubclass(eventloop.run(_loop_type(), "asyncio"), uvloop.Loop)


def test_an_unknown_loop_is_refused_and_its_coroutine_closed_not_left_unawaited() -> None:
    main = _loop_type()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine was never awaited" would be one
        with pytest.raises(ValueError, match="'trio' is not one of uvloop, asyncio"):
            eventloop.run(main, "trio")
    assert main.cr_frame is None  # closed


def test_settings_refuse_an_unknown_loop_and_a_certificate_without_tls() -> None:
    with pytest.raises(ValueError, match="--event-loop must be one of uvloop, asyncio"):
        ServeSettings(event_loop="trio")
    with pytest.raises(ValueError, match="--cert-path needs --secure-serving"):
        ServeSettings(cert_path=Path("/certs"), secure_serving=False)
    assert ServeSettings(event_loop="asyncio").event_loop == "asyncio"
