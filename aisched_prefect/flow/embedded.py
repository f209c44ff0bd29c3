"""Starting an embedded control plane for one flow run, as Prefect starts a temporary server.

It is a child process (`python -m aisched_prefect.control.server --embedded`)
that gets the blocks the flow names on stdin and answers with its URL and a
credential bound to them. It lives as long as the flow run's runner.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any

from aisched_prefect.errors import ConfigurationError


class EmbeddedControlPlane:
    def __init__(self, spec: dict[str, Any], *, declared: str | None = None, queue: bool = True,
                 timeout: float = 60.0) -> None:
        self.spec, self.declared, self.queue, self.timeout = spec, declared, queue, timeout
        self.proc: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {}

    def start(self) -> dict[str, Any]:
        cmd = [sys.executable, "-m", "aisched_prefect.control.server", "--embedded", "--port", "0"]
        if self.declared:
            cmd += ["--declared", self.declared]
        if not self.queue:
            cmd.append("--no-queue")
        env = {**os.environ}  # its Dask cluster's INFO lines (nannies starting, preloads) are not the flow's output
        env.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(self.spec) + "\n")
        self.proc.stdin.close()
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(self.timeout)
        if not line or not line[0].strip():
            code = self.proc.poll()
            self.close()
            raise ConfigurationError(
                f"the embedded control plane did not start within {self.timeout:g}s"
                + (f" (it exited with {code}; its error is printed above)" if code is not None else "")
                + ". Fix: see its error above, or run a shared one (`aisched serve`) and set AISCHED_CONTROL_PLANE")
        self.info = json.loads(line[0])
        return self.info

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
