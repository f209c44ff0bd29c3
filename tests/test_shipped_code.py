"""Code identity is everything the body can import of the shipped code (issue 39).

Before: only the modules a task's module referenced when the flow imported it travelled; a helper imported inside the
task function was neither shipped nor in the digest, and in the body a shipped package kept the flow host's
`__path__`, so on a worker with the same path (a shared checkout) a changed helper ran under the digest a person
had approved. Now a task's regular package ships whole, a flow file ships what its source imports from its folder
(inside functions too), and the body refuses to import an un-shipped module beside shipped ones.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from dask_gpu.body.code import ShippedCode, ship, unwrap

TASK = """
from aisched_prefect import ai_task

@ai_task(gpus=1, gpu_type="H100", kind="training", est_seconds=5)
def tune(x: int) -> int:
    from {helper} import factor  # imported lazily, inside the task: never in sys.modules of the flow process
    return x * factor()
"""


def _package(root: Path, factor: int = 2) -> str:
    """A project package `pkg_<id>` with a task module and a helper only the task's body imports."""
    name = f"pkg_{uuid.uuid4().hex[:8]}"
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("")
    (root / name / "tasks.py").write_text(TASK.format(helper=f"{name}.helper"))
    (root / name / "helper.py").write_text(f"def factor():\n    return {factor}\n")
    return name


def _flow_file(root: Path) -> str:
    """A flow file (a top-level module) with a helper module beside it that only the task's body imports."""
    name = f"flow_{uuid.uuid4().hex[:8]}"
    helper = f"{name}_helper"
    (root / f"{name}.py").write_text(TASK.format(helper=helper))
    (root / f"{helper}.py").write_text("def factor():\n    return 2\n")
    return name


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return tmp_path


def _shipped(module: str) -> ShippedCode:
    mod = importlib.import_module(module)
    code = ship(unwrap(mod.tune))
    assert code is not None
    return code


@pytest.mark.parametrize("layout", ["package", "flow file"])
def test_a_changed_lazily_imported_helper_is_new_code(on_path, layout):
    name = _package(on_path) if layout == "package" else _flow_file(on_path)
    module = f"{name}.tasks" if layout == "package" else name
    helper = on_path / (f"{name}/helper.py" if layout == "package" else f"{name}_helper.py")
    before = _shipped(module)
    assert any(f.module.endswith("helper") for f in before.files), [f.module for f in before.files]
    assert _shipped(module).digest() == before.digest()  # the same bytes, the same code
    helper.write_text("def factor():\n    return 3\n")  # edited after the flow imported the task: nothing reloads
    after = _shipped(module)
    # The digest is the call's code_digest: what the body checks, what the warm key hashes (control.dispatch.warm.warm_key)
    # and, through the shipped bytes, what `new_flow_version` keys on.
    assert after.digest() != before.digest()
    assert after.encode() != before.encode()


def test_a_regular_package_ships_whole(on_path):
    name = _package(on_path)
    (on_path / name / "sub").mkdir()
    (on_path / name / "sub" / "__init__.py").write_text("")
    (on_path / name / "sub" / "deep.py").write_text("X = 1\n")
    (on_path / name / "data").mkdir()  # not a package: not code
    (on_path / name / "data" / "notes.py").write_text("X = 2\n")
    code = _shipped(f"{name}.tasks")
    assert {f.module for f in code.files} == {name, f"{name}.tasks", f"{name}.helper", f"{name}.sub",
                                              f"{name}.sub.deep"}


def test_a_package_too_large_to_ship_says_so(on_path, monkeypatch):
    import dask_gpu.body.code as bodycode
    from dask_gpu.errors import ShippedCodeTooLarge

    name = _package(on_path)
    monkeypatch.setattr(bodycode, "MAX_FILES", 2)
    with pytest.raises(ShippedCodeTooLarge, match="Fix: install"):
        _shipped(f"{name}.tasks")


def test_a_package_inside_a_namespace_ships_the_packages_above_the_task(on_path, tmp_path_factory):
    """`tests/` without `__init__.py` holding `tests/attacks/__init__.py`: importing `ns.sub.tasks` in the body
    imports `ns.sub` first, so its `__init__` ships with the task (it was refused as un-shipped)."""
    ns = f"ns_{uuid.uuid4().hex[:8]}"
    (on_path / ns / "sub").mkdir(parents=True)
    (on_path / ns / "sub" / "__init__.py").write_text("MARK = 1\n")
    # The task imports nothing of its own package (as a test module in `tests/attacks` does).
    (on_path / ns / "sub" / "tasks.py").write_text(TASK.format(helper="math").replace("import factor", "import floor as factor").replace("factor()", "factor(2.5)"))
    code = _shipped(f"{ns}.sub.tasks")
    assert {f.module for f in code.files} == {ns, f"{ns}.sub", f"{ns}.sub.tasks"}
    blob = tmp_path_factory.mktemp("body") / "code"
    blob.write_bytes(code.encode())
    here = Path(__file__).resolve().parents[1]
    ok = subprocess.run([sys.executable, "-c", BODY, str(blob)], capture_output=True, text=True, timeout=120,
                        cwd=str(on_path), env={"PYTHONPATH": f"{on_path}:{here}", "PATH": "/usr/bin:/bin"})
    assert ok.stdout.strip() == "ran 6", ok.stdout + ok.stderr


