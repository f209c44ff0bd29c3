"""One flow run's session in the flow process: a thin client of the control plane.

It turns an AI task call into a request and opaque bytes, hands them to the
control plane, and turns the reply back into a result, an exception, or a
wait for a person (a Prefect pause whose form links to the control plane's
approval page). Nothing here decides authority, money or evidence.
"""

from __future__ import annotations

import asyncio
import io
import logging
import threading
from collections.abc import Callable
from typing import Any

import cloudpickle

from aisched_prefect.approvals import parameters_summary
from aisched_prefect.flow.approval_wait import PauseDesk
from aisched_prefect.flow.client import ControlPlaneClient, ControlPlaneError
from aisched_prefect.flow.config import RunnerConfig
from aisched_prefect.flow.embedded import EmbeddedControlPlane
from aisched_prefect.errors import AdmissionDenied, ConfigurationError, UnshippableCode
from aisched_prefect.request import AIRequest
from aisched_prefect.settings import settings
from aisched_prefect.flow.stream import ENGINE_SLOT, CallStream, LoopThread
from aisched_prefect.flow.taskcontext import as_sync
from aisched_prefect.wire import ApprovalView, CallMeta, Reply
from dask_gpu import StopRequested
from dask_gpu.body.code import code_digest, preloads, ship

logger = logging.getLogger("aisched_prefect")
ARTIFACT_KEY = "aisched-evidence"


def _load_block(kind: str, name: str | None) -> dict[str, Any] | None:
    """A named block's content, for the embedded control plane the flow run starts (it acts as its operator)."""
    if name is None:
        return None
    from aisched_prefect.control.authority.state import CONFIG_KINDS, block_body

    cls = CONFIG_KINDS[kind]
    try:
        block = cls.load(name)
    except ValueError as exc:
        raise AdmissionDenied("configuration", f"{kind} block {name!r} could not be loaded ({exc})",
                              f"create it: {cls.__name__}(...).save({name!r}), or change the runner's {kind}= argument"
                              ) from None
    return {"name": name, "body": block_body(block)}


_by_value_lock = threading.Lock()
_by_value: dict[str, int] = {}


def _installed(module: Any) -> bool:
    path = getattr(module, "__file__", None) or ""
    return "site-packages" in path or "dist-packages" in path or not path


def pickle_body(fn: Callable[..., Any]) -> tuple[bytes, list[str], str]:
    """The task's code as bytes a worker can load, the modules its body should find already imported, and the
    code's digest (what its ticket binds and its body checks).

    A function or class at module level of a module the worker cannot import by name (a flow file, a deployment's
    entrypoint) travels as source (dask_gpu.body.code.ship): imported in the body, so its module-level state is
    created there, once per warm body, and never pickled. Anything else is pickled: by reference where the module
    is an installed package, by value where it cannot be imported (a closure, a lambda, `__main__`).
    """
    import sys

    shipped = ship(fn)
    if shipped is not None:
        return shipped.encode(), preloads(shipped), shipped.digest()
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    by_value = module is not None and module.__name__ != "__main__" and not _installed(module)
    if by_value:
        assert module is not None
        with _by_value_lock:
            if _by_value.get(module.__name__, 0) == 0:
                cloudpickle.register_pickle_by_value(module)
            _by_value[module.__name__] = _by_value.get(module.__name__, 0) + 1
    try:
        data = cloudpickle.dumps(fn)
    except Exception as exc:  # a lock, a client, an open file among what it carries by value
        raise UnshippableCode(
            f"AI task {getattr(fn, '__qualname__', fn)!r}: its code cannot be sent to a GPU worker "
            f"({type(exc).__name__}: {exc}): defined in a script run as `python FILE` (or in a closure), it is pickled "
            "with the module state it uses. Fix: define it at module level of a module and run the flow with "
            "`python -m package.module` (or import it), so its module travels as source") from None
    finally:
        if by_value:
            assert module is not None
            with _by_value_lock:
                _by_value[module.__name__] -= 1
                if _by_value[module.__name__] == 0:
                    cloudpickle.unregister_pickle_by_value(module)
    names: set[str] = set()
    code = getattr(fn, "__code__", None)
    for name in (code.co_names if code is not None else ()):
        value = getattr(fn, "__globals__", {}).get(name)
        used = value.__name__ if isinstance(value, type(sys)) else getattr(value, "__module__", None)
        if isinstance(used, str) and used in sys.modules and used != "__main__" and (module is None or used != module.__name__):
            names.add(used)
    if module is not None and not by_value and module.__name__ != "__main__":
        names.add(module.__name__)
    return data, sorted(names)[:16], code_digest(fn)


