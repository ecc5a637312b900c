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

Who may speak ext_proc (``ClientAuth``): whoever reaches the port can name any tenant in header
mode and have it charged, so the picker authenticates its client. ``mtls`` (``--client-ca``): the
handshake requires a client certificate signed by the configured CA (reloaded with the serving
pair), optionally one of ``--client-name`` (a SAN or the CN), checked on each stream. Without a
CA, ``none`` (the default) serves ext_proc to anyone but refuses every stream while the config is
in header mode: an unauthenticated peer's tenant header is not believed, and rather than
charge the default tenant for it (which would route and charge on an impostor's say, and bill a
misconfigured gateway's every tenant as one, silently) the stream is refused, loudly (the
gateway answers 5xx, the picker counts and logs why). API-key mode is served: the picker
authenticates each request itself. ``trust-network`` is the explicit development mode: no client
certificate, tenant headers believed from whoever connects (a NetworkPolicy is then all that
stands between a pod and every tenant's budget).
``certificate_authority`` and ``issue`` make the CA and the certificates for tests and the stack.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import logging
import os
import ssl
import threading
from collections.abc import Iterable, Mapping, Sequence
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

    def configuration(self, client_ca: bytes | None = None
                      ) -> grpc.ServerCertificateConfiguration:
        """This pair served; ``client_ca``: the PEM CAs a client certificate must chain to."""
        return grpc.ssl_server_certificate_configuration([(self.key_pem, self.cert_pem)],
                                                         root_certificates=client_ca)

    def write(self, directory: Path, cert_file: str = CERT_FILE,
              key_file: str = KEY_FILE) -> tuple[Path, Path]:
        """Write the pair (as a TLS Secret's keys by default); returns the two paths."""
        directory.mkdir(parents=True, exist_ok=True)
        cert, key = directory / cert_file, directory / key_file
        cert.write_bytes(self.cert_pem)
        key.write_bytes(self.key_pem)
        key.chmod(0o600)
        return cert, key


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
    subject = _subject(all_names[0])
    cert = (_builder(subject, subject, key, validity)
            .add_extension(x509.SubjectAlternativeName([_san(n) for n in all_names]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return _pair(cert, key)


def _subject(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fairway"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey,
             validity: datetime.timedelta) -> x509.CertificateBuilder:
    """A certificate of ``key`` valid from five minutes ago (clock skew) for ``validity``."""
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder()
            .subject_name(subject).issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + validity))


def _pair(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> KeyPair:
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM),
                   key.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()),
                   cert.not_valid_after_utc)


