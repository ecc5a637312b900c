"""Who may speak to the picker, decided without a network: ``picker.tls.ClientAuth`` per
ext_proc stream, the settings that choose it, and ``picker.tokens.TokenFile`` (the admin API's
and the metrics page's bearer token, reread when its Secret rotates)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from picker.server import ServeSettings
from picker.tls import UNAUTHENTICATED_HEADER_MODE, ClientAuth
from picker.tokens import TokenFile


class _Context:
    """The part of a gRPC servicer context ``ClientAuth`` reads."""

    def __init__(self, names: dict[str, list[bytes]]) -> None:
        self.names = names
        self.asked = 0

    def auth_context(self) -> dict[str, list[bytes]]:
        self.asked += 1
        return self.names


GATEWAY = _Context({"x509_common_name": [b"fairway-gateway"],
                    "x509_subject_alternative_name": [b"fairway-gateway", b"10.0.0.7"]})


def test_without_a_ca_only_header_mode_is_refused() -> None:
    auth = ClientAuth("none")
    assert auth.refusal(_Context({}), header_mode=True) == UNAUTHENTICATED_HEADER_MODE
    assert auth.refusal(_Context({}), header_mode=False) is None  # API keys: per request


def test_trust_network_believes_anyone() -> None:
    assert ClientAuth("trust-network").refusal(_Context({}), header_mode=True) is None


def test_mtls_pins_a_name_and_looks_at_the_connection_only_then() -> None:
    unpinned = _Context({})
    assert ClientAuth("mtls").refusal(unpinned, header_mode=True) is None
    assert unpinned.asked == 0  # the handshake verified the chain: nothing to read per stream
    pinned = ClientAuth("mtls", frozenset({"fairway-gateway"}))
    assert pinned.refusal(GATEWAY, header_mode=True) is None
    by_ip = ClientAuth("mtls", frozenset({"10.0.0.7"}))
    assert by_ip.refusal(GATEWAY, header_mode=False) is None
    stranger = _Context({"x509_common_name": [b"impostor"],
                         "x509_subject_alternative_name": [b"impostor"]})
    reason = pinned.refusal(stranger, header_mode=False)
    assert reason is not None and "impostor" in reason


def test_the_settings_choose_the_mode_and_refuse_contradictions() -> None:
    assert ServeSettings().client_authentication() == ClientAuth("none")
    mtls = ServeSettings(client_ca=Path("/ca.crt"), client_names=("gw",))
    assert mtls.client_authentication() == ClientAuth("mtls", frozenset({"gw"}))
    for bad, message in [
            ({"client_auth": "mtls"}, "--client-auth=mtls needs --client-ca"),
            ({"client_ca": Path("/ca.crt"), "client_auth": "none"}, "--client-ca means"),
            ({"client_ca": Path("/ca.crt"), "secure_serving": False}, "needs --secure-serving"),
            ({"client_names": ("gw",)}, "--client-name needs --client-ca"),
            ({"client_auth": "open"}, "--client-auth must be one of"),
            ({"admin_auth": "token"}, "--admin-auth=token needs --admin-token-file")]:
        with pytest.raises(ValueError, match=message):
            ServeSettings(**bad)  # type: ignore[arg-type]


def test_an_admin_api_beyond_loopback_needs_a_token_or_says_it_does_not() -> None:
    assert ServeSettings().exposure_problem() is None  # 127.0.0.1
    problem = ServeSettings(host="0.0.0.0").exposure_problem()
    assert problem is not None and "--admin-token-file" in problem
    assert ServeSettings(host="0.0.0.0", admin_token_file=Path("/t")).exposure_problem() is None
    assert ServeSettings(host="0.0.0.0", admin_auth="none").exposure_problem() is None


def test_a_token_file_follows_its_rotation_and_keeps_the_last_good_one(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first-token\n")
    token = TokenFile(path)
    assert token.accepts("Bearer first-token")
    for wrong in (None, "first-token", "Bearer first", "Basic first-token", b"Bearer first-token"):
        assert not token.accepts(wrong)  # type: ignore[arg-type]
    # A Secret update swaps the file: the new token, the old one refused.
    replacement = tmp_path / "token.new"
    replacement.write_text("second-token")
    os.replace(replacement, path)
    assert token.accepts("Bearer second-token") and not token.accepts("Bearer first-token")
    # Caught half-written (empty), or gone: the last good token stays.
    path.write_text("")
    assert token.accepts("Bearer second-token")
    path.unlink()
    assert token.accepts("Bearer second-token")
    with pytest.raises(ValueError, match="empty"):
        (tmp_path / "empty").write_text(" \n")
        TokenFile(tmp_path / "empty")
