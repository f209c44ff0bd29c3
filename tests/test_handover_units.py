"""A run handed straight to its worker, as the control plane follows it: its worker's leave or death ends it, whatever
its connection says (units: no cluster, no server; tests/test_handover.py runs it on real processes)."""

from __future__ import annotations


def _handed_run(worker: str, issued_at: float):
    """A run handed over to `worker` (devices 2 and 3), as the dispatcher's table holds it."""
    from types import SimpleNamespace

    from aisched_prefect.control.dispatch.running import Placement, Running

    r = Running(admission=None, key="aisched-k1", holds=[], covered_seconds=60.0, submitted=0.0)  # type: ignore[arg-type]
    r.placement, r.handed_over, r.dask_at = Placement(workers=[worker], devices=[["2", "3"]]), True, 1.0
    r.ticket = SimpleNamespace(issued_at=issued_at, id="t1")  # type: ignore[assignment]
    return r


class _Plane:
    """The dispatcher's loss-finding part over a scheduler that answers which workers left, and when."""

    def __init__(self, left: dict[str, float]) -> None:
        import threading
        from types import SimpleNamespace

        from aisched_prefect.control.dispatch.losses import Losses

        self.losses = type("L", (Losses,), {})()
        self.losses.client = SimpleNamespace(sync=lambda op, **kw: op(**kw), scheduler=SimpleNamespace(
            gpu_workers_left=lambda: left, gpu_task_states=lambda keys: {},
            gpu_ticket_where=lambda id: {"members": [{"member": 0, "worker": "tls://10.0.0.5:4000", "name": "gpu-b"}]}))
        self.losses.lock = threading.Lock()
        self.losses.warm = SimpleNamespace(worker_died=lambda *a: None)


def test_a_handed_over_run_whose_worker_left_is_lost_though_its_connection_stands():
    """A stopped or deadlocked worker keeps its TCP connection up; the scheduler's word that it left ends the run."""
    plane = _Plane({"tls://10.0.0.5:4000": 100.0, "tls://10.0.0.6:4000": 50.0})
    gone, earlier, elsewhere = (_handed_run("tls://10.0.0.5:4000", 90.0), _handed_run("tls://10.0.0.6:4000", 90.0),
                                _handed_run("tls://10.0.0.7:4000", 90.0))
    plane.losses.check_stuck({"a": gone, "b": earlier, "c": elsewhere})
    # named as the registry names it: the walk-through's evidence showed the dead worker as an address when this
    # backstop spoke before the death event
    assert gone.lost == {"worker": "tls://10.0.0.5:4000", "name": "gpu-b", "keys": ["aisched-k1"],
                         "devices": ["2", "3"], "found": "left"} and gone.wake.is_set()
    assert earlier.lost is None  # a worker at that address left before this run was handed to the one there now
    assert elsewhere.lost is None


def test_a_workers_death_names_the_runs_handed_to_it_with_their_devices():
    plane = _Plane({})
    on_it, other = _handed_run("tls://10.0.0.5:4000", 1.0), _handed_run("tls://10.0.0.6:4000", 1.0)
    plane.losses.running = {"a": on_it, "b": other}
    plane.losses._on_worker_died((0.0, {"worker": "tls://10.0.0.5:4000", "name": "gpu-5", "runs": [], "keys": []}))
    assert on_it.lost is not None and on_it.lost["name"] == "gpu-5" and on_it.lost["devices"] == ["2", "3"]
    assert other.lost is None


class _Worker:
    """A Dask server on 127.0.0.1 in a loop thread of its own, answering `gpu_run` as `handler` says (None: it has
    no such handler, as a worker older than the hand-over), and the plane's `Handovers` to it."""

    def __init__(self, handler=None) -> None:
        import asyncio
        import threading
        from types import SimpleNamespace

        from distributed.core import Server

        from aisched_prefect.control.dispatch.handover import Handovers

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def start():
            server = Server({"gpu_run": handler} if handler else {})
            await server.listen("tcp://127.0.0.1:0")
            return server

        self.server = self.run(start())
        client = SimpleNamespace(loop=SimpleNamespace(asyncio_loop=self.loop), connection_args={}, _serializers=None,
                                 _deserializers=None, status="running", sync=lambda f: self.run(f()))
        self.handovers = Handovers(client)

    def run(self, coro):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def send(self):
        return self.handovers.send(self.server.address, ticket={"t": 1}, body={"b": 1}, key="aisched-k1")  # type: ignore[arg-type]

    def close(self) -> None:
        self.run(self.server.close())
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_a_worker_without_the_hand_over_refuses_the_run_by_name():
    import pytest

    from dask_gpu.tickets import TicketRejected

    worker = _Worker()
    try:
        with pytest.raises(TicketRejected, match="older than this control plane. Fix: .*AISCHED_HAND_OVER_PLACED=false"):
            worker.send().result()
    finally:
        worker.close()


def test_a_connection_that_breaks_under_a_run_is_its_worker_lost_unless_the_plane_is_stopping():
    import asyncio

    import pytest
    from distributed import KilledWorker

    from aisched_prefect.control.dispatch.handover import PlaneStopping, WorkerUnreachable
    from tests.helpers import wait_until

    calls: list = []

    async def hang_up(comm, **msg):
        calls.append(msg["key"])
        if len(calls) == 1:
            comm.abort()  # the worker's end goes away mid-run
        await asyncio.Event().wait()  # the second run runs on until its caller goes

    worker = _Worker(hang_up)
    try:
        with pytest.raises(WorkerUnreachable, match="the connection to worker tcp://127.0.0.1:.* running 'aisched-k1' broke") as exc:
            worker.send().result()
        assert isinstance(exc.value, KilledWorker)  # settled as the worker dying, as a Dask task's would be
        waiting = worker.send()
        wait_until(lambda: len(calls) == 2, 30, "the second run on its worker")
        worker.handovers.close()  # the plane stops while a run waits on its worker
        with pytest.raises(PlaneStopping, match="the control plane stopped while this run was on worker"):
            waiting.result()
    finally:
        worker.close()


def test_the_plane_raises_its_open_file_limit_and_sizes_hand_overs_past_the_dask_clients_connections():
    """A soft limit of 1,024 (a common default) with a pool of half of it and the Dask client's 512 left the plane
    no descriptor for a flow's connection: the limit is raised to the hard one, and the pool leaves the rest room."""
    import subprocess
    import sys

    code = ("import resource; from aisched_prefect.control.dispatch.handover import open_files_limit, pool_size\n"
            "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
            "got = open_files_limit()\n"
            "print(got == hard, resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard, pool_size(got) >= 64)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True", "True"]
    from aisched_prefect.control.dispatch.handover import CLIENT_CONNECTIONS, RESERVED_FILES, pool_size

    for soft in (1024, 2048, 20000):
        assert pool_size(soft) >= 64 and 2 * pool_size(soft) + CLIENT_CONNECTIONS + RESERVED_FILES <= max(soft, 1216)
