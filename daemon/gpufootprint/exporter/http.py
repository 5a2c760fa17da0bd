"""The HTTP side: /metrics, /healthz, /readyz and JSON routes, on a bounded server (exporter/bounded.py).

prometheus_client's own ``start_http_server`` serves only /metrics; we need health
routes and JSON routes beside it, so we use its ``choose_encoder`` for content
negotiation (text or OpenMetrics, gzip) inside a small standard-library server.
With an ``ExpositionCache`` (the daemon's), /metrics writes out a body rendered ahead
of time (exporter/exposition.py); without one, it renders at each scrape.
"""

from __future__ import annotations

import gzip
import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from gpufootprint.exporter.bounded import WRITE_DEADLINE_S, BoundedHTTPServer, FastAnswer
from gpufootprint.exporter.exposition import ExpositionCache
from gpufootprint.exporter.webconfig import WebConfig

log = logging.getLogger(__name__)

JsonRoute = Callable[[], Any]


#: Paths served without basic auth (liveness and readiness probes carry no secrets and say nothing).
OPEN_PATHS = frozenset({"/healthz", "/readyz"})


@dataclass(frozen=True)
class HttpCounters:
    """What the HTTP side counted, copied at scrape time for the metrics."""

    auth_failures: int  # requests answered 401
    accept_errors: int  # failed accept() calls on the listener
    closed: tuple[tuple[str, int], ...]  # connections the server closed on its own, by reason
    tls_handshake_failures: int  # since the web config was last (re)loaded
    renders: int | None  # bodies rendered ahead (None: every scrape renders its own)
    render_errors: int | None  # renderings ahead that raised


class MetricsServer:
    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 ready: Callable[[], bool], json_routes: dict[str, JsonRoute] | None = None,
                 web_config: WebConfig | None = None, exposition: ExpositionCache | None = None) -> None:
        self.registry = registry
        self.exposition = exposition
        self.ready = ready
        self.json_routes = dict(json_routes or {})
        handler = _make_handler(self)
        self._negotiated: dict[tuple[str, str], tuple[Callable[..., bytes], str, bool]] = {}
        self.httpd = BoundedHTTPServer((host, port), handler, fast=self._fast)
        self.httpd.web_config = web_config or WebConfig()
        self.auth_failures = 0
        self._thread: threading.Thread | None = None

    def _fast(self, method: str, target: str, headers: Mapping[str, str]) -> FastAnswer | None:
        """What can be answered at once on the server's I/O thread: the health routes, and /metrics from
        the pre-rendered body when no password is asked. Everything else goes to a worker (Handler)."""
        path = target.split("?", 1)[0]
        web = self.web_config
        text = "text/plain; charset=utf-8"
        common = list(web.headers.items())
        if path == "/healthz":
            return 200, "OK", [*common, ("Content-Type", text)], b"ok\n"
        if path == "/readyz":
            ok = self.ready()
            return (200, "OK", [*common, ("Content-Type", text)], b"ready\n") if ok else \
                (503, "Service Unavailable", [*common, ("Content-Type", text)], b"not ready\n")
        if path == "/metrics" and self.exposition is not None and not web.users:
            key = (headers.get("accept", ""), headers.get("accept-encoding", ""))
            chosen = self._negotiated.get(key)
            if chosen is None:
                chosen = (*choose_encoder(key[0]), accepts_gzip(key[1]))
                if len(self._negotiated) < 64:  # scrapers send the same few headers every time
                    self._negotiated[key] = chosen
            encoder, content_type, gz = chosen
            body = self.exposition.cached(encoder, content_type, gz)
            if body is None:
                return None
            extra = [("Content-Encoding", "gzip")] if gz else []
            return 200, "OK", [*common, ("Content-Type", content_type), *extra], body
        return None

    @property
    def web_config(self) -> WebConfig:
        web: WebConfig = self.httpd.web_config
        return web

    def counters(self) -> HttpCounters:
        httpd, cache = self.httpd, self.exposition
        return HttpCounters(self.auth_failures, httpd.accept_errors,
                            (("evicted", httpd.evicted), ("refused", httpd.refused), ("timed_out", httpd.timed_out)),
                            self.web_config.handshake_failures, cache.renders if cache is not None else None,
                            cache.render_errors if cache is not None else None)

    def set_web_config(self, web_config: WebConfig) -> None:
        """SIGHUP: new TLS files and users apply from the next connection on."""
        self.httpd.web_config = web_config

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def url(self) -> str:
        host = str(self.httpd.server_address[0])
        shown = "localhost" if host in ("0.0.0.0", "127.0.0.1", "::") else host
        scheme = "https" if self.web_config.tls is not None else "http"
        return f"{scheme}://{shown}:{self.port}/metrics"

    def start(self) -> None:
        if self.exposition is not None:
            self.exposition.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="gpufootprint-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self.exposition is not None:
            self.exposition.stop()


