"""The embedded nats-server fixture is real: publish/subscribe and JetStream work."""

from __future__ import annotations

import nats

from sim.mock.natsd import EmbeddedNats


async def test_pub_sub_and_jetstream(nats_server: EmbeddedNats) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        sub = await nc.subscribe("kv.events.w0")
        await nc.publish("kv.events.w0", b"hello", headers={"Kv-Seq": "7"})
        msg = await sub.next_msg(timeout=2)
        assert msg.data == b"hello"
        assert msg.headers == {"Kv-Seq": "7"}
        js = nc.jetstream()
        await js.add_stream(name="KVTEST", subjects=["kvtest.>"])
        ack = await js.publish("kvtest.a", b"x")
        assert ack.seq == 1
    finally:
        await nc.close()


def test_stop_frees_the_port() -> None:
    server = EmbeddedNats().start()
    port = server.port
    server.stop()
    again = EmbeddedNats(port).start()
    again.stop()
