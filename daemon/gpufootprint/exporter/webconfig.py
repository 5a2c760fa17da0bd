"""TLS and basic auth for the HTTP endpoints, from a Prometheus exporter-toolkit web config file.

The file is the one every Prometheus exporter reads with ``--web.config.file``
(prometheus/exporter-toolkit, docs/web-configuration.md)::

    tls_server_config:
      cert_file: server.crt          # relative paths are relative to this file
      key_file: server.key
      client_auth_type: NoClientCert # or RequireAndVerifyClientCert, VerifyClientCertIfGiven, ...
      client_ca_file: ca.crt
      min_version: TLS12
    http_server_config:
      headers: {X-Frame-Options: deny}
    basic_auth_users:
      prometheus: $2y$10$...          # bcrypt hash (htpasswd -nBC 10 "" | tr -d ':\\n')

``client_auth_type`` behaves as in Go's crypto/tls: RequestClientCert asks for a certificate and
takes any (or none), RequireAnyClientCert takes any but needs one, VerifyClientCertIfGiven checks
one against ``client_ca_file`` when given, RequireAndVerifyClientCert needs a checked one.
The certificate, key and CA files are re-read when they change (checked at most once a second,
at a new connection); a half-rotated pair that does not load keeps the previous one, logged.
A failed handshake is logged as a warning, at most once a minute with the count since.

Supported: the keys above plus ``max_version``. ``cipher_suites``, ``curve_preferences``,
``prefer_server_cipher_suites`` and ``http2`` are Go-specific and refused with a message rather
than silently ignored. Passwords are bcrypt only (the toolkit's only format); results are cached
by a hash of (user, stored hash, password) as the toolkit does, so a scrape every 15 s does not
pay bcrypt's deliberate ~50-250 ms each time.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import ssl
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufootprint.errors import ConfigError
from gpufootprint.yamlsafe import read_yaml_file

log = logging.getLogger(__name__)

_TLS_KEYS = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version"}
_GO_ONLY = {"cipher_suites", "curve_preferences", "prefer_server_cipher_suites", "client_allowed_sans"}
_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1, "TLS12": ssl.TLSVersion.TLSv1_2,
             "TLS13": ssl.TLSVersion.TLSv1_3}
# (OpenSSL verify mode, whether the chain is checked against client_ca_file)
_CLIENT_AUTH = {"NoClientCert": (ssl.CERT_NONE, False), "RequestClientCert": (ssl.CERT_OPTIONAL, False),
                "RequireAnyClientCert": (ssl.CERT_REQUIRED, False),
                "VerifyClientCertIfGiven": (ssl.CERT_OPTIONAL, True),
                "RequireAndVerifyClientCert": (ssl.CERT_REQUIRED, True)}
#: how often a new connection may stat the TLS files, and how often a failed handshake is logged
TLS_FILE_CHECK_S = 1.0
HANDSHAKE_LOG_S = 60.0
# Checked when the user is unknown, so a wrong user name takes as long as a wrong password.
_DUMMY_HASH = b"$2b$10$" + b"C" * 53
_CACHE_SIZE = 256


@dataclass
class WebConfig:
    path: str | None = None
    tls: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    _cache: OrderedDict[bytes, bool] = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # TLS file reloads: what the context was built from, and the files' state then
    _tls_source: tuple[dict[str, Any], Path, str] | None = field(default=None, repr=False)
    _tls_stamp: tuple[tuple[int, int, int], ...] = field(default=(), repr=False)
    _tls_next_check: float = field(default=0.0, repr=False)
    handshake_failures: int = 0
    _handshake_logged: int = field(default=0, repr=False)
    _handshake_next_log: float = field(default=0.0, repr=False)

    def cert_and_key(self) -> tuple[Path, Path] | None:
        """The server's certificate and key files, as the web config names them (None: no TLS)."""
        if self._tls_source is None:
            return None
        tls, base, _ = self._tls_source
        return base / str(tls["cert_file"]), base / str(tls["key_file"])

    def current_tls(self) -> ssl.SSLContext | None:
        """The TLS context for a new connection, rebuilt first if a certificate, key or CA file changed."""
        if self._tls_source is None:
            return self.tls
        now = time.monotonic()
        with self._lock:
            if now < self._tls_next_check:
                return self.tls
            self._tls_next_check = now + TLS_FILE_CHECK_S
            tls, base, where = self._tls_source
            stamp = _stamp(_tls_files(tls, base))
            if stamp == self._tls_stamp:
                return self.tls
            self._tls_stamp = stamp  # a broken file is tried again when it changes, not every second
            try:
                self.tls = _tls_context(tls, base, where)
            except ConfigError as exc:
                log.error("tls files changed but do not load, keeping the previous ones: %s", exc)
            else:
                log.info("tls files changed: reloaded %s", ", ".join(str(p) for p in _tls_files(tls, base)))
            return self.tls

    def handshake_failed(self, client: Any, exc: BaseException) -> None:
        """Count a failed TLS handshake; log the first, then at most once a minute with the count."""
        now = time.monotonic()
        with self._lock:
            self.handshake_failures += 1
            if now < self._handshake_next_log:
                return
            self._handshake_next_log = now + HANDSHAKE_LOG_S
            since, self._handshake_logged = self.handshake_failures - self._handshake_logged, self.handshake_failures
        host = client[0] if isinstance(client, tuple) and client else client
        log.warning("tls handshake failed client=%s error=%r failures_since_last_log=%d", host,
                    getattr(exc, "reason", None) or str(exc), since)

    @property
    def auth_required(self) -> bool:
        return bool(self.users)

    def check_authorization(self, header: str | None) -> bool:
        """True when basic auth is off, or ``header`` carries a known user and its password."""
        if not self.users:
            return True
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, sep, password = base64.b64decode(header[6:].strip(), validate=True).decode("utf-8").partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        if not sep:
            return False
        stored = self.users.get(user)
        key = hashlib.sha256(b"\0".join([user.encode(), stored or b"", password.encode()])).digest()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit and stored is not None
        import bcrypt  # lazily: only configurations with basic_auth_users need it

        try:
            ok = bcrypt.checkpw(password.encode(), stored if stored is not None else _DUMMY_HASH)
        except ValueError:
            ok = False
        ok = ok and stored is not None
        with self._lock:
            self._cache[key] = ok
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return ok


