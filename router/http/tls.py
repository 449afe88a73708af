"""TLS contexts that follow their files: the listener's, and the one the router shows engines.

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

The same holds for the router's side of mutual TLS to the engines (``engine_tls``): a
client context whose certificate the engines check (and whose CA bundle checks theirs),
followed the same way, shared by the proxy's connections and the health checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl

log = logging.getLogger(__name__)


class ReloadingTls:
    """An ``SSLContext`` that follows its certificate and key files."""

    def __init__(
        self, cert: str | None, key: str | None = None, client_ca: str | None = None,
        interval: float = 5.0, *, context: ssl.SSLContext | None = None,
    ) -> None:  # fmt: skip
        """A server context by default; ``client_ca``: clients must present a certificate
        it signed (mutual TLS). ``context``: a client context to follow instead, its
        certificate optional (``engine_tls``)."""
        self.cert = cert
        self.key = key
        self.interval = interval
        if context is None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            if client_ca is not None:
                context.verify_mode = ssl.CERT_REQUIRED
                context.load_verify_locations(cafile=client_ca)
        self.context = context
        self.context.set_alpn_protocols(["http/1.1"])
        self._side = context.protocol
        if cert is not None:  # a bad pair at start is a config error
            self.context.load_cert_chain(cert, key)
        self.stamp = self._stamp()
        self.reloads = 0
        self.failures = 0
        self._timer: asyncio.TimerHandle | None = None

    def _stamp(self) -> tuple[int, ...]:
        out: list[int] = []
        for path in (self.cert, self.key):  # (neither: nothing to follow, an empty stamp)
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
        if stamp == self.stamp or self.cert is None:
            return False
        self.stamp = stamp
        try:
            # tried on a scratch context first: a failed load leaves the one it ran on with
            # the new certificate and the old key, refusing every handshake
            ssl.SSLContext(self._side).load_cert_chain(self.cert, self.key)
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
        self.follow()
        return self.context

    def follow(self) -> None:
        """Check the files every ``interval`` on the running loop from now on."""
        if self._timer is None and self.cert is not None:
            with contextlib.suppress(RuntimeError):  # no loop: nothing to follow with
                self._next(asyncio.get_running_loop())

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _next(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = loop.call_later(self.interval, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self.check()
        self._next(loop)


def engine_tls(
    ca: str | None, cert: str | None, key: str | None, check_hostname: bool = True
) -> ReloadingTls:
    """The context the router connects to ``https://`` engines with: their certificates
    checked against ``ca`` (the system's CAs without it), and ``cert`` shown to them when
    they ask for one (mutual TLS). ``check_hostname`` off: engines addressed by pod IP
    whose certificates name only their Service (the chain is still checked)."""
    context = ssl.create_default_context(cafile=ca)
    context.check_hostname = check_hostname
    return ReloadingTls(cert, key, context=context)
