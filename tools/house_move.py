#!/usr/bin/env python3
"""Move the flat modules of `dask_gpu/` and `aisched_prefect/` into folders by process and trust side (issue 44).

Where a module runs, and whom it may trust, becomes its path: `dask_gpu/scheduler/` runs in the Dask scheduler,
`dask_gpu/worker/` in the worker (trusted: it holds the cluster's key), `dask_gpu/body/` inside a body (untrusted:
a tenant's code runs there), and so on (FOLDERS below says each). The move is a script, not a patch, so it can be
run again on a tree that has changed since it was written: it reads the tree, it does not expect today's lines.

    python tools/house_move.py --check              # what it would do; refuses as the real run would
    python tools/house_move.py                      # git mv, new folders' __init__.py, every import rewritten
    python tools/house_move.py --map dask_gpu/queue_gauges.py=dask_gpu/scheduler/gauges.py

It refuses, changing nothing, when a module in a flat folder (dask_gpu/*.py, aisched_prefect/control/*.py,
aisched_prefect/*.py) is neither in TABLE nor in STAYS: place it with `--map OLD=NEW` (NEW may be a folder ending
in `/`: the module keeps its name), or add it to TABLE. It also refuses when a target exists already, or a folder
would hold more than 15 modules.

What it rewrites, in every file git tracks (code, tests, bench, flows, docs, mkdocs.yml, pyproject.toml,
Makefile): each moved module's dotted name wherever it stands as a whole name (imports, `import a.b as c`,
`python -m`, entry points, Dask preload names, `::: module` references, monkeypatch strings, docstrings), its path
(`dask_gpu/queue_plugin.py`, `control/phases.py`), and `from package import module` forms of a moved module
(rewritten as `from new.package import module as name`). The setuptools package list is written from the folders.
Kept names: ALIASES (a thin module at the old path, for names operators type on Dask command lines).
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

MAX_MODULES = 15  # per folder, __init__.py not counted

# The flat folders: every module directly in one of them is moved by TABLE or stays by STAYS.
FLAT = ("dask_gpu", "aisched_prefect/control", "aisched_prefect")

STAYS = {
    # dask_gpu/ itself: what every process of a GPU cluster shares (records, names, the wire); nothing that runs.
    "dask_gpu/__init__.py", "dask_gpu/errors.py", "dask_gpu/request.py", "dask_gpu/inventory.py",
    "dask_gpu/framing.py", "dask_gpu/security.py", "dask_gpu/gate.py", "dask_gpu/tickets.py", "dask_gpu/lazy.py",
    "dask_gpu/ports.py",  # (another branch's) a port already taken, said in one line: scheduler, worker, isolation
    # aisched_prefect/control/: the plane's wiring (the service, its processes, a run's intake and reply).
    "aisched_prefect/control/__init__.py", "aisched_prefect/control/service.py", "aisched_prefect/control/server.py",
    "aisched_prefect/control/process.py", "aisched_prefect/control/runs.py", "aisched_prefect/control/calls.py",
    "aisched_prefect/control/outcomes.py", "aisched_prefect/control/reports.py",
    "aisched_prefect/control/metrics.py",  # (another branch's) the plane's Prometheus metrics, read by every part
    # aisched_prefect/: what the flow process and the plane share.
    "aisched_prefect/__init__.py", "aisched_prefect/approvals.py", "aisched_prefect/body.py",
    "aisched_prefect/errors.py", "aisched_prefect/evidence.py", "aisched_prefect/grants.py", "aisched_prefect/logs.py",
    "aisched_prefect/request.py", "aisched_prefect/settings.py", "aisched_prefect/usage.py", "aisched_prefect/wire.py",
    "aisched_prefect/words.py", "aisched_prefect/simulator.py",
}

TABLE = {
    # -- dask_gpu: the Dask scheduler
    "dask_gpu/queue_plugin.py": "dask_gpu/scheduler/queue.py",
    "dask_gpu/queue_books.py": "dask_gpu/scheduler/books.py",
    "dask_gpu/queue_devices.py": "dask_gpu/scheduler/devices.py",
    "dask_gpu/queue_membership.py": "dask_gpu/scheduler/membership.py",
    "dask_gpu/queue_stream.py": "dask_gpu/scheduler/stream.py",
    "dask_gpu/queue_warm.py": "dask_gpu/scheduler/warm.py",
    "dask_gpu/queue_backlog.py": "dask_gpu/scheduler/backlog.py",
    "dask_gpu/limits.py": "dask_gpu/scheduler/limits.py",
    "dask_gpu/scheduler_preload.py": "dask_gpu/scheduler/preload.py",
    "dask_gpu/scheduler_cli.py": "dask_gpu/scheduler/cli.py",
    # -- dask_gpu: the worker (trusted)
    "dask_gpu/plugin.py": "dask_gpu/worker/plugin.py",
    "dask_gpu/sandbox.py": "dask_gpu/worker/sandbox.py",
    "dask_gpu/zygote.py": "dask_gpu/worker/zygote.py",
    "dask_gpu/bodies.py": "dask_gpu/worker/bodies.py",
    "dask_gpu/allocator.py": "dask_gpu/worker/allocator.py",
    "dask_gpu/containment.py": "dask_gpu/worker/containment.py",
    "dask_gpu/results.py": "dask_gpu/worker/results.py",
    "dask_gpu/execute.py": "dask_gpu/worker/execute.py",
    "dask_gpu/live.py": "dask_gpu/worker/live.py",
    "dask_gpu/preload.py": "dask_gpu/worker/preload.py",
    "dask_gpu/nanny_preload.py": "dask_gpu/worker/nanny_preload.py",
    "dask_gpu/worker_cli.py": "dask_gpu/worker/cli.py",
    # -- dask_gpu: inside a body (untrusted)
    "dask_gpu/child.py": "dask_gpu/body/child.py",
    "dask_gpu/current.py": "dask_gpu/body/current.py",
    "dask_gpu/bodycode.py": "dask_gpu/body/code.py",
    "dask_gpu/gang.py": "dask_gpu/body/gang.py",
    # -- dask_gpu: a Dask client's process (a user's script, the control plane)
    "dask_gpu/cluster.py": "dask_gpu/client/cluster.py",
    # -- dask_gpu: Slurm, the simulator
    "dask_gpu/slurm_allocation.py": "dask_gpu/slurm/allocation.py",
    "dask_gpu/slurm_cli.py": "dask_gpu/slurm/cli.py",
    "dask_gpu/slurm_jobs.py": "dask_gpu/slurm/jobs.py",
    "dask_gpu/slurm_scaler.py": "dask_gpu/slurm/scaler.py",
    "dask_gpu/slurm_scaling.py": "dask_gpu/slurm/scaling.py",
    "dask_gpu/simulator.py": "dask_gpu/sim/simulator.py",
    "dask_gpu/sim_baselines.py": "dask_gpu/sim/baselines.py",
    "dask_gpu/sim_metrics.py": "dask_gpu/sim/metrics.py",
    "dask_gpu/queue_policy.py": "dask_gpu/sim/policies.py",
    # -- the control plane: admission
    "aisched_prefect/control/admission.py": "aisched_prefect/control/admission/record.py",
    "aisched_prefect/control/phases.py": "aisched_prefect/control/admission/phases.py",
    "aisched_prefect/control/pipeline.py": "aisched_prefect/control/admission/pipeline.py",
    "aisched_prefect/control/stages.py": "aisched_prefect/control/admission/stages.py",
    "aisched_prefect/control/decisions.py": "aisched_prefect/control/admission/decisions.py",
    # -- approvals
    "aisched_prefect/control/approvals.py": "aisched_prefect/control/approvals/requests.py",
    "aisched_prefect/control/approval_desk.py": "aisched_prefect/control/approvals/desk.py",
    "aisched_prefect/control/approval_links.py": "aisched_prefect/control/approvals/links.py",
    "aisched_prefect/control/approval_page.py": "aisched_prefect/control/approvals/page.py",
    "aisched_prefect/control/approval_proof.py": "aisched_prefect/control/approvals/proof.py",
    "aisched_prefect/control/approval_waiters.py": "aisched_prefect/control/approvals/waiters.py",
    "aisched_prefect/control/approval_words.py": "aisched_prefect/control/approvals/words.py",
    # -- dispatch (with warm bodies)
    "aisched_prefect/control/dispatch.py": "aisched_prefect/control/dispatch/dispatcher.py",
    "aisched_prefect/control/queueing.py": "aisched_prefect/control/dispatch/queueing.py",
    "aisched_prefect/control/running.py": "aisched_prefect/control/dispatch/running.py",
    "aisched_prefect/control/settlement.py": "aisched_prefect/control/dispatch/settlement.py",
    "aisched_prefect/control/losses.py": "aisched_prefect/control/dispatch/losses.py",
    "aisched_prefect/control/warm.py": "aisched_prefect/control/dispatch/warm.py",
    "aisched_prefect/control/watcher.py": "aisched_prefect/control/dispatch/watcher.py",
    "aisched_prefect/control/model_slots.py": "aisched_prefect/control/dispatch/model_slots.py",
    "aisched_prefect/control/scheduler_link.py": "aisched_prefect/control/dispatch/scheduler_link.py",
    # -- authority
    "aisched_prefect/control/credentials.py": "aisched_prefect/control/authority/credentials.py",
    "aisched_prefect/control/grants.py": "aisched_prefect/control/authority/grants.py",
    "aisched_prefect/control/identity.py": "aisched_prefect/control/authority/identity.py",
    "aisched_prefect/control/keys.py": "aisched_prefect/control/authority/keys.py",
    "aisched_prefect/control/state.py": "aisched_prefect/control/authority/state.py",
    "aisched_prefect/control/records.py": "aisched_prefect/control/authority/records.py",
    "aisched_prefect/control/configuration.py": "aisched_prefect/control/authority/configuration.py",
    # -- http
    "aisched_prefect/control/app.py": "aisched_prefect/control/http/app.py",
    "aisched_prefect/control/http_bounds.py": "aisched_prefect/control/http/bounds.py",
    # -- modules the other branches of this round add in the flat layout (placed here ahead of the merge)
    "aisched_prefect/control/outlast.py": "aisched_prefect/control/dispatch/outlast.py",
    "aisched_prefect/control/warm_reconcile.py": "aisched_prefect/control/dispatch/warm_reconcile.py",
    "aisched_prefect/control/warm_rows.py": "aisched_prefect/control/dispatch/warm_rows.py",
    "aisched_prefect/control/warm_tail.py": "aisched_prefect/control/dispatch/warm_tail.py",
    "aisched_prefect/control/time_limit.py": "aisched_prefect/control/dispatch/time_limit.py",
    "aisched_prefect/control/idle_price.py": "aisched_prefect/control/admission/idle_price.py",
    "aisched_prefect/control/capacity.py": "aisched_prefect/control/admission/capacity.py",
    "aisched_prefect/control/metrics_http.py": "aisched_prefect/control/http/prometheus.py",
    "aisched_prefect/idle_share.py": "aisched_prefect/reports/idle_share.py",
    "aisched_prefect/run_summary.py": "aisched_prefect/reports/run_summary.py",
    "dask_gpu/shiptree.py": "dask_gpu/body/shiptree.py",
    "dask_gpu/time_stop.py": "dask_gpu/body/time_stop.py",
    "dask_gpu/limit_names.py": "dask_gpu/body/limit_names.py",
    "dask_gpu/slurm_capacity.py": "dask_gpu/slurm/capacity.py",
    "dask_gpu/queue_metrics.py": "dask_gpu/scheduler/metrics.py",
    # -- aisched_prefect: reports, read from the ledger and the evidence
    "aisched_prefect/report.py": "aisched_prefect/reports/runs.py",
    "aisched_prefect/usage_report.py": "aisched_prefect/reports/usage.py",
}

# Each new folder's __init__.py: where its code runs, and what it may trust.
FOLDERS = {
    "dask_gpu/scheduler": "Runs in the Dask scheduler (trusted by the workers' gate): the cluster's one queue and its "
                          "parts, per-model call limits, the scheduler's preload and command.",
    "dask_gpu/worker": "Runs in a GPU worker (trusted: it holds the plane's ticket key and the cluster's certificate): "
                       "tickets checked, devices held, bodies contained, started and ended; a body's life as steps.",
    "dask_gpu/body": "Runs inside a body (untrusted: a tenant's code runs here): the child loop, shipped code, its "
                     "devices and gang; it imports nothing that holds a key or a ticket registry.",
    "dask_gpu/client": "Runs in a Dask client's process (a user's script, the control plane): a local GPU cluster, "
                       "and reading and steering a running one; trusts what the scheduler answers.",
    "dask_gpu/slurm": "Runs beside Slurm (a scaler's process, a worker in a Slurm job): worker jobs that follow the "
                      "queue, the scaling policy (pure), what a job gave its worker; trusts Slurm's own clients.",
    "dask_gpu/sim": "Runs offline (the simulator, benches): queue policies replayed over a workload with baselines "
                    "and figures; no cluster, no Prefect, trusts nothing it was not given.",
    "aisched_prefect/control/admission": "Runs in the control plane (trusted): admission as numbered phases over one "
                                         "snapshot of authority, and the record an admitted run carries.",
    "aisched_prefect/control/approvals": "Runs in the control plane (trusted): requests for a person's approval, "
                                         "answers proved by who gave them, one execution each; trusts no requester.",
    "aisched_prefect/control/dispatch": "Runs in the control plane (trusted, the only Dask client): queueing, running, "
                                        "settling exactly once, losses, warm bodies, the watcher, the scheduler link.",
    "aisched_prefect/control/authority": "Runs in the control plane (trusted, holds the signing key): who a caller is, "
                                         "credentials, grants, applied configuration, state folded from the evidence.",
    "aisched_prefect/control/http": "Runs in the control plane (trusted) at its edge: the HTTP API and what it takes "
                                    "before any route runs; trusts no caller before its credential is proved.",
    "aisched_prefect/reports": "Runs where a person reads (the CLI, the flow): evidence and ledger rows turned into "
                               "tables of runs, usage and cost; read-only, trusts the chain it verified.",
}

# Old module paths that stay importable as a thin alias: names operators type on Dask command lines.
ALIASES = {
    "dask_gpu/preload.py": "`dask worker --preload dask_gpu.preload`, the name the docs and operators' command lines use",
}

# Files that name the old layout on purpose: this script's table, and its test's flat tree.
NOT_REWRITTEN = ("tools/house_move.py", "tests/test_layout.py")
TEXT_SKIP = (".png", ".jpg", ".jpeg", ".gif", ".ico", ".csv", ".pdf", ".svg", ".woff", ".woff2", ".gz", ".zip")


class Refused(SystemExit):
    """The move cannot start: nothing was changed. The message says what to fix."""


def dotted(path: str) -> str:
    """`dask_gpu/queue_plugin.py` -> `dask_gpu.queue_plugin`; a package's `__init__.py` -> the package."""
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout


