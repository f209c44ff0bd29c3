"""Nothing of a run outlives it: its directories and its UID's files are removed, however deep or hostile.

Why not `shutil.rmtree`. A body writes its working directory and /tmp as it
likes, and root removes them afterwards. CPython 3.11's rmtree recurses on
the Python stack, one frame per level: a 3,000-deep tree raises
RecursionError, which `ignore_errors=True` does not catch, so the tree stays
and fills the disk (and Dask's own stale-directory purge dies the same way).
Path-based removal also fails past PATH_MAX and, as root, is one rename away
from following a symlink out of the tree.

So the walk here is iterative (an explicit stack of frames, not the Python
stack), holds at most a few directory descriptors at a time (never one per
level: 10,000 levels would pass RLIMIT_NOFILE), names every entry relative to
its directory's descriptor (`unlinkat`, `openat` with O_NOFOLLOW), never
follows a symlink (a symlink is removed, never its target), never crosses
into another filesystem, and climbs back with `..` only after checking that
`..` is still the directory it came from (a tree moved under the walk stops
it rather than sending it elsewhere). Read-only directories are made u+rwx
through their descriptor before they are emptied.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterable

from dask_gpu.isolation._errors import lazy_errors

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
RESCANS = 3  # times a directory is emptied when its removal finds it not empty (a writer still at work)


__getattr__ = lazy_errors(__name__, {
    "RemovalError": "A directory tree (a run's working directory, its /tmp) could not be removed, or was moved "
                    "while it was being removed."})


class _Frame:
    """One directory on the walk's stack: who it is, how it was reached, what is left to visit in it."""

    __slots__ = ("dev", "ino", "name", "remove_all", "pending", "skip", "retries")

    def __init__(self, st: os.stat_result, name: str | None, remove_all: bool) -> None:
        self.dev, self.ino, self.name, self.remove_all = st.st_dev, st.st_ino, name, remove_all
        self.pending: list[str] = []
        self.skip: set[str] = set()  # directories already queued (a later listing does not queue them again)
        self.retries: dict[str, int] = {}


