"""The Responses API (``/v1/responses``) as the router sees it.

A create request is routed cache-aware like a chat completion: its ``instructions`` and
``input`` rendered as chat messages (a string input is one user message; content parts
contribute their text) are what the engine's template sees first, so their blocks are
the prefix the index matches. The body goes to the engine unchanged, or, where the
engine takes token ids and the rendering is exact (``render_reason``), as the router's
ids (``router.forward.tokens_in``, ``router.forward.responses_out``).

vLLM (0.32, non-Harmony models) renders a Responses request as a chat
(``responses/utils.py``: ``construct_input_messages``), then encodes the rendered text
*with* the tokenizer's special tokens (a ``ResponsesRequest``'s tokenize parameters keep
``add_special_tokens`` at its default, true; a chat request's is false): a Llama
tokenizer whose template writes ``<s>`` itself gets two. ``prompt_chat`` asks the
router's tokenizer for the same, so the blocks the router hashes are the engine's.

With ``previous_response_id`` the engine that stored that response is the only one
that can answer (``router.routing.affinity``); the routing decision pins it. The stored
conversation the engine prepends is not in the request, so the router does not try
to match it: the pinned engine holds it anyway.

``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` go to the engine that
made ``id`` (``router.forward.passthrough``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from router.http.errors import ApiError
from router.tokens.tokenize import Tokenizer, num_tokens


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, "invalid_request", param)


def check_responses(body: dict[str, Any]) -> None:
    """Validate the fields routing reads; ``ApiError`` 400 naming the field."""
    given = body.get("input")
    if isinstance(given, str):
        if not given:
            raise _bad("input must not be empty", "input")
    elif isinstance(given, list) and given:
        for i, item in enumerate(given):
            if not isinstance(item, dict):
                raise _bad(f"input[{i}] must be an object", "input")
    else:
        raise ApiError(400, "input must be a string or a non-empty array", "missing_field",
                       "input")  # fmt: skip
    for key in ("instructions", "previous_response_id"):
        value = body.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise _bad(f"{key} must be a non-empty string", key)
    value = body.get("max_output_tokens")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise _bad("max_output_tokens must be an integer", "max_output_tokens")


def content_text(content: Any) -> str:
    """The text of a content value, a string or a list of text parts (Responses input items
    and Anthropic blocks alike); other parts carry no text to tokenize."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p
        )
    return ""


def prompt_chat(messages: list[dict[str, Any]], tok: Tokenizer) -> dict[str, Any]:
    """The chat body the router's tokenizer renders and encodes for a Responses request's
    ``messages``: with special tokens, as vLLM's Responses layer encodes it, when the
    tokenizer adds any (else without: the same ids, and the conversation prefix cache
    and the segment cache still serve it)."""
    if adds_special_tokens(tok):
        return {"messages": messages, "add_special_tokens": True}
    return {"messages": messages}


@lru_cache(maxsize=64)
def adds_special_tokens(tok: Tokenizer) -> bool:
    """Whether encoding with special tokens adds any (a BOS, an EOS) to a text."""
    return num_tokens(tok.encode("a", True)) != num_tokens(tok.encode("a", False))


# the fields of an input message item vLLM's Responses layer reads as the router does
_ITEM_KEYS = frozenset(("role", "content", "type", "id", "status"))
_PART_KEYS = frozenset(("type", "text", "annotations", "logprobs"))
_TOOL_ITEMS = frozenset(
    ("function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output",
     "mcp_call", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response",
     "computer_call", "computer_call_output", "web_search_call", "file_search_call",
     "code_interpreter_call", "local_shell_call", "local_shell_call_output")
)  # fmt: skip


def render_reason(body: dict[str, Any]) -> str | None:
    """Why vLLM's Responses layer may render this request's ``instructions`` and ``input``
    to other tokens than ``as_messages`` + ``prompt_chat`` (None: the same ids).

    Exact: a string input; or items that are messages (``role`` user, system or
    assistant; no ``type`` or ``type: message``; ``status`` absent or completed) whose
    content is a string or one text part (``input_text``; an assistant's
    ``output_text``). Not: tool calls and their outputs, reasoning items (``tools``,
    ``reasoning``), media parts (``media``), several text parts (vLLM joins them by a
    newline or hands the template a list, by the template's content format), the
    ``developer`` role (vLLM adds a ``tools`` key to it), a partial last assistant
    message (vLLM continues it) or any other key (``field``)."""
    given = body.get("input")
    if isinstance(given, str):
        return None
    if not isinstance(given, list):
        return "field"
    for item in given:
        if not isinstance(item, dict):
            return "field"
        kind = item.get("type")
        if kind in _TOOL_ITEMS:
            return "tools"
        if kind == "reasoning":
            return "reasoning"
        role = item.get("role")
        if kind not in (None, "message") or role not in ("user", "system", "assistant"):
            return "field"
        if not _ITEM_KEYS.issuperset(item) or item.get("status", "completed") != "completed":
            return "field"
        content = item.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list) or len(content) != 1:
            return "field"
        (part,) = content
        if not isinstance(part, dict):
            return "field"
        if part.get("type") in ("input_image", "input_file", "input_audio"):
            return "media"
        want = "output_text" if role == "assistant" else "input_text"
        if (
            part.get("type") != want
            or not isinstance(part.get("text"), str)
            or not _PART_KEYS.issuperset(part)
        ):
            return "field"
    return None


def as_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """``instructions`` + ``input`` as chat messages, for tokenizing and hashing."""
    messages = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            if isinstance(item, dict) and isinstance(item.get("role"), str):
                text = content_text(item.get("content"))
                messages.append({"role": item["role"], "content": text})
            elif isinstance(item, dict):  # a tool call or its output: its text, if any
                messages.append({"role": "user", "content": content_text(item.get("output"))})
    return messages
