"""Finding the API server and credentials: an explicit URL, or kubeconfig (as outside a cluster)."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
import yaml

from picker.k8s import KubeClient
from picker.k8s.client import ApiError, Gone, _error


def test_an_explicit_server_is_used_as_is_with_an_optional_token() -> None:
    client = KubeClient.from_environment("http://127.0.0.1:8080/")
    assert client.server == "http://127.0.0.1:8080"
    assert client._request_headers() == {"accept": "application/json"}
    client = KubeClient.from_environment("https://api.example:6443", token="t0k")
    assert client._request_headers()["authorization"] == "Bearer t0k"


def test_kubeconfig_gives_server_token_and_tls_settings(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "dev",
        "clusters": [{"name": "c", "cluster": {"server": "https://10.9.8.7:6443",
                                               "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "s3cret"}}],
        "contexts": [{"name": "dev", "context": {"cluster": "c", "user": "u"}},
                     {"name": "other", "context": {"cluster": "c", "user": "u"}}],
    }))
    client = KubeClient.from_environment(kubeconfig=str(kubeconfig))
    assert client.server == "https://10.9.8.7:6443"
    assert client._request_headers()["authorization"] == "Bearer s3cret"
    assert client._ssl is not None and client._ssl.verify_mode == ssl.CERT_NONE


def test_api_errors_carry_the_status_and_410_is_gone() -> None:
    error = _error(404, {"kind": "Status", "code": 404, "reason": "NotFound", "message": "x"})
    assert type(error) is ApiError and error.code == 404 and error.reason == "NotFound"
    assert isinstance(_error(200, {"code": 410, "reason": "Expired"}), Gone)
    assert _error(502, "<html>bad gateway</html>").code == 502
