"""``cache-router serve``: run the router under uvicorn (uvloop + httptools).

Flags override ``CACHE_ROUTER_*`` env variables, which override the TOML file (see
``router.config``). SIGTERM/SIGINT stop accepting connections and let in-flight
requests, streams included, finish for up to ``drain_timeout`` seconds.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from router.config import ConfigError, RouterConfig, load_config

# Flag name -> config field; these names are a contract other tools script against.
_FLAGS = {
    "host": str,
    "port": int,
    "nats_url": str,
    "block_size": int,
    "policy": str,
    "tokenizer": str,
    "admin_token": str,
    "subject_prefix": str,
    "gateway": bool,
    "metrics_token": str,
    "replica_id": str,
    "events_transport": str,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config file (see router/config.py)")
    parser.add_argument("--host", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (default 8000)")
    parser.add_argument("--nats-url", help="NATS for KV events; omit to route on load alone")
    parser.add_argument(
        "--worker", action="append", default=[], metavar="ID=URL", help="an engine (repeatable)"
    )
    parser.add_argument(
        "--discover",
        action="append",
        default=[],
        metavar="dns://NAME:PORT|srv://NAME",
        help="engines behind a DNS name, re-resolved (repeatable; see router/discovery.py)",
    )
    parser.add_argument("--block-size", type=int, help="engine KV block size in tokens (16)")
    parser.add_argument("--policy", help="routing policy (default cache_aware)")
    parser.add_argument("--tokenizer", help="tokenizer.json or its directory, for every model")
    parser.add_argument("--admin-token", help="bearer token for /admin/* (off without it)")
    parser.add_argument("--subject-prefix", help="NATS subject prefix (default kv)")
    parser.add_argument(
        "--gateway",
        action="store_true",
        default=None,
        help="region gateway: workers are cluster routers, policy session_affinity by default",
    )
    parser.add_argument("--metrics-token", help="bearer token for /metrics (open without it)")
    parser.add_argument("--replica-id", help="this replica's name among its peers (random)")
    parser.add_argument(
        "--events-transport",
        choices=("auto", "jetstream", "core"),
        help="KV events from the JetStream stream or live core NATS (auto: stream if there)",
    )
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error")


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    overrides = {name: getattr(args, name) for name in _FLAGS}
    if args.gateway and args.policy is None and args.config is None:
        # the gateway's natural policy, unless a file or the environment names one
        overrides["policy"] = os.environ.get("CACHE_ROUTER_POLICY", "session_affinity")
    return load_config(
        args.config,
        overrides=overrides,
        extra_workers=args.worker,
        extra_discovery=args.discover,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from router.app import build_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = config_from_args(args)
        app = build_app(cfg)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"cache-router serve: {exc}", file=sys.stderr)
        return 2
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=cfg.host,
            port=cfg.port,
            loop="uvloop",
            http="httptools",
            lifespan="on",
            access_log=False,
            proxy_headers=False,  # X-Forwarded-* rewriting costs every request; unused here
            log_level=args.log_level.lower(),
            timeout_graceful_shutdown=int(cfg.drain_timeout),
            backlog=4096,
        )
    )
    server.run()
    return 0