def _ran_nothing(exc: BaseException) -> bool:
    """The plane's answer for a flow run it has no record of (nothing of it reached the plane)."""
    return isinstance(exc, ControlPlaneError) and "ran nothing in flow run" in str(exc)


class RunnerSession:
    """Open for one flow run: the control plane's client (and the embedded plane, if this run started one)."""

    def __init__(self, config: RunnerConfig, loop: LoopThread) -> None:
        self.config = config
        self.loop = loop
        self.embedded: EmbeddedControlPlane | None = None
        self.flow_run_ids: set[str] = set()
        self._pickles: dict[Any, tuple[bytes, list[str], str]] = {}
        self._pickle_lock = threading.Lock()
        self._hooked: set[str] = set()  # approval requests whose hook was called
        env = settings()
        urls = [u.strip().rstrip("/") for u in config.control_plane.split(",")] if config.control_plane else env.control_plane_urls()
        token = config.credential or (env.token.get_secret_value() if env.token else None)
        try:
            if urls:
                if not token:
                    raise ConfigurationError("a control plane is configured (AISCHED_CONTROL_PLANE) but no credential. "
                                             "Fix: set AISCHED_TOKEN to the token an operator issued for this flow "
                                             "(aisched credentials issue PRINCIPAL --authority ... --budget ...)")
                self.client = ControlPlaneClient(urls, token)
                self.stream = CallStream(urls, token)
                self.identity = self.client.whoami(first=True)
                self._check_identity()
            else:
                self._start_embedded()
        except BaseException:
            self.close()
            raise
        self._desk = PauseDesk(self)

    def _check_identity(self) -> None:
        """The runner's arguments may name what the credential proves, never something else."""
        ident = self.identity
        for arg, key in (("principal", "principal"), ("tenant", "tenant"), ("authority", "authority"),
                         ("budget", "budget"), ("approval_policy", "policy"), ("cluster", "cluster")):
            said = getattr(self.config, arg)
            if said is not None and said != ident.get(key):
                raise ConfigurationError(
                    f"AISchedTaskRunner({arg}={said!r}), but the credential proves {key}={ident.get(key)!r}: the "
                    f"control plane decides who a flow is and what it runs under. Fix: drop {arg}=, or use the "
                    "credential issued for it")

    def _start_embedded(self) -> None:
        cfg = self.config
        if cfg.credential or settings().token is not None:
            given = "AISchedTaskRunner(credential=...)" if cfg.credential else "AISCHED_TOKEN"
            raise ConfigurationError(f"{given} is set but no control plane address (AISCHED_CONTROL_PLANE, or "
                                     "control_plane=): the runner would start a private embedded plane and ignore the "
                                     "token. Fix: set AISCHED_CONTROL_PLANE to the URL of the plane that issued it, or "
                                     + ("drop credential=" if cfg.credential else "unset AISCHED_TOKEN")
                                     + " to run on an embedded plane")
        if cfg.principal is None or cfg.authority is None or cfg.budget is None:
            raise ConfigurationError("with no control plane configured, the runner starts an embedded one and needs "
                                     "principal=, authority= and budget= (block names); or set AISCHED_CONTROL_PLANE "
                                     "and AISCHED_TOKEN")
        spec = {"principal": cfg.principal, "tenant": cfg.tenant or cfg.principal.split("/")[0], "configs": {
            "authority": _load_block("authority", cfg.authority), "budget": _load_block("budget", cfg.budget),
            "policy": _load_block("policy", cfg.approval_policy), "cluster": _load_block("cluster", cfg.cluster)}}
        self.embedded = EmbeddedControlPlane(spec, declared=cfg.declared, queue=cfg.queue,
                                             timeout=settings().embedded_start_seconds)
        info = self.embedded.start()
        self.client = ControlPlaneClient([info["url"]], info["token"])
        self.stream = CallStream([info["url"]], info["token"])
        self.identity = self.client.whoami()

    def interrupt(self, why: str) -> None:
        """A signal stopped the flow (called from its handler: no locks): the waits for people end and withdraw."""
        desk = getattr(self, "_desk", None)
        if desk is not None:
            desk.interrupt(why)

    def close(self, why: str = "the flow run ended while it waited") -> None:
        """End the session: withdraw what still waits for a person (`why` is recorded), publish the evidence
        artifact, close the stream, the client and an embedded plane."""
        try:
            if getattr(self, "_desk", None) is not None:
                self._desk.stop(why)
            if getattr(self, "client", None) is not None:
                self._publish_artifacts()
        finally:
            if getattr(self, "stream", None) is not None and not self.loop.loop.is_closed():
                try:
                    self.loop.start(self.stream.aclose()).result(timeout=10)
                except Exception:
                    logger.debug("closing the call stream failed", exc_info=True)
            if getattr(self, "client", None) is not None:
                self.client.close()
            if self.embedded is not None:
                self.embedded.close()

    # -- one call -------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], request: AIRequest, args: tuple[Any, ...], kwargs: dict[str, Any], *,
            task_name: str, task_run_id: str, flow_run_id: str, flow_name: str | None = None,
            run_key: str | None = None, deployment: bool = False, attempt: int = 1,
            array: dict[str, Any] | None = None) -> Any:
        """Admit one call of an AI task at the control plane, run it on its devices there, return its result
        (waiting in this thread: a direct call in the flow; submitted runs wait as coroutines, `run_async`)."""
        return self.loop.run(self.run_async(fn, request, args, kwargs, task_name=task_name, task_run_id=task_run_id,
                                            flow_run_id=flow_run_id, flow_name=flow_name, run_key=run_key,
                                            deployment=deployment, attempt=attempt, array=array))

    async def run_async(self, fn: Callable[..., Any], request: AIRequest, args: tuple[Any, ...],
                        kwargs: dict[str, Any], *, task_name: str, task_run_id: str, flow_run_id: str,
                        flow_name: str | None = None, run_key: str | None = None, deployment: bool = False,
                        attempt: int = 1, array: dict[str, Any] | None = None) -> Any:
        """`run`, as a coroutine on the session's loop: a waiting run holds no thread and no connection."""
        self.flow_run_ids.add(flow_run_id)
        fn_bytes, modules, digest = self._pickled(fn)
        args_bytes = cloudpickle.dumps((args, kwargs))
        meta = CallMeta(task_name=task_name, task_run_id=task_run_id, flow_run_id=flow_run_id, flow_name=flow_name,
                        run_key=run_key or f"{flow_run_id}/{task_run_id}", request=request.model_dump(mode="json"),
                        code_digest=digest, modules=modules,
                        args_offset=len(fn_bytes), grant=self.config.grant, attempt=attempt,
                        parameters=parameters_summary(fn, args, kwargs),
                        approver="policy" if self.config.approver == "policy" else "pause", array=array)
        slot = ENGINE_SLOT.get()
        if slot is not None:  # waiting on the plane: the engine's turn at the Prefect API goes to another run
            slot.release()
        try:
            reply, out = await self.stream.call(meta, fn_bytes, args_bytes)
        finally:
            if slot is not None:
                await slot.acquire()
        while reply.status == "approval-pending":
            assert reply.approval is not None
            if reply.approval.id not in self._hooked:  # a map's shards wait on one request: its hook is told once
                self._hooked.add(reply.approval.id)
                await asyncio.to_thread(as_sync(self._hook), reply.approval)
            view = await asyncio.to_thread(as_sync(self._desk.wait), reply.approval, deployment=deployment)
            reply, out = await self.stream.call(meta.model_copy(update={"admission": view.id}), fn_bytes, args_bytes)
        return self._result(reply, out, task_name)

    def _pickled(self, fn: Callable[..., Any]) -> tuple[bytes, list[str], str]:
        """The function's pickle, modules and digest, made once per function per session (a .map() of 10,000
        shards pickles its function once, and sends it once per request)."""
        with self._pickle_lock:
            got = self._pickles.get(fn)
            if got is None:
                got = self._pickles[fn] = pickle_body(fn)
            return got

    def _hook(self, view: ApprovalView) -> None:
        hook = self.config.approval_hook
        if hook is None:
            return
        try:
            if isinstance(hook, str):
                import httpx

                httpx.post(hook, json={"event": "aisched.approval.requested", **view.model_dump(mode="json")}, timeout=10)
            else:
                hook(view)
        except Exception:  # a chat hook that fails must not decide the run
            logger.exception("approval hook failed")

    def _result(self, reply: Reply, out: bytes, task_name: str) -> Any:
        if reply.logs:
            from prefect.logging import get_run_logger

            task_log = get_run_logger()
            for level, message in reply.logs:
                task_log.log(level, message)
        if reply.status == "completed":
            return cloudpickle.loads(out)
        if reply.status == "denied":
            raise AdmissionDenied(reply.stage or "admission", reply.reason, reply.fix)
        if reply.status == "stopped":
            raise StopRequested(f"AI task {task_name} was stopped: {reply.reason}")
        error: BaseException | None = None
        if out:
            try:
                error = cloudpickle.load(io.BytesIO(out))
            except Exception:
                error = None
        if not isinstance(error, BaseException):
            error = RuntimeError(f"{reply.error_type}: {reply.error_message}")
            line = (reply.error_text.strip().splitlines() or [reply.error_message])[-1]
        else:  # what is raised, in one line (a limit the body reached by its name, not the kernel's errno)
            line = (f"{type(error).__name__}: {error}".splitlines() or [""])[0]
        where = reply.placement.get("worker")
        logger.warning("AI task %s failed%s: %s", task_name, f" on {where} devices {reply.placement.get('devices')}"
                       if where else "", line)
        raise error

    # -- evidence artifact ----------------------------------------------------------------------
    def _publish_artifacts(self) -> None:
        """The control plane's records of each flow run this session served, as a Prefect table artifact."""
        if not self.flow_run_ids:
            return
        from uuid import UUID

        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import ArtifactCreate

        from aisched_prefect.evidence import EvidenceRecord
        from aisched_prefect.reports.runs import evidence_rows

        try:
            with get_client(sync_client=True) as prefect:
                for flow_run_id in sorted(self.flow_run_ids):
                    records = [EvidenceRecord.model_validate(r) for r in self.client.get(f"/v1/flow-runs/{flow_run_id}/records")]
                    prefect.create_artifact(ArtifactCreate(
                        key=ARTIFACT_KEY, type="table", data=evidence_rows(records), flow_run_id=UUID(flow_run_id),
                        description="AI task runs admitted, denied and settled by aisched-prefect in this flow run "
                                    "(from the control plane's records)."))
        except Exception as exc:  # an artifact that cannot be published never fails the flow
            if _ran_nothing(exc):  # every call failed before it reached the plane (its code could not be sent): no news
                return
            logger.warning("could not publish the evidence artifact", exc_info=True)
        for flow_run_id in sorted(self.flow_run_ids):  # usage and cost: published by the control plane (the ledger's)
            try:
                self.client.post(f"/v1/flow-runs/{flow_run_id}/usage-artifacts")
            except Exception as exc:
                if _ran_nothing(exc):
                    continue
                logger.error("could not publish the usage report artifacts of flow run %s: %s", flow_run_id, exc)
