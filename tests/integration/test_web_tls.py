"""The web config's TLS as Prometheus's exporters (exporter-toolkit, Go's crypto/tls) do it, against
a real server on 127.0.0.1 with real certificates made here: every client_auth_type with no client
certificate, one from an unknown issuer and one from the configured CA; failed handshakes logged
(rate limited); certificate files re-read when they change."""

from __future__ import annotations

import contextlib
import datetime
import http.client
import ipaddress
import logging
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from gpufootprint.exporter import webconfig
from gpufootprint.exporter.http import MetricsServer
from gpufootprint.exporter.webconfig import load_web_config
from prometheus_client.registry import CollectorRegistry

# One worker runs this file's tests (pytest-xdist --dist loadgroup): its module fixture is built once.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("test_web_tls")]

Key = ec.EllipticCurvePrivateKey


def _cert(cn: str, key: Key, issuer: tuple[x509.Certificate, Key] | None, *, ca: bool = False,
          server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    b = (x509.CertificateBuilder().subject_name(subject)
         .issuer_name(issuer[0].subject if issuer else subject).public_key(key.public_key())
         .serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
    if not ca:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                   else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return b.sign(issuer[1] if issuer else key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key: Key | None = None) -> None:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("test ca", ca_key, None, ca=True)
    _write(d / "ca", ca)
    for name, issuer in (("server", (ca, ca_key)), ("server2", (ca, ca_key)), ("client", (ca, ca_key)),
                         ("stranger", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        _write(d / name, _cert(name, key, issuer, server=name.startswith("server")), key)
    return d


def _serve(tmp: Path, pki: Path, mode: str) -> MetricsServer:
    (tmp / "server.crt").write_bytes((pki / "server.crt").read_bytes())
    (tmp / "server.key").write_bytes((pki / "server.key").read_bytes())
    ca = f"\n  client_ca_file: {pki / 'ca.crt'}" if "Verify" in mode else ""
    (tmp / "web.yml").write_text(f"tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
                                 f"  client_auth_type: {mode}{ca}\n")
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0, ready=lambda: True,
                           web_config=load_web_config(str(tmp / "web.yml")))
    server.start()
    return server


def _get(port: int, pki: Path, client: str | None) -> tuple[int | None, str]:
    """(HTTP status, server certificate CN); status None when the TLS connection failed."""
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if client:
        ctx.load_cert_chain(str(pki / f"{client}.crt"), str(pki / f"{client}.key"))
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
    try:
        conn.request("GET", "/healthz")
        status = conn.getresponse().status
        peer = conn.sock.getpeercert() if conn.sock else None
        cn = dict(x[0] for x in peer["subject"])["commonName"] if peer else ""
        return status, str(cn)
    except (ssl.SSLError, OSError, http.client.HTTPException):
        return None, ""
    finally:
        conn.close()


@pytest.fixture
def captured() -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(webconfig.__name__)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


# Go's crypto/tls: which clients each mode lets in
EXPECTED = {
    "NoClientCert": {None: True, "stranger": True, "client": True},
    "RequestClientCert": {None: True, "stranger": True, "client": True},
    "RequireAnyClientCert": {None: False, "stranger": True, "client": True},
    "VerifyClientCertIfGiven": {None: True, "stranger": False, "client": True},
    "RequireAndVerifyClientCert": {None: False, "stranger": False, "client": True},
}


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_client_auth_type_lets_in_whom_prometheus_exporters_let_in(mode: str, pki: Path, tmp_path: Path) -> None:
    server = _serve(tmp_path, pki, mode)
    try:
        got = {client: _get(server.port, pki, client)[0] == 200 for client in EXPECTED[mode]}
    finally:
        server.stop()
    assert got == EXPECTED[mode]


def test_failed_handshakes_are_logged_once_then_rate_limited(pki: Path, tmp_path: Path,
                                                              captured: list[logging.LogRecord]) -> None:
    server = _serve(tmp_path, pki, "RequireAndVerifyClientCert")
    try:
        for _ in range(3):
            assert _get(server.port, pki, "stranger")[0] is None
        deadline = time.monotonic() + 10
        while server.web_config.handshake_failures < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        server.stop()
    assert server.web_config.handshake_failures == 3
    warnings = [r for r in captured if r.levelno == logging.WARNING and "tls handshake failed" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "client=127.0.0.1" in warnings[0].getMessage()


def test_a_plain_http_client_on_the_tls_port_is_a_failed_handshake(pki: Path, tmp_path: Path) -> None:
    server = _serve(tmp_path, pki, "NoClientCert")
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            with contextlib.suppress(OSError):  # reset by the server
                s.recv(100)
        deadline = time.monotonic() + 10
        while server.web_config.handshake_failures < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        server.stop()
    assert server.web_config.handshake_failures == 1


def test_certificate_files_are_reread_when_they_change(pki: Path, tmp_path: Path,
                                                       captured: list[logging.LogRecord]) -> None:
    server = _serve(tmp_path, pki, "NoClientCert")
    try:
        assert _get(server.port, pki, None) == (200, "server")
        # WHEN the certificate is rotated in place, first the certificate alone (a pair that does not load)
        (tmp_path / "server.crt").write_bytes((pki / "server2.crt").read_bytes())
        time.sleep(webconfig.TLS_FILE_CHECK_S + 0.2)
        assert _get(server.port, pki, None) == (200, "server")  # the previous pair is kept
        assert any("do not load" in r.getMessage() for r in captured)
        # THEN with its key too, the next connection gets the new certificate, no SIGHUP needed
        (tmp_path / "server.key").write_bytes((pki / "server2.key").read_bytes())
        time.sleep(webconfig.TLS_FILE_CHECK_S + 0.2)
        assert _get(server.port, pki, None) == (200, "server2")
    finally:
        server.stop()


@pytest.mark.parametrize("mode", ["NoClientCert", "RequestClientCert", "RequireAnyClientCert"])
def test_the_image_healthcheck_speaks_tls_when_the_web_config_does(mode: str, pki: Path, tmp_path: Path) -> None:
    from gpufootprint.healthcheck import check

    server = _serve(tmp_path, pki, mode)
    try:
        assert check(f"0.0.0.0:{server.port}", str(tmp_path / "web.yml")) is None
        assert check(f"0.0.0.0:{server.port}", None) is not None  # plain HTTP to a TLS port fails
    finally:
        server.stop()
    assert check(f"127.0.0.1:{server.port}", str(tmp_path / "web.yml")) is not None  # stopped


def test_failed_handshakes_are_counted_in_the_daemons_metrics(pki: Path, tmp_path: Path) -> None:
    from gpufootprint.app import App
    from gpufootprint.configload import load_config

    (tmp_path / "server.crt").write_bytes((pki / "server.crt").read_bytes())
    (tmp_path / "server.key").write_bytes((pki / "server.key").read_bytes())
    (tmp_path / "web.yml").write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n")
    app = App(load_config(env={}, overrides={"exporter.web_config_file": str(tmp_path / "web.yml"),
                                             "exporter.render_interval_ms": 100}),
              socket_path=None, listen="127.0.0.1:0")
    app.start()
    try:
        assert app.http is not None
        with socket.create_connection(("127.0.0.1", app.http.port), timeout=10) as s:  # plain HTTP: no handshake
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            with contextlib.suppress(OSError):
                s.recv(100)
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        wanted = "gpufootprint_exporter_tls_handshake_failures_total 1.0"
        body = ""
        deadline = time.monotonic() + 10
        while wanted not in body and time.monotonic() < deadline:
            conn = http.client.HTTPSConnection("127.0.0.1", app.http.port, context=ctx, timeout=10)
            try:
                conn.request("GET", "/metrics")
                body = conn.getresponse().read().decode()
            finally:
                conn.close()
            time.sleep(0.1)
        assert wanted in body
    finally:
        app.stop()