BODY = """
import sys
from dask_gpu.body.code import load, split
code, _ = split(open(sys.argv[1], "rb").read())
fn = load(code)
try:
    print("ran", fn(3))
except ModuleNotFoundError as exc:
    print("refused", exc)
"""


@pytest.mark.parametrize("layout", ["package", "flow file"])
def test_an_unshipped_module_beside_shipped_code_is_not_imported_in_the_body(on_path, tmp_path_factory, layout):
    """The body runs on a worker with the flow host's path (a shared checkout): a module that appeared there after
    the code was shipped (or was never shipped) is refused, not run."""
    name = _package(on_path) if layout == "package" else _flow_file(on_path)
    module = f"{name}.tasks" if layout == "package" else name
    code = _shipped(module)
    extra = f"{name}.extra" if layout == "package" else f"{name}_extra"
    (on_path / (f"{name}/extra.py" if layout == "package" else f"{name}_extra.py")).write_text(
        "def factor():\n    return 100\n")
    # The shipped task now imports the un-shipped module (as an edit on the shared path would make it).
    files = tuple(f.model_copy(update={"source": f.source.replace(
        f"{name}.helper" if layout == "package" else f"{name}_helper", extra)}) if f.module == module else f
        for f in code.files)
    blob = tmp_path_factory.mktemp("body") / "code"
    blob.write_bytes(code.model_copy(update={"files": files}).encode())
    here = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", BODY, str(blob)], capture_output=True, text=True, timeout=120,
                         cwd=str(on_path), env={"PYTHONPATH": f"{on_path}:{here}", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused"), out.stdout
    assert "was not shipped" in out.stdout and "Fix:" in out.stdout
    # The shipped helper still imports.
    good = tmp_path_factory.mktemp("body") / "code"
    good.write_bytes(code.encode())
    ok = subprocess.run([sys.executable, "-c", BODY, str(good)], capture_output=True, text=True, timeout=120,
                        cwd=str(on_path), env={"PYTHONPATH": f"{on_path}:{here}", "PATH": "/usr/bin:/bin"})
    assert ok.stdout.strip() == "ran 6", ok.stdout + ok.stderr


def _call(t, task, flow: str, x: int):
    """A call as the runner sends it: the task's code shipped as source (aisched_prefect.flow.session.pickle_body)."""
    import cloudpickle

    from aisched_prefect.flow.session import pickle_body
    from tests.approval_helpers import RawCall

    call = RawCall(t, task, x)
    data, modules, digest = pickle_body(unwrap(task))
    call.blob = data + cloudpickle.dumps(((x,), {}))
    call.meta = call.meta.model_copy(update={"flow_name": flow, "code_digest": digest, "modules": modules,
                                             "args_offset": len(data)})
    return call


@pytest.mark.usefixtures("prefect_api")
def test_new_flow_version_asks_again_when_a_lazily_imported_helper_changed(control_plane, on_path):
    from blocks import ApprovalPolicyBlock, ApprovalRule
    from tests.approval_helpers import api_answer
    from tests.helpers import tenant

    t = tenant(control_plane, policy=ApprovalPolicyBlock(rules=[ApprovalRule(name="new-code", new_flow_version=True)],
                                                         timeout_seconds=60))
    alice = control_plane.approver("alice", t.authority)
    flow = f"nightly-{uuid.uuid4().hex[:8]}"
    name = _package(on_path)
    task = importlib.import_module(f"{name}.tasks").tune

    first = _call(t, task, flow, 3)
    reply, _ = first.send()
    assert reply.status == "approval-pending" and reply.approval.rule == "new-code"
    assert api_answer(control_plane, reply.approval.id, alice).status_code == 200
    done, result = first.send(admission=reply.approval.id)
    assert done.status == "completed" and result == 6
    again = _call(t, task, flow, 4)  # the approved code: not asked
    assert again.send()[0].status == "completed"

    (on_path / name / "helper.py").write_text("def factor():\n    return 100\n")  # only the lazy helper changed
    changed = _call(t, task, flow, 3)
    assert changed.meta.code_digest != first.meta.code_digest  # so its warm key differs too (control.dispatch.warm.warm_key)
    asked, _ = changed.send()
    assert asked.status == "approval-pending" and asked.approval.rule == "new-code"
    for c in (first, again, changed):
        c.close()
