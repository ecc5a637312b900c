"""The streamed-body answer built in place is the message the keyword build gave; the inline
response path's echo, made as wire bytes, is that message's serialization at every chunk size;
and a request on the inline response path has every chunk echoed in order and is settled with
nothing left in flight (``bench.extproc_cost``'s request, which measures that path's CPU)."""

from __future__ import annotations

import asyncio

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry

from bench.extproc_cost import CHUNKS, CONFIG, Driver
from picker.config.schema import load_config
from picker.dispatch import Dispatcher
from picker.extproc import service
from picker.extproc.service import ExternalProcessor, _body, echo_reply, serialize_reply
from picker.metrics import PickerMetrics


@pytest.mark.parametrize("field", ["request_body", "response_body"])
@pytest.mark.parametrize("end", [False, True])
def test_the_body_answer_is_the_keyword_built_message(field: str, end: bool) -> None:
    mutation = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=b"chunk",
                                                                         end_of_stream=end))
    expected = pb.ProcessingResponse(**{field: pb.BodyResponse(
        response=pb.CommonResponse(body_mutation=mutation))})
    assert _body(field, b"chunk", end) == expected
    assert _body(field, b"", end).WhichOneof("response") == field


SIZES = [0, 1, 100, 114, 115, 116, 117, 127, 128, 129, 200, 16370, 16383, 16384, 20000,
         2**21 - 20, 2**21, 2**21 + 5]
"""Chunk sizes around each length's varint growing a byte (at 128, 2**14 and 2**21, in the
chunk's own length or in one of the four messages around it)."""


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("end", [False, True])
def test_the_echo_is_the_bytes_grpc_sends_for_the_message(size: int, end: bool) -> None:
    chunk = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    expected = _body("response_body", chunk, end).SerializeToString()
    assert echo_reply(chunk, end) == expected
    assert echo_reply(chunk, end) == expected  # its head kept for the size, the same bytes
    assert serialize_reply(echo_reply(chunk, end)) == expected
    parsed = pb.ProcessingResponse.FromString(echo_reply(chunk, end))
    assert parsed.response_body.response.body_mutation.streamed_response.body == chunk


def test_past_the_heads_kept_the_echo_is_the_serialized_message(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "_echo_heads", {})
    monkeypatch.setattr(service, "ECHO_HEADS_KEPT", 2)
    for size in (3, 5, 7, 9):
        chunk = b"y" * size
        assert echo_reply(chunk, False) == _body("response_body", chunk, False).SerializeToString()
    assert len(service._echo_heads) == 2


def test_the_reply_serializer_sends_bytes_as_they_are_and_serializes_messages() -> None:
    message = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
    assert serialize_reply(message) == message.SerializeToString()
    assert serialize_reply(b"\x22\x00") == b"\x22\x00"
    assert pb.ProcessingResponse.FromString(service._RESPONSE_BODY_CONTINUE) \
        == pb.ProcessingResponse(response_body=pb.BodyResponse())


def test_a_streamed_request_echoes_every_chunk_and_charges_its_tokens() -> None:
    config = load_config(CONFIG)
    dispatcher = Dispatcher(config, metrics=PickerMetrics(CollectorRegistry()))
    processor = ExternalProcessor(dispatcher, lambda: config)
    driver = Driver()
    messages = driver.messages(1, CHUNKS)

    async def run() -> list[pb.ProcessingResponse]:
        async def stream():  # type: ignore[no-untyped-def]
            for message in messages:
                yield message
        # As Envoy gets them: through the servicer's serializer, parsed.
        return [pb.ProcessingResponse.FromString(serialize_reply(reply))
                async for reply in processor.Process(stream(), driver_context())]

    replies = asyncio.run(run())
    echoed = [r.response_body.response.body_mutation.streamed_response for r in replies
              if r.WhichOneof("response") == "response_body"]
    assert [e.body for e in echoed] == [m.response_body.body for m in messages[3:]]
    assert [e.end_of_stream for e in echoed] == [False] * CHUNKS + [True]
    # One token a chunk while streaming; the usage event settles the request at the engine's
    # figures, and nothing is left in flight.
    served = dispatcher.scheduler.service["heavy"]
    assert served > 0
    assert all(e.inflight_tokens == 0 for e in dispatcher.endpoints.values())


def driver_context():  # type: ignore[no-untyped-def]
    class Context:
        def invocation_metadata(self) -> tuple[()]:
            return ()
    return Context()