def suggest(path: str) -> str:
    """A likely home for an unmapped module, from its prefix (only a suggestion: the lead decides)."""
    folder, name = path.rsplit("/", 1)
    rules = [("dask_gpu", "queue_", "dask_gpu/scheduler/"), ("dask_gpu", "scheduler_", "dask_gpu/scheduler/"),
             ("dask_gpu", "worker_", "dask_gpu/worker/"), ("dask_gpu", "slurm_", "dask_gpu/slurm/"),
             ("dask_gpu", "sim_", "dask_gpu/sim/"), ("dask_gpu", "body", "dask_gpu/body/"),
             ("aisched_prefect/control", "approval_", "aisched_prefect/control/approvals/"),
             ("aisched_prefect/control", "http_", "aisched_prefect/control/http/")]
    for where, prefix, target in rules:
        if folder == where and name.startswith(prefix):
            stem = name[len(prefix):] if prefix.endswith("_") else name
            return target + stem
    return {"dask_gpu": "dask_gpu/worker/", "aisched_prefect/control": "aisched_prefect/control/dispatch/",
            "aisched_prefect": "aisched_prefect/reports/"}.get(folder, folder + "/") + name


def build_table(root: Path, extra: list[str], stay: list[str] = ()) -> dict[str, str]:
    """TABLE plus `--map` entries, checked against the tree: refuses on an unmapped flat module."""
    table = dict(TABLE)
    stays = STAYS | set(stay)
    for item in extra:
        old, sep, new = item.partition("=")
        if not sep or not old.endswith(".py") or not new:
            raise Refused(f"--map {item!r}: expected OLD=NEW, OLD a module path (dask_gpu/foo.py), NEW a path or a "
                          "folder ending in '/'. Fix: --map dask_gpu/foo.py=dask_gpu/worker/foo.py")
        table[old] = new + old.rsplit("/", 1)[1] if new.endswith("/") else new
    for old, new in table.items():
        if not new.endswith(".py"):
            raise Refused(f"{old} -> {new}: the target must be a module path ending in .py (or a folder ending in '/')")
    tracked = set(git(root, "ls-files").split())
    flat = sorted(p for p in tracked if p.endswith(".py") and p.rsplit("/", 1)[0] in FLAT and "/" in p)
    unmapped = [p for p in flat if p not in table and p not in stays]
    if unmapped:
        lines = "\n".join(f"  --map {p}={suggest(p)}" for p in unmapped)
        raise Refused(f"refused: {len(unmapped)} module(s) of a flat folder have no place in the table; nothing was "
                      f"changed.\nFix: place each (the suggestions are guesses from the name; check where it runs), "
                      f"then run again with:\n{lines}\n(or --stay PATH for one that every process shares), or add them "
                      "to TABLE (or STAYS) in tools/house_move.py.")
    missing = sorted(old for old in table if old not in tracked)
    for old in missing:  # deleted or renamed since the table was written: nothing to move
        print(f"note: {old} is not in the tree; skipped", file=sys.stderr)
        del table[old]
    taken = sorted(new for new in table.values() if (root / new).exists())
    if taken:
        raise Refused("refused: these targets exist already (has the move run?): " + ", ".join(taken)
                      + ". Fix: run it on the flat layout, or drop those rows.")
    counts: dict[str, set[str]] = {}
    for path in (tracked - set(table)) | set(table.values()):
        if path.endswith(".py") and not path.endswith("/__init__.py") and path.startswith(("dask_gpu/", "aisched_prefect/")):
            counts.setdefault(path.rsplit("/", 1)[0], set()).add(path)
    full = {k: len(v) for k, v in counts.items() if len(v) > MAX_MODULES}
    if full:
        raise Refused(f"refused: folders over {MAX_MODULES} modules after the move: {full}. Fix: place some elsewhere "
                      "with --map, or open a folder of their own.")
    return table


