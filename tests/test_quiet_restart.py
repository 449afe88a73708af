"""An engine restarted on the same ``ipc://`` endpoint, unseen by health checks, that
publishes nothing in its new life: the real router (``router.events.consumer.EventSync``, not a
test double) must drop the old life's blocks at once, as vLLM's restart in
tests/real_engines showed it did not.

The agent sees the restart on reconnect (the new engine's replay socket no longer holds
its last batch) and publishes an epoch start. The router does not trust a new epoch on
its word and asks the agent's replay; the agent, with no batch of the new life yet,
answers only ``end`` (seq -1, the new epoch). The router used to learn nothing from
that, then dropped the held epoch start as forged: the stale blocks stayed until the
engine's next batch (none came, since the router kept sending the prefix elsewhere).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from stack import Served, until

from agent.node import AgentConfig, NodeAgent
from index.codec import BlockStored
from router.config import RouterConfig, WorkerSpec
from router.http.app import RouterApp
from sim.mock.natsd import free_port
from sim.mock.publisher import KvEventPublisher

BS = 4


def blocks(app: RouterApp, worker: str) -> int:
    pool = app.state.registry.pools["default"]
    return sum(pool.index.stats().workers.get(worker, {}).values())


async def test_a_quiet_engine_restarted_on_an_ipc_endpoint_is_cleared_in_the_router(
    nats_url: str, tmp_path: Path
) -> None:
    # ipc:// as vLLM binds it: the file is unlinked and made again by the new process
    endpoint = f"ipc://{tmp_path}/engine.events"
    replay = f"tcp://127.0.0.1:{free_port()}"
    first = KvEventPublisher(endpoint, replay)
    first.start()
    agent = NodeAgent(
        AgentConfig(
            worker_id="w",
            zmq_endpoint=endpoint,
            replay_endpoint=replay,
            nats_url=nats_url,
            replay_timeout=0.5,
        )
    )
    cfg = RouterConfig(
        nats_url=nats_url,
        block_size=BS,
        admin_token="t",
        health_interval=3600.0,  # the restart goes unseen by health checks
        workers=[WorkerSpec("w", "http://127.0.0.1:9", model="m")],
    )
    app = RouterApp(cfg)
    served = await Served(app).start()
    second = None
    try:
        await agent.start()
        await until(lambda: app.state.bus.connected, what="router on NATS")
        await until(lambda: agent.engine_connected, what="agent on the engine")
        first.publish([BlockStored([1, 2], None, list(range(2 * BS)), BS, medium="GPU")])
        await until(lambda: blocks(app, "w") == 2, timeout=15, what="blocks in the router")
        await first.close()
        await until(lambda: not agent.engine_connected, timeout=15, what="disconnect seen")
        second = KvEventPublisher(endpoint, replay)
        second.start()  # a new life that publishes nothing
        await until(lambda: blocks(app, "w") == 0, timeout=15, what="the old life's blocks gone")
        assert agent.stats()["epoch_starts_published"] == 1
        pool = app.state.registry.pools["default"]
        assert pool.ingest.in_sync("w") and pool.ingest.epoch("w") == agent.core.epoch
        # the new life's first batch (seq 0) follows the epoch start without a resync
        replays = app.state.events.counts["replay_requests"]
        second.publish([BlockStored([3], None, list(range(BS)), BS, medium="GPU")])
        await until(lambda: blocks(app, "w") == 1, timeout=15, what="the new life's block")
        assert app.state.events.counts["replay_requests"] == replays
    finally:
        if second is not None:
            await second.close()
        await agent.stop()
        await served.stop()


_SCENARIO = """
import asyncio, sys
sys.path.insert(0, "tests")
from stack import until
from agent.node import AgentConfig, NodeAgent
from index.codec import BlockStored
from sim.mock.natsd import free_port
from sim.mock.publisher import KvEventPublisher

async def main(nats_url, tmp):
    endpoint, replay = f"ipc://{tmp}/engine.events", f"tcp://127.0.0.1:{free_port()}"
    pub = KvEventPublisher(endpoint, replay)
    pub.start()
    agent = NodeAgent(AgentConfig(worker_id="w", zmq_endpoint=endpoint,
                                  replay_endpoint=replay, nats_url=nats_url, replay_timeout=0.5))
    await agent.start()
    try:
        await until(lambda: agent.engine_connected, what="agent on the engine")

        async def broken() -> None:
            raise RuntimeError("a connect handler that fails")

        agent._check_restart = broken
        for _ in range(2):  # each restart: a disconnect, then a connect that fails
            await pub.close()
            await until(lambda: not agent.engine_connected, timeout=15, what="disconnect seen")
            pub = KvEventPublisher(endpoint, replay)
            pub.start()
            await until(lambda: agent.engine_connected, timeout=15, what="reconnect seen")
        before = agent.stats()["batches"]
        for _ in range(50):  # PUB/SUB: the first ones may go before the SUB has joined
            pub.publish([BlockStored([7], None, [1, 2, 3, 4], 4, medium="GPU")])
            if agent.stats()["batches"] > before:
                break
            await asyncio.sleep(0.1)
        assert agent.stats()["batches"] > before, "the agent no longer reads the engine"
        assert agent.stats()["internal_errors"] == 2
    finally:
        await agent.stop()
        await pub.close()
    print("stopped")

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_a_failing_connect_handler_neither_deafens_nor_hangs_the_agent(
    nats_url: str, tmp_path: Path
) -> None:
    """Closing the ZMQ monitor socket while libzmq still sends it events blocks libzmq's
    I/O thread, and then ``stop`` hangs holding the GIL (agent/node.py, _monitor_loop).
    A subprocess: a hang must fail this test, not freeze the suite."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _SCENARIO, nats_url, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=90,
            cwd=Path(__file__).resolve().parent.parent,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the agent hung: {exc.stderr!r}") from None
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "stopped"
