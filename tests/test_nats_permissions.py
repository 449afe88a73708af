"""deploy/nats.conf (what docker-compose.yml runs) on a real nats-server: each role may
publish only its own subjects, and a router with the router user still gets its events
through the JetStream stream."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml
from stack import Served, until

from index.codec import BlockStored, EventBatch, encode
from index.gapfill import GapFillMessage
from router.config import RouterConfig, WorkerSpec
from router.http.app import RouterApp
from sim.mock.natsd import EmbeddedNats

CONF = Path(__file__).resolve().parent.parent / "deploy" / "nats.conf"
AGENT0 = {"user": "agent-engine-0", "password": "agent-0-demo-secret"}


@pytest.fixture
def server(tmp_path: Path) -> Any:
    with EmbeddedNats(store=tmp_path, args=["-c", str(CONF)]) as srv:
        yield srv


async def connect(url: str, creds: dict[str, str], errors: list[Exception]) -> Any:
    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    return await nats.connect(url, error_cb=on_error, allow_reconnect=False, **creds)


async def delivered(agent: Any, subject: str, got: list[tuple[str, bytes]]) -> None:
    """The agent's own message on ``subject`` reaches the watcher's subscription (sent again
    until it does): nats-py 2.16's flush() writes its PING ahead of the commands still
    queued, so a SUB it "flushed" may reach the server after the next publish (that first
    message was lost in 3 of 100 tries here). Sent again after the forgeries, it also
    marks their turn: the agent's messages arrive in order, a forgery let through first."""
    seen = len(got)

    async def arrived() -> bool:
        await agent.publish(subject, b"own")
        await agent.flush()
        await asyncio.sleep(0.05)
        return len(got) > seen

    await until(arrived, timeout=15, what=f"the agent's own {subject}")


async def test_an_agent_cannot_speak_for_another_worker(server: EmbeddedNats) -> None:
    errors: list[Exception] = []
    router = await connect(server.url, {"user": "router", "password": "router-demo-secret"}, errors)
    agent = await connect(server.url, AGENT0, errors)
    got: list[tuple[str, bytes]] = []

    async def on_msg(msg: Any) -> None:
        got.append((msg.subject, msg.data))

    try:
        # kv.load.* first: the server takes one client's commands in order, so once the
        # agent's events reach the router, its kv.load.* subscription is in place too
        await router.subscribe("kv.load.*", cb=on_msg)
        await router.subscribe("kv.events.>", cb=on_msg)
        await router.flush()
        await delivered(agent, "kv.events.engine-0", got)
        await agent.publish("kv.events.engine-1", b"forged")  # another worker's events
        await agent.publish("kv.load.engine-1", b"forged")
        await agent.flush()
        await router.publish("kv.events.engine-0", b"a router forging events")
        await router.flush()
        await until(lambda: len(errors) >= 3, what="three permission violations")
        await delivered(agent, "kv.events.engine-0", got)  # after the forgeries
    finally:
        await agent.close()
        await router.close()
    assert set(got) == {("kv.events.engine-0", b"own")}
    assert all("permissions violation" in str(e).lower() for e in errors), errors


async def test_a_router_with_the_router_user_reads_the_event_stream(server: EmbeddedNats) -> None:
    errors: list[Exception] = []
    agent = await connect(server.url, AGENT0, errors)

    async def on_replay(msg: Any) -> None:  # what the agent answers: nothing newer than 0
        await agent.publish(msg.reply, GapFillMessage("end", 0, epoch="e1").encode())

    await agent.subscribe("kv.replay.engine-0", cb=on_replay)
    cfg = RouterConfig(
        workers=[WorkerSpec("engine-0", "http://127.0.0.1:9", model="m")],
        block_size=4,
        nats_url=server.url,
        nats_user="router",
        nats_password="router-demo-secret",
        events_transport="jetstream",
    )
    app = RouterApp(cfg)
    served = await Served(app).start()
    try:
        await until(lambda: app.state.bus.connected, what="router on NATS")
        ingest = app.state.registry.get("engine-0").pool.ingest
        stored = BlockStored([11, 12], None, list(range(8)), 4, medium="GPU")
        payload = encode(EventBatch(time.time(), [stored], None))

        async def applied() -> bool:
            await agent.publish(
                "kv.events.engine-0", payload, headers={"Kv-Seq": "0", "Kv-Epoch": "e1"}
            )
            await agent.flush()
            await asyncio.sleep(0.1)
            return set(ingest.engine_blocks("engine-0")) == {11, 12}

        await until(applied, timeout=15, what="the agent's batch through the stream")
        assert app.state.feed.using == "jetstream"
    finally:
        await served.stop()
        await agent.close()
    assert not [e for e in errors if "permissions" in str(e).lower()], errors


