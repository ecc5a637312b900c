"""What a worker is given (``picker.workers.worker_settings``), how the supervisor tends a dead
worker (without starting processes), and what ``bench.workers``' ladder concludes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench.workers import summary
from picker.server import ServeSettings
from picker.workers import (
    RESTART_BACKOFF,
    Supervisor,
    Worker,
    worker_settings,
    workers_problem,
)


def test_a_worker_shares_the_ext_proc_port_and_keeps_its_other_ports_private() -> None:
    pod = ServeSettings(host="0.0.0.0", grpc_port=9002, grpc_health_port=9003,
                        metrics_port=9090, admin_port=9004, identity="picker-abc")
    second = worker_settings(pod, 1, 9002)
    assert (second.grpc_port, second.reuse_port, second.host) == (9002, True, "0.0.0.0")
    assert (second.grpc_health_port, second.metrics_port) == (0, 0)  # the supervisor's
    assert second.admin_port == 9005 and second.identity == "picker-abc-w1"
    assert not second.announce and second.connection_age is not None
    assert worker_settings(ServeSettings(admin_port=0), 3, 1234).admin_port == 0


@pytest.mark.parametrize("workers, lease, age, problem", [
    (1, None, 30.0, "--workers must be 2 or more"),
    (2, "ns/lease", 30.0, "run them without --lease"),
    (2, None, 0.0, "--connection-age must be positive"),
])
def test_the_supervisor_refuses_one_worker_a_lease_and_no_connection_age(
        workers: int, lease: str | None, age: float, problem: str) -> None:
    settings = ServeSettings(lease=lease)
    assert problem in (workers_problem(settings, workers, age) or "")
    with pytest.raises(ValueError, match=problem):
        Supervisor(settings, workers, connection_age=age)
    assert workers_problem(ServeSettings(), 2) is None


def test_settings_refuse_a_certificate_without_tls_wherever_they_are_made() -> None:
    # One check for the command line, serve() and run_workers(): the settings' own.
    with pytest.raises(ValueError, match="--cert-path needs --secure-serving"):
        ServeSettings(cert_path=Path("/certs"), secure_serving=False)
    with pytest.raises(ValueError, match="--cert-path needs --secure-serving"):
        replace(ServeSettings(cert_path=Path("/certs")), secure_serving=False)


class _Dead:
    exitcode = -9
    pid = 1

    def is_alive(self) -> bool:
        return False


def test_a_dead_worker_waits_its_back_off_which_doubles_until_it_serves_again() -> None:
    supervisor = Supervisor(ServeSettings(), 2)
    spawned: list[int] = []
    supervisor._spawn = lambda worker: spawned.append(worker.index)  # type: ignore[method-assign]
    worker = Worker(0, ServeSettings(), process=_Dead(), ports={"grpc": 1})  # type: ignore[arg-type]
    supervisor.workers.append(worker)
    supervisor.tend(100.0)
    assert worker.due == 100.0 + RESTART_BACKOFF[0] and not worker.ports and spawned == []
    assert worker.backoff == 2 * RESTART_BACKOFF[0]
    supervisor.tend(100.5)
    assert spawned == []
    supervisor.tend(101.0)
    assert spawned == [0]
    assert supervisor.restarts._value.get() == 1  # type: ignore[attr-defined]


def _row(rate: float, achieved: float, added_p99: float | None) -> dict[str, Any]:
    return {"rate": rate, "picker": {"achieved_rate": achieved}, "added_p99_ms": added_p99}


def test_the_ladder_summary() -> None:
    rows = [_row(200, 199, 4.0), _row(400, 398, 12.0), _row(600, 590, 9.0), _row(800, 700, 3.0)]
    got = summary(rows)
    # 600 is within both limits although 400 was not; 800 delivered only 87.5 %.
    assert got == {"p99_within_10ms": 600, "delivered_95": 600, "most_delivered": 700}
    assert summary([_row(200, 150, 1.0)])["p99_within_10ms"] is None


def test_ghz_is_given_one_whole_exchange_and_the_service_it_calls(tmp_path: Any) -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc_pb2
    from google.protobuf import descriptor_pb2, json_format

    from bench.workers import EXT_PROC_CALL, exchange_messages, write_protoset

    kinds = [json_format.ParseDict(m, ext_proc_pb2.ProcessingRequest()).WhichOneof("request")
             for m in exchange_messages()]
    assert kinds == ["request_headers", "request_body", "response_headers", "response_body"]
    files = descriptor_pb2.FileDescriptorSet.FromString(
        write_protoset(tmp_path / "set").read_bytes()).file
    names = [f.name for f in files]
    service, method = EXT_PROC_CALL.rsplit(".", 1)
    (own,) = [f for f in files if f.package == service.rsplit(".", 1)[0]
              and any(s.name == service.rsplit(".", 1)[1] for s in f.service)]
    assert method in [m.name for s in own.service for m in s.method]
    # Every import comes before the file that imports it, as a FileDescriptorSet must have it.
    for index, file in enumerate(files):
        assert all(names.index(dependency) < index for dependency in file.dependency)
