"""The proxy's failure table: each upstream failure gets its own row, subclasses first."""

from __future__ import annotations

from router.forward.relay import SEND_FAILURES, send_failure
from router.forward.upstream import ConnectFailed, UpstreamError, UpstreamTimeout


def test_each_send_failure_maps_to_its_row() -> None:
    connect = send_failure(ConnectFailed("refused"))
    timeout = send_failure(UpstreamTimeout("slow"))
    other = send_failure(UpstreamError("reset"))
    # only a connect failure (nothing reached the engine) is retried elsewhere
    assert (connect.status, connect.retry, connect.suspect) == (502, True, True)
    assert (timeout.status, timeout.retry, timeout.suspect) == (504, False, True)
    assert (other.status, other.retry, other.suspect) == (502, False, False)


def test_no_row_is_shadowed_by_an_earlier_base_class() -> None:
    for i, (cls, _) in enumerate(SEND_FAILURES):
        assert not any(issubclass(cls, earlier) for earlier, _ in SEND_FAILURES[:i])
