"""TLS on the ext_proc port: which certificate the picker serves, and how a client that does not
verify (as the gateways do) dials it.

The gateways that implement the Inference Extension (Envoy AI Gateway, kgateway) always dial the
Endpoint Picker over TLS, with an ``UpstreamTlsContext`` that has no validation context: the
channel is encrypted, the picker is not authenticated. Upstream's picker therefore serves TLS by
default (``--secure-serving=true``) with a self-signed certificate generated at start, or the
``tls.crt``/``tls.key`` of ``--cert-path`` (a mounted Kubernetes TLS Secret). fairway does the
same:

* ``CertificateSource`` holds the certificate being served. gRPC asks it before every new TLS
  handshake (``grpc.dynamic_ssl_server_credentials``); from ``--cert-path`` it then compares the
  files' identity (inode, size, mtime) with the last it loaded and loads them again when they
  changed, so a rotated Secret is served to new connections without a restart. A pair that does
  not load, or whose key does not match its certificate (a rotation caught half-written), is
  logged and the last good pair is kept. A self-signed certificate is replaced a day before it
  expires.
* ``server_certificate`` and ``unverified_channel_credentials`` are for clients (tests, tools)
  that dial a picker the way a gateway does: they fetch the certificate the server presents and
  trust exactly that one.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import logging
import os
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

log = logging.getLogger(__name__)

CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"
"""The names in ``--cert-path``: those of a ``kubernetes.io/tls`` Secret's keys."""

SELF_SIGNED_VALIDITY = datetime.timedelta(days=365)
RENEW_BEFORE = datetime.timedelta(days=1)
"""A self-signed certificate is replaced when it has less than this left."""
DEFAULT_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class KeyPair:
    """A PEM certificate and its private key."""

    cert_pem: bytes
    key_pem: bytes
    not_after: datetime.datetime

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the DER certificate, hex (what ``openssl x509 -fingerprint`` prints)."""
        der = x509.load_pem_x509_certificate(self.cert_pem).public_bytes(
            serialization.Encoding.DER)
        return hashlib.sha256(der).hexdigest()

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.key_pem, self.cert_pem)])


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def self_signed(names: Sequence[str] = (), *,
                validity: datetime.timedelta = SELF_SIGNED_VALIDITY) -> KeyPair:
    """A new ECDSA P-256 key and a self-signed certificate for ``localhost``, the loopback
    addresses and ``names`` (the pod name, say), valid from five minutes ago (clock skew) for
    ``validity``."""
    all_names = list(dict.fromkeys([*names, *DEFAULT_NAMES]))
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fairway"),
                         x509.NameAttribute(NameOID.COMMON_NAME, all_names[0])])
    cert = (x509.CertificateBuilder()
            .subject_name(subject).issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + validity)
            .add_extension(x509.SubjectAlternativeName([_san(n) for n in all_names]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM),
                   key.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()),
                   cert.not_valid_after_utc)


def load_pair(directory: Path) -> KeyPair:
    """``tls.crt`` and ``tls.key`` of ``directory``, checked: both parse and the key is the
    certificate's. ``OSError`` when a file cannot be read, ``ValueError`` when they are not a
    matching pair (the message says which)."""
    cert_pem = (directory / CERT_FILE).read_bytes()
    key_pem = (directory / KEY_FILE).read_bytes()
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as error:
        raise ValueError(f"{directory / CERT_FILE}: not a PEM certificate ({error})") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{directory / KEY_FILE}: not an unencrypted PEM private key "
                         f"({error})") from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, public) != \
            cert.public_key().public_bytes(serialization.Encoding.DER, public):
        raise ValueError(f"{directory / KEY_FILE} is not the key of {directory / CERT_FILE}")
    return KeyPair(cert_pem, key_pem, cert.not_valid_after_utc)


def _identity(directory: Path) -> tuple[int, ...]:
    """What changes when either file is replaced (a Secret update swaps a symlink: new inodes;
    an in-place write: new size or mtime). ``stat`` follows the symlinks."""
    out: list[int] = []
    for name in (CERT_FILE, KEY_FILE):
        st = os.stat(directory / name)
        out += [st.st_ino, st.st_size, st.st_mtime_ns]
    return tuple(out)


class CertificateSource:
    """The certificate the ext_proc port serves: from ``cert_path`` (reloaded when its files
    change) or self-signed for ``names``.

    ``fetch`` is gRPC's certificate-configuration fetcher: called before each new handshake, on
    gRPC's threads, it returns a configuration when the certificate changed, else None.
    """

    def __init__(self, cert_path: Path | None = None, names: Sequence[str] = ()) -> None:
        self.cert_path = cert_path
        self.names = tuple(names)
        self._lock = threading.Lock()
        self._seen: tuple[int, ...] | None = None
        if cert_path is None:
            self.current = self_signed(self.names)
        else:
            self._seen = _identity(cert_path)
            self.current = load_pair(cert_path)
        self.reloads = 0
        """Certificates taken after the first (for tests and logs)."""

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials that serve ``current`` and ask ``fetch`` before each handshake.
        No client certificate is asked for: gateways present none."""
        return grpc.dynamic_ssl_server_credentials(self.current.configuration(), self.fetch,
                                                   require_client_authentication=False)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            with self._lock:
                changed = self._refresh()
                return self.current.configuration() if changed else None
        except Exception:  # an exception here would fail the handshake: keep the old pair
            log.exception("TLS certificate check failed; serving the previous certificate")
            return None

    def _refresh(self) -> bool:
        if self.cert_path is None:
            if self.current.not_after - datetime.datetime.now(datetime.UTC) > RENEW_BEFORE:
                return False
            self.current = self_signed(self.names)
            log.info("self-signed TLS certificate renewed: sha256 %s", self.current.fingerprint)
            self.reloads += 1
            return True
        try:
            identity = _identity(self.cert_path)
        except OSError as error:  # mid-rotation, or the mount is gone: keep serving
            log.warning("TLS certificate in %s unreadable (%s); serving the previous one",
                        self.cert_path, error)
            return False
        if identity == self._seen:
            return False
        self._seen = identity  # tried once per change: a bad pair is logged once
        try:
            pair = load_pair(self.cert_path)
        except (OSError, ValueError) as error:
            log.warning("TLS certificate in %s not loaded (%s); serving the previous one",
                        self.cert_path, error)
            return False
        if pair.cert_pem == self.current.cert_pem and pair.key_pem == self.current.key_pem:
            return False
        self.current = pair
        self.reloads += 1
        log.info("TLS certificate reloaded from %s: sha256 %s", self.cert_path,
                 pair.fingerprint)
        return True


def server_certificate(host: str, port: int, timeout: float = 5.0) -> bytes:
    """The PEM certificate a TLS server presents on ``host:port``, unverified."""
    return ssl.get_server_certificate((host, port), timeout=timeout).encode()


def unverified_channel_credentials(host: str, port: int,
                                   timeout: float = 5.0) -> grpc.ChannelCredentials:
    """Channel credentials that trust exactly the certificate ``host:port`` presents now: a
    gateway's "TLS without verification", for gRPC clients (which always verify). The
    self-signed certificate names ``localhost`` and the loopback addresses, so dial one of
    those (or override the target name)."""
    return grpc.ssl_channel_credentials(root_certificates=server_certificate(host, port, timeout))
