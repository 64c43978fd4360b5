"""TLS for the listeners: TLS 1.2 or later only, forward-secret AEAD ciphers,
and certificates reloaded in place (``SIGHUP``) without dropping a connection.

Why reloading in place drops nothing::

    Certificates.context ──(one per listener)──> trio.SSLListener
         │                                          │ each accepted connection:
         │ reload(): load_cert_chain(new files)     └─> SSLObject made from the context
         ▼                                               (its certificate fixed at handshake)
    handshakes from now on present the new certificate;
    connections already up keep the SSLObject they have

OpenSSL copies the context's certificate and key into each connection's
``SSL`` object when it is made, so loading a new chain into the live context
changes only later handshakes. The new files are first loaded into a scratch
context: a failed ``load_cert_chain`` may leave a context holding the new
certificate with the old key, so a bad pair (a key that does not match, a
half-written file) must never reach the live one; the old certificate then
stays in service and the error is reported.

Policy (Mozilla's "intermediate" profile): TLS 1.2 and 1.3 only; for 1.2,
ECDHE key exchange with AES-GCM or ChaCha20-Poly1305, server's preference
(TLS 1.3's suites are all AEAD and forward secret, and fixed by OpenSSL); no
compression (CRIME), no renegotiation, a fresh ECDH key per handshake.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence

__all__ = ["CIPHERS", "HANDSHAKE_TIMEOUT", "Certificates", "server_context"]

CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"
HANDSHAKE_TIMEOUT = 10.0  # seconds a client may take over its TLS handshake (hypercorn: 60)
_OPTIONS = ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE | ssl.OP_NO_RENEGOTIATION | ssl.OP_SINGLE_ECDH_USE


def server_context(certfile: str, keyfile: str, alpn: Sequence[str] = ("h2", "http/1.1")) -> ssl.SSLContext:
    """A server context with the policy above and ``certfile``/``keyfile``
    loaded; raises ``OSError`` or ``ssl.SSLError`` on bad files."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(CIPHERS)
    context.options |= _OPTIONS
    context.set_alpn_protocols(list(alpn))
    context.load_cert_chain(certfile, keyfile)
    return context


class Certificates:
    """One listener's certificate and key files and the live context made
    from them; :meth:`reload` re-reads the files into that context."""

    def __init__(self, certfile: str, keyfile: str, alpn: Sequence[str] = ("h2", "http/1.1")) -> None:
        self.certfile, self.keyfile, self.alpn = certfile, keyfile, tuple(alpn)
        self.context = server_context(certfile, keyfile, self.alpn)
        self.reloads = 0

    def reload(self) -> None:
        """New handshakes present what the files hold now. Raises
        ``OSError`` or ``ssl.SSLError`` (the old certificate stays) when the
        files do not load as a matching pair."""
        server_context(self.certfile, self.keyfile, self.alpn)  # a scratch copy first: see the module docstring
        self.context.load_cert_chain(self.certfile, self.keyfile)
        self.reloads += 1
