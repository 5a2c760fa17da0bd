"""Ask for a client certificate and accept any (exporter-toolkit's RequestClientCert, RequireAnyClientCert).

Go's crypto/tls, and so every Prometheus exporter, can request a client certificate without
checking who signed it. Python's ssl module cannot: asking (CERT_OPTIONAL, CERT_REQUIRED) always
verifies the chain against the trusted CAs, so an unknown issuer fails the handshake ("unknown ca").
OpenSSL can: ``SSL_CTX_set_cert_verify_callback`` replaces the chain check. The ssl module does not
expose it, so it is called here through ctypes on the context's ``SSL_CTX``, in the same libssl the
ssl module has loaded. The pointer is trusted only after OpenSSL reads back, through it, the verify
modes Python set; otherwise the mode is refused with a message rather than half applied.
"""

from __future__ import annotations

import ctypes
import ssl

_VERIFY_CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


def _accept(_store_ctx: int | None, _arg: int | None) -> int:
    return 1  # chain accepted: whoever signed it


_ACCEPT_ANY = _VERIFY_CB(_accept)  # module level: OpenSSL keeps the pointer as long as the context lives
#: OpenSSL's SSL_VERIFY_PEER and SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT
_OPENSSL_MODES = {ssl.CERT_OPTIONAL: 0x01, ssl.CERT_REQUIRED: 0x03}


def _libssl() -> ctypes.CDLL:
    with open("/proc/self/maps") as maps:
        path = next((line.split()[-1] for line in maps if "/libssl.so" in line), None)
    if path is None:
        raise OSError("the ssl module's libssl is not mapped in this process")
    lib = ctypes.CDLL(path)
    lib.SSL_CTX_get_verify_mode.argtypes = [ctypes.c_void_p]
    lib.SSL_CTX_get_verify_mode.restype = ctypes.c_int
    lib.SSL_CTX_set_cert_verify_callback.argtypes = [ctypes.c_void_p, _VERIFY_CB, ctypes.c_void_p]
    lib.SSL_CTX_set_cert_verify_callback.restype = None
    return lib


def accept_any_client_certificate(ctx: ssl.SSLContext, mode: ssl.VerifyMode) -> None:
    """Set ``mode`` (CERT_OPTIONAL: request, CERT_REQUIRED: require) with no check of the issuer."""
    lib = _libssl()
    # PySSLContext: PyObject_HEAD, then the SSL_CTX pointer (Modules/_ssl.c, every CPython 3).
    raw = ctypes.c_void_p.from_address(id(ctx) + object.__basicsize__).value
    for probe in (ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
        ctx.verify_mode = probe
        if raw is None or lib.SSL_CTX_get_verify_mode(raw) != _OPENSSL_MODES[probe]:
            raise OSError("cannot reach OpenSSL's context behind this Python's ssl module")
    ctx.verify_mode = mode
    lib.SSL_CTX_set_cert_verify_callback(raw, _ACCEPT_ANY, None)