def accepts_gzip(header: str) -> bool:
    """Does an Accept-Encoding header accept gzip? ``gzip;q=0`` (RFC 9110: "not acceptable") does not,
    nor does ``*;q=0``; ``*`` with a non-zero q does."""
    star: bool | None = None
    for part in header.split(","):
        coding, _, params = part.strip().partition(";")
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        coding = coding.strip().lower()
        if coding in ("gzip", "x-gzip"):
            return q > 0
        if coding == "*":
            star = q > 0
    return bool(star)


def _make_handler(server: MetricsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        timeout = WRITE_DEADLINE_S  # the request was read whole before this runs: this bounds the reply
        head = False

        def do_HEAD(self) -> None:  # what GET would answer, without the body
            self.head = True
            self.do_GET()

        def do_GET(self) -> None:  # http.server's naming
            path = self.path.split("?", 1)[0]
            web = server.web_config
            if path not in OPEN_PATHS and not web.check_authorization(self.headers.get("Authorization")):
                server.auth_failures += 1
                self._send(401, b"unauthorized\n", "text/plain; charset=utf-8",
                           extra={"WWW-Authenticate": 'Basic realm="gpufootprint"'})
                return
            try:
                if path == "/metrics":
                    encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                    gz = accepts_gzip(self.headers.get("Accept-Encoding", ""))
                    if server.exposition is not None:
                        body = server.exposition.body(encoder, content_type, gz)
                        self._send(200, body, content_type, gzipped=gz)
                    else:
                        self._send(200, encoder(server.registry), content_type, gzip_body=gz)
                elif path == "/healthz":
                    self._send(200, b"ok\n", "text/plain; charset=utf-8")
                elif path == "/readyz":
                    ok = server.ready()
                    self._send(200 if ok else 503, b"ready\n" if ok else b"not ready\n", "text/plain; charset=utf-8")
                elif path in server.json_routes:
                    body = json.dumps(server.json_routes[path](), indent=1).encode()
                    self._send(200, body, "application/json")
                elif path == "/":
                    links = "".join(f'<li><a href="{p}">{p}</a></li>' for p in
                                    ["/metrics", "/healthz", "/readyz", *server.json_routes])
                    self._send(200, f"<html><body><h1>gpufootprint</h1><ul>{links}</ul></body></html>".encode(),
                               "text/html; charset=utf-8")
                else:
                    self._send(404, b"not found\n", "text/plain; charset=utf-8")
            except BrokenPipeError:
                pass
            except Exception:  # one bad request must not stop the server
                log.exception("request %s failed", path)
                self._send(500, b"internal error\n", "text/plain; charset=utf-8")

        def _send(self, code: int, body: bytes, ctype: str, gzip_body: bool = False,
                  extra: dict[str, str] | None = None, gzipped: bool = False) -> None:
            """``gzip_body``: compress ``body`` here; ``gzipped``: it is compressed already."""
            if gzip_body:
                body = gzip.compress(body)
                gzipped = True
            self.send_response(code)
            for name, value in {**server.web_config.headers, **(extra or {})}.items():
                self.send_header(name, value)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            if gzipped:
                self.send_header("Content-Encoding", "gzip")
            self.end_headers()
            if not self.head:
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # signature from the base
            log.debug("http %s", format % args)

    return Handler