class _Walk:
    """Remove, under one open directory, what `selects` picks (a picked directory goes with everything in it)."""

    def __init__(self, selects: Callable[[os.stat_result], bool] | None) -> None:
        self.selects = selects  # None: everything
        self.removed = 0
        self.failures: list[str] = []

    def _picked(self, st: os.stat_result) -> bool:
        return self.selects is None or self.selects(st)

    def _fail(self, what: str, exc: OSError) -> None:
        if len(self.failures) < 20:
            self.failures.append(f"{what}: {exc.strerror or exc}")

    def _open_dir(self, name: str, parent: int, removing: bool = True) -> int | None:
        """`name` in `parent`, opened as a directory without following a symlink (None, and noted, if it cannot be).
        Not root but the owner of a 0000 directory that goes (`removing`): made u+rwx first."""
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except PermissionError as exc:  # chmod it through an O_PATH descriptor, never by its name again
            if not removing:
                self._fail(name, exc)
                return None
            try:
                path_fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
            except OSError as exc:
                self._fail(name, exc)
                return None
            try:
                proc = f"/proc/self/fd/{path_fd}"  # names exactly the inode opened, never a path to resolve again
                os.chmod(proc, stat.S_IMODE(os.fstat(path_fd).st_mode) | stat.S_IRWXU)
                fd = os.open(proc, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as exc:
                self._fail(name, exc)
                return None
            finally:
                os.close(path_fd)
        except OSError as exc:  # ELOOP/ENOTDIR: swapped for a symlink or a file since it was listed
            self._fail(name, exc)
            return None
        return fd

    @staticmethod
    def _writable(fd: int, st: os.stat_result) -> None:
        """u+rwx on a directory about to be emptied (through its descriptor); only on one that goes."""
        mode = stat.S_IMODE(st.st_mode)
        if mode & stat.S_IRWXU != stat.S_IRWXU:
            try:
                os.fchmod(fd, mode | stat.S_IRWXU)
            except OSError:
                pass  # not ours to change (root needs no bits anyway); what cannot be removed is reported

    def _scan(self, frame: _Frame, fd: int) -> None:
        """Unlink the picked non-directories; queue every directory not yet visited."""
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            if entry.name not in frame.skip:
                                frame.pending.append(entry.name)
                                frame.skip.add(entry.name)
                            continue
                        if frame.remove_all or self._picked(entry.stat(follow_symlinks=False)):
                            os.unlink(entry.name, dir_fd=fd)
                            self.removed += 1
                    except FileNotFoundError:
                        continue
                    except OSError as exc:
                        self._fail(entry.name, exc)
        except OSError as exc:
            self._fail(frame.name or ".", exc)

    def run(self, top: int, remove_all: bool) -> None:
        """Walk beneath the directory open on `top` (it is not closed, nor removed)."""
        fd = os.dup(top)
        top_st = os.fstat(fd)
        stack = [_Frame(top_st, None, remove_all)]
        self._scan(stack[0], fd)
        try:
            while stack:
                frame = stack[-1]
                if frame.pending:
                    name = frame.pending.pop()
                    child = self._open_dir(name, fd, removing=frame.remove_all)
                    if child is None:
                        continue
                    st = os.fstat(child)
                    if st.st_dev != top_st.st_dev:  # a mount point: another filesystem is not this tree's
                        os.close(child)
                        self._fail(name, OSError(errno.EXDEV, "a mount point, left alone"))
                        continue
                    stack.append(_Frame(st, name, frame.remove_all or self._picked(st)))
                    if stack[-1].remove_all:
                        self._writable(child, st)
                    os.close(fd)
                    fd = child
                    self._scan(stack[-1], fd)
                    continue
                if len(stack) == 1:
                    return
                parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
                st = os.fstat(parent)
                above = stack[-2]
                if (st.st_dev, st.st_ino) != (above.dev, above.ino):
                    os.close(parent)
                    raise __getattr__("RemovalError")(
                        "a directory was moved out of the tree while it was being removed (its '..' is no longer "
                        "the directory it was reached from); the removal stopped rather than follow it. Fix: stop "
                        "every process of the run (BodyCgroup.kill_all) before its directories are removed")
                os.close(fd)
                fd = parent
                stack.pop()
                if frame.remove_all:
                    try:
                        os.rmdir(frame.name, dir_fd=fd)
                        self.removed += 1
                    except FileNotFoundError:
                        pass
                    except OSError as exc:
                        above.retries[frame.name] = tries = above.retries.get(frame.name, 0) + 1
                        if exc.errno == errno.ENOTEMPTY and tries < RESCANS:
                            above.pending.append(frame.name)  # written to since it was listed: once more
                        else:
                            self._fail(frame.name, exc)
        finally:
            os.close(fd)


def remove_tree(path: str) -> int:
    """Remove `path` and everything under it, without recursion and without following any symlink in it.

    Returns how many entries were removed (0 when `path` did not exist). A symlink at `path` is itself removed,
    never its target. Raises RemovalError only if `path` itself is still there afterwards."""
    path = os.path.abspath(path)
    parent_path, name = os.path.split(path.rstrip("/") or "/")
    if not name:
        raise __getattr__("RemovalError")("remove_tree('/') refused. Fix: pass the run's own directory")
    parent = os.open(parent_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return 0
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=parent)
            return 1
        walk = _Walk(None)
        for attempt in range(RESCANS):
            top = walk._open_dir(name, parent)
            if top is not None:
                try:
                    walk._writable(top, os.fstat(top))
                    walk.run(top, remove_all=True)
                finally:
                    os.close(top)
            try:
                os.rmdir(name, dir_fd=parent)
                return walk.removed + 1
            except FileNotFoundError:
                return walk.removed
            except OSError as exc:
                if exc.errno == errno.ENOTEMPTY and attempt < RESCANS - 1:
                    continue  # written to while it was emptied
                walk._fail(name, exc)
                break
        shown = "; ".join(walk.failures[:5])
        raise __getattr__("RemovalError")(
            f"{path} could not be removed ({walk.removed} entries were): {shown}. Fix: stop every process of the run "
            "first, and remove it as root (or as the owner of every directory in it)")
    finally:
        os.close(parent)


def remove_owned_by(uid: int, roots: Iterable[str]) -> int:
    """Remove every file and directory `uid` owns under each of `roots` (e.g. the host's /tmp, /var/tmp, /dev/shm).

    A directory `uid` owns goes with everything in it (it decided what went in); other directories are searched, not
    removed; the roots themselves stay. No symlink is followed and no other filesystem entered. Returns how many entries
    were removed; a root that does not exist is skipped. A UID is fit to be leased again only after this (and after
    every process of it is gone)."""
    if uid == 0:
        raise __getattr__("RemovalError")("remove_owned_by(0, ...) would remove root's files. Fix: pass a body's UID")
    walk = _Walk(lambda st: st.st_uid == uid)
    for root in roots:
        try:
            top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            continue
        try:
            walk.run(top, remove_all=False)
        finally:
            os.close(top)
    return walk.removed
