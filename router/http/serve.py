"""``cache-router serve``: run the router under uvicorn (uvloop + httptools).

Flags override ``CACHE_ROUTER_*`` env variables, which override the TOML file (see
``router.config``). SIGTERM/SIGINT stop accepting connections and let in-flight
requests, streams included, finish for up to ``drain_timeout`` seconds. With
``processes`` > 1 this process supervises that many routers on the port
(``router.http.processes``) and serves nothing itself.
"""

from __future__ import annotations

import argparse
import gc
import logging
import socket
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from router.config import FLAGS, SCALARS, ConfigError, RouterConfig, load_config

if TYPE_CHECKING:
    import uvicorn

    from router.http.asgi import App


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config file (see router/config/settings.py)")
    parser.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="[ROLE:]ID=URL",
        help="an engine (repeatable); ROLE prefill or decode for a disaggregated pool",
    )
    parser.add_argument(
        "--discover",
        action="append",
        default=[],
        metavar="dns://NAME:PORT|srv://NAME",
        help="engines behind a DNS name, re-resolved (repeatable; see router/workers/discovery.py)",
    )
    for name, help_ in FLAGS:
        flag = "--" + name.replace("_", "-")
        scalar = SCALARS[name]
        if scalar.kind is bool:  # default None: "not given" leaves the file's and env's value
            parser.add_argument(flag, action="store_true", default=None, help=help_)
        else:
            parser.add_argument(flag, type=scalar.kind, choices=scalar.choices or None, help=help_)
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error")


def config_from_args(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> RouterConfig:
    """The config the flags, ``env`` (default: the process's) and ``--config`` say."""
    return load_config(
        args.config,
        env=env,
        overrides={name: getattr(args, name) for name, _ in FLAGS},
        extra_workers=args.worker,
        extra_discovery=args.discover,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from router.http.app import build_app
    from router.http.processes import (
        Child,
        ProcessesApp,
        Supervisor,
        control_socket,
        reuseport_socket,
    )
    from router.observe.ratelog import RateLimitFilter

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per health check otherwise
    logging.getLogger("uvicorn.error").addFilter(RateLimitFilter())  # a line per bad request
    child = Child.from_env()
    sockets: list[socket.socket] | None = None
    try:
        cfg = child.config() if child is not None else config_from_args(args)
        if cfg.processes > 1 and child is None:
            return Supervisor(cfg, args.log_level).run()
        app: App = build_app(cfg)
        if child is not None:  # one of the supervisor's processes (router/http/processes.py)
            app = ProcessesApp(app, child)
            sockets = [
                reuseport_socket(cfg.host, cfg.port),
                control_socket(child.control_path()),
            ]
    except (ConfigError, ValueError, OSError) as exc:
        print(f"cache-router serve: {exc}", file=sys.stderr)
        return 2
    server = uvicorn.Server(server_config(app, cfg, log_level=args.log_level.lower()))
    settle_collector()
    server.run(sockets=sockets)
    return 0


# The cyclic collector's first-generation threshold (CPython's default: 700).
GC_YOUNG = 10_000


def settle_collector() -> None:
    """Before serving: what start-up made (modules, FastAPI, the templates,
    the config) leaves the cyclic collector's scans (``gc.freeze``), and the young
    generation is collected every ``GC_YOUNG`` allocations instead of 700. A request
    allocates a few hundred tracked objects, nearly all freed by reference counting, so
    at the default the collector ran every request or two. perf on bench/proxy.py's
    short chats (``cache_aware``, concurrency 32): the collector's share of the router's
    CPU 5.1 % by default, 1.8 % frozen, 0.2 % frozen with this threshold; the whole CPU
    per request moved within the noise (353 against 357 us, 5 rounds under the lock,
    BENCHMARKS.md). Cycles still go within some tens of requests. Called by ``run``
    only: a process that builds many apps (the tests) would keep every frozen one's
    cycles for ever."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])


def server_config(app: App, cfg: RouterConfig, **overrides: Any) -> uvicorn.Config:
    """uvicorn's settings for the router: uvloop, httptools behind ``router.http.guard``."""
    import uvicorn

    from router.http.guard import Limits, default_max_connections, guarded_protocol

    limits = Limits(
        # the parsed-header limit (router.http.edge) plus room for the request line and framing
        max_head_bytes=cfg.max_header_bytes + 8 * 1024,
        header_timeout=cfg.header_timeout,
        max_connections=cfg.max_connections or default_max_connections(),
    )
    settings: dict[str, Any] = {
        "host": cfg.host,
        "port": cfg.port,
        "loop": "uvloop",
        "http": guarded_protocol(limits),
        "ws": "none",  # no websocket routes: an upgrade is refused by the guard
        "lifespan": "on",
        "access_log": False,
        "proxy_headers": False,  # X-Forwarded-* rewriting costs every request; unused here
        "timeout_keep_alive": cfg.idle_timeout,
        "timeout_graceful_shutdown": int(cfg.drain_timeout),
        "backlog": 4096,
        **overrides,
    }
    if cfg.tls_cert is not None:  # HTTPS, the files followed (router.http.tls)
        from router.http.tls import ReloadingTls

        tls = ReloadingTls(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
        settings["ssl_context_factory"] = tls.factory
    return uvicorn.Config(app, **settings)
