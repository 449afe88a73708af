"""Client writes of one loop iteration sent as one: the response head with its body.

uvicorn writes a response's status line and headers as soon as the app sends
``http.response.start``, and its body with each ``http.response.body``: two ``send()``
syscalls for every non-streamed answer, and on loopback each one also runs the
receiver's side of TCP. py-spy on bench/hotpath.py's saturation phase (short chat
requests, 16 workers) had those two writes at 12 % of the event loop's samples. The
proxy sends the head and a complete body in the same iteration, so holding writes until
the iteration ends (``call_soon``) makes them one syscall and one segment; a streamed
answer's head leaves a few microseconds later than it did, with nothing reordered.

Every write, the protocol's own (a 400, a refusal) included, goes through the same
buffer, so bytes leave in the order they were written; ``close`` sends what is held
first, ``abort`` drops it (as the transport's own abort drops its buffer).
"""

from __future__ import annotations

import asyncio
from typing import Any


class CoalescingTransport:
    """Wraps a connection's transport; ``write`` joins what one iteration writes."""

    __slots__ = ("_held", "_loop", "transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self._loop = loop
        self._held: list[bytes] | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is None:
            self._held = [bytes(data)]
            self._loop.call_soon(self.flush)
        else:
            held.append(bytes(data))

    def flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if not self.transport.is_closing():
                self.transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def abort(self) -> None:
        self._held = None
        self.transport.abort()

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def __getattr__(self, name: str) -> Any:  # get_extra_info, pause_reading, ...
        return getattr(self.transport, name)
