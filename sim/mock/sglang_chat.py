"""SGLang's chat request with token ids in, for the mock engine run as SGLang (``--sglang``).

What SGLang's OpenAI layer does since its "TITO" change (sgl-project/sglang#23751, April
2026; ``python/sglang/srt/entrypoints/openai/protocol.py`` and ``serving_chat.py``):

- ``input_ids`` beside ``messages`` in ``POST /v1/chat/completions``: the prompt is those
  ids; the messages are not rendered (they still name the tools and the stop strings).
  An empty list is refused, as ``GenerateReqInput`` refuses it ("input_ids cannot be
  empty.").
- ``return_prompt_token_ids``: each choice of a whole answer carries the ``prompt_token_ids``
  the engine ran; asked with ``stream`` it is refused with 400 ("return_prompt_token_ids is
  not supported with streaming. ...").
- ``/v1/models`` cards are ``owned_by: "sglang"`` (``protocol.py``'s ``ModelCard``).

The rest of the mock's chat answer stays the mock's (vLLM's shape): what these fields
change is which ids run and one field of the answer.
"""

from __future__ import annotations

from typing import Any

from router.http.errors import ApiError

OWNED_BY = "sglang"


def input_ids(body: Any) -> list[int] | None:
    """The prompt a chat body gives as ids (None: render its messages); ``ApiError`` for
    what SGLang refuses."""
    check(body)
    if not isinstance(body, dict) or body.get("input_ids") is None:
        return None
    ids = body["input_ids"]
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in ids
    ):
        raise ApiError(400, "input_ids must be a list of token ids", "invalid_value", "input_ids")
    if not ids:
        raise ApiError(400, "input_ids cannot be empty.", "invalid_value", "input_ids")
    return ids


def check(body: Any) -> None:
    """SGLang's refusal of what its chat layer does not combine."""
    if isinstance(body, dict) and body.get("stream") and body.get("return_prompt_token_ids"):
        raise ApiError(
            400,
            "return_prompt_token_ids is not supported with streaming. "
            "Please set stream=false when using return_prompt_token_ids=true.",
            "invalid_value",
            "return_prompt_token_ids",
        )


def echo(answer: dict[str, Any], body: Any, prompt: list[int]) -> None:
    """A whole chat answer with ``prompt_token_ids`` on each choice, if the body asks."""
    if isinstance(body, dict) and body.get("return_prompt_token_ids"):
        for choice in answer["choices"]:
            choice["prompt_token_ids"] = list(prompt)
