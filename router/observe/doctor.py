"""``cache-router doctor``: is this deployment's view of the engines' caches true?

Asks a running router (its admin API) and each of its engines, and prints what is wrong
on one screen (``--json`` for scripts; exit status 1 when something is):

- events: has each worker's KV-event stream reached the router, and is it in sync;
- block size: the router's pool against the engine's (vLLM's ``cache_config_info``
  metric, SGLang's ``page_size`` in ``/get_server_info``);
- tokenizer: the router's token ids for a probe prompt (``POST /admin/tokenize``)
  against the engine's ``/tokenize`` (chat and completion); any difference means no
  hash can ever match;
- hits: the router's predicted cached tokens against the engine-reported ones
  (the hit audit in ``/admin/index``), with its warnings.
- event loop: how late the router's own loop ran in the last minute, and whether the
  machine (CPU wait) or the router's work is why (``router.observe.loop``).
- admission: each engine's limit as the router learnt it, its load and room, and
  whether a request would wait at the router now (``POST /admin/explain``).

Each check says ok, warn, fail or skip (the engine cannot tell) and why.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import orjson

from router.observe.loop import verdict as loop_verdict

PROBE = "The cache-router doctor checks that router and engine tokenize alike: 12 ünïcode 🙂"
_VLLM_BLOCK = re.compile(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"')


@dataclass(slots=True)
class Check:
    worker: str
    name: str
    status: str  # ok | warn | fail | skip
    detail: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router", default="http://127.0.0.1:8000", help="router base URL")
    parser.add_argument("--admin-token", required=True, help="the router's admin_token")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per HTTP call")


def engine_block_size(http: httpx.Client, url: str) -> int | None:
    try:
        text = http.get(url + "/metrics").text
        m = _VLLM_BLOCK.search(text)
        if m:
            return int(m.group(1))
        info = http.get(url + "/get_server_info")
        if info.status_code == 200:
            size = info.json().get("page_size")
            return int(size) if isinstance(size, int) else None
    except (httpx.HTTPError, ValueError):
        return None
    return None


def engine_tokens(http: httpx.Client, url: str, body: dict[str, Any]) -> list[int] | None:
    req = dict(body)
    if "messages" in req:
        req["add_generation_prompt"] = True
    try:
        r = http.post(url + "/tokenize", json=req)
        if r.status_code != 200:
            return None
        tokens = r.json().get("tokens")
        return list(tokens) if isinstance(tokens, list) else None
    except (httpx.HTTPError, ValueError):
        return None


def diagnose(http: httpx.Client, router: str, token: str) -> list[Check]:
    auth = {"authorization": f"Bearer {token}"}
    checks: list[Check] = []
    workers = http.get(router + "/admin/workers", headers=auth)
    workers.raise_for_status()
    index = http.get(router + "/admin/index", headers=auth).json()
    audit = index.get("audit", {})
    for w in workers.json()["workers"]:
        wid, url, pool = w["id"], w["url"].rstrip("/"), index["pools"].get(w["pool"], {})
        held = sum(pool.get("index", {}).get("workers", {}).get(wid, {}).values())
        a = audit.get(wid, {})
        if not w["healthy"]:
            checks.append(Check(wid, "health", "fail", w.get("last_error") or "down"))
            continue
        seen = a.get("events_seen", held > 0)
        if not seen and not held:
            checks.append(
                Check(
                    wid,
                    "events",
                    "warn" if not a.get("requests") else "fail",
                    "no KV event from this worker has arrived: is its agent running, "
                    "and the engine's endpoint a wildcard (tcp://*:P) or ipc://?",
                )
            )
        elif not w.get("in_sync", True):
            checks.append(Check(wid, "events", "warn", "out of sync (a replay is pending)"))
        else:
            checks.append(Check(wid, "events", "ok", f"arriving, {held} blocks indexed"))
        size = engine_block_size(http, url)
        if size is None:
            checks.append(Check(wid, "block_size", "skip", "the engine does not report it"))
        elif size != w["block_size"]:
            checks.append(
                Check(wid, "block_size", "fail", f"router {w['block_size']}, engine {size}")
            )
        else:
            checks.append(Check(wid, "block_size", "ok", str(size)))
        for model in sorted(w["models"])[:1] or [None]:
            if model is None:
                checks.append(Check(wid, "tokenizer", "skip", "no model known yet"))
                continue
            for kind, body in (
                ("completion", {"model": model, "prompt": PROBE}),
                ("chat", {"model": model, "messages": [{"role": "user", "content": PROBE}]}),
            ):
                mine = http.post(router + "/admin/tokenize", headers=auth, json=body)
                theirs = engine_tokens(http, url, body)
                if theirs is None or mine.status_code != 200:
                    checks.append(Check(wid, f"tokenizer.{kind}", "skip", "no /tokenize answer"))
                    continue
                ours = mine.json()["tokens"]
                if ours == theirs:
                    checks.append(Check(wid, f"tokenizer.{kind}", "ok", f"{len(ours)} tokens"))
                else:
                    at = next(
                        (i for i, (x, y) in enumerate(zip(ours, theirs, strict=False)) if x != y),
                        min(len(ours), len(theirs)),
                    )
                    checks.append(
                        Check(
                            wid,
                            f"tokenizer.{kind}",
                            "fail",
                            f"router {len(ours)} tokens, engine {len(theirs)}, first "
                            f"difference at {at}: configure the model's tokenizer",
                        )
                    )
        if not a or not a.get("requests"):
            checks.append(Check(wid, "hits", "skip", "no audited request yet"))
            continue
        div = a.get("divergence")
        detail = (
            f"predicted {a['predicted_hit_tokens']} vs reported {a['reported_hit_tokens']} "
            f"cached tokens, {a['mismatched_requests']}/{a['requests']} requests differ"
        )
        if a.get("warnings"):
            for kind, text in a["warnings"].items():
                checks.append(Check(wid, f"hits.{kind}", "fail", text))
        else:
            status = "ok" if div is None or div == 0 else "warn"
            checks.append(Check(wid, "hits", status, detail))
    if index.get("loop") is not None:
        late, detail = loop_verdict(index["loop"])
        checks.append(Check("-", "event_loop", "warn" if late else "ok", detail))
    checks.extend(admission(http, router, auth, workers.json()["workers"]))
    return checks


def admission(
    http: httpx.Client, router: str, auth: dict[str, str], workers: list[dict[str, Any]]
) -> list[Check]:
    """Where a probe request would wait (router.admission): warn when it would be held."""
    model = next((m for w in workers for m in sorted(w["models"])), None)
    if model is None:
        return []
    r = http.post(router + "/admin/explain", headers=auth, json={"model": model, "prompt": PROBE})
    found = r.json().get("admission") if r.status_code == 200 else None
    if found is None:
        return [Check("-", "admission", "skip", "off (or the probe was not routable)")]
    checks = []
    for wid, w in found["workers"].items():
        if w["limit"] is None:
            checks.append(Check(wid, "admission", "ok", "never seen full: nothing held"))
        else:
            room = w["room"]
            detail = f"limit {w['limit']}, {w['inflight']} in flight, room {room}"
            checks.append(Check(wid, "admission", "ok" if room > 0 else "warn", detail))
    held = found["queued"]["queued"]
    status = "ok" if found["would"].startswith("bound") else "warn"
    checks.append(
        Check("-", "admission", status, f"{held} held; a request would be {found['would']}")
    )
    return checks


def render(checks: list[Check]) -> str:
    mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": "skip"}
    lines = [f"{mark[c.status]} {c.worker:<16} {c.name:<20} {c.detail}" for c in checks]
    bad = sum(c.status in ("fail", "warn") for c in checks)
    lines.append(f"{bad} problem(s)" if bad else "all checks passed")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        with httpx.Client(timeout=args.timeout) as http:
            checks = diagnose(http, args.router.rstrip("/"), args.admin_token)
    except httpx.HTTPError as exc:
        print(
            f"cache-router doctor: cannot ask the router at {args.router}: {exc}", file=sys.stderr
        )
        return 2
    if args.json:
        sys.stdout.write(orjson.dumps([asdict(c) for c in checks]).decode() + "\n")
    else:
        print(render(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0
