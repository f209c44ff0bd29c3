"""Which calls each control-plane replica follows for one flow process, and which life of that replica took them.

Why: a plane that restarts (killed, redeployed, a container's pid 1 again) keeps its calls in the call book but
loses the sessions and outcome queues it held in memory; it answers polls for a session it does not know with
nothing and `pending: 0`. A flow that took that for "still running" would wait for ever. So every answer (a submit's,
a poll's) names the plane's *instance* (a fresh id per process), and each followed call remembers the instance that
accepted it. A poll answered by another instance, or one saying fewer calls are pending than this flow has waiting
there since before it asked, means those calls are lost to that replica: they are sent again under the same keys
(the call book re-attaches or takes them over, each admitted and settled once, or returns the stored reply of one
that ended). A call is sent again at most `most_resends` times; then it fails as `RunLost`, never hangs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

RESENDS = 5  # a plane that loses a call this often (a crash loop) fails it, named, instead of trying for ever


@dataclass
class _Followed:
    instance: str  # the plane's life that accepted the call ("" for a plane that does not say)
    since: float  # when its acceptance reached this process (monotonic)


class Following:
    """Per replica: the calls it follows for this process and the instance it last answered as."""

    def __init__(self, most_resends: int = RESENDS) -> None:
        self.most_resends = most_resends
        self._at: dict[int, dict[str, _Followed]] = {}
        self._instance: dict[int, str] = {}
        self._resends: dict[str, int] = {}

    def accepted(self, k: int, key: str, instance: str) -> None:
        """Replica `k` (as `instance`) accepted `key`: its outcome comes on k's poll."""
        self._at.setdefault(k, {})[key] = _Followed(instance, time.monotonic())

    def waiting(self, k: int) -> bool:
        return bool(self._at.get(k))

    def keys(self, k: int) -> set[str]:
        return set(self._at.get(k, {}))

    def ended(self, k: int, key: str) -> None:
        """`key`'s outcome came: nothing more is followed of it."""
        self._at.get(k, {}).pop(key, None)
        self._resends.pop(key, None)

    def take(self, k: int) -> set[str]:
        """Every call `k` follows, no longer followed there (they go to another replica, or fail)."""
        return set(self._at.pop(k, {}))

    def answered(self, k: int, instance: str, pending: int, outcomes: int, asked_at: float) -> tuple[bool, set[str]]:
        """A poll of `k` (sent at `asked_at`) answered as `instance`, with `outcomes` outcomes and `pending` calls it
        still counts: whether `k` is a new life (its outcome sequence starts again), and the calls lost to it (no
        longer followed there; the caller sends them again, or fails those `resend` refuses)."""
        known = self._instance.get(k)
        restarted = bool(instance) and known is not None and known != instance
        if instance:
            self._instance[k] = instance
        followed = self._at.get(k, {})
        lost = {key for key, f in followed.items() if instance and f.instance and f.instance != instance}
        if not lost and not outcomes:
            before = {key for key, f in followed.items() if f.since < asked_at}
            if pending < len(before):  # calls it should count and does not: it lost them (its session expired)
                lost = before
        for key in lost:
            followed.pop(key, None)
        return restarted, lost

    def seen(self, k: int, instance: str) -> bool:
        """A submit's answer from `k` as `instance`: whether it is a new life of `k` (its outcome sequence starts
        again; what its earlier life accepted is found lost by the next poll)."""
        known = self._instance.get(k)
        if instance:
            self._instance[k] = instance
        return bool(instance) and known is not None and known != instance

    def instance(self, k: int) -> str:
        """The instance `k` last answered as ("" before any answer): a poll names it, so a new life of `k` never
        takes the poll's `after` (a sequence of the earlier life) as acknowledging its own outcomes."""
        return self._instance.get(k, "")

    def resend(self, key: str) -> bool:
        """Whether `key` may be sent again (counted): False once it was sent `most_resends` times."""
        n = self._resends.get(key, 0) + 1
        self._resends[key] = n
        return n <= self.most_resends
