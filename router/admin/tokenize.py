"""``POST /admin/tokenize``: the router's token ids for a request body, to hold against
the engine's own ``/tokenize`` (``cache-router doctor`` does): hashes match only if these
agree."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import Response

from router.admin.common import AdminDeps, json_response

if TYPE_CHECKING:
    from router.routing.decide import Kind


def mount(api: APIRouter, state: AdminDeps) -> None:
    @api.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """The router's token ids for a request body (chat or completion)."""
        raw = await request.body()
        kind: Kind = "chat" if b'"messages"' in raw else "completion"
        parsed = state.router.parse(kind, raw, {})
        tok = state.tokenizers.get(parsed.model)
        body = parsed.body
        if kind == "chat":
            ids, _ = tok.chat(body)
        else:
            ids, _ = tok.completion(body["prompt"], bool(body.get("add_special_tokens", True)))
        tokens = (
            list(ids)
            if not isinstance(ids, bytes)
            else [int.from_bytes(ids[i : i + 4], "little") for i in range(0, len(ids), 4)]
        )
        return json_response({"model": parsed.model, "tokenizer": tok.name, "tokens": tokens})
