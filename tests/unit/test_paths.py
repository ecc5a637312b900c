"""Request paths: every spelling of an inference path is recognised, nothing else passes uncharged.

A table of hostile spellings (each must classify as its inference kind or be refused, never pass
through), the pass-through list (exact method, ``*``, normalised), 404/405/400 answers, and
properties: normalising is idempotent, and any percent-encoding of an inference path classifies
like the plain path.
"""

from __future__ import annotations

from urllib.parse import unquote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.config.schema import load_config
from picker.errors import BadRequest, MethodNotAllowed, NotFound, RequestError
from picker.openai.paths import INFERENCE_PATHS, ApiKind, classify, forward_path, normalise_path

DEFAULT_PASS = frozenset({("GET", "/v1/models"), ("GET", "/health")})

C, CH, R, E, M = (ApiKind.COMPLETIONS, ApiKind.CHAT, ApiKind.RESPONSES, ApiKind.EMBEDDINGS,
                  ApiKind.MESSAGES)

HOSTILE: list[tuple[str, ApiKind]] = [
    ("/v1/completions", C),
    ("/v1/chat/completions", CH),
    ("/v1/responses", R),
    ("/v1/embeddings", E),
    ("/v1/messages", M),
    ("/v1/chat/%63ompletions", CH),          # the bypass of issue 10
    ("/v1/chat/%43ompletions", CH),          # an upper-case escape of an upper-case letter
    ("/%76%31/%63%68%61%74/%63%6f%6d%70%6c%65%74%69%6f%6e%73", CH),
    ("//v1/completions", C),
    ("/v1//completions", C),
    ("///v1///chat////completions", CH),
    ("/V1/Completions", C),
    ("/V1/CHAT/COMPLETIONS", CH),
    ("/v1/./completions", C),
    ("/./v1/./././embeddings", E),
    ("/v1/completions/", C),
    ("/v1/completions//", C),
    ("/v1/completions/.", C),
    ("/v1/x/../completions", C),
    ("/v1/x/y/../../responses", R),
    ("/../v1/messages", M),                  # ".." above the root stays at the root
    ("/../../../v1/completions", C),
    ("/v1/models/../completions", C),         # a pass-through prefix does not carry over
    ("/health/../v1/chat/completions", CH),
    ("/v1%2Fcompletions", C),
    ("/v1%2fchat%2fcompletions", CH),
    ("%2Fv1%2Fcompletions", C),
    ("/v1%5Ccompletions", C),
    ("/v1\\chat\\completions", CH),
    ("\\v1\\embeddings", E),
    ("/v1/%2e/completions", C),
    ("/v1/x/%2e%2e/completions", C),
    ("/v1/x/%2E%2E%2Fcompletions", C),
    ("/v1/chat/%2563ompletions", CH),         # double-encoded
    ("/v1/chat/%252563ompletions", CH),       # triple-encoded
    ("/v1/%2563hat/%2563ompletions", CH),
    ("/v1/completions?stream=true", C),
    ("/v1/completions#frag", C),
    ("/v1/completions/?x=/../models", C),
    ("v1/completions", C),                     # no leading slash
    ("/v1/Messages/./", M),
    ("/v1/models%2F..%2Fcompletions", C),
    ("/V1/EMBEDDINGS%2F", E),
]


@pytest.mark.parametrize(("raw", "kind"), HOSTILE, ids=[raw for raw, _ in HOSTILE])
def test_every_spelling_of_an_inference_path_is_that_kind(raw: str, kind: ApiKind) -> None:
    assert classify("POST", raw, DEFAULT_PASS) is kind
    # Even with every path passed through, an inference path stays an inference path.
    assert classify("POST", raw, frozenset({("*", normalise_path(raw))})) is kind


