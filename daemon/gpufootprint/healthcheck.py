"""``python -m gpufootprint.healthcheck``: exit 0 when the local daemon answers /healthz, else 1.

The image's HEALTHCHECK. It reads the daemon's own configuration (file, ``GPUFOOTPRINT_*``
environment, the same flags) to find the port and the web config, so it speaks TLS when the
daemon does. It checks that this container's daemon is alive, not who it is: the server
certificate is not verified, and where the web config asks for a client certificate the daemon's
own certificate is presented (enough for RequestClientCert and RequireAnyClientCert; with
RequireAndVerifyClientCert, only if ``client_ca_file`` signed the server certificate too and the
certificate allows client use: extended key usage clientAuth, or none).
/healthz needs no basic auth.
"""

from __future__ import annotations

import argparse
import http.client
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path

from gpufootprint.configload import load_config, parse_listen
from gpufootprint.errors import GpuFootprintError
from gpufootprint.exporter.webconfig import load_web_config

_ANY_HOST = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def check(listen: str, web_config_file: str | None, timeout: float = 2.0) -> str | None:
    """None when /healthz answers 200, else what went wrong."""
    host, port = parse_listen(listen, "exporter.listen")
    host = _ANY_HOST.get(host, host)
    web = load_web_config(web_config_file)
    conn: http.client.HTTPConnection
    if web.tls is not None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        own = web.cert_and_key()
        if own is not None:  # presented only where the server asks for a client certificate
            ctx.load_cert_chain(str(own[0]), str(own[1]))
        conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=ctx)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/healthz")
        status = conn.getresponse().status
    except (OSError, http.client.HTTPException) as exc:
        return f"{host}:{port}: {exc}"
    finally:
        conn.close()
    return None if status == 200 else f"{host}:{port}: /healthz answered {status}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpufootprint.healthcheck", description=__doc__.splitlines()[0])
    ap.add_argument("--config", metavar="FILE")
    ap.add_argument("--listen", metavar="HOST:PORT")
    ap.add_argument("--web.config.file", dest="web_config_file", metavar="FILE")
    args = ap.parse_args(argv)
    overrides = {k: v for k, v in (("exporter.listen", args.listen),
                                   ("exporter.web_config_file", args.web_config_file)) if v is not None}
    try:
        config = load_config(Path(args.config) if args.config else None, overrides=overrides)
        problem = check(config.exporter.listen, config.exporter.web_config_file)
    except (GpuFootprintError, ssl.SSLError, OSError) as exc:
        problem = str(exc)
    if problem is not None:
        print(f"gpufootprint healthcheck: error: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
