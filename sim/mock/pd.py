"""The mock engine's side of prefill/decode disaggregation, in both engines' protocols.

What the request body says decides, as in the engines (a vLLM ``kv_both`` engine does
either side; the role names what it is deployed as):

- vLLM KV connector: ``kv_transfer_params.do_remote_decode`` -> prefill only (the router
  sends ``max_tokens`` 1), keep the blocks for a pull and answer with
  ``kv_transfer_params`` naming them (``remote_engine_id``, ``remote_block_ids``, the
  engine's own block hashes here, ``remote_host``, ``remote_port``, ``tp_size``).
  ``do_remote_prefill`` -> pull those blocks from ``remote_host:remote_port`` (the mock's
  HTTP port, ``POST /mock/kv_pull``), land them after the modelled transfer time (its KV
  events say ``BlockStored``), then decode. A failed pull fails the request, as vLLM
  0.32's default ``kv_load_failure_policy = "fail"`` does.
- SGLang bootstrap: ``bootstrap_room`` on a decode-role engine -> join the room on
  ``bootstrap_host:bootstrap_port`` (the prefill mock's HTTP port, ``POST
  /mock/bootstrap/{room}``: SGLang's decode side sends its KV indices there), wait
  until the room is done (``GET``), land the blocks, decode; a prefill that never
  comes fails the request, as SGLang's decode side aborts on a transfer failure. On a
  prefill-role engine -> wait until a decode engine joined the room (SGLang's prefill
  holds the request in its bootstrap queue until the decode side's transfer info
  arrives), then prefill only (one token) and the room is done. A decode engine that
  never joins fails the prefill after ``bootstrap_timeout`` seconds with a 500 naming
  the room, as SGLang's ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` (default 300 s)
  aborts a request stuck in ``KVPoll.Bootstrapping``.

The blocks a pull names must be the prompt's blocks as this engine hashes them (engines
with one ``seed`` agree): a transfer of another prompt is a failed transfer.

DP ranks (``dp_size`` > 1) as the engines keep them: each rank holds its own KV, so a
transfer is between one prefill rank and one decode rank. vLLM names the prefill rank's
engine in ``remote_engine_id`` (``<engine id>_dp<rank>``, as vLLM's DP engine cores
suffix theirs); a pull names it back. SGLang's rooms live per prefill rank: a prefill
runs on the rank its body names (``routed_dp_rank``), else on ``room % dp_size``
(SGLang's ``follow_bootstrap_room``); a decode engine joins the room of the rank its
``disagg_prefill_dp_rank`` names, else of ``room % dp_size`` (SGLang's receiver asks the
bootstrap server for the prefill's dp size and takes the same remainder). A decode engine
that joins another rank's room never gets the KV, and both sides time out, as in SGLang.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from router.http.errors import ApiError
from sim.cache import PrefixCache
from sim.mock.scheduler import Timing

log = logging.getLogger(__name__)

Role = Literal["mixed", "prefill", "decode"]
_KEEP = 4096  # pending transfers and rooms remembered at most
BOOTSTRAP_WAIT = 30.0  # seconds a decode engine waits for its prefill engine
BOOTSTRAP_TIMEOUT = 30.0  # seconds a prefill engine waits for a decode engine to join
UNREACHABLE_WAIT = 1.0  # seconds it keeps asking a bootstrap server it cannot reach
_POLL = 0.005


@dataclass(slots=True)
class Plan:
    """What one request does on this engine."""

    side: Literal["none", "prefill", "decode"]
    protocol: Literal["vllm", "sglang", ""] = ""
    room: int | None = None
    rank: int = 0  # the DP rank it runs on


class PdSide:
    """Rooms and pending transfers of one mock engine, and its pulls from others."""

    def __init__(
        self,
        role: Role,
        engine_id: str,
        host: str,
        port: Callable[[], int],
        hasher: PrefixCache,
        timing: Timing,
        bootstrap_timeout: float = BOOTSTRAP_TIMEOUT,
        dp_size: int = 1,
    ) -> None:
        if not 0 < bootstrap_timeout <= 3600:
            raise ValueError(f"bootstrap_timeout must be in (0, 3600] s, got {bootstrap_timeout}")
        self.role = role
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self.hasher = hasher  # the engine's block hashes (every rank's are the same)
        self.timing = timing
        self.bootstrap_timeout = bootstrap_timeout
        self.dp_size = dp_size
        # (the rank's engine id, blocks) -> when kept for a pull
        self.pending: OrderedDict[tuple[str, tuple[int, ...]], float] = OrderedDict()
        # (room, prefill rank) -> "joined" (a decode engine, no prefill yet), "pending"
        # (a prefill waiting for a decode engine), "ready" (both), "done", "failed"
        self.rooms: OrderedDict[tuple[int, int], str] = OrderedDict()
        self.counts: dict[str, int] = {
            "prefills": 0,
            "decodes": 0,
            "blocks_received": 0,
            "transfer_failures": 0,
            "bootstrap_timeouts": 0,
        }
        self._client: httpx.AsyncClient | None = None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=2.0)
        return self._client

    # -- requests -------------------------------------------------------------------
    def rank_engine_id(self, rank: int) -> str:
        """The engine id of ``rank`` in transfer params (vLLM's DP engine cores')."""
        return self.engine_id if self.dp_size <= 1 else f"{self.engine_id}_dp{rank}"

    def plan(self, body: dict[str, Any], rank: int = 0) -> Plan:
        """The side this request takes on ``rank``; a prefill's body is cut to one token."""
        params = body.get("kv_transfer_params")
        if isinstance(params, dict) and params.get("do_remote_decode"):
            body["max_tokens"] = 1
            return Plan("prefill", "vllm", rank=rank)
        if isinstance(params, dict) and params.get("do_remote_prefill"):
            return Plan("decode", "vllm", rank=rank)
        room = body.get("bootstrap_room")
        if room is not None and self.role != "mixed":
            if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 1 << 64:
                raise ApiError(400, "bootstrap_room must be a 64-bit integer", "invalid_value")
            if self.role == "prefill":
                body["max_tokens"] = 1
                body.pop("max_completion_tokens", None)
                joined = self.rooms.get((room, rank)) == "joined"
                _put(self.rooms, (room, rank), "ready" if joined else "pending")
                return Plan("prefill", "sglang", room, rank)
            return Plan("decode", "sglang", room, rank)
        return Plan("none")

    async def receive(
        self,
        plan: Plan,
        body: dict[str, Any],
        prompt: list[int],
        cache: PrefixCache,
        flush: Callable[[], None],
        gone: Callable[[], Awaitable[bool]],
    ) -> None:
        """A decode: get the prompt's blocks from the prefill engine into ``cache`` (the
        rank's that will decode it) before decoding; ``flush`` sends its KV events. An
        SGLang prefill: wait for the decode engine to join the room first."""
        if plan.side == "prefill" and plan.protocol == "sglang" and plan.room is not None:
            await self._wait_joined((plan.room, plan.rank), gone)
            return
        if plan.side != "decode":
            return
        self.counts["decodes"] += 1
        hashes = cache.hash_blocks(prompt)
        if plan.protocol == "vllm":
            ok = await self._pull(body["kv_transfer_params"], hashes)
            if not ok:  # vLLM 0.32's kv_load_failure_policy "fail" (the default)
                self.counts["transfer_failures"] += 1
                raise ApiError(500, "KV load failed: the prefill engine's blocks", "kv_transfer")
        else:
            ok = await self._wait_room(body, plan.room, gone)
            if not ok:
                self.counts["transfer_failures"] += 1
                message = "KV transfer failed: the prefill engine never sent"
                raise ApiError(500, message, "kv_transfer")
        gpu, host = cache.lookup(hashes)
        missing = len(hashes) - gpu - host
        await asyncio.sleep(self.timing.scaled(missing * self.timing.transfer_s_per_block))
        self.counts["blocks_received"] += cache.prefetch(prompt, block_hashes=hashes)
        flush()  # the decode engine's KV events: the blocks are here now

    def finished(self, plan: Plan, prompt: list[int], ok: bool) -> dict[str, Any] | None:
        """A prefill is done: the room is done, or the blocks wait for a pull; the
        ``kv_transfer_params`` of a vLLM prefill's answer."""
        if plan.side != "prefill":
            return None
        self.counts["prefills"] += 1
        if plan.protocol == "sglang" and plan.room is not None:
            _put(self.rooms, (plan.room, plan.rank), "done" if ok else "failed")
            return None
        hashes = self.hasher.hash_blocks(prompt)
        engine_id = self.rank_engine_id(plan.rank)
        if ok:
            _put(self.pending, (engine_id, tuple(hashes)), time.monotonic())
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine_id,
            "remote_block_ids": hashes,
            "remote_host": self.host,
            "remote_port": self.port(),
            "tp_size": 1,
        }

    # -- the other engine -------------------------------------------------------------
    def pull(self, request: Any) -> dict[str, Any]:
        """``POST /mock/kv_pull``: hand over kept blocks (once), from the rank whose
        engine id the pull names."""
        ids = request.get("remote_block_ids") if isinstance(request, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ApiError(400, "remote_block_ids must be a list of ints", "invalid_value")
        engine_id = request.get("remote_engine_id", self.engine_id)
        if self.pending.pop((engine_id, tuple(ids)), None) is None:
            raise ApiError(404, "no such transfer (expired or pulled)", "transfer_not_found")
        return {"blocks": len(ids)}

    def group(self, room: int, rank: int | None) -> int:
        """The prefill rank whose room a decode engine means: the one it names, else
        ``room % dp_size`` (SGLang's receiver without ``disagg_prefill_dp_rank``)."""
        group = room % self.dp_size if rank is None else rank
        if not 0 <= group < self.dp_size:
            raise ApiError(400, f"prefill dp rank {rank} is out of range", "invalid_value")
        return group

    def room(self, room: int, rank: int | None = None) -> dict[str, Any]:
        """``GET /mock/bootstrap/{room}[?dp_rank=]``: how the prefill of a room is going."""
        key = (room, self.group(room, rank))
        return {"room": room, "dp_rank": key[1], "state": self.rooms.get(key, "unknown")}

    def join(self, room: int, rank: int | None = None) -> dict[str, Any]:
        """``POST /mock/bootstrap/{room}[?dp_rank=]``: a decode engine joins the room
        (before or after the prefill request arrived: the two are sent at once)."""
        key = (room, self.group(room, rank))
        state = self.rooms.get(key)
        if state is None:
            _put(self.rooms, key, "joined")
        elif state == "pending":
            _put(self.rooms, key, "ready")
        return self.room(room, rank)

    async def _wait_joined(self, key: tuple[int, int], gone: Callable[[], Awaitable[bool]]) -> None:
        """Hold the prefill until a decode engine joined the room; ApiError 500 after
        ``bootstrap_timeout`` (the room is failed: a late decode engine hears so)."""
        room = key[0]
        deadline = time.monotonic() + self.bootstrap_timeout
        while self.rooms.get(key) == "pending":
            if time.monotonic() >= deadline or await gone():
                _put(self.rooms, key, "failed")
                self.counts["bootstrap_timeouts"] += 1
                message = (
                    f"bootstrap room {room}: no decode engine joined within "
                    f"{self.bootstrap_timeout:g} s (KVPoll.Bootstrapping timed out)"
                )
                raise ApiError(500, message, "bootstrap_timeout")
            await asyncio.sleep(_POLL)

    async def _pull(self, params: dict[str, Any], hashes: list[int]) -> bool:
        ids = params.get("remote_block_ids")
        host, port = params.get("remote_host"), params.get("remote_port")
        if ids != hashes:
            log.warning("kv pull: the transfer names other blocks than this prompt's")
            return False
        pull = {"remote_block_ids": ids, "remote_engine_id": params.get("remote_engine_id")}
        try:
            resp = await self.client().post(f"http://{host}:{port}/mock/kv_pull", json=pull)
        except httpx.HTTPError as exc:
            log.warning("kv pull from %s:%s failed: %s", host, port, exc)
            return False
        return resp.status_code == 200

    async def _wait_room(
        self, body: dict[str, Any], room: int | None, gone: Callable[[], Awaitable[bool]]
    ) -> bool:
        where = f"{body.get('bootstrap_host')}:{body.get('bootstrap_port')}"
        url = f"http://{where}/mock/bootstrap/{room}"
        rank = body.get("disagg_prefill_dp_rank")
        if rank is not None:
            url += f"?dp_rank={rank}"
        now = time.monotonic()
        deadline, reached = now + BOOTSTRAP_WAIT, now
        joined = False
        while now < deadline and now - reached < UNREACHABLE_WAIT:
            if await gone():
                return False
            try:
                if joined:
                    state = (await self.client().get(url)).json().get("state")
                else:
                    state = (await self.client().post(url)).json().get("state")
                    joined = True
                reached = time.monotonic()
            except (httpx.HTTPError, ValueError, AttributeError):
                state = "unreachable"
            if state == "done":
                return True
            if state == "failed":
                return False
            await asyncio.sleep(_POLL)
            now = time.monotonic()
        return False


def _put(table: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    table.pop(key, None)
    table[key] = value
    if len(table) > _KEEP:
        table.popitem(last=False)