@pytest.mark.parametrize(("raw", "kind"), HOSTILE, ids=[raw for raw, _ in HOSTILE])
@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "post"])
def test_an_inference_path_with_another_method_is_405(raw: str, kind: ApiKind,
                                                      method: str) -> None:
    with pytest.raises(MethodNotAllowed) as caught:
        classify(method, raw, frozenset({("*", "/v1/models")}))
    assert caught.value.http_status == 405
    assert "POST" in caught.value.message


REFUSED_SPELLINGS = [
    "/v1/completions%00",            # NUL
    "/v1/completions\x00",
    "/v1/chat/completions%0d%0a",    # CR LF
    "/v1/\x7fcompletions",
    "/v1/%zzcompletions",            # invalid escapes
    "/v1/completions%",
    "/v1/completions%2",
    "/v1/%ff%fecompletions",         # not UTF-8
    "/v1/chat/%25252525252563ompletions",  # encoded more times than decoded
]


@pytest.mark.parametrize("raw", REFUSED_SPELLINGS)
def test_undecodable_paths_are_a_400(raw: str) -> None:
    with pytest.raises(BadRequest) as caught:
        classify("POST", raw, frozenset({("*", "/v1/completions")}))
    assert caught.value.http_status == 400
    assert "\x00" not in caught.value.message


NOT_INFERENCE = ["/v1/completion", "/v1/chat", "/v1/chat/completions.json", "/v2/completions",
                 "/v1/completions;x", "/v1/completions%20", "/v1/completionsx",
                 "/openai/v1/completions", "/v1/embeddings/x", "/v1/messages/count_tokens",
                 "/metrics", "/", "", "/v1/chat/completions%3F"]


@pytest.mark.parametrize("raw", NOT_INFERENCE)
def test_other_paths_are_404_naming_method_and_path(raw: str) -> None:
    with pytest.raises(NotFound) as caught:
        classify("POST", raw, DEFAULT_PASS)
    assert caught.value.http_status == 404
    assert caught.value.message == f"Invalid URL (POST {normalise_path(raw)})"


def test_pass_through_needs_the_listed_method() -> None:
    assert classify("GET", "/v1/models", DEFAULT_PASS) is None
    assert classify("GET", "/health", DEFAULT_PASS) is None
    with pytest.raises(MethodNotAllowed) as caught:
        classify("POST", "/v1/models", DEFAULT_PASS)
    assert caught.value.message.endswith("allowed: GET")
    with pytest.raises(NotFound):
        classify("GET", "/metrics", DEFAULT_PASS)


def test_pass_through_star_matches_any_method() -> None:
    listed = frozenset({("*", "/metrics"), ("GET", "/v1/models")})
    for method in ("GET", "POST", "DELETE"):
        assert classify(method, "/metrics", listed) is None


@pytest.mark.parametrize("raw", ["/V1/Models", "//v1/models/", "/v1/x/../models",
                                 "/v1/mod%65ls", "/v1/models?x=1", "/v1%2Fmodels"])
def test_pass_through_matches_the_normalised_path(raw: str) -> None:
    assert classify("GET", raw, DEFAULT_PASS) is None


def test_the_error_message_bounds_a_long_path() -> None:
    with pytest.raises(NotFound) as caught:
        classify("POST", "/" + "a" * 5000, DEFAULT_PASS)
    assert len(caught.value.message) < 300


@pytest.mark.parametrize(("raw", "expected"), [
    ("/v1/completions", "/v1/completions"),
    ("/", "/"),
    ("", "/"),
    ("//", "/"),
    ("/a/b/..", "/a"),
    ("/a/b/../..", "/"),
    ("/a/./b/.", "/a/b"),
    ("/a/..b/c", "/a/..b/c"),       # "..b" is a name, not a dot segment
    ("/a/.b", "/a/.b"),
    ("/100%25", "/100%25"),         # a literal percent sign stays one, escaped
    ("/a%3Fb", "/a%3Fb"),           # so does a decoded "?"
    ("/a%23b", "/a%23b"),
    ("/caf%C3%A9", "/café"),
    ("/A%2FB", "/a/b"),
])
def test_normalise_examples(raw: str, expected: str) -> None:
    assert normalise_path(raw) == expected