def import_edits(text: str, names: dict[str, str], file_module: str, is_package: bool) -> list[tuple[int, int, str]]:
    """Edits for imports a plain rename cannot mend: `from pkg import moved_module [as x]` and relative imports."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))

    def offset(line: int, col: int) -> int:  # ast columns are UTF-8 byte offsets
        start = starts[line - 1]
        return start + len(text[start:starts[line]].encode()[:col].decode(errors="ignore"))

    edits = []
    package = file_module if is_package else file_module.rpartition(".")[0]
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, *([node.module] if node.module else [])])
        moved_names = [a for a in node.names if f"{base}.{a.name}" in names]
        if not node.level and not moved_names:
            continue
        indent = " " * node.col_offset
        stmts = []
        rest = [a for a in node.names if a not in moved_names]
        if rest:
            target = names.get(base, base)
            stmts.append(f"from {target} import " + ", ".join(a.name + (f" as {a.asname}" if a.asname else "")
                                                              for a in rest))
        for a in moved_names:
            new = names[f"{base}.{a.name}"]
            pkg, _, mod = new.rpartition(".")
            alias = a.asname or a.name
            stmts.append(f"from {pkg} import {mod}" + (f" as {alias}" if alias != mod else ""))
        replacement = ("\n" + indent).join(stmts)
        edits.append((offset(node.lineno, node.col_offset), offset(node.end_lineno, node.end_col_offset), replacement))
    return edits


def rewrite(text: str, names: dict[str, str], paths: dict[str, str], py: tuple[str, bool] | None) -> str:
    """One pass over the original text: a name or path already rewritten is never read again."""
    edits = import_edits(text, names, *py) if py else []
    name_re = re.compile(r"(?<![\w.])(" + "|".join(re.escape(k) for k in sorted(names, key=len, reverse=True))
                         + r")(?!\w)")
    path_re = re.compile(r"(?<![\w./-])(" + "|".join(re.escape(k) for k in sorted(paths, key=len, reverse=True))
                         + r")(?![\w])")
    for rx, table in ((name_re, names), (path_re, paths)):
        for m in rx.finditer(text):
            if any(s < m.end() and m.start() < e for s, e, _ in edits):
                continue
            edits.append((m.start(), m.end(), table[m.group(1)]))
    out, last = [], 0
    for s, e, new in sorted(edits):
        if s < last:
            continue
        out.append(text[last:s])
        out.append(new)
        last = e
    out.append(text[last:])
    return "".join(out)


def path_forms(table: dict[str, str], tracked: set[str]) -> dict[str, str]:
    """Each moved file's path as prose writes it: whole; as `control/phases.py` (the plane's folder named); and a
    file name alone in backticks (`phases.py`), where no other file of the tree bears that name, as the path from
    the folder it stood in (`admission/phases.py`)."""
    names: dict[str, int] = {}
    for path in tracked:
        names[path.rsplit("/", 1)[-1]] = names.get(path.rsplit("/", 1)[-1], 0) + 1
    forms = {}
    for old, new in table.items():
        forms[old] = new
        if old.startswith("aisched_prefect/control/"):
            forms[old[len("aisched_prefect/"):]] = new[len("aisched_prefect/"):]
        folder, base = old.rsplit("/", 1)
        if names.get(base) == 1 and new.startswith(folder + "/"):
            forms[f"`{base}`"] = f"`{new[len(folder) + 1:]}`"
    return forms


def package_list(root: Path, text: str) -> str:
    """pyproject's `packages = [...]`: every package found under the ones it lists, in the order listed."""
    m = re.search(r'^packages = \[(.*?)\]', text, flags=re.M | re.S)
    if not m:
        return text
    listed = re.findall(r'"([^"]+)"', m.group(1))
    on_disk = {".".join(i.parent.relative_to(root).parts) for name in listed if "." not in name
               for i in (root / name).rglob("__init__.py")}
    found: list[str] = []

    def add(name: str) -> None:  # a package, then the packages below it that the list does not name
        found.append(name)
        for sub in sorted(p for p in on_disk if p.rpartition(".")[0] == name and p not in listed):
            add(sub)

    for name in dict.fromkeys(listed):
        add(name)
    return text[: m.start(1)] + ", ".join(f'"{n}"' for n in found) + text[m.end(1):]