def test_compose_agents_use_users_limited_to_their_worker() -> None:
    compose = yaml.safe_load((CONF.parent.parent / "docker-compose.yml").read_text())
    text = CONF.read_text()
    nats_cmd = compose["services"]["nats"]["command"]
    assert nats_cmd[:2] == ["-c", "/etc/nats/nats.conf"]
    checked = 0
    for name, svc in compose["services"].items():
        cmd = svc.get("command") or []
        if not cmd or cmd[0] != "agent":
            continue
        flags = dict(a.removeprefix("--").split("=", 1) for a in cmd[1:] if "=" in a)
        user = flags["nats-user"]
        assert f"user: {user}," in text, name
        block = text.split(f"user: {user},", 1)[1].split("user:", 1)[0]
        wid, prefix = flags["worker-id"], flags.get("subject-prefix", "kv")
        stream = flags.get("events-stream", "KV_EVENTS")
        assert f'"{prefix}.events.{wid}"' in block and f'"{prefix}.replay.{wid}"' in block, name
        assert f"{prefix}.events.*" not in block and f"{prefix}.events.>" not in block, name
        assert f'"$JS.API.STREAM.CREATE.{stream}"' in block, name
        checked += 1
    assert checked == 8  # the default profile's four and the region profile's four
    for name in ("router", "cluster-a-0", "cluster-b-0"):
        env = compose["services"][name]["environment"]
        assert f"user: {env['CACHE_ROUTER_NATS_USER']}, password: " in text, name
    assert "user: region," not in text  # the region profile's old unlimited user


REGION_A = {"user": "region-router-a", "password": "region-a-demo-secret"}
AGENT_A0 = {"user": "agent-a-engine-0", "password": "agent-a0-demo-secret"}


async def test_the_region_profile_users_are_held_to_their_cluster(server: EmbeddedNats) -> None:
    """The region profile's users (docker compose --profile region): an agent of cluster a
    speaks only for its worker under ``cluster-a``, its router only as a router there."""
    errors: list[Exception] = []
    router = await connect(server.url, REGION_A, errors)
    agent = await connect(server.url, AGENT_A0, errors)
    watcher = await connect(server.url, {"user": "router", "password": "router-demo-secret"}, [])
    got: list[tuple[str, bytes]] = []

    async def on_msg(msg: Any) -> None:
        got.append((msg.subject, msg.data))

    forged = [
        (agent, "cluster-a.events.a-engine-1"),  # another worker of its cluster
        (agent, "cluster-b.events.b-engine-0"),  # another cluster
        (agent, "kv.events.engine-0"),  # the default profile
        (agent, "cluster-a.load.a-engine-1"),
        (router, "cluster-a.events.a-engine-0"),  # a router forging events
        (router, "cluster-b.replay.b-engine-0"),  # the other cluster's agents
        (router, "kv.prefetch.engine-0"),
        (router, "$JS.API.STREAM.DELETE.KV_EVENTS"),  # another cluster's (or profile's) stream
    ]
    try:
        await router.subscribe("cluster-a.events.>", cb=on_msg)
        await watcher.subscribe("kv.>", cb=on_msg)
        await watcher.subscribe("cluster-b.>", cb=on_msg)
        await router.flush()
        await watcher.flush()
        await delivered(agent, "cluster-a.events.a-engine-0", got)
        for client, subject in forged:
            await client.publish(subject, b"forged")
        await agent.flush()
        await router.flush()
        await router.subscribe("cluster-b.events.>")  # reading the other cluster
        await router.flush()
        await until(lambda: len(errors) > len(forged), what="every forgery refused")
        await delivered(agent, "cluster-a.events.a-engine-0", got)  # after the forgeries
    finally:
        await agent.close()
        await router.close()
        await watcher.close()
    assert set(got) == {("cluster-a.events.a-engine-0", b"own")}
    assert all("permissions violation" in str(e).lower() for e in errors), errors
    assert any('subscription to "cluster-b.events.>"' in str(e).lower() for e in errors), errors


async def test_a_region_router_reads_its_clusters_stream(server: EmbeddedNats) -> None:
    errors: list[Exception] = []
    agent = await connect(server.url, AGENT_A0, errors)

    async def on_replay(msg: Any) -> None:
        await agent.publish(msg.reply, GapFillMessage("end", 0, epoch="e1").encode())

    await agent.subscribe("cluster-a.replay.a-engine-0", cb=on_replay)
    cfg = RouterConfig(
        workers=[WorkerSpec("a-engine-0", "http://127.0.0.1:9", model="m")],
        block_size=4,
        nats_url=server.url,
        subject_prefix="cluster-a",
        events_stream="KV_EVENTS_CLUSTER_A",
        events_transport="jetstream",
        nats_user=REGION_A["user"],
        nats_password=REGION_A["password"],
    )
    app = RouterApp(cfg)
    router_errors: list[Exception] = []

    async def on_router_error(exc: Exception) -> None:
        router_errors.append(exc)

    app.state.bus.on_error(on_router_error)
    served = await Served(app).start()
    try:
        await until(lambda: app.state.bus.connected, what="router on NATS")
        ingest = app.state.registry.get("a-engine-0").pool.ingest
        stored = BlockStored([21, 22], None, list(range(8)), 4, medium="GPU")
        payload = encode(EventBatch(time.time(), [stored], None))

        async def applied() -> bool:
            await agent.publish(
                "cluster-a.events.a-engine-0", payload, headers={"Kv-Seq": "0", "Kv-Epoch": "e1"}
            )
            await agent.flush()
            await asyncio.sleep(0.1)
            return set(ingest.engine_blocks("a-engine-0")) == {21, 22}

        await until(applied, timeout=15, what="the agent's batch through the cluster's stream")
        assert app.state.feed.using == "jetstream"
        info = await agent.jsm().stream_info("KV_EVENTS_CLUSTER_A")
        assert info.config.subjects == ["cluster-a.events.>"]
    finally:
        await served.stop()
        await agent.close()
    assert not [e for e in errors if "permissions" in str(e).lower()], errors
    assert not router_errors, router_errors  # no JetStream call the router user may not make