def test_fast_path_returns_the_same_string() -> None:
    raw = "/v1/chat/completions"
    assert normalise_path(raw) is raw


# -- properties --

_SEGMENT_CHARS = st.sampled_from([*"abcXYZ019-._~%/\\?#;:@", "%2F", "%2e", "%25", "%41", "..",
                                  "é", "v1", "/v1/", "chat", "completions", "%63ompletions",
                                  "embeddings", "%2565mbeddings", "/models"])
_RAW_PATHS = st.lists(_SEGMENT_CHARS, max_size=24).map(lambda parts: "/" + "".join(parts))


@settings(max_examples=400, deadline=None)
@given(_RAW_PATHS)
def test_normalise_is_idempotent(raw: str) -> None:
    try:
        once = normalise_path(raw)
    except BadRequest:
        return
    assert normalise_path(once) == once
    assert once.startswith("/") and "//" not in once
    assert once == "/" or not once.endswith("/")


def _encode(text: str, mask: list[bool], upper: list[bool]) -> str:
    """Percent-encode the characters ``mask`` picks, and every "%" (a correct encoder must)."""
    out = []
    for i, ch in enumerate(text):
        if ch == "%" or mask[i % len(mask)]:
            escape = f"%{ord(ch):02x}"
            out.append(escape.upper() if upper[i % len(upper)] else escape)
        else:
            out.append(ch)
    return "".join(out)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(INFERENCE_PATHS)),
       st.lists(st.booleans(), min_size=1, max_size=30),
       st.lists(st.booleans(), min_size=1, max_size=30),
       st.integers(min_value=1, max_value=3))
def test_any_percent_encoding_of_an_inference_path_is_that_kind(
        path: str, mask: list[bool], upper: list[bool], rounds: int) -> None:
    raw = path
    for _ in range(rounds):
        raw = _encode(raw, mask, upper)
    assert classify("POST", raw, DEFAULT_PASS) is INFERENCE_PATHS[path]


@st.composite
def _mutated_inference_paths(draw: st.DrawFn) -> str:
    """An inference path with characters encoded (once or twice), cased, or noise inserted."""
    path = draw(st.sampled_from(sorted(INFERENCE_PATHS)))
    # Half the time only what a server decoding once undoes (so it sees the inference path).
    ways = draw(st.sampled_from([["keep", "enc", "ENC"],
                                 ["keep", "keep", "enc", "ENC", "enc2", "upper", "noise"]]))
    out = []
    for ch in path:
        how = draw(st.sampled_from(ways))
        if how == "enc":
            out.append(f"%{ord(ch):02x}")
        elif how == "ENC":
            out.append(f"%{ord(ch):02X}")
        elif how == "enc2":
            out.append(f"%25{ord(ch):02x}")
        elif how == "upper":
            out.append(ch.upper())
        elif how == "noise":
            out.append(draw(st.sampled_from(["/", "/./", "\\", "%2F", "/x/../", ";"])) + ch)
        else:
            out.append(ch)
    return "".join(out)


@settings(max_examples=600, deadline=None)
@given(st.one_of(_RAW_PATHS, _mutated_inference_paths()), st.sampled_from(["GET", "POST", "*"]))
def test_a_path_a_server_decodes_to_an_inference_path_never_passes(raw: str, method: str) -> None:
    """Whatever a server that decodes once and matches exactly (vLLM behind Starlette) would
    take for an inference path, ``classify`` takes for the same one or refuses, even with the
    path on the pass-through list."""
    server_sees = unquote(raw.split("?", 1)[0].split("#", 1)[0])
    try:
        listed = frozenset({(method, normalise_path(raw))})
    except BadRequest:
        return  # refused as undecodable before any routing
    try:
        kind = classify("POST", raw, listed)
    except RequestError:
        assert server_sees not in INFERENCE_PATHS
        return
    if server_sees in INFERENCE_PATHS:
        assert kind is INFERENCE_PATHS[server_sees]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(INFERENCE_PATHS)), st.lists(
    st.sampled_from(["", "/", "//", "/.", "/x/..", "/./", "\\"]), min_size=1, max_size=4))