def load_web_config(path: str | None) -> WebConfig:
    """Read and check the file; every error names the file and the key."""
    if not path:
        return WebConfig()
    where = f"web config {path}"
    data = read_yaml_file(path, "web config") or {}  # no aliases, bounded depth and size, as the config
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping")
    unknown = set(data) - {"tls_server_config", "http_server_config", "basic_auth_users"}
    if unknown:
        raise ConfigError(f"{where}: {min(unknown)}: unknown key "
                          "(known: basic_auth_users, http_server_config, tls_server_config)")
    base = Path(path).resolve().parent
    cfg = WebConfig(path=path)
    tls = data.get("tls_server_config")
    if tls:
        cfg.tls = _tls_context(tls, base, where)
        cfg._tls_source = (dict(tls), base, where)
        cfg._tls_stamp = _stamp(_tls_files(tls, base))
    http = data.get("http_server_config") or {}
    if not isinstance(http, dict):
        raise ConfigError(f"{where}: http_server_config: expected a mapping")
    for key, value in http.items():
        if key == "headers":
            if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in value.items()):
                raise ConfigError(f"{where}: http_server_config.headers: expected a mapping of strings")
            if any("\n" in k or "\r" in k or "\n" in v or "\r" in v for k, v in value.items()):
                raise ConfigError(f"{where}: http_server_config.headers: a header contains a line break")
            cfg.headers = dict(value)
        elif key != "http2":  # HTTP/2 is a Go server option; this server speaks HTTP/1.1
            raise ConfigError(f"{where}: http_server_config.{key}: unknown key (known: headers, http2)")
    users = data.get("basic_auth_users") or {}
    if not isinstance(users, dict):
        raise ConfigError(f"{where}: basic_auth_users: expected a mapping of user to bcrypt hash")
    for user, hashed in users.items():
        if not isinstance(hashed, str) or not hashed.startswith(("$2a$", "$2b$", "$2y$")):
            raise ConfigError(f"{where}: basic_auth_users.{user}: expected a bcrypt hash ($2y$..., as htpasswd -B "
                              "writes)")
        cfg.users[str(user)] = hashed.encode()
    if cfg.users:
        try:
            import bcrypt  # noqa: F401 - fail at load, not at the first scrape
        except ImportError:
            raise ConfigError(f"{where}: basic_auth_users needs the bcrypt package (pip install bcrypt)") from None
    return cfg


