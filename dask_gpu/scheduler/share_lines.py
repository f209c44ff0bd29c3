"""The queue plugin's lines of waiting fractions, one per shape: a pass over the queue costs what it starts.

A fraction that finds no shared device with room waits (as a one-GPU run for the policy); each pass then offers the
devices that opened since to the waiting fractions, oldest first. Looking at every waiting fraction on every pass
made a pass cost what waits: a 10,000-shard map had thousands waiting, and a pass runs after every burst of ends.
Fractions of one shape (the same `Spec` and allowed hosts) fit the same devices, so once the oldest of a shape finds
no room none of that shape does: a line per shape, oldest first, stops at its first miss. A pass costs the fractions
it starts plus one look per shape.

Lines are heaps of job ids (ids grow as runs enter, so the smallest is the oldest); an id that left the queue, or
whose shape changed (a worker joined and widened its hosts: it is lined up again under its new shape), is dropped as
found, and a line grown to twice what waits in the whole queue keeps only its live ids (so runs that enter and
leave behind one that waits long do not pile up).
"""

from __future__ import annotations

import heapq
from typing import Any

from dask_gpu.scheduler.devices import Spec

Shape = tuple[Spec, "frozenset[int] | None"]
COMPACT_AT = 64  # a line longer than this, and than twice the runs waiting, keeps only its ids still waiting


class ShareLines:
    """A mixin of GPUQueuePlugin: it works on that plugin's `waiters` and `specs`."""

    def _share_init(self) -> None:
        self.share_lines: dict[Shape, list[int]] = {}  # shape -> waiting fraction ids (a heap; stale ones skipped)

    def _line_up(self, jid: int) -> None:
        """A waiting run entered (or its hosts widened): a fraction joins its shape's line."""
        spec = self.specs.get(jid)
        if spec is None or not spec.share or jid not in self.waiters:
            return
        shape = (spec, self.waiters[jid][1].hosts)
        line = self.share_lines.setdefault(shape, [])
        heapq.heappush(line, jid)
        if len(line) > COMPACT_AT and len(line) > 2 * len(self.waiters):  # mostly ids that left behind a waiting
            line[:] = [j for j in line if self._waits_as(j, shape)]  # head: only the ones still waiting are kept
            heapq.heapify(line)

    def _waits_as(self, jid: int, shape: Shape) -> bool:
        spec = self.specs.get(jid)
        entry = self.waiters.get(jid)
        return spec is not None and entry is not None and (spec, entry[1].hosts) == shape

    def _head(self, shape: Shape) -> int | None:
        """The oldest fraction still waiting in this shape's line (the stale ones before it dropped)."""
        line = self.share_lines[shape]
        while line and not self._waits_as(line[0], shape):
            heapq.heappop(line)
        if not line:
            del self.share_lines[shape]
            return None
        return line[0]

    def _start_shares(self) -> None:
        """Waiting fractions start on shared devices with room, oldest first across shapes, until each shape's
        oldest finds none. The shapes' oldest stand in a heap of their own for the pass: a pass costs one look per
        shape and one per start, however many shapes a tenant's runs make (each memory size is one)."""
        heads = [(jid, n, shape) for n, shape in enumerate(list(self.share_lines))
                 if (jid := self._head(shape)) is not None]
        heapq.heapify(heads)
        while heads:
            jid, n, shape = heapq.heappop(heads)
            fit = self._open_fit(*shape)
            if fit is None:
                continue  # no room for this shape: none of it is looked at again in this pass
            heapq.heappop(self.share_lines[shape])
            client, job = self.waiters[jid]
            self._book_start(job)
            self._start_fraction(jid, client, fit[0], fit[1], self.specs.pop(jid), job)
            if (after := self._head(shape)) is not None:  # (the line is there: its head was just taken from it)
                heapq.heappush(heads, (after, n, shape))

    # what the mixin uses of the plugin (declared for readers and type checkers)
    waiters: dict[int, tuple[str, Any]]
    specs: dict[int, Spec]