def test_slash_and_dot_noise_keeps_the_kind(path: str, noise: list[str]) -> None:
    head, _, tail = path.rpartition("/")
    raw = noise[0] + head + noise[-1] + "/" + tail + ("/" if len(noise) > 2 else "")
    assert classify("POST", raw.upper() if len(noise) == 3 else raw,
                    DEFAULT_PASS) is INFERENCE_PATHS[path]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(INFERENCE_PATHS)),
       st.lists(st.booleans(), min_size=1, max_size=30),
       st.lists(st.booleans(), min_size=1, max_size=30))
def test_a_sloppy_nested_encoding_is_that_kind_or_refused(
        path: str, mask: list[bool], upper: list[bool]) -> None:
    """Encoding the characters of an escape but not its "%" ("%7%36" for "%76", which a hop that
    decodes twice reads as "v") is refused with 400 unless it decodes cleanly; it never passes."""
    once = _encode(path, mask, upper)
    raw = "".join(f"%{ord(ch):02x}" if ch != "%" and m else ch
                  for ch, m in zip(once, mask * (len(once) // len(mask) + 1), strict=False))
    try:
        kind = classify("POST", raw, frozenset({("*", "/v1/models")}))
    except BadRequest:
        return
    assert kind is INFERENCE_PATHS[path]


# -- the routing config feeds the classifier --

def test_default_routing_passes_models_and_health() -> None:
    config = load_config({})
    assert config.routing.pass_through_set == DEFAULT_PASS
    assert classify("GET", "/v1/models", config.routing.pass_through_set) is None
    with pytest.raises(NotFound):
        classify("GET", "/metrics", config.routing.pass_through_set)


def test_routing_entries_are_stored_normalised() -> None:
    config = load_config({"routing": {"passThrough": [
        {"method": "GET", "path": "//V1/Models/"}, {"method": "*", "path": "/metrics/./"}]}})
    assert [e.name for e in config.routing.pass_through] == ["GET /v1/models", "* /metrics"]
    assert config.routing.pass_through_set == frozenset({("GET", "/v1/models"),
                                                         ("*", "/metrics")})
    assert classify("DELETE", "/METRICS", config.routing.pass_through_set) is None


def test_an_empty_pass_through_list_refuses_every_other_path() -> None:
    listed = load_config({"routing": {"passThrough": []}}).routing.pass_through_set
    assert listed == frozenset()
    with pytest.raises(NotFound):
        classify("GET", "/v1/models", listed)
    assert classify("POST", "/v1/responses", listed) is ApiKind.RESPONSES


# -- the path sent to the engine (issue 26: judged inference, forwarded as a 404) --

@pytest.mark.parametrize(("raw", "forwarded"), [
    ("/v1/chat/completions", None),
    ("/v1/chat/completions?api-version=1", None),
    ("/v1/chat/completions/", "/v1/chat/completions"),
    ("/V1/chat/completions", "/v1/chat/completions"),
    ("/v1//Chat/./completions/?api-version=1", "/v1/chat/completions?api-version=1"),
    ("/v1/chat%2Fcompletions", "/v1/chat/completions"),
    ("/v1/messages/", "/v1/messages"),
])
def test_an_inference_path_is_forwarded_as_the_picker_judged_it(raw: str,
                                                                forwarded: str | None) -> None:
    assert forward_path(raw) == forwarded
    sent = forward_path(raw) or raw
    assert sent.partition("?")[0] in INFERENCE_PATHS