def certificate_authority(name: str = "fairway-ca", *,
                          validity: datetime.timedelta = SELF_SIGNED_VALIDITY) -> KeyPair:
    """A new self-signed CA (ECDSA P-256) that signs only certificates (``issue``): what the
    chart's ``genCA`` makes for the gateway's client certificate, for tests and the stack."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = _subject(name)
    cert = (_builder(subject, subject, key, validity)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return _pair(cert, key)


def issue(ca: KeyPair, names: Sequence[str], *, client: bool = True,
          validity: datetime.timedelta = SELF_SIGNED_VALIDITY) -> KeyPair:
    """A certificate for ``names`` (the first is also the CN) signed by ``ca``: a client
    certificate (the gateway's) or, with ``client=False``, a server certificate."""
    if not names:
        raise ValueError("a certificate needs at least one name")
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    usage = x509.ExtendedKeyUsageOID.CLIENT_AUTH if client \
        else x509.ExtendedKeyUsageOID.SERVER_AUTH
    cert = (_builder(_subject(names[0]), ca_cert.subject, key, validity)
            .add_extension(x509.SubjectAlternativeName([_san(n) for n in names]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return _pair(cert, key)


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

    def __init__(self, cert_path: Path | None = None, names: Sequence[str] = (),
                 client_ca: Path | None = None) -> None:
        self.cert_path = cert_path
        self.names = tuple(names)
        self.client_ca = client_ca
        """A PEM file of the CAs a client certificate must chain to (``--client-ca``): set, the
        handshake requires one (mTLS); reloaded when the file changes, like the pair."""
        self._lock = threading.Lock()
        self._seen: tuple[int, ...] | None = None
        if cert_path is None:
            self.current = self_signed(self.names)
        else:
            self._seen = _identity(cert_path)
            self.current = load_pair(cert_path)
        self._ca_seen: tuple[int, ...] | None = None
        self.client_ca_pem: bytes | None = None
        if client_ca is not None:
            self._ca_seen = _file_identity(client_ca)
            self.client_ca_pem = load_ca(client_ca)
        self.reloads = 0
        """Certificates taken after the first (for tests and logs)."""

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials that serve ``current`` and ask ``fetch`` before each handshake.
        A client certificate is required (and verified against ``client_ca``) only with a CA."""
        # gRPC takes None from fetch as "no change"; its stubs declare the configuration only.
        return grpc.dynamic_ssl_server_credentials(
            self.current.configuration(self.client_ca_pem),
            self.fetch,  # type: ignore[arg-type]
            require_client_authentication=self.client_ca_pem is not None)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            with self._lock:
                changed = self._refresh()
                changed = self._refresh_ca() or changed
                return self.current.configuration(self.client_ca_pem) if changed else None
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


    def _refresh_ca(self) -> bool:
        if self.client_ca is None:
            return False
        try:
            identity = _file_identity(self.client_ca)
            if identity == self._ca_seen:
                return False
            self._ca_seen = identity
            pem = load_ca(self.client_ca)
        except (OSError, ValueError) as error:
            log.warning("client CA %s not loaded (%s); verifying against the previous one",
                        self.client_ca, error)
            return False
        if pem == self.client_ca_pem:
            return False
        self.client_ca_pem = pem
        self.reloads += 1
        log.info("client CA reloaded from %s", self.client_ca)
        return True


def _file_identity(path: Path) -> tuple[int, ...]:
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def load_ca(path: Path) -> bytes:
    """The PEM CA certificates of ``path`` (a bundle may hold several, as during a rotation),
    checked to parse: ``ValueError`` names the file when none does."""
    pem = path.read_bytes()
    try:
        certificates = x509.load_pem_x509_certificates(pem)
    except ValueError as error:
        raise ValueError(f"{path}: not PEM CA certificates ({error})") from None
    if not certificates:
        raise ValueError(f"{path}: no certificate")
    return pem


CLIENT_AUTH_MODES = ("mtls", "none", "trust-network")
"""``--client-auth``: who may speak ext_proc (module docstring)."""


@dataclass(frozen=True)
class ClientAuth:
    """Who may speak ext_proc: the rule ``ExternalProcessor`` applies to each stream."""

    mode: str = "none"
    names: frozenset[str] = frozenset()
    """With ``mtls``: the client certificate must carry one of these (a DNS, URI or IP SAN, or
    its CN); empty: any certificate the CA signed."""

    def __post_init__(self) -> None:
        if self.mode not in CLIENT_AUTH_MODES:
            raise ValueError(f"--client-auth must be one of {', '.join(CLIENT_AUTH_MODES)}")
        if self.names and self.mode != "mtls":
            raise ValueError("--client-name needs --client-ca (mTLS)")

    def refusal(self, context: grpc.aio.ServicerContext, header_mode: bool) -> str | None:
        """Why this stream's peer may not speak ext_proc, or None. Only a pinned name costs a
        look at the connection (the handshake verified the chain already)."""
        if self.mode == "trust-network":
            return None
        if self.mode == "none":
            return UNAUTHENTICATED_HEADER_MODE if header_mode else None
        if not self.names:
            return None
        presented = peer_names(context.auth_context())
        if presented & self.names:
            return None
        return f"client certificate names {sorted(presented)[:4]} are not among --client-name"


UNAUTHENTICATED_HEADER_MODE = (
    "tenancy.mode is header and this connection has no verified client certificate: a tenant "
    "header is believed only from an authenticated gateway (--client-ca), or with the explicit "
    "--client-auth=trust-network")


def peer_names(auth_context: Mapping[str, Iterable[bytes]]) -> set[str]:
    """The SANs and CN of a verified client certificate, from gRPC's auth context."""
    return {value.decode(errors="replace")
            for key in ("x509_subject_alternative_name", "x509_common_name")
            for value in auth_context.get(key, ())}


def server_certificate(host: str, port: int, timeout: float = 5.0) -> bytes:
    """The PEM certificate a TLS server presents on ``host:port``, unverified."""
    return ssl.get_server_certificate((host, port), timeout=timeout).encode()


def unverified_channel_credentials(host: str, port: int, timeout: float = 5.0,
                                   client: KeyPair | None = None) -> grpc.ChannelCredentials:
    """Channel credentials that trust exactly the certificate ``host:port`` presents now: a
    gateway's "TLS without verification", for gRPC clients (which always verify). The
    self-signed certificate names ``localhost`` and the loopback addresses, so dial one of
    those (or override the target name). ``client``: the certificate to present (mTLS)."""
    return grpc.ssl_channel_credentials(
        root_certificates=server_certificate(host, port, timeout),
        private_key=client.key_pem if client else None,
        certificate_chain=client.cert_pem if client else None)
