"""A stand-in for the Kubernetes API server: a real local HTTP server that answers every GET
with one JSON body and records each request's path and Authorization header."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeKubeApi:
    def __init__(self, body: bytes) -> None:
        self.requests: list[tuple[str, str | None]] = []  # (path, Authorization)
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                api.requests.append((self.path, self.headers.get("Authorization")))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    @property
    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]

    def __enter__(self) -> FakeKubeApi:  # noqa: PYI034 - a test helper, never subclassed
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
