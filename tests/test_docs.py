"""The generated pages are current: docs/configuration.md from the settings' declarations,
docs/metrics.md from the metrics registry. A change to either without regenerating the
page fails here, with the command that regenerates it."""

from __future__ import annotations

from pathlib import Path

from router import config
from router.config import docs as config_docs
from router.observe import docs as metrics_docs

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_the_configuration_page_is_current() -> None:
    page = (DOCS / "configuration.md").read_text()
    assert page == config_docs.render(), (
        "docs/configuration.md is stale: python3 -m router.config.docs > docs/configuration.md"
    )


def test_every_setting_is_on_the_page_with_what_it_means() -> None:
    """Each setting has a row with its env variable, and a meaning (its flag's help or its
    comment): a setting declared without one fails."""
    rows = {
        line.split("|")[1].strip(" `"): line
        for line in config_docs.render().split("## Table entries")[0].splitlines()
        if line.startswith("| `")
    }
    for name in [*config.SCALARS, *config.TABLES]:
        assert name in rows, name
        assert rows[name].rstrip(" |").split("|")[-1].strip(), f"{name}: say what it means"
    for name in config.SCALARS:
        assert f"`CACHE_ROUTER_{name.upper()}`" in rows[name]


def test_the_metrics_page_is_current() -> None:
    page = (DOCS / "metrics.md").read_text()
    assert page == metrics_docs.render(), (
        "docs/metrics.md is stale: python3 -m router.observe.docs > docs/metrics.md"
    )


def test_every_metric_is_on_the_page() -> None:
    names = {f["name"] for f in metrics_docs.families()}
    assert "cache_router_requests_total" in names and "cache_router_process_up" in names
    assert all(f["help"] for f in metrics_docs.families())
