"""A real one-node Slurm on 127.0.0.1, for tests: munged, slurmctld and slurmd of Debian's `slurm-wlm` and `munge`.

Everything lives under one folder of the test's own: the munge key, pid and log; slurm.conf and gres.conf;
slurmctld's state, their pid and log files; and the GPU stand-ins (`dev/nvidia0`, `dev/nvidia1`, character devices
made with mknod, as Slurm's `gres.conf File=` wants device nodes). The Unix sockets (munged's, and slurmd's spool,
where each job step's `slurmstepd` makes `NODE_JOB.STEP`) live in a short folder of their own under /tmp
(`aisched-slurm-XXXXXXXX`, removed by `close()`): a socket's path is at most 107 bytes, and a test's tmp_path under
pytest-xdist (`/tmp/pytest-of-root/pytest-N/popen-gwN/test_..._0/slurm/spool/slurmd-NODE/NODE_1.4294967291`) is
longer, so every batch job's step failed to start (`_create_socket: Unix socket path ... is too long (109 > 108)`,
the job held as `launch_failed_requeued_held`). That, not munge, is why these tests failed beside other tests: only
under xdist, in any test process; munged's "Unauthorized credential for client UID=0 GID=0" is Slurm 22.05's own
self-check at each launch, logged whether the launch works or not. The daemons listen on free
ports of 127.0.0.1 (never Slurm's defaults, 6817/6818), read no file under /etc/slurm or /etc/munge, and run in the
foreground as children of the test: `close()` cancels every job, then ends each daemon by its pid after checking its
/proc/PID/cmdline names this cluster's files (and any job step, `slurmstepd`, whose environment names this
cluster's slurm.conf).

Clients (`sbatch`, `squeue`, `scontrol`, `scancel`, dask-jobqueue) reach it through the environment `env()` gives:
SLURM_CONF pointing at this cluster's slurm.conf.

    with SlurmCluster(tmp_path / "slurm").start() as slurm:
        job = slurm.sbatch(["--gres=gpu:h100:1", "--wrap", "env"])

`start()` raises SlurmUnavailable, with the reason, where the binaries are absent or the daemons do not come up;
tests turn that into a skip (or a failure where AISCHED_REQUIRE_SLURM is set, as .ci/run sets it).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

SOCKET_PATH_MAX = 107  # sizeof(sun_path) - 1 on Linux
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")
SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")


class SlurmUnavailable(RuntimeError):
    """The test Slurm cannot start here; the message says why and how to get it (Debian: slurm-wlm, munge)."""


def which(name: str) -> str | None:
    return shutil.which(name) or next((f"{d}/{name}" for d in SBIN if os.access(f"{d}/{name}", os.X_OK)), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def why_not() -> str | None:
    """Why no test Slurm can start on this host (None: it may)."""
    missing = [b for b in BINARIES if which(b) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing). Fix: apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "the test Slurm runs slurmd, which must start as root (it starts jobs as their users); run as root"
    return None


def started_or_skip(cluster: SlurmCluster) -> SlurmCluster:
    """Start it; where it cannot start, skip the test saying why (fail instead where AISCHED_REQUIRE_SLURM is set)."""
    import pytest

    try:
        return cluster.start()
    except SlurmUnavailable as exc:
        if os.environ.get("AISCHED_REQUIRE_SLURM"):
            pytest.fail(f"AISCHED_REQUIRE_SLURM is set but the test Slurm cannot start: {exc}")
        pytest.skip(str(exc).splitlines()[0])


class SlurmCluster:
    """One controller, one node (`gpus` GRES gpu stand-ins of `gpu_type`), one partition `gpu`."""

    def __init__(self, root: Path, *, gpus: int = 2, gpu_type: str = "h100", cpus: int = 8,
                 memory_mb: int = 16000, more_types: tuple[tuple[str, int], ...] = (),
                 down_partition: str | None = None) -> None:
        """`more_types`: GRES types after `gpu_type`'s (their devices numbered on); `down_partition`: a second
        partition of the node whose State is DOWN (jobs submitted there pend, reason PartitionDown)."""
        self.root = Path(root)
        self.gpus, self.gpu_type, self.cpus, self.memory_mb = gpus, gpu_type, cpus, memory_mb
        self.types = ((gpu_type, gpus), *more_types)
        self.down_partition = down_partition
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "etc" / "slurm.conf"
        self.sockets: Path | None = None  # the short folder of the Unix sockets (made by start, removed by close)
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen] = {}

    # --- configuration -------------------------------------------------------------------------------------

    def _write(self) -> None:
        for d in ("etc", "munge", "state", "log", "run", "dev"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self.sockets = Path(tempfile.mkdtemp(prefix="aisched-slurm-", dir="/tmp"))
        os.chmod(self.sockets, 0o755)  # munge's clients (a job's user) reach its socket through it
        self.munge_socket = self.sockets / "munge.socket"
        self.spool = self.sockets / "spool"
        self.spool.mkdir()
        longest = self.spool / f"slurmd-{self.node}" / f"{self.node}_4294967294.4294967294"  # a step's socket
        if len(str(longest)) > SOCKET_PATH_MAX:
            raise SlurmUnavailable(f"a job step's socket would be {longest} ({len(str(longest))} bytes, at most "
                                   f"{SOCKET_PATH_MAX}): this host's name is too long for the test Slurm")
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        for i in range(sum(n for _, n in self.types)):  # stand-ins: character devices, NVIDIA's major (195), minor i
            node = self.root / "dev" / f"nvidia{i}"
            if not node.exists():
                os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(195, i))
        r = self.root
        self.ports = (free_port(), free_port())
        gres = ",".join(f"gpu:{t}:{n}" for t, n in self.types)
        down = (f"PartitionName={self.down_partition} Nodes={self.node} MaxTime=INFINITE State=DOWN\n"
                if self.down_partition else "")
        self.conf.write_text(f"""\
