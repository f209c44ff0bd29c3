"""AISchedTaskRunner: Prefect's thread-pool runner plus admission and a GPU-aware Dask cluster.

Task orchestration (states, retries, results) stays in the flow process, as
with `ThreadPoolTaskRunner`; each AI task's body is admitted and sent to a Dask
worker that assigns it devices. Plain `@task` tasks run in the flow process's
threads exactly as under `ThreadPoolTaskRunner`.
"""

from __future__ import annotations

from typing import Any

from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import ValidationError

from aisched_prefect.config import RunnerConfig
from aisched_prefect.errors import ConfigurationError, NoAdmissionContext
from aisched_prefect.session import RunnerSession
from blocks import ApprovalPolicyBlock, AuthorityBlock, BudgetBlock, ClusterBlock


class AISchedTaskRunner(ThreadPoolTaskRunner):
    """Admit every AI task (authority, budget, approval) and place it on a GPU of a Dask worker.

    Args:
        principal: who this flow acts as, e.g. "team-a/nightly".
        authority: name of an AuthorityBlock (or the block itself).
        budget: name of a BudgetBlock (or the block itself).
        grant: id of the grant this flow acts under (a root grant or one delegated to the
            principal); its whole chain is checked at every admission. None: the first root
            grant for the principal that covers the run.
        approval_policy: name of an ApprovalPolicyBlock; None approves without asking.
        approver: "pause" (Prefect pause + UI form), "policy" (no person), or an Approver.
        address: an existing Dask scheduler; None starts a LocalGPUCluster per flow run.
        declared: declared GPU inventory for the embedded cluster (else DASK_GPU_DECLARED, else NVML).
        ledger_url: SQLAlchemy URL of the ledger (else AISCHED_LEDGER_URL, else ~/.aisched/ledger.db).
        max_workers: flow-process threads that run task engines.
        tenant: who pays, for tenant-scoped budget limits; None: the principal up to its first '/'.
        hold_lease_seconds: lease of each budget hold, renewed while its task runs; if this
            process dies, its holds expire this long after the last renewal (charged in full).
        top_up_fraction: a GPU task nearing the runtime its hold covers asks for this share of
            est_seconds more; if refused, it is stopped when the cover runs out.
        approval_hook: called with each ApprovalRequest when a person is asked (a callable), or
            sent it as JSON (an http(s) URL): for teams that approve from chat.
        cluster: name of a ClusterBlock (or the block): per-model concurrency and rate limits for
            kind="model-call" tasks, shared by every flow run through Prefect's global concurrency limits.
        queue: wait in the cluster's one queue (a scheduler plugin, `dask_gpu.queue_plugin`) with every
            other flow run, and go to Dask only when the fair-share policy starts the run (whole GPUs).
    """

    def __init__(
        self,
        principal: str,
        authority: str | AuthorityBlock,
        budget: str | BudgetBlock,
        grant: str | None = None,
        approval_policy: str | ApprovalPolicyBlock | None = None,
        approver: Any = "pause",
        address: str | None = None,
        declared: str | None = None,
        ledger_url: str | None = None,
        max_workers: int | None = None,
        ticket_ttl_seconds: float = 24 * 3600,
        tenant: str | None = None,
        hold_lease_seconds: float = 300.0,
        top_up_fraction: float = 0.5,
        approval_hook: Any = None,
        cluster: str | ClusterBlock | None = None,
        queue: bool = False,
    ) -> None:
        try:
            self._config = RunnerConfig(
                principal=principal, authority=authority, budget=budget, grant=grant, approval_policy=approval_policy,
                approver=approver, address=address, declared=declared, ledger_url=ledger_url,
                max_workers=max_workers, ticket_ttl_seconds=ticket_ttl_seconds, tenant=tenant,
                hold_lease_seconds=hold_lease_seconds, top_up_fraction=top_up_fraction, approval_hook=approval_hook,
                cluster=cluster, queue=queue,
            )
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ConfigurationError(f"AISchedTaskRunner: {problems}") from None
        super().__init__(max_workers=max_workers)
        self._session: RunnerSession | None = None

    @property
    def config(self) -> RunnerConfig:
        return self._config

    def duplicate(self) -> AISchedTaskRunner:
        return type(self)(**{name: getattr(self._config, name) for name in RunnerConfig.model_fields})

    @property
    def session(self) -> RunnerSession:
        if self._session is None:
            raise NoAdmissionContext("AISchedTaskRunner is not started: AI tasks run inside the flow that uses it")
        return self._session

    def __enter__(self) -> AISchedTaskRunner:
        super().__enter__()
        try:
            self._session = RunnerSession(self._config)
        except BaseException:
            super().__exit__(None, None, None)
            raise
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        try:
            super().__exit__(exc_type, exc_value, traceback)  # waits for running task engines
        finally:
            session, self._session = self._session, None
            if session is not None:
                session.close()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AISchedTaskRunner) and other._config == self._config

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_session"] = None
        state["_executor"] = None
        return state
