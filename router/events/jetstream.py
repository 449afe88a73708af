"""The KV-event stream: JetStream keeps ``<prefix>.events.>`` so a late router replays it.

Agents publish events with plain NATS publishes and JetStream captures the subjects:
publishing needs no ack round trip, and an agent works the same when the server has no
JetStream. A batch the stream missed is not lost: its ``Kv-Seq`` gap makes the router
ask the agent (``<prefix>.replay.<worker>``). The stream is bounded by age and bytes and
drops the oldest batches first; a router that finds a worker's history cut short asks
that worker's agent for a dump.

Agents and routers create the stream when it is missing (first one wins, the others
find it); ``cache-router streams`` creates it or changes its limits for an operator.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import dataclass

import nats
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.js import api
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError

from index.wire import DEFAULT_MAX_AGE, DEFAULT_MAX_BYTES, DEFAULT_PREFIX, DEFAULT_STREAM, Subjects

log = logging.getLogger(__name__)


_JS_NOT_ENABLED = 10039  # "jetstream not enabled for account"


@dataclass(frozen=True, slots=True)
class StreamSpec:
    name: str = DEFAULT_STREAM
    prefix: str = DEFAULT_PREFIX
    max_age: float = DEFAULT_MAX_AGE
    max_bytes: int = DEFAULT_MAX_BYTES

    @property
    def subject(self) -> str:
        return Subjects(self.prefix).all_events

    def config(self) -> api.StreamConfig:
        return api.StreamConfig(
            name=self.name,
            subjects=[self.subject],
            retention=api.RetentionPolicy.LIMITS,
            discard=api.DiscardPolicy.OLD,
            storage=api.StorageType.FILE,
            max_age=self.max_age,
            max_bytes=self.max_bytes,
        )


def jetstream_missing(exc: BaseException) -> bool:
    """Whether ``exc`` says the server (or account) has no JetStream at all."""
    if isinstance(exc, NoRespondersError):
        return True
    return isinstance(exc, ServiceUnavailableError) and exc.err_code in (None, _JS_NOT_ENABLED)


async def ensure_stream(nc: Client, spec: StreamSpec) -> api.StreamInfo:
    """The stream that captures ``spec.subject``, created with ``spec``'s limits if missing.

    An existing stream keeps its limits (an operator may have tuned them). Another
    stream that already captures the subjects under a different name is used as is.
    """
    jsm = nc.jsm()
    try:
        return await jsm.stream_info(spec.name)
    except NotFoundError:
        pass
    try:
        info = await jsm.add_stream(spec.config())
        log.info("created stream %s on %s (%s)", spec.name, spec.subject, _limits(spec))
        return info
    except BadRequestError:
        # Created meanwhile by another replica or agent, or the subjects belong to an
        # operator's stream with another name: use whichever holds them.
        name = await jsm.find_stream_name_by_subject(spec.subject)
        return await jsm.stream_info(name)


async def apply_stream(nc: Client, spec: StreamSpec) -> api.StreamInfo:
    """Create the stream, or set its limits to ``spec``'s (the operator command)."""
    jsm = nc.jsm()
    try:
        await jsm.stream_info(spec.name)
    except NotFoundError:
        return await jsm.add_stream(spec.config())
    return await jsm.update_stream(spec.config())


def _limits(spec: StreamSpec) -> str:
    return f"max_age {spec.max_age:g}s, max_bytes {spec.max_bytes}"


# -- cache-router streams --------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", required=True, help="NATS server with JetStream")
    parser.add_argument("--name", default=DEFAULT_STREAM, help=f"stream name ({DEFAULT_STREAM})")
    parser.add_argument("--subject-prefix", default=DEFAULT_PREFIX, help="NATS subject prefix (kv)")
    parser.add_argument(
        "--max-age", type=float, default=DEFAULT_MAX_AGE, help="seconds a batch is kept"
    )
    parser.add_argument(
        "--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="stream size bound in bytes"
    )


def run(args: argparse.Namespace) -> int:
    if args.max_age <= 0 or args.max_bytes <= 0:
        print("cache-router streams: --max-age and --max-bytes must be positive", file=sys.stderr)
        return 2
    spec = StreamSpec(args.name, args.subject_prefix, args.max_age, args.max_bytes)
    return asyncio.run(_run(args.nats_url, spec))


async def _run(url: str, spec: StreamSpec) -> int:
    try:
        nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    except Exception as exc:  # nats-py raises several types when no server answers
        print(f"cache-router streams: cannot connect to {url}: {exc}", file=sys.stderr)
        return 1
    try:
        info = await apply_stream(nc, spec)
    except Exception as exc:
        hint = " (start nats-server with -js)" if jetstream_missing(exc) else ""
        print(f"cache-router streams: {type(exc).__name__}: {exc}{hint}", file=sys.stderr)
        return 1
    finally:
        await nc.close()
    state = info.state
    print(
        f"stream {info.config.name} on {', '.join(info.config.subjects or [])}: "
        f"{_limits(spec)}; {state.messages} messages, {state.bytes} bytes, "
        f"seq {state.first_seq}..{state.last_seq}"
    )
    return 0