ClusterName=aisched-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={self.ports[0]}
SlurmdPort={self.ports[1]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={r}/state
SlurmdSpoolDir={self.spool}/slurmd-%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
PlugStackConfig={r}/etc/plugstack.conf
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ReturnToService=2
KillWait=5
MinJobAge=600
InactiveLimit=0
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.memory_mb} Gres={gres} State=UNKNOWN
PartitionName=gpu Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
{down}""")
        (r / "etc" / "plugstack.conf").write_text("")
        lines, first = [], 0
        for gpu_type, n in self.types:
            last = first + n - 1
            devices = f"{r}/dev/nvidia[{first}-{last}]" if last > first else f"{r}/dev/nvidia{first}"
            lines.append(f"NodeName={self.node} Name=gpu Type={gpu_type} File={devices}\n")
            first = last + 1
        (r / "etc" / "gres.conf").write_text("".join(lines))

    def env(self) -> dict[str, str]:
        """The environment a Slurm client (sbatch, squeue, dask-jobqueue) needs to reach this cluster."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        return env

    # --- daemons -------------------------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")
        self.procs[name] = subprocess.Popen(argv, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        """Start munged, slurmctld and slurmd; return once the node is idle. SlurmUnavailable if it cannot."""
        why = why_not()
        if why:
            raise SlurmUnavailable(why)
        self._write()
        m = self.root / "munge"
        try:
            self._spawn("munged", [which("munged"), "-F", "--force", f"--socket={self.munge_socket}",
                                   f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}",
                                   f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'munged.seed'}"])
            self._wait(lambda: self.munge_socket.exists(), "munged", timeout)
            self._spawn("slurmctld", [which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            self._spawn("slurmd", [which("slurmd"), "-D", "-f", str(self.conf)])
            self._wait(self._node_idle, "slurmd (the node to be idle)", timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _wait(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"{what} not ready within {timeout:.0f} s"
                raise SlurmUnavailable(f"the test Slurm did not start: {why}.\n{self.logs()}")
            time.sleep(0.2)

    def _node_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False)
        states = out.stdout.split()  # one line per partition the node is in
        return out.returncode == 0 and bool(states) and all(s in ("idle", "mixed", "allocated") for s in states)

    def logs(self, lines: int = 25) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*")) + [self.root / "munge" / "munged.log"]:
            if f.exists():
                out.append(f"---- {f.name}\n" + "".join(f.read_text(errors="replace").splitlines(True)[-lines:]))
        return "\n".join(out)

    # --- clients -------------------------------------------------------------------------------------------

    def run(self, argv: list[str], check: bool = True, timeout: float = 30,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster (`env`: the environment a job it submits inherits)."""
        out = subprocess.run([which(argv[0]) or argv[0], *argv[1:]], env={**(env or self.env()), "SLURM_CONF": str(self.conf)},
                             capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
        return out

    def sbatch(self, args: list[str]) -> str:
        """Submit a batch job; its id."""
        out = self.run(["sbatch", "--parsable", *args]).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a mapping (JobState, Reason, ...); {} once Slurm forgot it."""
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        if out.returncode != 0:
            return {}
        return dict(re.findall(r"(\w[\w:/]*)=(\S*)", out.stdout))

    def jobs(self) -> list[str]:
        """Ids of the jobs pending or running."""
        return self.run(["squeue", "-h", "-o", "%i"]).stdout.split()

    def wait_job(self, job_id: str, states: tuple[str, ...], timeout: float = 60) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not in {states} within {timeout:.0f} s: {info}\n{self.logs()}")
            time.sleep(0.2)

    # --- the end -------------------------------------------------------------------------------------------

    def close(self) -> None:
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:
                jobs = self.jobs()
                if jobs:
                    self.run(["scancel", *jobs], check=False)
                    deadline = time.monotonic() + 20
                    while self.jobs() and time.monotonic() < deadline:
                        time.sleep(0.2)
            except Exception:
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None and self._ours(proc.pid, name):
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        for pid in self.job_steps():  # a job step slurmd left behind
            try:
                os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.procs.clear()
        if self.sockets is not None:
            shutil.rmtree(self.sockets, ignore_errors=True)
            self.sockets = None

    def _ours(self, pid: int, name: str) -> bool:
        """Whether `pid` is still this cluster's `name` (its command line names this cluster's files)."""
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return False
        return name in cmdline and str(self.root) in cmdline

    def job_steps(self) -> list[int]:
        """Pids of this cluster's `slurmstepd` processes (their environment names this cluster's slurm.conf)."""
        mine = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if b"slurmstepd" not in (entry / "cmdline").read_bytes():
                    continue
                if mine in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
