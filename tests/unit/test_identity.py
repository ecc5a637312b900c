"""Who sent a request: trusted headers, API keys mapped by hash, and the ``hash-key`` CLI."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from picker.errors import BadRequest, RequestError, Unauthorized
from picker.identity import KEY_HEADERS, Identity, KeyEntry, hash_api_key

ROOT = Path(__file__).resolve().parents[2]
HEADERS = ["x-gateway-inference-fairness-id", "x-llm-d-inference-fairness-id"]
ALICE_KEY = "sk-alice-7f3c9a1e2b4d6f8a0c1e3b5d7f9a1c3e"
BOB_KEY = "sk-bob-0a2c4e6f8b1d3f5a7c9e1b3d5f7a9c1e"


@pytest.fixture
def by_key() -> Identity:
    return Identity.api_keys([
        KeyEntry(hash_api_key(ALICE_KEY), "alice"),
        KeyEntry(hash_api_key(BOB_KEY), "bob"),
    ])


# --- trusted-header mode ---------------------------------------------------------------------

def test_header_mode_takes_the_first_configured_header() -> None:
    identity = Identity.trusted_header(HEADERS, "anonymous")
    assert identity.mode == "header"
    both = {HEADERS[0]: "alice", HEADERS[1]: "bob"}
    assert identity.tenant(both) == "alice"
    assert identity.tenant({HEADERS[1]: "bob"}) == "bob"


def test_header_mode_skips_empty_headers_and_strips_values() -> None:
    identity = Identity.trusted_header(HEADERS, "anonymous")
    assert identity.tenant({HEADERS[0]: "  ", HEADERS[1]: " bob "}) == "bob"
    assert identity.tenant({HEADERS[0]: ""}) == "anonymous"


def test_header_mode_falls_back_to_the_default_tenant() -> None:
    identity = Identity.trusted_header(HEADERS, "anonymous")
    assert identity.tenant({}) == "anonymous"
    assert identity.tenant({"x-other": "mallory"}) == "anonymous"


def test_header_mode_ignores_authorization() -> None:
    identity = Identity.trusted_header(HEADERS, "anonymous")
    assert identity.tenant({"authorization": "Bearer nonsense"}) == "anonymous"


def test_header_names_are_matched_lower_cased() -> None:
    identity = Identity.trusted_header(["X-Tenant"], "anonymous")
    assert identity.tenant({"x-tenant": "alice"}) == "alice"


@pytest.mark.parametrize(
    ("headers", "default"),
    [([], "anonymous"), ([""], "anonymous"), (["x-a", "X-A"], "anonymous"), (["x-a"], ""),
     ("x-a", "anonymous")],
    ids=["no-headers", "empty-name", "duplicate", "empty-default", "bare-string"],
)
def test_header_mode_refuses_a_bad_setup(headers: list[str], default: str) -> None:
    with pytest.raises(ValueError):
        Identity.trusted_header(headers, default)


# --- API-key mode ----------------------------------------------------------------------------

def test_hash_api_key_is_sha256_hex_of_utf8() -> None:
    assert hash_api_key("sk-é") == hashlib.sha256("sk-é".encode()).hexdigest()
    assert len(hash_api_key(ALICE_KEY)) == 64
    with pytest.raises(ValueError):
        hash_api_key("")


def test_api_key_mode_maps_keys_to_tenants(by_key: Identity) -> None:
    assert by_key.mode == "apiKey"
    assert by_key.tenant({"authorization": f"Bearer {ALICE_KEY}"}) == "alice"
    assert by_key.tenant({"authorization": f"Bearer {BOB_KEY}"}) == "bob"


@pytest.mark.parametrize("value", [f"bearer {ALICE_KEY}", f"BEARER  {ALICE_KEY} ",
                                   f" Bearer {ALICE_KEY}"])
def test_bearer_scheme_is_case_insensitive_and_spacing_tolerant(
    by_key: Identity, value: str
) -> None:
    assert by_key.tenant({"authorization": value}) == "alice"


def test_a_tenant_may_have_several_keys() -> None:
    identity = Identity.api_keys([KeyEntry(hash_api_key("old"), "alice"),
                                  KeyEntry(hash_api_key("new"), "alice")])
    assert identity.tenant({"authorization": "Bearer old"}) == "alice"
    assert identity.tenant({"authorization": "Bearer new"}) == "alice"


def test_api_key_mode_ignores_a_spoofed_tenant_header(by_key: Identity) -> None:
    headers = {"authorization": f"Bearer {BOB_KEY}", HEADERS[0]: "alice", HEADERS[1]: "alice"}
    assert by_key.tenant(headers) == "bob"
    with pytest.raises(Unauthorized):
        by_key.tenant({HEADERS[0]: "alice"})


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": ""},
        {"authorization": "Bearer"},
        {"authorization": "Bearer   "},
        {"authorization": ALICE_KEY},
        {"authorization": f"Basic {ALICE_KEY}"},
        {"authorization": f"Token {ALICE_KEY}"},
        {"authorization": f"Bearer {ALICE_KEY} extra"},
        {"authorization": "Bearer sk-unknown-key"},
        {"authorization": f"Bearer {hash_api_key(ALICE_KEY)}"},
        {"Authorization": f"Bearer {ALICE_KEY}"},
    ],
    ids=["missing", "empty", "no-token", "blank-token", "no-scheme", "basic", "token-scheme",
         "two-tokens", "unknown", "the-hash-itself", "name-not-lower-cased"],
)
def test_api_key_mode_refuses_with_401(by_key: Identity, headers: dict[str, str]) -> None:
    with pytest.raises(Unauthorized) as caught:
        by_key.tenant(headers)
    error = caught.value
    assert isinstance(error, RequestError)
    assert error.http_status == 401
    assert error.metric_label == "unauthorized"
    assert ALICE_KEY not in error.message


# --- the key headers of each SDK ---------------------------------------------------------

@pytest.mark.parametrize("headers", [
    {"authorization": f"Bearer {BOB_KEY}"},
    {"x-api-key": BOB_KEY},
    {"api-key": BOB_KEY},
    {"x-api-key": f"  {BOB_KEY} "},
], ids=["openai-bearer", "anthropic-x-api-key", "azure-api-key", "padded"])
def test_each_sdk_s_key_header_authenticates(by_key: Identity, headers: dict[str, str]) -> None:
    assert by_key.tenant(headers) == "bob"


@pytest.mark.parametrize("headers", [
    {"authorization": f"Bearer {BOB_KEY}", "x-api-key": BOB_KEY},
    {"authorization": f"bearer {BOB_KEY}", "x-api-key": BOB_KEY, "api-key": BOB_KEY},
    {"x-api-key": BOB_KEY, "api-key": BOB_KEY},
    # An empty header carries no key: as if it were absent.
    {"authorization": "", "x-api-key": BOB_KEY},
    {"x-api-key": " ", "api-key": BOB_KEY},
], ids=["bearer-and-x-api-key", "all-three", "x-api-key-and-api-key", "empty-authorization",
        "blank-x-api-key"])
def test_the_same_key_in_several_headers_is_one_key(by_key: Identity,
                                                    headers: dict[str, str]) -> None:
    assert by_key.tenant(headers) == "bob"


@pytest.mark.parametrize(("headers", "named"), [
    ({"authorization": f"Bearer {ALICE_KEY}", "x-api-key": BOB_KEY}, "Authorization and x-api-key"),
    ({"authorization": f"Bearer {ALICE_KEY}", "api-key": BOB_KEY}, "Authorization and api-key"),
    ({"x-api-key": ALICE_KEY, "api-key": BOB_KEY}, "x-api-key and api-key"),
    # Different keys are refused even when one of them is unknown: no guessing which counts.
    ({"authorization": "Bearer sk-unknown", "x-api-key": BOB_KEY}, "Authorization and x-api-key"),
    ({"x-api-key": BOB_KEY, "api-key": "sk-unknown"}, "x-api-key and api-key"),
], ids=["bearer-vs-x-api-key", "bearer-vs-api-key", "x-api-key-vs-api-key",
        "unknown-first", "unknown-last"])
def test_two_different_keys_are_refused(by_key: Identity, headers: dict[str, str],
                                        named: str) -> None:
    with pytest.raises(Unauthorized) as caught:
        by_key.tenant(headers)
    error = caught.value
    assert error.http_status == 401 and error.code == "invalid_api_key"
    assert f"two different API keys in one request ({named})" in error.message
    for value in headers.values():
        assert value.split()[-1] not in error.message  # no key echoed back


def test_precedence_a_malformed_authorization_is_refused_beside_a_good_x_api_key(
        by_key: Identity) -> None:
    """Authorization comes first: a client whose Authorization cannot be read is refused, not
    served on the next header (it is a mistake somewhere, and 401 says where)."""
    with pytest.raises(Unauthorized, match="malformed Authorization header"):
        by_key.tenant({"authorization": f"Basic {ALICE_KEY}", "x-api-key": ALICE_KEY})
    with pytest.raises(Unauthorized, match="malformed x-api-key header"):
        by_key.tenant({"x-api-key": f"{ALICE_KEY} extra", "api-key": ALICE_KEY})


def test_a_missing_key_names_every_header_a_key_may_come_in(by_key: Identity) -> None:
    with pytest.raises(Unauthorized) as caught:
        by_key.tenant({HEADERS[0]: "alice"})
    for spelling in ("Authorization: Bearer", "x-api-key", "api-key"):
        assert spelling in caught.value.message


@pytest.mark.parametrize("name", ["authorization", "x-api-key", "api-key"])
def test_a_spoofed_tenant_header_beside_any_key_header_is_ignored(by_key: Identity,
                                                                 name: str) -> None:
    value = f"Bearer {BOB_KEY}" if name == "authorization" else BOB_KEY
    assert by_key.tenant({name: value, HEADERS[0]: "alice", HEADERS[1]: "alice"}) == "bob"


def test_key_headers_are_stripped_toward_the_engine_in_api_key_mode_only(
        by_key: Identity) -> None:
    assert by_key.credential_headers == KEY_HEADERS == ("authorization", "x-api-key", "api-key")
    assert by_key.header_names == KEY_HEADERS
    header_mode = Identity.trusted_header(HEADERS, "anonymous")
    assert header_mode.credential_headers == ()
    assert header_mode.tenant({"x-api-key": BOB_KEY, "api-key": ALICE_KEY}) == "anonymous"


@pytest.mark.parametrize(
    "sha256",
    ["", "abc", hash_api_key("k").upper(), hash_api_key("k")[:63], hash_api_key("k") + "0",
     "g" * 64, " " + hash_api_key("k")[1:]],
    ids=["empty", "short", "uppercase", "63-chars", "65-chars", "not-hex", "space"],
)
def test_api_key_mode_refuses_a_bad_hash(sha256: str) -> None:
    with pytest.raises(ValueError, match=r"entries\[1\]\.sha256"):
        Identity.api_keys([KeyEntry(hash_api_key("ok"), "alice"), KeyEntry(sha256, "bob")])


def test_api_key_mode_refuses_duplicate_hashes() -> None:
    digest = hash_api_key("shared")
    with pytest.raises(ValueError, match="duplicate"):
        Identity.api_keys([KeyEntry(digest, "alice"), KeyEntry(digest, "bob")])


def test_api_key_mode_refuses_an_empty_tenant_or_no_keys() -> None:
    with pytest.raises(ValueError, match="tenant"):
        Identity.api_keys([KeyEntry(hash_api_key("k"), "")])
    with pytest.raises(ValueError, match="at least one key"):
        Identity.api_keys([])


def test_repr_shows_no_hashes(by_key: Identity) -> None:
    assert hash_api_key(ALICE_KEY) not in repr(by_key)
    assert "2 keys" in repr(by_key)


# --- python -m picker.config hash-key --------------------------------------------------------

def _hash_key(stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "picker.config", "hash-key"],
        input=stdin, capture_output=True, text=True, cwd=ROOT, timeout=30, check=False,
    )


def test_hash_key_cli_prints_one_hash_per_key() -> None:
    result = _hash_key(f"{ALICE_KEY}\n{BOB_KEY}\r\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [hash_api_key(ALICE_KEY), hash_api_key(BOB_KEY)]
    identity = Identity.api_keys([KeyEntry(h, "t") for h in result.stdout.split()])
    assert identity.tenant({"authorization": f"Bearer {BOB_KEY}"}) == "t"


def test_hash_key_cli_accepts_a_last_line_without_newline() -> None:
    result = _hash_key(ALICE_KEY)
    assert result.returncode == 0, result.stderr
    assert result.stdout == hash_api_key(ALICE_KEY) + "\n"


@pytest.mark.parametrize(
    ("stdin", "message"),
    [(f"{ALICE_KEY}\n\n{BOB_KEY}\n", "line 2 is empty"),
     (f"{ALICE_KEY}\n   \n", "line 2 is empty"),
     (f"{ALICE_KEY} {BOB_KEY}\n", "line 1 contains whitespace"),
     ("", "no API key")],
    ids=["empty-line", "blank-line", "two-keys-on-a-line", "nothing"],
)
def test_hash_key_cli_refuses_bad_input_with_exit_2(stdin: str, message: str) -> None:
    result = _hash_key(stdin)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""
    assert ALICE_KEY not in result.stderr


def test_check_still_works() -> None:
    good = ROOT / "tests" / "fixtures" / "config" / "good.yaml"
    result = subprocess.run(
        [sys.executable, "-m", "picker.config", "check", str(good)],
        capture_output=True, text=True, cwd=ROOT, timeout=30, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert ": ok (" in result.stdout


@pytest.mark.parametrize("value", ["x" * 254, "team a", "-x", "tëam", "a\x00b", "tab\there"])
def test_a_header_tenant_outside_the_id_rule_is_refused(value: str) -> None:
    identity = Identity.trusted_header(["x-tenant"], "anonymous")
    with pytest.raises(BadRequest, match="must be a tenant id"):
        identity.tenant({"x-tenant": value})


@pytest.mark.parametrize("value", ["a", "team-a", "org/team.a", "user@example.com", "x" * 253,
                                   "ns:tenant_1"])
def test_tenant_ids_of_the_rule_pass(value: str) -> None:
    assert Identity.trusted_header(["x-tenant"], "anonymous").tenant({"x-tenant": value}) == value
