"""``WorkerRegistry.for_model`` kept per model (O(1) a request) and dropped on any change
of who serves what: the next request sees a worker added, removed, draining, down, its
models changed or an adapter learnt."""

from __future__ import annotations

import time

from policies.base import RouteRequest
from router.config import ModelSpec, RouterConfig, WorkerSpec
from router.http.app import RouterState
from router.routing.decide import Parsed
from router.workers.lora import LoraSlots
from router.workers.registry import WorkerRegistry

BS = 16


def _reg(**models: ModelSpec) -> WorkerRegistry:
    return WorkerRegistry(RouterConfig(block_size=BS, models=dict(models)))


def test_the_same_list_while_nothing_changes() -> None:
    reg = _reg()
    a = reg.add(WorkerSpec("a", "http://h/a", model="m"))
    first = reg.for_model("m")
    assert first == [a] and reg.for_model("m") is first  # kept: no pass over the workers
    assert reg.for_model("other") == []  # an unknown model: none (no model-less worker)


def test_membership_changes_are_seen_by_the_next_call() -> None:
    reg = _reg()
    a = reg.add(WorkerSpec("a", "http://h/a", model="m"))
    before = reg.for_model("m")
    b = reg.add(WorkerSpec("b", "http://h/b", model="m"))
    assert reg.for_model("m") == [a, b] and before == [a]  # a new list; the old one as it was
    reg.remove("a")
    assert reg.for_model("m") == [b]
    reg.remove("b")
    assert reg.for_model("m") == []
    u = reg.add(WorkerSpec("u", "http://h/u"))  # serves no model it knows of yet: any
    assert reg.for_model("m") == [u]
    u.models = frozenset({"n"})  # its /v1/models answered
    assert reg.for_model("m") == [] and reg.for_model("n") == [u]


def test_a_removed_worker_no_longer_tells_the_registry() -> None:
    reg = _reg()
    a = reg.add(WorkerSpec("a", "http://h/a", model="m"))
    reg.remove("a")
    kept = reg.for_model("m")
    a.models = frozenset({"m", "x"})  # a worker gone: its changes are not the registry's
    assert reg.for_model("m") is kept


def test_adapters_follow_models_and_lora_slots() -> None:
    """An adapter a worker lists is served there; one nobody lists goes to its base's
    workers, those with a free adapter slot first (read again each time: slots change
    with each scrape)."""
    reg = _reg(ad=ModelSpec(base="m"))
    a = reg.add(WorkerSpec("a", "http://h/a", model="m"))
    b = reg.add(WorkerSpec("b", "http://h/b", model="m"))
    assert reg.for_model("ad") == [a, b]
    a.lora = LoraSlots(frozenset({"x"}), frozenset(), 1)  # full
    b.lora = LoraSlots(frozenset(), frozenset(), 1)
    assert reg.for_model("ad") == [b]
    b.lora = LoraSlots(frozenset({"y"}), frozenset(), 1)
    assert reg.for_model("ad") == [a, b]
    a.models = a.models | {"ad"}  # a lists it now
    assert reg.for_model("ad") == [a]
    assert reg.for_model("m") == [a, b]


def test_a_change_is_seen_by_the_next_request() -> None:
    """Through the router's own path (``Router.workers_for`` -> ``decide``): a worker
    added, drained or down, each seen by the request after it."""
    cfg = RouterConfig(
        workers=[WorkerSpec("a", "http://h/a", model="m")], block_size=BS, policy="least_load"
    )
    st = RouterState(cfg)
    router, reg = st.router, st.registry

    def route() -> str:
        parsed = Parsed("chat", {"model": "m"}, "m", False, None, "r", None)
        request = RouteRequest("r", "m", 64, [1, 2, 3], BS)
        prep = router.prepared(parsed, router.workers_for("m"), request)
        return router.decide(prep)[0].worker_id

    a = reg.get("a")
    assert a is not None
    a.load.begin(0)  # busier than a newcomer
    assert route() == "a"
    reg.add(WorkerSpec("b", "http://h/b", model="m"))
    assert route() == "b"
    reg.drain("b")
    assert route() == "a"
    b = reg.get("b")
    assert b is not None
    b.draining = False
    reg._unhealthy(a, "down")  # unhealthy_after failed checks in a row
    for _ in range(cfg.unhealthy_after):
        reg._unhealthy(a, "down")
    assert not a.usable(time.monotonic()) and route() == "b"


def test_the_admission_ticket_keeps_its_candidates_while_the_list_is_the_same() -> None:
    """The gate builds a plain request's candidates (and their set) once per list of the
    model's workers: the same objects while nothing changes, a new worker's targets (each
    data-parallel rank) in the next request's after a change; an excluded target or
    worker is left out of that request's alone."""
    cfg = RouterConfig(workers=[WorkerSpec("a", "http://h/a", model="m")], block_size=BS)
    st = RouterState(cfg)
    router, reg, gate = st.router, st.registry, st.gate
    assert gate is not None  # admission is on by default

    def ticket(exclude: frozenset[str] = frozenset()) -> tuple[tuple[str, ...], frozenset[str]]:
        parsed = Parsed("chat", {"model": "m"}, "m", False, None, "r", None)
        request = RouteRequest("r", "m", 64, [1, 2, 3], BS)
        t = gate.ticket(router.prepared(parsed, router.workers_for("m"), request), "t", 0,
                        exclude=exclude)  # fmt: skip
        assert t.every == frozenset(t.candidates)
        return t.candidates, t.every

    first, every = ticket()
    assert first == ("a",)
    again, every_again = ticket()
    assert again is first and every_again is every  # no pass over the targets
    reg.add(WorkerSpec("b", "http://h/b", model="m", dp_size=2))
    grown, _ = ticket()
    assert grown == ("a", "b-dp0", "b-dp1")
    assert ticket(frozenset({"b-dp1"}))[0] == ("a", "b-dp0")
    assert ticket(frozenset({"b"}))[0] == ("a",)
    assert ticket()[0] is grown  # the plain list's, kept
    reg.remove("a")
    assert ticket()[0] == ("b-dp0", "b-dp1")
