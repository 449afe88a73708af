"""TLS on the router's listener, its certificate read again when the files change.

Certificates in a cluster are short-lived (cert-manager renews them into the Secret a
pod mounts, and the kubelet swaps the files in place), so a listener that read them once
would serve an expired certificate weeks later, or need a restart for each renewal.
``ReloadingTls`` owns the one ``SSLContext`` uvicorn serves with (``factory``) and loads
the chain into it again when the certificate's or the key's file changes (checked every
``interval`` seconds on the server's loop: two ``stat`` calls). OpenSSL copies the
certificate into each connection when it is accepted, so connections already open keep
theirs and every new handshake gets the new one. A pair that fails to load (a
half-written renewal, a key that does not match) keeps the previous one serving, and is
tried again at the next change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl

log = logging.getLogger(__name__)


class ReloadingTls:
    """A server ``SSLContext`` that follows its certificate and key files."""

    def __init__(
        self, cert: str, key: str | None = None, client_ca: str | None = None,
        interval: float = 5.0,
    ) -> None:  # fmt: skip
        """``client_ca``: clients must present a certificate it signed (mutual TLS)."""
        self.cert = cert
        self.key = key
        self.interval = interval
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.context.set_alpn_protocols(["http/1.1"])
        if client_ca is not None:
            self.context.verify_mode = ssl.CERT_REQUIRED
            self.context.load_verify_locations(cafile=client_ca)
        self.context.load_cert_chain(cert, key)  # a bad pair at start is a config error
        self.stamp = self._stamp()
        self.reloads = 0
        self.failures = 0
        self._timer: asyncio.TimerHandle | None = None

    def _stamp(self) -> tuple[int, ...]:
        out: list[int] = []
        for path in (self.cert, self.key):
            if path is not None:
                st = os.stat(path)
                out += [st.st_mtime_ns, st.st_size, st.st_ino]
        return tuple(out)

    def check(self) -> bool:
        """Load the pair again if a file changed; whether new handshakes now get it."""
        try:
            stamp = self._stamp()
        except OSError as exc:  # mid-swap: a file briefly missing
            log.debug("tls: %s", exc)
            return False
        if stamp == self.stamp:
            return False
        self.stamp = stamp
        try:
            # tried on a scratch context first: a failed load leaves the one it ran on with
            # the new certificate and the old key, refusing every handshake
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.cert, self.key)
            self.context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            self.failures += 1
            log.warning("tls: %s and %s did not load (%s); serving the previous pair",
                        self.cert, self.key, exc)  # fmt: skip
            return False
        self.reloads += 1
        log.info("tls: certificate %s loaded again", self.cert)
        return True

    def factory(self, _config: object, _default: object) -> ssl.SSLContext:
        """uvicorn's ``ssl_context_factory``: this context, its files then checked every
        ``interval`` on the server's loop (uvicorn builds the context in it)."""
        if self._timer is None:
            with contextlib.suppress(RuntimeError):  # no loop: nothing to follow with
                self._next(asyncio.get_running_loop())
        return self.context

    def _next(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = loop.call_later(self.interval, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self.check()
        self._next(loop)