def _tls_context(tls: Any, base: Path, where: str) -> ssl.SSLContext:
    if not isinstance(tls, dict):
        raise ConfigError(f"{where}: tls_server_config: expected a mapping")
    for key in tls:
        if key in _GO_ONLY:
            raise ConfigError(f"{where}: tls_server_config.{key}: not supported by gpufootprint (Python's ssl "
                              "module chooses ciphers and curves); remove it")
        if key not in _TLS_KEYS:
            raise ConfigError(f"{where}: tls_server_config.{key}: unknown key (known: {', '.join(sorted(_TLS_KEYS))})")
    for key in ("cert_file", "key_file"):
        if not tls.get(key):
            raise ConfigError(f"{where}: tls_server_config.{key}: required")
    cert, key = base / str(tls["cert_file"]), base / str(tls["key_file"])
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{where}: tls_server_config: cannot load {cert} / {key} ({exc})") from None
    for name, attr in (("min_version", "minimum_version"), ("max_version", "maximum_version")):
        if tls.get(name) is not None:
            if tls[name] not in _VERSIONS:
                raise ConfigError(f"{where}: tls_server_config.{name}: {tls[name]!r} is not one of "
                                  f"{', '.join(_VERSIONS)}")
            setattr(ctx, attr, _VERSIONS[tls[name]])
    if tls.get("min_version") is None:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2  # the toolkit's default
    mode = tls.get("client_auth_type", "NoClientCert")
    if mode not in _CLIENT_AUTH:
        raise ConfigError(f"{where}: tls_server_config.client_auth_type: {mode!r} is not one of "
                          f"{', '.join(_CLIENT_AUTH)}")
    verify_mode, checked = _CLIENT_AUTH[mode]
    if tls.get("client_ca_file"):
        try:
            ctx.load_verify_locations(str(base / str(tls["client_ca_file"])))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"{where}: tls_server_config.client_ca_file: cannot load ({exc})") from None
    elif checked:
        raise ConfigError(f"{where}: tls_server_config.client_ca_file: required by client_auth_type {mode}")
    if verify_mode != ssl.CERT_NONE and not checked:
        from gpufootprint.exporter.tlsverify import accept_any_client_certificate

        try:
            accept_any_client_certificate(ctx, verify_mode)
        except OSError as exc:
            raise ConfigError(f"{where}: tls_server_config.client_auth_type: {mode} is not available here "
                              f"({exc}); use VerifyClientCertIfGiven or RequireAndVerifyClientCert") from None
    else:
        ctx.verify_mode = verify_mode
    return ctx


def _tls_files(tls: dict[str, Any], base: Path) -> list[Path]:
    return [base / str(tls[k]) for k in ("cert_file", "key_file", "client_ca_file") if tls.get(k)]


def _stamp(paths: list[Path]) -> tuple[tuple[int, int, int], ...]:
    """What changes when a file is rewritten or replaced (a Kubernetes secret swaps a symlink)."""
    out = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            out.append((-1, -1, -1))
        else:
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(out)
