"""Who sent this request? The tenant a request is scheduled and charged as.

Two modes:

* **trusted header** (``"header"``): the gateway in front of the picker has already authenticated
  the caller and names its tenant in a header. The first non-empty header of a configured list
  wins; a request with none of them belongs to the default tenant.
* **API key** (``"apiKey"``): the picker authenticates the caller itself. The key is mapped to a
  tenant by its SHA-256; the config holds only those hashes, never a key in clear. Tenant headers
  sent by the client are ignored, since anyone can set them, and a missing, malformed or unknown
  key is refused with ``Unauthorized`` (HTTP 401).

Clients send their key where their API's own SDK puts it (``KEY_HEADERS``): OpenAI's clients
``Authorization: Bearer <key>``, Anthropic's ``x-api-key: <key>``, Azure OpenAI's ``api-key:
<key>``. Each is accepted on every path: a key is the same credential whichever header carries it,
and Anthropic's SDK also calls ``/v1/models`` and OpenAI-compatible paths, so tying a header to a
path would only turn working clients away. The precedence is ``Authorization``, then ``x-api-key``,
then ``api-key``: the first present (non-empty) one names the key, and every other present one must
carry the same key, else the request is refused (two different keys in one request are a client
or proxy mistake, and guessing which one counts would charge one tenant for another's key). A
header repeated with the same value is fine; repeated with different values it is refused too
(``picker.extproc``). In this mode the picker removes all three headers from the request it
forwards (``credential_headers``): a tenant's key never reaches a model server.

API keys are high-entropy random strings, so an unsalted fast hash is the accepted way to store
them (as GitHub and Stripe do): a salt or a slow KDF protects low-entropy secrets such as passwords
from dictionary attacks, and no dictionary covers 128+ random bits. Produce the hashes with
``python -m picker.config hash-key`` (reads keys on stdin, so they stay out of shell history).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from picker.errors import BadRequest, Unauthorized

Mode = Literal["header", "apiKey"]

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
TENANT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,252}")
"""A tenant id from a header: what a TenantPolicy's ``tenants`` may hold (the CRD's pattern and
length). Anything else is refused, not cleaned: ids that differ only in bytes a terminal or a
log hides must not become one tenant, nor an 8,000-character id a row of ``picker.ctl top``."""
OBJECTIVE_HEADER = "x-gateway-inference-objective"
"""The InferenceObjective a gateway names for a request (it may ask for a lane)."""
KEY_HEADERS = ("authorization", "x-api-key", "api-key")
"""Where an API key may come, in precedence order: ``Authorization: Bearer`` (OpenAI's SDKs),
``x-api-key`` (Anthropic's), ``api-key`` (Azure OpenAI's)."""
_KEY_HELP = ("send 'Authorization: Bearer <key>', 'x-api-key: <key>' (Anthropic) or "
             "'api-key: <key>' (Azure OpenAI)")


def hash_api_key(key: str) -> str:
    """The lowercase SHA-256 hex digest of the UTF-8 ``key``: what the config stores for it."""
    if not key:
        raise ValueError("an API key must not be empty")
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class KeyEntry:
    """One accepted API key, known only by its hash, and the tenant it authenticates as."""

    sha256: str
    """Lowercase SHA-256 hex of the key (``hash_api_key``)."""
    tenant: str


class Identity:
    """Finds a request's tenant from its headers, by trusted header or by API key.

    Build it with ``Identity.trusted_header`` or ``Identity.api_keys``; it does not change after.
    """

    __slots__ = ("_default_tenant", "_headers", "_keys", "_mode")

    def __init__(
        self,
        mode: Mode,
        headers: tuple[str, ...],
        default_tenant: str,
        keys: Mapping[str, str],
    ) -> None:
        # Private: the two constructors below validate; this only stores.
        self._mode: Mode = mode
        self._headers = headers
        self._default_tenant = default_tenant
        self._keys = MappingProxyType(dict(keys))

    @classmethod
    def trusted_header(cls, headers: Sequence[str], default_tenant: str) -> Identity:
        """Tenant from the first non-empty of ``headers`` (tried in order), else ``default_tenant``.

        Header names are matched lower-cased, as HTTP/2 and Envoy present them.
        """
        if isinstance(headers, str):
            # A bare string is a Sequence[str] of its characters: certainly a mistake.
            raise ValueError("headers must be a list of header names, not a string")
        names = tuple(name.strip().lower() for name in headers)
        if not names:
            raise ValueError("trusted-header mode needs at least one header name")
        for i, name in enumerate(names):
            if not name:
                raise ValueError(f"headers[{i}]: header name must not be empty")
            if name in names[:i]:
                raise ValueError(f"headers[{i}]: duplicate header {name!r}")
        if not default_tenant:
            raise ValueError("default_tenant must not be empty")
        return cls("header", names, default_tenant, {})

    @classmethod
    def api_keys(cls, entries: Sequence[KeyEntry]) -> Identity:
        """Tenant from the key of ``KEY_HEADERS`` (``Authorization: Bearer <key>``, ``x-api-key``
        or ``api-key``), looked up by the key's SHA-256.

        Raises ValueError if a hash is not 64 lowercase hex characters, a hash appears twice, or a
        tenant is empty. One tenant may have several keys (e.g. while rotating).
        """
        keys: dict[str, str] = {}
        for i, entry in enumerate(entries):
            if not isinstance(entry.sha256, str) or not _SHA256_HEX.fullmatch(entry.sha256):
                raise ValueError(
                    f"entries[{i}].sha256: must be 64 lowercase hex characters "
                    "(the output of python -m picker.config hash-key)"
                )
            if not entry.tenant:
                raise ValueError(f"entries[{i}].tenant: must not be empty")
            if entry.sha256 in keys:
                raise ValueError(f"entries[{i}].sha256: duplicate key hash")
            keys[entry.sha256] = entry.tenant
        if not keys:
            # With no keys every request would be refused: surely a config mistake.
            raise ValueError("API-key mode needs at least one key")
        return cls("apiKey", (), "", keys)

    @property
    def mode(self) -> Mode:
        """``"header"`` (trusted header) or ``"apiKey"``."""
        return self._mode

    def tenant(self, headers: Mapping[str, str]) -> str:
        """The tenant of a request whose ``headers`` have lower-cased names.

        Raises ``Unauthorized`` in API-key mode when the key is missing, malformed or unknown.
        """
        if self._mode == "apiKey":
            return self._tenant_by_key(headers)
        for name in self._headers:
            value = headers.get(name, "").strip()
            if value:
                if not TENANT_ID.fullmatch(value):
                    # Not echoed: it may be long, binary, or a credential sent to the wrong place.
                    raise BadRequest(f"header {name!r} must be a tenant id: 1 to 253 characters "
                                     "of A-Z a-z 0-9 . _ : @ / -, starting with a letter or digit")
                return value
        return self._default_tenant

    @property
    def header_names(self) -> tuple[str, ...]:
        """The headers a tenant is read from (``KEY_HEADERS`` in API-key mode)."""
        return KEY_HEADERS if self._mode == "apiKey" else self._headers

    @property
    def credential_headers(self) -> tuple[str, ...]:
        """Headers to remove from the request before it reaches a model server: the key headers
        in API-key mode (the picker owns them), none in header mode (the gateway in front owns
        the credentials; an engine run with ``--api-key`` may need its own)."""
        return KEY_HEADERS if self._mode == "apiKey" else ()

    def _tenant_by_key(self, headers: Mapping[str, str]) -> str:
        # Messages never echo a header's value: it may hold a real key sent to the wrong place.
        key: str | None = None
        source = ""
        for name in KEY_HEADERS:
            value = headers.get(name, "").strip()
            if not value:
                continue
            token = _bearer_token(value) if name == "authorization" else value
            if not token or any(c.isspace() for c in token):
                raise Unauthorized(f"malformed {_SPELLING[name]} header; {_KEY_HELP}")
            if key is None:
                key, source = token, name
            elif token != key:
                raise Unauthorized(f"two different API keys in one request ({_SPELLING[source]} "
                                   f"and {_SPELLING[name]}); send one key")
        if key is None:
            raise Unauthorized(f"missing API key; {_KEY_HELP}")
        # A plain dict lookup on the digest is safe against timing attacks: the comparisons it
        # makes depend only on the digest of the presented key, and since nobody can choose a key
        # whose digest shares a prefix with a stored one (that needs SHA-256 preimages), timing
        # them teaches an attacker nothing about any stored hash or key. hmac.compare_digest
        # against every entry would cost O(keys) and protect nothing more.
        tenant = self._keys.get(hash_api_key(key))
        if tenant is None:
            raise Unauthorized("invalid API key")
        return tenant

    def __repr__(self) -> str:
        if self._mode == "apiKey":
            return f"Identity.api_keys(<{len(self._keys)} keys>)"
        return f"Identity.trusted_header({list(self._headers)!r}, {self._default_tenant!r})"


_SPELLING = {"authorization": "Authorization", "x-api-key": "x-api-key", "api-key": "api-key"}


def _bearer_token(value: str) -> str:
    """The token of ``Bearer <token>`` (scheme case-insensitive), or "" for any other form."""
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""
