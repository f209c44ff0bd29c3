"""The documentation stays true: the site builds strictly, and the Python snippets of every page run.

Snippets are the ```python blocks of README.md and docs/**/*.md. Those of one page run in order in
one namespace, as a reader would paste them (as `__main__`, so a page's script runs its flow). An
HTML comment on the lines just above a block says how to run it:

    <!-- docs-test: prefect (why) -->   needs a Prefect API: runs under the test harness (prefect_api)
    <!-- docs-test: skip (why) -->      not executed here; the reason says what it needs

Any other block needs no server and runs as it is. A flow a snippet runs starts an embedded
control plane (no AISCHED_CONTROL_PLANE), with its ledger in a temporary AISCHED_HOME.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(?P<mode>\S+)\s*(?P<why>.*?)\s*-->")
MODES = ("skip", "prefect")


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int
    code: str
    mode: str  # "run", "prefect" or "skip"
    why: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def snippets(page: Path) -> list[Snippet]:
    """The page's Python blocks, each with the directive in the HTML comments right above it."""
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        if m.group("info").strip().split(" ")[0] not in ("python", "py"):
            continue
        before = text[: m.start()].rstrip("\n").splitlines()
        mode, why = "run", ""
        while before and before[-1].strip().startswith("<!--"):  # comments directly above the fence
            d = DIRECTIVE.search(before.pop())
            if d:
                mode, why = d.group("mode"), d.group("why")
        body = "\n".join(line[len(m.group("indent")):] for line in m.group("body").splitlines())
        out.append(Snippet(page, text[: m.start()].count("\n") + 2, body, mode, why))
    return out


ALL = [s for page in PAGES for s in snippets(page)]
RUNNABLE_PAGES = sorted({s.page for s in ALL if s.mode != "skip"})


def test_every_directive_is_known_and_every_skip_says_why():
    bad = [f"{s.where}: {s.mode!r}" for s in ALL if s.mode not in ("run", *MODES)]
    assert not bad, f"unknown docs-test directives (use one of {MODES}): {bad}"
    silent = [s.where for s in ALL if s.mode == "skip" and not s.why.strip("() ")]
    assert not silent, f"snippets marked not executed must say why: {silent}"
    assert ALL, "no Python snippets found: the pattern no longer matches the pages"


@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_snippets_run(page: Path, request, tmp_path, monkeypatch):
    chosen = [s for s in snippets(page) if s.mode != "skip"]
    if any(s.mode == "prefect" for s in chosen):
        request.getfixturevalue("prefect_api")
    for name in ("AISCHED_CONTROL_PLANE", "AISCHED_TOKEN", "AISCHED_OPERATOR_TOKEN", "AISCHED_LEDGER_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AISCHED_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    for s in chosen:
        path = tmp_path / f"{page.stem}_line{s.line}.py"  # a real file: tracebacks and inspect.getsource work
        path.write_text(s.code)
        try:
            exec(compile(s.code, str(path), "exec"), namespace)
        except BaseException as exc:
            raise AssertionError(f"the snippet at {s.where} failed: {type(exc).__name__}: {exc}") from exc


def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a broken link, a missing page or an unresolved API reference fails it."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "aisched grants delegate" in cli and "--control-plane" in cli  # generated from the Typer app


def test_the_cli_reference_covers_every_command():
    """The generated page names every command of the Typer app, so a new command is documented by construction."""
    import typer.main

    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from docs_hooks import cli_markdown
    finally:
        sys.path.remove(str(ROOT / "tools"))
    from aisched_prefect.cli import app

    page = cli_markdown()

    def paths(command, prefix):
        yield prefix
        for name, sub in getattr(command, "commands", {}).items():
            yield from paths(sub, f"{prefix} {name}")

    missing = [p for p in paths(typer.main.get_command(app), "aisched") if p != "aisched" and f"`{p}`" not in page]
    assert not missing, missing
