"""Bad HTTP input: every refusal is a clear 4xx in the OpenAI error shape, and nothing
the client does wrong stops the router serving others.

The router runs in-process under uvicorn on a loopback port in front of an engine
double; raw sockets send what no well-behaved client library would.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson


def assert_openai_error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"], err
    return err


async def raw_exchange(url: str, request: bytes, *, timeout: float = 10.0) -> bytes:
    """Send raw bytes, read until the router closes the connection (bounded)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(-1), timeout)
    finally:
        writer.close()


def split_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


async def test_oversized_body_is_413_with_or_without_content_length(make_stack):
    stack = await make_stack(1, max_body_bytes=1000)
    url, engine = stack.url, stack.engines[0]
    big = orjson.dumps({"model": "m", "prompt": "x" * 5000})
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        r = await http.post("/v1/completions", content=big)
        assert_openai_error(r, 413, "request_too_large")
        assert r.headers["connection"] == "close"  # the rest of the upload is not waited for

        # no content-length (chunked): the body is counted as it comes
        chunks = b"".join(b"%x\r\n%s\r\n" % (500, big[i : i + 500]) for i in range(0, 5000, 500))
        raw = await raw_exchange(
            url,
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
            + chunks,
        )
        status, _, payload = split_response(raw)
        assert status == 413 and orjson.loads(payload)["error"]["code"] == "request_too_large"
        r = await http.post("/v1/completions", json={"model": "m", "prompt": "small"})
        assert r.status_code == 200
    assert len(engine.requests) == 1  # nothing oversized reached the engine


async def test_slow_client_gets_408_and_does_not_block_others(make_stack):
    stack = await make_stack(1, body_timeout=0.5)
    url, engine = stack.url, stack.engines[0]
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = orjson.dumps({"model": "m", "prompt": "slowly typed"})
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    writer.write(head + body[:5])  # ...and then nothing more
    await writer.drain()
    try:
        # while the slow client holds its connection, everyone else is served
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            for i in range(5):
                r = await http.post("/v1/completions", json={"model": "m", "prompt": f"p{i}"})
                assert r.status_code == 200
        raw = await asyncio.wait_for(reader.read(-1), 10)  # the router ends the connection
    finally:
        writer.close()
    status, headers, payload = split_response(raw)
    assert status == 408 and headers["connection"] == "close"
    assert orjson.loads(payload)["error"]["code"] == "request_timeout"
    assert len(engine.requests) == 5
    text = (await httpx.AsyncClient().get(url + "/metrics")).text
    assert 'kind="request_timeout"' in text


async def test_invalid_utf8_and_bad_sampling_values_are_400(make_stack):
    stack = await make_stack(1, max_n=4)
    url, engine = stack.url, stack.engines[0]
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        bad_utf8 = b'{"model": "m", "prompt": "caf\xc3\x28 \xff\xfe"}'
        r = await http.post("/v1/completions", content=bad_utf8)
        assert_openai_error(r, 400, "invalid_json")
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        cases = [
            ({"n": 5}, "n", "at most 4"),
            ({"n": 10**12}, "n", "at most 4"),
            ({"n": 0}, "n", "positive"),
            ({"n": "3"}, "n", "positive"),
            ({"max_tokens": -1}, "max_tokens", "at least 1"),
            ({"max_tokens": 0}, "max_tokens", "at least 1"),
            ({"max_completion_tokens": -50}, "max_completion_tokens", "at least 1"),
            ({"max_tokens": 2.5}, "max_tokens", "integer"),
        ]
        for extra, param, words in cases:
            for path, body in (("/v1/chat/completions", chat), ("/v1/completions", None)):
                body = body or {"model": "m", "prompt": "hi"}
                r = await http.post(path, json={**body, **extra})
                err = assert_openai_error(r, 400, r.json()["error"]["code"])
                assert err["param"] == param and words in err["message"], (extra, err)
        r = await http.post("/v1/completions", json={"model": "m", "prompt": "hi", "n": 4})
        assert r.status_code == 200
    assert len(engine.requests) == 1  # only the valid one went on


async def test_too_many_or_too_large_headers_are_431(make_stack):
    stack = await make_stack(1, max_header_count=30, max_header_bytes=4096)
    url, engine = stack.url, stack.engines[0]
    body = {"model": "m", "prompt": "hi"}
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        many = {f"x-h{i}": "v" for i in range(40)}
        r = await http.post("/v1/completions", json=body, headers=many)
        assert_openai_error(r, 431, "too_many_headers")
        r = await http.post("/v1/completions", json=body, headers={"x-big": "a" * 8000})
        assert_openai_error(r, 431, "headers_too_large")
        r = await http.get("/v1/models", headers={"x-big": "a" * 8000})  # every route
        assert_openai_error(r, 431, "headers_too_large")
        r = await http.post("/v1/completions", json=body, headers={"x-ok": "a" * 1000})
        assert r.status_code == 200
    # a header far over uvicorn's own limits is cut off by the server, never crashes it
    raw = await raw_exchange(
        url, b"GET /health HTTP/1.1\r\nhost: x\r\nx-huge: " + b"a" * 200_000 + b"\r\n\r\n"
    )
    assert raw == b"" or split_response(raw)[0] in (400, 431)
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        assert (await http.get("/health")).status_code == 200
    assert len(engine.requests) == 1


async def test_malformed_http_and_unknown_routes(make_stack):
    stack = await make_stack(1)
    url, engine = stack.url, stack.engines[0]
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        r = await http.get("/v1/completions")  # the raw routes take POST only
        assert_openai_error(r, 404, "http_404")
        r = await http.post("/v1/nothing", json={})
        assert_openai_error(r, 404, "http_404")
        r = await http.post("/v1/completions", content=b"[1, 2]")
        assert_openai_error(r, 400, "invalid_json")
        r = await http.post("/v1/completions", content=b"")
        assert_openai_error(r, 400, "invalid_json")
    raw = await raw_exchange(url, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nbroken\r\n\r\n")
    assert raw == b"" or split_response(raw)[0] == 400
    assert engine.requests == []


async def test_openapi_describes_the_raw_completion_routes(make_stack):
    stack = await make_stack(1, max_n=7, admin_token="adm")
    url = stack.url
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        public = (await http.get("/openapi.json")).json()
        schema = (await http.get("/openapi.json", headers={"authorization": "Bearer adm"})).json()
    assert not any(p.startswith("/admin") for p in public["paths"])  # the admin API unlisted
    assert public["paths"]["/v1/completions"] == schema["paths"]["/v1/completions"]
    for path in ("/v1/chat/completions", "/v1/completions"):
        op = schema["paths"][path]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert body["properties"]["n"]["maximum"] == 7
        assert body["properties"]["max_tokens"]["minimum"] == 1
        assert {"400", "413", "503"} <= set(op["responses"])
    assert "/v1/models" in schema["paths"] and "/admin/workers" in schema["paths"]
