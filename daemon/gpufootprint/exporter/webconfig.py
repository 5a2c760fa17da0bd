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

Supported: the keys above plus ``max_version``. ``cipher_suites``, ``curve_preferences``,
``prefer_server_cipher_suites`` and ``http2`` are Go-specific and refused with a message rather
than silently ignored. Passwords are bcrypt only (the toolkit's only format); results are cached
by a hash of (user, stored hash, password) as the toolkit does, so a scrape every 15 s does not
pay bcrypt's deliberate ~50-250 ms each time.
"""

from __future__ import annotations

import base64
import hashlib
import ssl
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpufootprint.errors import ConfigError

_TLS_KEYS = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version"}
_GO_ONLY = {"cipher_suites", "curve_preferences", "prefer_server_cipher_suites", "client_allowed_sans"}
_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1, "TLS12": ssl.TLSVersion.TLSv1_2,
             "TLS13": ssl.TLSVersion.TLSv1_3}
_CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "RequestClientCert": ssl.CERT_OPTIONAL,
                "RequireAnyClientCert": ssl.CERT_REQUIRED, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
                "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
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
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: invalid YAML ({str(exc).splitlines()[0]})") from None
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping")
    unknown = set(data) - {"tls_server_config", "http_server_config", "basic_auth_users"}
    if unknown:
        raise ConfigError(f"{where}: {sorted(unknown)[0]}: unknown key "
                          "(known: basic_auth_users, http_server_config, tls_server_config)")
    base = Path(path).resolve().parent
    cfg = WebConfig(path=path)
    tls = data.get("tls_server_config")
    if tls:
        cfg.tls = _tls_context(tls, base, where)
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
    ctx.verify_mode = _CLIENT_AUTH[mode]
    if tls.get("client_ca_file"):
        try:
            ctx.load_verify_locations(str(base / str(tls["client_ca_file"])))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"{where}: tls_server_config.client_ca_file: cannot load ({exc})") from None
    elif mode in ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert"):
        raise ConfigError(f"{where}: tls_server_config.client_ca_file: required by client_auth_type {mode}")
    return ctx
