"""A local Prefect server, a control plane, a process work pool and worker, the example deployments: `make demo-server`.

    .venv/bin/python -m flows.demo_server up      # server, control plane, worker; deploy prefect.yaml; run the nightly
    .venv/bin/python -m flows.demo_server down    # stop them

What an operator sets up, in miniature: `aisched serve` (the control plane, with
a local GPU cluster of declared devices), the example blocks saved in Prefect
and applied (`aisched apply`), one credential for the worker's flow runs
(principal examples/deployments, in the worker's environment) and one for the
approver alice. Everything lives under `.aisched/` in the checkout (ledger,
keys, tokens, Prefect home, logs, pids) and listens on 127.0.0.1 only. `up`
waits until the nightly run either completes or is suspended for the approval
of its promotion step (the process exits; the run waits, holding nothing),
then prints what to do next. `.aisched/demo-server.env` holds the settings the
`aisched` CLI needs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
POOL = "aisched-local"
NIGHTLY = "nightly-training/nightly"
DEPLOYMENTS_PRINCIPAL = "examples/deployments"
"""Who the worker's flow runs are: one credential in the worker's environment (a member of the examples group)."""


@dataclass(frozen=True)
class DemoServer:
    """Where the demo's server, worker and ledger live."""

    home: Path
    port: int = 4200

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def env(self) -> dict[str, str]:
        """The environment of the server, the control plane and the CLI (the worker adds its credential)."""
        env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_KEY", "AISCHED_TOKEN",
                                                                "AISCHED_CONTROL_PLANE", "AISCHED_OPERATOR_TOKEN")}
        env.update({
            "PREFECT_HOME": str(self.home / "prefect"), "PREFECT_API_URL": self.api, "PREFECT_UI_API_URL": self.api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "AISCHED_HOME": str(self.home),
            "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true", "PYTHONPATH": str(ROOT),
        })
        if (self.home / "control-plane.json").exists():
            env["AISCHED_CONTROL_PLANE"] = json.loads((self.home / "control-plane.json").read_text())["url"]
        return env

    @property
    def control_plane(self) -> str:
        return self.env()["AISCHED_CONTROL_PLANE"]

    def _aisched(self, *args: str, **env: str) -> str:
        return self._aisched_finish(*self._aisched_start(*args, **env))

    def _aisched_start(self, *args: str, **env: str) -> tuple[tuple[str, ...], subprocess.Popen[str]]:
        proc = subprocess.Popen([str(Path(sys.executable).with_name("aisched")), *args], env={**self.env(), **env},
                                cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        return args, proc

    @staticmethod
    def _aisched_finish(args: tuple[str, ...], proc: subprocess.Popen[str]) -> str:
        stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"aisched {' '.join(args)} failed:\n{stdout}\n{stderr}")
        return stdout

    def _spawn_control_plane(self) -> int:
        """`aisched serve` with a local cluster of declared GPUs; returns where its log starts (see _await_control_plane)."""
        from flows.nightly import DECLARED

        log = self.home / "control-plane.log"
        if self.running("control-plane") and (self.home / "control-plane.json").exists():
            return -1
        start = log.stat().st_size if log.exists() else 0
        self._spawn("control-plane", [sys.executable, "-m", "aisched_prefect.control.server", "--port", "0",
                                      "--declared", os.environ.get("DASK_GPU_DECLARED", DECLARED)])
        return start

    def _await_control_plane(self, start: int, timeout: float) -> None:
        """Wait for the ready line the control plane prints from `start` in its log; it goes to control-plane.json."""
        if start < 0:
            return
        log = self.home / "control-plane.log"
        deadline = time.time() + timeout
        while time.time() < deadline:
            for line in log.read_text(errors="replace")[start:].splitlines() if log.exists() else []:
                if line.startswith("{") and '"url"' in line:
                    (self.home / "control-plane.json").write_text(line)
                    return
            if not self.running("control-plane"):
                break
            time.sleep(0.3)
        raise RuntimeError(f"the control plane did not start: see {log}")

    def _credentials(self) -> dict[str, str]:
        """The worker's flow credential and alice's approver credential (issued once, kept 0600 in the home)."""
        from flows.common import APPROVER, BLOCK_NAME

        out, issuing = {}, []
        for name, principal, role in (("worker", DEPLOYMENTS_PRINCIPAL, "flow"), ("alice", APPROVER, "approver")):
            path = self.home / f"{name}.token"
            if not path.exists():
                bindings = ["--authority", BLOCK_NAME] + (
                    ["--budget", BLOCK_NAME, "--policy", BLOCK_NAME, "--cluster", BLOCK_NAME, "--tenant", "examples"]
                    if role == "flow" else ["--tenant", "approvers"])
                issuing.append(self._aisched_start("credentials", "issue", principal, "--role", role, *bindings,
                                                   "--out", str(path)))
            out[name] = str(path)
        for args, proc in issuing:  # issued side by side: each is one CLI start-up
            self._aisched_finish(args, proc)
        return out

    def _prefect(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "prefect", *args], env=self.env(), cwd=ROOT, text=True,
                              capture_output=True, check=check)

    def _spawn(self, name: str, args: list[str], **env: str) -> subprocess.Popen[bytes]:
        log = open(self.home / f"{name}.log", "ab")
        proc = subprocess.Popen(args, env={**self.env(), **env}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        (self.home / f"{name}.pid").write_text(str(proc.pid))
        return proc

    def running(self, name: str) -> bool:
        """Whether the process this demo started as `name` is still alive.

        A child of this process that exited stays a zombie, which signal 0 still reaches, until it is reaped: reaping
        it here is what lets a wait see a server or control plane that died at start.
        """
        pid_file = self.home / f"{name}.pid"
        try:
            pid = int(pid_file.read_text())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return False
        try:
            return os.waitpid(pid, os.WNOHANG)[0] == 0
        except ChildProcessError:  # started by an earlier `up`: not ours to reap, and it answered signal 0
            return True

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.api}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self, timeout: float = 300) -> None:
        """Server (unless one already answers on the port), work pool, deployments, worker."""
        (self.home / "prefect").mkdir(parents=True, exist_ok=True)
        server_up = self.healthy()
        if not server_up:
            self._spawn("server", [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                   "--port", str(self.port)])
        plane_log = self._spawn_control_plane()  # it needs nothing from Prefect: both start at once
        if not server_up:
            deadline = time.time() + timeout
            while not self.healthy():  # a busy machine can take minutes to migrate a new database
                alive = self.running("server")
                if time.time() > deadline or not alive:
                    state = f"did not answer in {timeout:.0f} s" if alive else "stopped"
                    raise RuntimeError(f"the Prefect server on {self.api} {state}: see {self.home / 'server.log'}")
                time.sleep(0.5)
        pool = httpx.get(f"{self.api}/work_pools/{POOL}", timeout=10)
        if pool.status_code == 404:
            self._prefect("work-pool", "create", POOL, "--type", "process")
        else:
            pool.raise_for_status()
        blocks = subprocess.run([sys.executable, "-m", "flows.common"], env=self.env(), cwd=ROOT, text=True,
                                capture_output=True)
        if blocks.returncode != 0:
            raise RuntimeError(f"could not save the example blocks:\n{blocks.stdout}\n{blocks.stderr}")
        # Deploying needs only the server: it runs while the control plane is applied to and issues credentials.
        deploy = subprocess.Popen([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"], env=self.env(),
                                  cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        from flows.common import BLOCK_NAME

        try:
            self._await_control_plane(plane_log, timeout)
            # An operator applies what was saved: from here on the control plane enforces it.
            self._aisched("apply", "--authority", BLOCK_NAME, "--budget", BLOCK_NAME, "--policy", BLOCK_NAME,
                          "--cluster", BLOCK_NAME)
            tokens = self._credentials()
        except BaseException:
            deploy.kill()
            raise
        deployed, _ = deploy.communicate()
        if deploy.returncode != 0:
            raise RuntimeError(f"prefect deploy failed:\n{deployed}")
        if not self.running("worker"):  # `up` twice must not leave a second worker nobody stops
            self._spawn("worker", [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL],
                        AISCHED_TOKEN=Path(tokens["worker"]).read_text().strip())
        (self.home / "demo-server.env").write_text("".join(
            f"export {k}={self.env()[k]}\n" for k in ("PREFECT_API_URL", "PREFECT_HOME", "AISCHED_HOME",
                                                      "AISCHED_CONTROL_PLANE")))

    def run(self, deployment: str, parameters: dict[str, object] | None = None) -> str:
        """Start one run of a deployment now (as its schedule would); returns its flow run id."""
        args = ["deployment", "run", deployment]
        for k, v in (parameters or {}).items():
            args += ["--param", f"{k}={json.dumps(v)}"]
        out = self._prefect(*args).stdout
        for line in out.splitlines():
            if "UUID:" in line:
                return line.split("UUID:")[1].strip()
        raise RuntimeError(f"could not read the flow run id from:\n{out}")

    def state(self, flow_run_id: str) -> tuple[str, str]:
        """The run's state (type, name)."""
        r = httpx.get(f"{self.api}/flow_runs/{flow_run_id}", timeout=10)
        r.raise_for_status()
        state = r.json()["state"] or {}
        return state.get("type", ""), state.get("name", "")

    def wait(self, flow_run_id: str, until: set[str], timeout: float = 300) -> tuple[str, str]:
        """Wait until the run's state name is one of `until` (or it ends); returns the state."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            kind, name = self.state(flow_run_id)
            if name in until or kind in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}:
                return kind, name
            time.sleep(1)
        raise TimeoutError(f"flow run {flow_run_id} did not reach {sorted(until)} within {timeout:.0f}s")

    def stop(self) -> None:
        (self.home / "control-plane.json").unlink(missing_ok=True)
        for name in ("worker", "control-plane", "server"):
            pid_file = self.home / f"{name}.pid"
            if pid_file.exists():
                try:
                    os.killpg(int(pid_file.read_text()), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass
                pid_file.unlink()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("action", choices=["up", "down"])
    p.add_argument("--home", type=Path, default=ROOT / ".aisched")
    p.add_argument("--port", type=int, default=int(os.environ.get("AISCHED_DEMO_PORT", "4200")))
    args = p.parse_args()
    demo = DemoServer(args.home.resolve(), args.port)
    if args.action == "down":
        demo.stop()
        print("stopped the demo server and worker")
        return
    demo.start()
    print(f"Prefect UI: http://127.0.0.1:{args.port}  (server and worker logs in {demo.home})")
    flow_run = demo.run(NIGHTLY)
    print(f"started a run of {NIGHTLY}: {flow_run}; waiting for it ...")
    kind, name = demo.wait(flow_run, {"Suspended"})
    print(f"flow run {flow_run}: {name}")
    env = demo.home / "demo-server.env"
    if name == "Suspended":
        print(f"\nIts promotion step waits for a person (the run holds no process and no budget). Approve it as alice:\n"
              f"  source {env}\n"
              f"  .venv/bin/aisched approvals list --token-file {demo.home / 'alice.token'}\n"
              f"  .venv/bin/aisched approve <ID> --reason 'eval looks good' --token-file {demo.home / 'alice.token'}\n"
              f"or on the approval page linked from the run's pause in the UI "
              f"(http://127.0.0.1:{args.port}/runs/flow-run/{flow_run}), signing in with the token in "
              f"{demo.home / 'alice.token'}.\n"
              f"The worker then re-runs it to completion; `.venv/bin/aisched report` shows what it cost.")
    elif kind != "COMPLETED":
        sys.exit(f"the nightly run ended {name}: see {demo.home / 'worker.log'}")
    print("Stop everything with `make demo-server-stop`.")


if __name__ == "__main__":
    main()