def alias_text(root: Path, new: str, why: str) -> str:
    tree = ast.parse((root / new).read_text())
    hooks = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
             and n.name.startswith("dask_")]
    names = ", ".join(hooks) if hooks else "*"
    return (f'"""Kept name: {why}; the code is {dotted(new)}."""\n\n'
            f"from {dotted(new)} import {names}  # noqa: F401,F403\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--map", action="append", default=[], metavar="OLD=NEW",
                        help="place a module the table does not know (NEW may be a folder ending in '/')")
    parser.add_argument("--stay", action="append", default=[], metavar="PATH",
                        help="keep a module where it is: what every process of its package shares")
    parser.add_argument("--check", action="store_true", help="say what would move; change nothing")
    parser.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    args = parser.parse_args(argv)
    root = Path(args.root).resolve()
    table = build_table(root, args.map, args.stay)
    names = {dotted(old): dotted(new) for old, new in table.items()}
    paths = path_forms(table, set(git(root, "ls-files").split()))
    if args.check:
        for old, new in sorted(table.items()):
            print(f"{old} -> {new}")
        return 0
    if git(root, "status", "--porcelain", "--untracked-files=no").strip():
        raise Refused("refused: the work tree has uncommitted changes. Fix: commit them first, so that the move is a "
                      "commit of its own")
    for old, new in sorted(table.items()):
        (root / new).parent.mkdir(parents=True, exist_ok=True)
        git(root, "mv", old, new)
    for folder, doc in FOLDERS.items():
        init = root / folder / "__init__.py"
        if (root / folder).is_dir() and not init.exists():
            init.write_text(f'"""{doc}"""\n')
            git(root, "add", str(init.relative_to(root)))
    old_of = {new: old for old, new in table.items()}
    kept = {dotted(old) for old in ALIASES if old in table}  # prose keeps naming these: the alias answers
    prose_names = {k: v for k, v in names.items() if k not in kept}
    for path in git(root, "ls-files").split():
        if path.endswith(TEXT_SKIP) or path in NOT_REWRITTEN or not (root / path).is_file():
            continue
        try:
            text = (root / path).read_text()
        except UnicodeDecodeError:
            continue
        was = old_of.get(path, path)  # a relative import is read from where its file stood
        py = (dotted(was), was.endswith("__init__.py")) if path.endswith(".py") else None
        new = rewrite(text, names if py else prose_names, paths, py)
        if path == "pyproject.toml":
            new = package_list(root, new)
        if new != text:
            (root / path).write_text(new)
    for old, why in ALIASES.items():
        if old in table:
            (root / old).write_text(alias_text(root, table[old], why))
            git(root, "add", old)
    git(root, "add", "-u")
    print(f"moved {len(table)} modules into {len({n.rsplit('/', 1)[0] for n in table.values()})} folders; "
          "imports, names and paths rewritten. Review `git diff --cached --stat`, run the tests, commit.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
