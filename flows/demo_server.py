"""A local Prefect server, a process work pool and worker, and the example deployments: `make demo-server`.

    .venv/bin/python -m flows.demo_server up      # server + worker, deploy prefect.yaml, run the nightly once
    .venv/bin/python -m flows.demo_server down    # stop the server and the worker

Everything lives under `.aisched/` in the checkout (ledger, Prefect home, logs,
pids) and listens on 127.0.0.1 only. `up` waits until the nightly run either
completes or is suspended for the approval of its promotion step (the process
exits; the run waits in Prefect, holding nothing), then prints what to do next.
`.aisched/demo-server.env` holds the settings the `aisched` CLI needs to see
the same server and ledger.
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


@dataclass(frozen=True)
class DemoServer:
    """Where the demo's server, worker and ledger live."""

    home: Path
    port: int = 4200

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def env(self) -> dict[str, str]:
        """The environment of the server, the worker (and so every flow run) and the CLI."""
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_KEY"}
        env.update({
            "PREFECT_HOME": str(self.home / "prefect"), "PREFECT_API_URL": self.api, "PREFECT_UI_API_URL": self.api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "AISCHED_HOME": str(self.home),
            "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true", "PYTHONPATH": str(ROOT),
        })
        return env

    def _prefect(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "prefect", *args], env=self.env(), cwd=ROOT, text=True,
                              capture_output=True, check=check)

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.home / f"{name}.log", "ab")
        proc = subprocess.Popen(args, env=self.env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        (self.home / f"{name}.pid").write_text(str(proc.pid))
        return proc

    def running(self, name: str) -> bool:
        """Whether the process this demo started as `name` is still alive."""
        pid_file = self.home / f"{name}.pid"
        try:
            os.kill(int(pid_file.read_text()), 0)
            return True
        except (OSError, ValueError):
            return False

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.api}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self, timeout: float = 120) -> None:
        """Server (unless one already answers on the port), work pool, deployments, worker."""
        (self.home / "prefect").mkdir(parents=True, exist_ok=True)
        if not self.healthy():
            self._spawn("server", [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                   "--port", str(self.port)])
            deadline = time.time() + timeout
            while not self.healthy():
                if time.time() > deadline:
                    raise RuntimeError(f"the Prefect server did not answer on {self.api}: see {self.home / 'server.log'}")
                time.sleep(0.5)
        if self._prefect("work-pool", "inspect", POOL, check=False).returncode != 0:
            self._prefect("work-pool", "create", POOL, "--type", "process")
        blocks = subprocess.run([sys.executable, "-m", "flows.common"], env=self.env(), cwd=ROOT, text=True,
                                capture_output=True)
        if blocks.returncode != 0:  # the runner loads the example blocks when each flow run starts
            raise RuntimeError(f"could not save the example blocks:\n{blocks.stdout}\n{blocks.stderr}")
        done = self._prefect("--no-prompt", "deploy", "--all", check=False)
        if done.returncode != 0:
            raise RuntimeError(f"prefect deploy failed:\n{done.stdout}\n{done.stderr}")
        if not self.running("worker"):  # `up` twice must not leave a second worker nobody stops
            self._spawn("worker", [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL])
        (self.home / "demo-server.env").write_text("".join(
            f"export {k}={self.env()[k]}\n" for k in ("PREFECT_API_URL", "PREFECT_HOME", "AISCHED_HOME")))

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
        for name in ("worker", "server"):
            pid_file = self.home / f"{name}.pid"
            if pid_file.exists():
                try:
                    os.killpg(int(pid_file.read_text()), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass
                pid_file.unlink()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
        print(f"\nIts promotion step waits for a person (the run holds no process and no budget). Approve it:\n"
              f"  source {env}\n"
              f"  .venv/bin/aisched approvals list\n"
              f"  .venv/bin/aisched approve <ID> --as alice --reason 'eval looks good'\n"
              f"or in the UI: http://127.0.0.1:{args.port}/runs/flow-run/{flow_run} -> Resume.\n"
              f"The worker then re-runs it to completion; `.venv/bin/aisched report` shows what it cost.")
    elif kind != "COMPLETED":
        sys.exit(f"the nightly run ended {name}: see {demo.home / 'worker.log'}")
    print("Stop everything with `make demo-server-stop`.")


if __name__ == "__main__":
    main()
