"""A body's limits, for real: its own /dev, its cgroup (memory, PIDs, devices, every process), the removal of what it
left, and the keyrings it is refused. Real mounts, cgroups, files and system calls on this host (as root), each in
a scratch folder or cgroup subtree of the test's own, removed afterwards."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import platform
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from dask_gpu.isolation import IsolationError, cgroups, cleanup, devices, syscalls

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: mounts, cgroups, mknod and chown are real here")
PR_SET_CHILD_SUBREAPER = 36


class Child:
    """A Python snippet (or a command) in a process of its own, read line by line with a deadline (never a sleep)."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     bufsize=0)  # unbuffered: select() sees every byte not yet read
        self.pid = self.proc.pid

    def line(self, timeout: float = 60.0) -> str:
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise AssertionError(f"no line from child {self.pid} in {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=timeout)
            raise AssertionError(f"child {self.pid} ended ({self.proc.returncode}) without a line: "
                                 f"{self.proc.stderr.read().decode()[-2000:]}")
        return line.decode().rstrip("\n")

    def send(self) -> None:
        self.proc.stdin.write(b"go\n")

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # by its pid: only what this test started
        self.proc.wait(timeout=60)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()


@pytest.fixture
def children():
    """children(snippet, *args) runs `python -c snippet args`; children([argv...]) runs a command. All are ended."""
    started: list[Child] = []

    def start(code: str | list[str], *args: str) -> Child:
        started.append(Child(code if isinstance(code, list) else [sys.executable, "-c", code, *args]))
        return started[-1]

    yield start
    for child in started:
        child.end()


def _exited(pids, timeout: float = 30.0) -> bool:
    """Whether every process in `pids` has exited within `timeout` (each waited on through a pidfd: an event)."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        with os.fdopen(fd, "rb", buffering=0) as pidfd:
            if not select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return False
    return True


@pytest.fixture
def subreaper():
    """Orphans of this test's children (a daemon, a fork bomb's) come to this process, which reaps the pids put in
    the set it yields once they have exited: this host's PID 1 reaps nothing."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    owed: set[int] = set()
    yield owed
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    assert _exited(owed), f"processes {owed} were not ended"
    for pid in owed:
        with contextlib.suppress(ChildProcessError):  # reaped by its own parent before that died
            os.waitpid(pid, os.WNOHANG)


# -- 1. each body its own /dev ---------------------------------------------------------------------------------------

BODY_DEV = r"""
import json, os, stat, sys
from dask_gpu.isolation import devices, filesystem
filesystem.unshare(filesystem.CLONE_NEWNS)
filesystem.mount("none", "/", None, filesystem.MS_REC | filesystem.MS_PRIVATE)
dev = sys.argv[1]
kept = devices.private_dev([int(sys.argv[2])], dev)
def one(path, st):
    if stat.S_ISCHR(st.st_mode):
        return f"c {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    return "-> " + os.readlink(path) if stat.S_ISLNK(st.st_mode) else look(path) if stat.S_ISDIR(st.st_mode) else "file"
def look(d):
    return {n: one(os.path.join(d, n), os.lstat(os.path.join(d, n))) for n in sorted(os.listdir(d))}
print(json.dumps({"kept": kept, "seen": look(dev)}), flush=True)
sys.stdin.readline()
print(json.dumps({"seen": look(dev)}), flush=True)
"""


