"""``cache-router agent``: run the node agent beside one vLLM / SGLang / mock engine."""

from __future__ import annotations

import argparse

from agent.node import AgentConfig, NodeAgent
from index.wire import DEFAULT_PREFIX, DEFAULT_STREAM
from router.cli import serve_until_signalled

NATS_AUTH = (
    "nats_user",
    "nats_password",
    "nats_token",
    "nats_credentials",
    "nats_tls_ca",
    "nats_tls_cert",
    "nats_tls_key",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker-id", required=True, help="this engine's id in the pool")
    parser.add_argument("--zmq-endpoint", required=True, help="the engine's KV-event PUB socket")
    parser.add_argument("--replay-endpoint", help="the engine's KV-event replay ROUTER socket")
    parser.add_argument("--engine-url", help="engine HTTP base URL (/metrics, mock /prefetch)")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--subject-prefix", default=DEFAULT_PREFIX)
    parser.add_argument("--prefetch-hook", help="URL to POST prefetch hints to (real engines)")
    parser.add_argument("--load-interval", type=float, default=1.0, help="seconds; 0 disables")
    parser.add_argument("--buffer", type=int, default=10_000, help="batches kept for replay")
    parser.add_argument("--topic", default="", help="ZMQ topic the engine publishes under")
    parser.add_argument(
        "--events-stream",
        default=DEFAULT_STREAM,
        help=f"JetStream stream of the events, created if missing ({DEFAULT_STREAM})",
    )
    auth = parser.add_argument_group("NATS credentials and TLS (as the router's nats_* settings)")
    for name in NATS_AUTH:
        auth.add_argument("--" + name.replace("_", "-"))
    parser.add_argument("--log-level", default="INFO")


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    if args.buffer <= 0:
        raise SystemExit("--buffer must be positive")
    try:
        return _config(args)
    except ValueError as exc:
        raise SystemExit(f"--worker-id: {exc}") from None


def _config(args: argparse.Namespace) -> AgentConfig:
    return AgentConfig(
        worker_id=args.worker_id,
        zmq_endpoint=args.zmq_endpoint,
        nats_url=args.nats_url,
        engine_url=args.engine_url,
        replay_endpoint=args.replay_endpoint,
        subject_prefix=args.subject_prefix,
        prefetch_hook=args.prefetch_hook,
        load_interval=args.load_interval,
        buffer=args.buffer,
        topic=args.topic,
        events_stream=args.events_stream,
        **{name: getattr(args, name) for name in NATS_AUTH},
    )


def run(args: argparse.Namespace) -> int:
    serve_until_signalled(NodeAgent(config_from_args(args)), args.log_level)
    return 0
