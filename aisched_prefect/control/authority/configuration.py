"""Applying configuration: what an operator's apply makes admission read, and blocks edited past it.

An apply checks everything before it records anything (the name, the content, the accounts a budget
books) and writes the configuration record and the limits it sets in one transaction: a refused
change leaves nothing behind. A block edited in Prefect but never applied changes what the UI shows,
not what is enforced: `record_drift` says so once per content.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from typing import Any

from aisched_prefect.control.authority import records
from aisched_prefect.control.authority.state import CONFIG_KINDS, Applied, AuthorityState, content_digest
from aisched_prefect.errors import AISchedError, InvalidConfig, InvalidLedgerInput
from aisched_prefect.ledger import Ledger

logger = logging.getLogger("aisched_prefect.control")

CONFIG_NAME_LENGTH = 100
_CONFIG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_config_name(kind: str, name: object) -> str:
    """A configuration's name as the books, the CLI and Prefect can carry it: 1 to 100 letters, digits, '.', '_'
    or '-', starting with a letter or digit (no '/', which separates a budget from its limits; no NUL)."""
    fix = f"name the {kind} block like a Prefect block, e.g. 'team-a' (at most {CONFIG_NAME_LENGTH} characters)"
    if not isinstance(name, str) or not 0 < len(name) <= CONFIG_NAME_LENGTH:
        raise InvalidConfig(f"{kind} name", name, f"a name is 1 to {CONFIG_NAME_LENGTH} characters", fix)
    if not _CONFIG_NAME.fullmatch(name):
        raise InvalidConfig(f"{kind} name", name, "a name has only letters, digits, '.', '_' and '-', and starts "
                            "with a letter or digit", fix)
    return name


class Configuration:
    """Applies blocks' content as evidence records (and the limits they set); notices blocks edited past them.

    `on_cluster_applied` is called after a ClusterBlock is applied (its tenant weights reach the queue now)."""

    def __init__(self, ledger: Ledger, state: AuthorityState, on_cluster_applied: Callable[[], None]) -> None:
        self.ledger, self.state = ledger, state
        self.on_cluster_applied = on_cluster_applied
        self._drift_seen: set[tuple[str, str, str]] = set()

    def apply(self, by: str, kind: str, name: str, body: dict[str, Any]) -> Applied:
        """Apply a block's content: from now on it is what admission reads. Same content: nothing changes.

        Everything is checked before anything is recorded (the name, the content, and for a budget the
        accounts the ledger must book), and the configuration record and the limits it sets are written in
        one transaction: a refused change leaves nothing behind."""
        cls = CONFIG_KINDS.get(kind)
        if cls is None:
            raise InvalidConfig("kind", kind, f"apply one of {', '.join(sorted(CONFIG_KINDS))}",
                                "name the block's kind in the URL: /v1/config/<kind>/<name>")
        check_config_name(kind, name)
        try:
            model = cls.model_validate(body)
        except Exception as exc:
            raise AISchedError(f"{kind} {name!r} is not valid: {exc}") from None
        if kind == "authority":
            problems = model.problems()
            if problems:
                raise AISchedError(f"authority {name!r} cannot be applied: " + "; ".join(problems))
        canonical = json.loads(model.model_dump_json(include=set(cls.model_fields)))
        digest_ = content_digest(canonical)
        snap = self.state.refresh()
        current = snap.config(kind, name)
        if self.state.broken is not None:
            raise AISchedError(f"the evidence log is broken ({self.state.broken}): nothing is applied until it is "
                               "restored. Fix: investigate the database (aisched evidence verify --checkpoint DIR)")
        if current is not None and current.digest == digest_:
            return current
        version = (current.version if current else 0) + 1
        item = records.ConfigApplied(config_kind=kind, name=name, version=version, digest=digest_, body=canonical, by=by)
        limits: list[tuple[list[Any], int]] = []
        if kind in ("budget", "authority"):  # a lowered limit applies to the next reservation, in every process
            configs = {**snap.configs, (kind, name): Applied(kind=kind, name=name, version=version, digest=digest_,
                                                             seq=-1, body=canonical, model=model)}
            limits = self._limit_sets(configs, checked=(kind, name) if kind == "budget" else None)
        self.ledger.record_with_limits(item.kind, records._wire(item), limits, by=by)
        applied = self.state.refresh().config(kind, name)
        assert applied is not None
        if kind == "cluster":  # its tenant weights reach the queue now (model limits are read per call)
            self.on_cluster_applied()
        return applied

    def _limit_sets(self, configs: dict[tuple[str, str], Applied],
                    checked: tuple[str, str] | None = None) -> list[tuple[list[Any], int]]:
        """Each applied budget's limit lines and the version they carry: its own plus the newest authority's (see
        stages.config_version). What an apply tells the ledger, in the transaction that records it. Grant-share
        accounts (`<account>#<grant>`) are set by the lines of the runs that use them.

        The budget `checked` (one being applied) must be bookable: InvalidConfig names its account otherwise.
        Any other that cannot be booked (a record from before names were checked) is left out and logged: one
        bad record in the log never blocks the applies that follow it."""
        from aisched_prefect.ledger.limits import check_line

        authorities = [a.version for (k, _), a in configs.items() if k == "authority"]
        now = self.ledger.now()
        out: list[tuple[list[Any], int]] = []
        for (kind, name), budget in sorted(configs.items()):
            if kind != "budget":
                continue
            version = budget.version + max(authorities, default=0)
            try:
                lines = budget.model.limit_lines(name, now, config_version=version)
                for i, line in enumerate(lines):
                    check_line(line, f"budget {name!r} account {i}")
            except (ValueError, InvalidLedgerInput) as exc:
                if (kind, name) == checked:
                    why = " ".join(str(exc).split()[:40])  # one line: pydantic's errors span several
                    raise InvalidConfig("budget", name, f"the ledger cannot book its accounts ({why})",
                                        "shorten the budget's name or its limits' names (an account, "
                                        "<budget>/<limit>, is at most 200 characters)") from None
                logger.warning("budget %r (applied version %s) cannot be booked and is left out of the limits: %s",
                               name[:60], budget.version, exc)
                continue
            out.append((lines, version))
        return out

    def record_drift(self) -> list[dict[str, Any]]:
        """Blocks edited in Prefect but not applied: recorded once per content, and ignored.

        A flow that rewrites its AuthorityBlock through Prefect's API changes what the
        UI shows, not what is enforced; the record says so, and an operator sees it.
        """
        if not os.environ.get("PREFECT_API_URL"):
            return []
        from aisched_prefect.control.authority.state import block_body

        snap = self.state.refresh()
        found = []
        for (kind, name), applied in snap.configs.items():
            try:
                body = block_body(CONFIG_KINDS[kind].load(name))
            except Exception:  # no such block in Prefect (applied from elsewhere), or Prefect is down
                continue
            canonical = json.loads(CONFIG_KINDS[kind].model_validate(body).model_dump_json(
                include=set(CONFIG_KINDS[kind].model_fields)))
            edited = content_digest(canonical)
            key = (kind, name, edited)
            if edited == applied.digest or key in self._drift_seen:
                continue
            self._drift_seen.add(key)
            item = records.ConfigDrift(config_kind=kind, name=name, applied_version=applied.version,
                                       applied_digest=applied.digest, block_digest=edited)
            records.record(self.ledger, item)
            logger.warning("%s block %r was edited in Prefect but not applied: ignored (aisched apply --%s %s)",
                           kind, name, kind, name)
            found.append(item.model_dump())
        return found
