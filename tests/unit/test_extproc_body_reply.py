"""The streamed-body answer built in place is the message the keyword build gave, and a request
on the inline response path has every chunk echoed in order and is settled with nothing left in
flight (``bench.extproc_cost``'s request, which measures that path's CPU)."""

from __future__ import annotations

import asyncio

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry

from bench.extproc_cost import CHUNKS, CONFIG, Driver
from picker.config.schema import load_config
from picker.dispatch import Dispatcher
from picker.extproc.service import ExternalProcessor, _body
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
        return [reply async for reply in processor.Process(stream(), driver_context())]

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