def _stand_in_dev(path) -> None:
    """A sandbox's /dev as bwrap makes it, with stand-in GPU nodes (major 195, no driver behind them)."""
    path.mkdir()
    for i in range(4):
        os.mknod(path / f"nvidia{i}", 0o666 | stat.S_IFCHR, os.makedev(195, i))
    os.mknod(path / "nvidiactl", 0o666 | stat.S_IFCHR, os.makedev(195, 255))
    (path / "nvidia-caps").mkdir()
    os.mknod(path / "nvidia-caps" / "nvidia-cap1", 0o400 | stat.S_IFCHR, os.makedev(237, 1))
    os.mknod(path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.symlink("/proc/self/fd", path / "fd")
    os.symlink("pts/ptmx", path / "ptmx")
    (path / "shm").mkdir()
    (path / "shm" / "left-by-another").write_text("x")
    (path / "notes").write_text("not a device: no body sees it")


@root_only
def test_two_bodies_of_one_tenant_each_see_only_their_own_gpu_and_the_shared_dev_keeps_every_node(tmp_path, children):
    """The defect: `keep_only` unlinked the other nvidiaN nodes from the /dev all of a tenant's bodies share, so a
    later body lost its own. Now each body covers /dev with a tmpfs of its own and binds back what it keeps."""
    dev = tmp_path / "dev"
    _stand_in_dev(dev)
    before = sorted(os.listdir(dev))
    a = children(BODY_DEV, str(dev), "0")
    first_a = json.loads(a.line())
    b = children(BODY_DEV, str(dev), "1")  # starts while A runs, on another GPU
    first_b = json.loads(b.line())
    a.send()
    again_a = json.loads(a.line())  # after B made its /dev
    b.send()
    for own, seen in ((0, first_a["seen"]), (0, again_a["seen"]), (1, first_b["seen"])):
        gpus = {name: kind for name, kind in seen.items() if name.startswith("nvidia") and name[6:].isdigit()}
        assert gpus == {f"nvidia{own}": f"c 195:{own}"}, seen
        assert seen["nvidiactl"] == "c 195:255" and seen["null"] == "c 1:3"
        assert seen["nvidia-caps"] == {"nvidia-cap1": "c 237:1"}
        assert seen["fd"] == "-> /proc/self/fd" and seen["ptmx"] == "-> pts/ptmx"
        assert seen["shm"] == {} and "notes" not in seen  # an empty shm of its own; nothing it was not given
    assert first_a["kept"] == sorted(first_a["seen"])
    for child in (a, b):
        assert child.proc.wait(timeout=60) == 0, child.proc.stderr.read().decode()
    assert sorted(os.listdir(dev)) == before  # nothing was removed from the shared /dev
    assert (dev / "shm" / "left-by-another").read_text() == "x" and (dev / "nvidia1").stat().st_rdev == 195 << 8 | 1


ENTER_RUN = r"""
import json, os
from dask_gpu.isolation import filesystem
out = {}
for i, own in enumerate([0, 1, 0]):  # bodies of one tenant, one after another, from one zygote
    r, w = os.pipe()
    if (pid := os.fork()) == 0:
        try:
            filesystem.enter_run(20001, 20001, f"/run/aisched-bodies/body{i}", [own])
            open("/dev/null", "w").write("x"), open("/dev/shm/mine", "w").close()
            shm = [l.split(" - ")[1].split()[0] for l in open("/proc/self/mountinfo") if l.split()[4] == "/dev/shm"]
            info = {"dev": sorted(os.listdir("/dev")), "shm": shm[-1:], "pts": os.path.ismount("/dev/pts")}
        except BaseException as exc:
            info = {"error": repr(exc)}
        os.write(w, json.dumps(info).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    out[str(i)] = json.loads(os.fdopen(r, "rb").read())
out.update(zygote=sorted(os.listdir("/dev")), zygote_shm=os.listdir("/dev/shm"))
print(json.dumps(out), flush=True)
"""


@root_only
def test_enter_run_in_a_tenants_bwrap_sandbox_gives_each_body_its_own_dev(tmp_path, children):
    """The production order: bwrap's /dev (its nodes, devpts, symlinks, the --dev-bind'ed GPUs), then `enter_run`
    in each body: a /dev of its own first, then its own tmpfs on /dev/shm."""
    from dask_gpu.isolation import IsolationSettings, can_isolate, filesystem

    if why := can_isolate(IsolationSettings()):
        pytest.skip(f"needs root and bubblewrap: {why}")
    dev, bodies = tmp_path / "dev", tmp_path / "bodies"
    _stand_in_dev(dev)
    for i in range(3):
        (bodies / f"body{i}").mkdir(parents=True)
    argv = filesystem.sandbox_argv("/usr/bin/bwrap", read_only=filesystem.code_paths(sys.path), hide=[],
                                   bodies_dir=str(bodies), devices=devices.sandbox_nodes(str(dev), [0, 1]))
    zygote = children([*argv, sys.executable, "-c", ENTER_RUN])
    out = json.loads(zygote.line())
    assert zygote.proc.wait(timeout=60) == 0
    allowed = {*devices.STANDARD, "shm", *devices.CONTROL_NODES}
    for i, own in enumerate([0, 1, 0]):
        body = out[str(i)]
        assert "error" not in body, body
        assert [n for n in body["dev"] if n.startswith("nvidia") and n[6:].isdigit()] == [f"nvidia{own}"], body
        assert {"null", "zero", "urandom", "pts", "ptmx", "fd", "nvidiactl"} <= set(body["dev"]) <= allowed | {
            f"nvidia{own}"}, body  # bwrap's own nodes, devpts and links, and nothing else
        assert body["shm"] == ["tmpfs"] and body["pts"]
    assert {"nvidia0", "nvidia1", "nvidiactl"} <= set(out["zygote"])  # the shared /dev lost nothing
    assert out["zygote_shm"] == []  # each body's /dev/shm was its own


# -- 2. a cgroup per body --------------------------------------------------------------------------------------------

@pytest.fixture
def cgroup_root():
    """A cgroup subtree of this test's own (aisched-test-<uuid>) in each controller; everything in it is killed and
    removed afterwards. Yields a factory: make(name, limits=..., devices=..., mount=...)."""
    if why := cgroups.cgroups_available():
        pytest.skip(f"cgroups cannot be used here: {why}")
    root = f"aisched-test-{uuid.uuid4().hex[:12]}"
    made: list[cgroups.BodyCgroup] = []
    mounts = {cgroups.MOUNT}

    def make(name: str, limits: cgroups.Limits = cgroups.Limits(), devices=None, mount: str = cgroups.MOUNT):
        mounts.add(mount)
        made.append(cgroups.BodyCgroup(name, limits, devices, root=root, mount=mount))
        return made[-1]

    yield make
    for cg in made:
        cg.remove()
    roots = [os.path.join(d, root) for mount in mounts for d in cgroups.layout(mount).dirs.values()]
    for path in roots:
        if os.path.isdir(path):
            os.rmdir(path)
    assert not any(os.path.exists(path) for path in roots)


ALLOCATE = r"""
import sys
sys.stdin.readline()
want, held = int(sys.argv[1]), []
while len(held) * 8 < want:
    held.append(b"\x01" * (8 << 20))  # touched, not just reserved
print("allocated", len(held) * 8, flush=True)
"""


@root_only
def test_a_body_past_its_memory_limit_is_oom_killed_and_its_neighbour_is_untouched(cgroup_root, children):
    greedy = cgroup_root("greedy", cgroups.Limits(memory_bytes=64 << 20, pids=33, cpu_shares=512))
    if greedy.version == 1:  # the limits, where the kernel reads them
        assert open(os.path.join(greedy.dirs["memory"], "memory.limit_in_bytes")).read().strip() == str(64 << 20)
        assert open(os.path.join(greedy.dirs["cpu"], "cpu.shares")).read().strip() == "512"
    assert open(os.path.join(greedy.dirs["pids" if greedy.version == 1 else ""], "pids.max")).read().strip() == "33"
    assert [cgroups.Limits(cpu_shares=n).cpu_weight() for n in (1024, 262144)] == [39, 10000]  # v2's scale
    neighbour = cgroup_root("neighbour", cgroups.Limits(memory_bytes=256 << 20))
    a, b = children(ALLOCATE, "1024"), children(ALLOCATE, "48")
    greedy.add(a.pid)
    neighbour.add(b.pid)
    assert greedy.pids() == {a.pid} and neighbour.pids() == {b.pid}
    a.send(), b.send()
    assert a.proc.wait(timeout=120) == -signal.SIGKILL
    assert b.line() == "allocated 48" and b.proc.wait(timeout=60) == 0
    assert greedy.oom_killed() and not neighbour.oom_killed()
    assert cgroups.OOM_REASON == "body-out-of-memory"
    assert 32 << 20 < greedy.peak_memory_bytes() <= 64 << 20  # what a settlement records
    assert neighbour.peak_memory_bytes() >= 48 << 20


FORK_BOMB = r"""
import os, signal, sys
sys.stdin.readline()
forked = 0
try:
    while forked < 200:  # bounded, should the limit not hold
        if os.fork() == 0:
            signal.pause()
            os._exit(0)
        forked += 1
except BlockingIOError:
    print("EAGAIN", forked, flush=True)
else:
    print("unbounded", forked, flush=True)
signal.pause()
"""


@root_only
def test_a_fork_bomb_stops_at_its_pid_limit_and_kill_all_ends_every_process(subreaper, cgroup_root, children):
    cg = cgroup_root("bomb", cgroups.Limits(pids=20))
    bomb = children(FORK_BOMB)
    cg.add(bomb.pid)
    bomb.send()
    what, forked = bomb.line().split()
    assert what == "EAGAIN" and int(forked) == 19  # the bomb itself is the 20th
    members = cg.pids()
    subreaper.update(members - {bomb.pid})
    assert len(members) == 20 and bomb.pid in members
    assert cg.kill_all(timeout=30) == 20 and cg.pids() == set()
    assert bomb.proc.wait(timeout=30) == -signal.SIGKILL and _exited(members)


DAEMON = r"""
import os, signal, sys
sys.stdin.readline()
if os.fork() == 0:
    os.setsid()  # a session and process group of its own: killpg of the body's group misses it
    if os.fork() == 0:
        print("daemon", os.getpid(), flush=True)
        signal.pause()
    os._exit(0)
os.wait()
"""


def _v2_mount() -> str | None:
    return next((line.split()[4] for line in open("/proc/self/mountinfo") if " - cgroup2 " in line), None)


@root_only
@pytest.mark.parametrize("version", [1, 2])
def test_a_double_forked_daemon_that_left_the_bodys_session_is_found_and_killed(version, subreaper, cgroup_root,
                                                                              children):
    """proctrack/cgroup: the body's process ends; its daemon (setsid + fork) is still in its cgroup, and is ended."""
    mount = cgroups.MOUNT if cgroups.layout().version == version else _v2_mount() if version == 2 else None
    if mount is None:
        pytest.skip(f"this host has no cgroup v{version} hierarchy to track processes in")
    if version == 2 and "memory" not in open(os.path.join(mount, "cgroup.controllers")).read().split():
        with pytest.raises(cgroups.CgroupError, match=r"memory controller is not available here\)\. Fix: "):
            cgroup_root("nomemory", cgroups.Limits(memory_bytes=64 << 20), mount=mount)  # an error, not a silent run
    cg = cgroup_root("daemon", mount=mount)
    assert cg.version == version
    body = children(DAEMON)
    cg.add(body.pid)
    body.send()
    daemon = int(body.line().split()[1])
    subreaper.add(daemon)
    assert body.proc.wait(timeout=30) == 0  # the body is gone; the daemon is not
    assert os.getsid(daemon) != os.getsid(0) and os.getpgid(daemon) != os.getpgid(0)  # left the body's group
    assert cg.pids() == {daemon} and not _exited([daemon], timeout=0)
    assert cg.kill_all(timeout=30) == 1 and cg.pids() == set() and _exited([daemon])


OPEN_NODES = r"""
import json, os, sys
sys.stdin.readline()
def errno_of(path):
    try:
        return os.close(os.open(path, os.O_RDWR)) or 0
    except OSError as exc:
        return exc.errno
print(json.dumps({path: errno_of(path) for path in sys.argv[1:]}), flush=True)
"""


@root_only
def test_the_device_rule_refuses_a_node_the_body_was_not_given(cgroup_root, children, tmp_path):
    """ConstrainDevices: a node made another way (mknod c 195:7) cannot be opened, even by root; the standard ones
    and the body's own GPU node pass the rule (a stand-in GPU then finds no driver: ENXIO, not EPERM)."""
    own, other = tmp_path / "nvidia0", tmp_path / "nvidia7"
    os.mknod(own, 0o666 | stat.S_IFCHR, os.makedev(195, 0))
    os.mknod(other, 0o666 | stat.S_IFCHR, os.makedev(195, 7))
    assert "c 195:0 rwm" in cgroups.device_rules([str(own), str(tmp_path / "missing")])
    assert "c 195:7 rwm" not in cgroups.device_rules([str(own)])
    cg = cgroup_root("devices", devices=[str(own)])
    if cg.version != 1:
        pytest.skip("cgroup v2's device controller is a BPF program: the rule is skipped there (logged)")
    rules = open(os.path.join(cg.dirs["devices"], "devices.list")).read().split("\n")
    assert "c 195:0 rwm" in rules and "c 1:3 rwm" in rules and "a *:* rwm" not in rules
    body = children(OPEN_NODES, "/dev/null", str(own), str(other))
    cg.add(body.pid)
    body.send()
    opened = json.loads(body.line())
    assert opened["/dev/null"] == 0 and opened[str(other)] == errno.EPERM
    assert opened[str(own)] not in (errno.EPERM, errno.EACCES)
    outside = children(OPEN_NODES, str(other))  # not in the cgroup: the host's rule lets it through to the driver
    outside.send()
    assert json.loads(outside.line())[str(other)] != errno.EPERM


def test_a_worker_without_usable_cgroups_is_told_why(tmp_path):
    why = cgroups.cgroups_available(str(tmp_path))
    assert why and ("no cgroup filesystem is mounted at" in why or "does not run as root" in why)
    with pytest.raises(IsolationError, match="Fix: "):
        cgroups.BodyCgroup("x", root="../escape")
    with pytest.raises(cgroups.CgroupError, match="Fix: "):
        cgroups.BodyCgroup("x", mount=str(tmp_path))
    import doctest

    assert doctest.testmod(cgroups).failed == 0


# -- 3. removal that cannot recurse or follow symlinks ---------------------------------------------------------------

@pytest.fixture
def deep_scratch(tmp_path):
    """A scratch folder for deep trees: on tmpfs (/dev/shm/aisched-test-<uuid>) where the host has one, since ext4's
    rmdir under load costs a millisecond a level; the walk is the same on any filesystem."""
    if not os.access("/dev/shm", os.W_OK):
        yield tmp_path
        return
    path = f"/dev/shm/aisched-test-{uuid.uuid4().hex[:12]}"
    os.mkdir(path, 0o700)
    try:
        yield Path(path)
    finally:
        cleanup.remove_tree(path)


def _deep_tree(top, depth: int, name: str = "level-directory", at_bottom=None) -> int:
    """A chain of `depth` directories, each with a file, built relative to directory descriptors (its full path is far
    past PATH_MAX); `at_bottom(fd)` adds more to the deepest one. Returns how many entries it holds."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir(name, dir_fd=fd)
            os.close(os.open("file", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
            deeper = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = deeper
        return 2 * depth + (at_bottom(fd) if at_bottom else 0)
    finally:
        os.close(fd)


@root_only
def test_a_3000_deep_working_directory_that_shutil_rmtree_cannot_remove_is_removed_without_following_symlinks(
        deep_scratch):
    """Why dask_gpu.isolation.cleanup exists: CPython 3.11's rmtree recurses on the Python stack, and
    `ignore_errors=True` does not catch RecursionError (3.12 made rmtree iterative)."""
    outside = deep_scratch / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the run's")

    def hostile(fd: int) -> int:  # at the bottom, where rmtree never gets
        os.symlink(outside / "keep.txt", "link-to-file", dir_fd=fd)
        os.symlink(outside, "link-to-dir", dir_fd=fd)
        os.mkdir("read-only", dir_fd=fd)
        os.close(os.open("read-only/inside", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
        os.chmod("read-only", 0o500, dir_fd=fd)
        os.close(os.open("theirs", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
        os.chown("theirs", 20001, 20001, dir_fd=fd)  # another UID's file
        return 5

    work = deep_scratch / "work"
    work.mkdir()
    _deep_tree(work, 3000, at_bottom=hostile)
    assert 3000 * len("/level-directory") > os.pathconf("/", "PC_PATH_MAX")
    if sys.version_info < (3, 12):
        with pytest.raises(RecursionError):
            shutil.rmtree(work, ignore_errors=True)
        assert work.exists()
    assert cleanup.remove_tree(str(work)) > 3000 and not work.exists()
    assert sorted(os.listdir(outside)) == ["keep.txt"]  # the symlinks went, not what they pointed at
    assert (outside / "keep.txt").read_text() == "not the run's"


@root_only
def test_a_10000_deep_tree_is_removed_completely(deep_scratch):
    top = deep_scratch / "deep"
    top.mkdir()
    entries = _deep_tree(top, 10000, name="d")
    assert cleanup.remove_tree(str(top)) == entries + 1
    assert not top.exists() and cleanup.remove_tree(str(top)) == 0


MOUNTED_TREE = r"""
import json, os, sys
from dask_gpu.isolation import cleanup, filesystem as fs
fs.unshare(fs.CLONE_NEWNS), fs.mount("none", "/", None, fs.MS_REC | fs.MS_PRIVATE)
work = sys.argv[1]
os.makedirs(mnt := os.path.join(work, "a", "mnt")), fs.mount("tmpfs", mnt, "tmpfs", 0, "size=64k")
open(mnt + "/elsewhere", "w").close(), open(work + "/a/file", "w").close()
try:
    raised = cleanup.remove_tree(work) and None
except cleanup.RemovalError as exc:
    raised = str(exc)
print(json.dumps({"raised": raised, "kept": os.path.exists(mnt + "/elsewhere"),
                  "file": os.path.exists(work + "/a/file")}))
"""


@root_only
def test_the_removal_does_not_enter_another_filesystem_and_says_what_stayed(tmp_path, children):
    body = children(MOUNTED_TREE, str(tmp_path / "work"))
    out = json.loads(body.line())
    assert body.proc.wait(timeout=60) == 0
    assert out["kept"] and not out["file"]
    assert "could not be removed" in out["raised"] and "Fix: " in out["raised"]
    assert cleanup.remove_tree(str(tmp_path / "work")) > 0  # the mount went with its namespace


@root_only
def test_every_file_a_body_uid_owns_is_removed_from_the_hosts_shared_directories(tmp_path):
    uid, other = 20001, 20002
    tmp, shm, elsewhere = tmp_path / "tmp", tmp_path / "shm", tmp_path / "elsewhere"
    for d in (tmp, shm, elsewhere):
        d.mkdir()

    def owned(path, by):
        path.write_text("x"), os.chown(path, by, by)

    owned(tmp / "body-file", uid)
    owned(shm / "body-segment", uid)
    owned(tmp / "neighbour-file", other)
    (tmp / "shared-dir").mkdir()
    owned(tmp / "shared-dir" / "deep-body-file", uid)
    owned(tmp / "shared-dir" / "deep-neighbour-file", other)
    (tmp / "body-dir" / "sub").mkdir(parents=True)
    os.chown(tmp / "body-dir", uid, uid)
    owned(tmp / "body-dir" / "sub" / "written-by-another", other)  # inside the UID's own directory: it goes too
    owned(elsewhere / "body-file-not-under-a-root", uid)
    os.symlink(elsewhere, tmp / "root-link-to-elsewhere")  # root's link: not followed
    os.symlink(elsewhere / "body-file-not-under-a-root", tmp / "body-link")
    os.lchown(tmp / "body-link", uid, uid)  # the UID's link: removed, its target not
    assert cleanup.remove_owned_by(uid, [str(tmp), str(shm), str(tmp_path / "missing")]) == 7
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == ["elsewhere", "elsewhere/body-file-not-under-a-root", "shm", "tmp", "tmp/neighbour-file",
                    "tmp/root-link-to-elsewhere", "tmp/shared-dir", "tmp/shared-dir/deep-neighbour-file"]
    with pytest.raises(cleanup.RemovalError, match="Fix: "):
        cleanup.remove_owned_by(0, [str(tmp)])


# -- 4. keyrings --------------------------------------------------------------------------------------------------

KEYRINGS = r"""
import ctypes, errno, json, os, sys
from dask_gpu.isolation import syscalls
from dask_gpu.isolation.identity import no_new_privs
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
add_key, request_key, keyctl = (ctypes.c_long(n) for n in syscalls.KEYRING_SYSCALLS[syscalls.this_arch()])
PROCESS_KEYRING, KEYCTL_READ = ctypes.c_int(-2), ctypes.c_long(11)
buf = ctypes.create_string_buffer(64)
def call(*args):
    ctypes.set_errno(0)
    return libc.syscall(*args), ctypes.get_errno()
def add(text):
    return call(add_key, b"user", b"aisched-test", text, ctypes.c_size_t(len(text)), PROCESS_KEYRING)
def read(key):
    n, err = call(keyctl, KEYCTL_READ, ctypes.c_long(key), buf, ctypes.c_size_t(64))
    return (buf.raw[:n].decode() if n >= 0 else None), err
out = {"before_add": add(b"secret")}
key = out["before_add"][0]
out["before_read"] = read(key) if key > 0 else None
no_new_privs()
syscalls.deny_keyrings()
out["after_add"] = add(b"leak")
out["after_read"] = read(key if key > 0 else 1)
out["after_request"] = call(request_key, b"user", b"aisched-test", None, PROCESS_KEYRING)
out["getpid"] = libc.getpid() == os.getpid()
out["open"] = open(os.devnull, "rb").read() == b""
print(json.dumps(out), flush=True)
if syscalls.this_arch() == syscalls.AUDIT_ARCH_X86_64:
    libc.syscall(ctypes.c_long(syscalls.X32_SYSCALL_BIT | 39))  # x32 getpid: another ABI, the process is killed
    print("survived an x32 system call", flush=True)
"""


def test_a_body_cannot_use_the_kernel_keyrings_that_outlive_its_uid(children):
    body = children(KEYRINGS)
    out = json.loads(body.line())
    key, err = out["before_add"]
    if key > 0:  # the kernel lets this process use keyrings before the filter: the filter is what stops it
        assert out["before_read"] == ["secret", 0]
    else:
        assert err in (errno.ENOSYS, errno.EPERM, errno.EACCES, errno.EDQUOT), err  # keyrings forbidden here already
    assert out["after_add"] == out["after_request"] == [-1, errno.EPERM] and out["after_read"] == [None, errno.EPERM]
    assert out["getpid"] and out["open"]  # everything else is allowed
    code = body.proc.wait(timeout=60)
    if platform.machine() == "x86_64":
        assert code == -signal.SIGSYS and "survived" not in body.proc.stdout.read().decode()
    else:
        assert code == 0


def test_the_filter_is_the_program_written_for_each_architecture():
    import struct

    x86, arm = syscalls.keyring_filter(syscalls.AUDIT_ARCH_X86_64), syscalls.keyring_filter(syscalls.AUDIT_ARCH_AARCH64)
    assert len(x86) == 8 * 10 and len(arm) == 8 * 9  # struct sock_filter is 8 bytes; x86_64 also checks for x32
    insns = [struct.unpack("=HBBI", x86[i:i + 8]) for i in range(0, len(x86), 8)]
    assert insns[1] == (syscalls.BPF_JEQ_K, 0, 7, syscalls.AUDIT_ARCH_X86_64)  # any other arch: to the kill
    assert [k for *_, k in insns[-3:]] == [syscalls.SECCOMP_RET_ALLOW, syscalls.SECCOMP_RET_ERRNO | errno.EPERM,
                                          syscalls.SECCOMP_RET_KILL_PROCESS]
    assert [k for code, _, _, k in insns if code == syscalls.BPF_JEQ_K][1:] == [248, 249, 250]
    with pytest.raises(syscalls.SyscallFilterError, match="Fix: "):
        syscalls.keyring_filter(0x40000028)  # ARM (32-bit)
