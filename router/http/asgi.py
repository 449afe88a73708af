"""The ASGI types the router's raw handlers use (``router.http.app``, ``router.forward.proxy``,
``router.http.edge``): one definition, so every handler agrees on what a message is."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
