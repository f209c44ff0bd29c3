"""Large results go worker -> flow, not through the control plane: the worker's store and listener, and the flow's fetch.

Units, with a real listener on 127.0.0.1 and real HTTP (no cluster): what a flow relies on is that it gets the
bytes the settlement recorded or a named error before anything is unpickled, and that a token opens one result once.
The end-to-end path through a real cluster and control plane is in tests/test_direct_results_cluster.py.
"""

from __future__ import annotations

import asyncio
import doctest
import hashlib
import os
import pickle
import socket
import threading
import time

import httpx
import pytest

from aisched_prefect.flow import direct
from aisched_prefect.control import calls, outcomes
from aisched_prefect.control.authority import keys
from aisched_prefect.control.outcomes import direct_reply, result_evidence
from aisched_prefect.errors import ResultLost, ResultMismatch
from aisched_prefect.wire import DirectResult, Reply
from dask_gpu.worker import results
from dask_gpu.worker.results import DirectResults, ResultSettings, ResultStore
from tests.helpers import wait_until

MiB = 2**20


@pytest.fixture
def listener():
    kept = DirectResults(ResultSettings(min_bytes=MiB, max_bytes=8 * MiB), "127.0.0.1")
    yield kept
    kept.close()


def _ref(kept) -> DirectResult:
    return DirectResult.model_validate(kept.model_dump())


class Tripwire:
    """Unpickling one touches `path`: a test sees whether bytes were loaded."""

    def __init__(self, path: str, size: int) -> None:
        self.path, self.blob = path, os.urandom(size)

    def __setstate__(self, state: dict) -> None:
        open(state["path"], "w").close()
        self.__dict__.update(state)


def test_the_modules_examples_hold():
    for module in (results, direct, outcomes, calls, keys):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_a_large_result_is_kept_and_fetched_once_with_its_token(listener):
    data = os.urandom(3 * MiB)
    kept = listener.hold(data, ttl=60)
    assert kept is not None and kept.size == len(data) and kept.digest == hashlib.sha256(data).hexdigest()
    assert kept.token not in kept.url and len(kept.token) >= 43
    assert listener.store.stats() == {"results": 1, "bytes": len(data)}
    got = asyncio.run(direct.fetch_result(_ref(kept), "big"))
    assert got == data
    assert listener.store.stats() == {"results": 0, "bytes": 0}  # dropped once fetched
    again = httpx.get(f"{kept.url}/results/{kept.token}", trust_env=False)
    assert again.status_code == 404 and again.content.startswith(b"no such result")
    with pytest.raises(ResultLost, match=r"HTTP 404.*already fetched.*Fix: "):
        asyncio.run(direct.fetch_result(_ref(kept), "big"))


def test_a_small_result_is_not_kept(listener):
    assert listener.hold(b"x" * (MiB - 1), ttl=60) is None
    assert listener.store.stats()["results"] == 0


def test_unknown_tokens_and_other_requests_get_nothing(listener):
    kept = listener.hold(os.urandom(MiB), ttl=60)
    assert kept is not None
    wrong = kept.token[:-1] + ("A" if kept.token[-1] != "A" else "B")  # one character off
    for path in (f"/results/{wrong}", "/results/", "/results", "/", f"/results/{kept.token}/x",
                 f"/results/{'a' * 5000}", f"/RESULTS/{kept.token}"):
        resp = httpx.get(kept.url + path, trust_env=False)
        assert resp.status_code == 404, path
    assert httpx.post(f"{kept.url}/results/{kept.token}", trust_env=False).status_code == 405
    assert listener.store.stats()["results"] == 1  # none of that used it up
    assert httpx.get(f"{kept.url}/results/{kept.token}", trust_env=False).status_code == 200


def test_a_tampered_digest_is_refused_before_anything_is_unpickled(listener, tmp_path):
    marker = tmp_path / "unpickled"
    data = pickle.dumps(Tripwire(str(marker), MiB))
    assert pickle.loads(data) and marker.exists()  # the tripwire works
    marker.unlink()
    kept = listener.hold(data, ttl=60)
    assert kept is not None
    tampered = _ref(kept).model_copy(update={"digest": hashlib.sha256(b"other").hexdigest()})
    with pytest.raises(ResultMismatch, match=r"not the one the control plane recorded.*not unpickled.*Fix: "):
        asyncio.run(direct.fetch_result(tampered, "big"))
    assert not marker.exists()
    short = _ref(kept).model_copy(update={"size": kept.size + 1})
    with pytest.raises(ResultMismatch):
        direct.checked(short, data, "big")


def test_a_fetch_from_a_worker_that_is_gone_is_a_lost_result():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ref = DirectResult(url=f"http://127.0.0.1:{port}", token="t" * 43, digest="0" * 64, size=1, expires_at=0.0)
    with pytest.raises(ResultLost, match="could not be fetched from its worker.*ConnectionRefusedError.*Fix: .*retry the task"):
        asyncio.run(direct.fetch_result(ref, "big", attempts=2))
    with pytest.raises(ResultLost):
        direct.fetch_result_sync(ref, "big", attempts=1)


def test_the_store_is_bounded_and_entries_expire():
    store = ResultStore(max_bytes=10)
    first = store.put(b"x" * 6, ttl=60)
    assert first is not None and store.put(b"y" * 6, ttl=60) is None  # does not fit: the caller sends it inline
    short = ResultStore(max_bytes=10)
    token = short.put(b"z", ttl=0.01)
    wait_until(lambda: short.stats()["results"] == 0, 5, what="the entry to expire")
    assert short.claim(token) is None and short.stats() == {"results": 0, "bytes": 0}
    assert store.claim(first) == b"x" * 6 and store.put(b"y" * 6, ttl=60) is not None  # room again


def test_a_full_store_sends_the_result_the_usual_way():
    kept = DirectResults(ResultSettings(min_bytes=10, max_bytes=15), "127.0.0.1")
    try:
        assert kept.hold(b"a" * 10, ttl=60) is not None
        assert kept.hold(b"b" * 10, ttl=60) is None
    finally:
        kept.close()


def test_results_can_be_turned_off_and_bad_settings_name_their_key(monkeypatch):
    import dask

    with dask.config.set({"dask-gpu.results.enabled": False}):
        assert results.start("127.0.0.1") is None
    assert results.start("") is None  # no host to listen on (an inproc worker)
    with dask.config.set({"dask-gpu.results.min-bytes": -1}):
        with pytest.raises(results.ResultsError, match=r"dask-gpu.results is malformed: min_bytes.*Fix: "):
            results.settings_from_config()


def test_the_settlement_records_the_digest_and_size_never_the_token(listener):
    data = os.urandom(MiB)
    kept = listener.hold(data, ttl=60)
    evidence = result_evidence(b"", kept)
    assert evidence == {"result_digest": hashlib.sha256(data).hexdigest(), "result_bytes": MiB,
                        "result_via": "worker"}
    assert kept.token not in str(evidence)
    assert result_evidence(b"abc") == {"result_digest": hashlib.sha256(b"abc").hexdigest(), "result_bytes": 3,
                                       "result_via": "control-plane"}
    reply = Reply(status="completed", **direct_reply(kept))
    assert Reply.model_validate_json(reply.model_dump_json()) == reply  # it crosses the wire as it is
    assert direct_reply(None) == {}


def test_a_reply_whose_reference_disagrees_with_its_digest_is_refused(listener):
    kept = listener.hold(os.urandom(MiB), ttl=60)
    fields = direct_reply(kept)
    with pytest.raises(ValueError, match="result_digest must be the digest of result_ref"):
        Reply(status="completed", result_ref=fields["result_ref"], result_digest="0" * 64)
    with pytest.raises(ValueError):  # the reference is strict: no extra fields, a plain http(s) origin
        DirectResult.model_validate({**kept.model_dump(), "url": "file:///etc/passwd"})
    with pytest.raises(ValueError):
        DirectResult.model_validate({**kept.model_dump(), "extra": 1})


def _address(kept: DirectResults) -> tuple[str, int]:
    host, port = kept.base_url.removeprefix("http://").split(":")
    return host, int(port)


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the listener closed `sock` within `within` seconds (an EOF or a reset), reading what it sent."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_connection_that_finds_every_slot_serving_a_fetch_is_closed_at_once():
    kept = DirectResults(ResultSettings(min_bytes=1, max_connections=2, max_per_peer=2), "127.0.0.1")
    try:
        host, port = _address(kept)
        big = [kept.hold(os.urandom(32 * MiB), ttl=60) for _ in range(2)]
        slow = []  # two fetches whose clients do not read: both slots serve a fetch (blocked on its write)
        for ref in big:
            s = socket.create_connection((host, port))
            s.sendall(f"GET /results/{ref.token} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            slow.append(s)
        wait_until(lambda: kept.store.stats()["results"] == 0, 10, what="both fetches to begin")
        with socket.create_connection((host, port)) as extra:  # nothing to take a slot from
            assert _closed_by_server(extra, 5)
        assert kept.connections()["refused"] >= 1 and kept.connections()["connections"] == 2
        for s, ref in zip(slow, big):  # the fetches go on: each reads its whole result
            s.settimeout(20)
            got = b""
            while chunk := s.recv(2**20):
                got += chunk
            s.close()
            assert hashlib.sha256(got.split(b"\r\n\r\n", 1)[1]).hexdigest() == ref.digest
        small = kept.hold(b"payload", ttl=60)
        assert wait_until(lambda: kept.connections()["connections"] == 0, 10, what="the slots to be free")
        assert httpx.get(f"{small.url}/results/{small.token}", trust_env=False).content == b"payload"
    finally:
        kept.close()


def test_a_client_that_trickles_its_request_is_cut_at_one_deadline_for_all_of_it():
    kept = DirectResults(ResultSettings(min_bytes=1, request_seconds=1.5), "127.0.0.1")
    try:
        ref = kept.hold(b"payload", ttl=60)
        request = f"GET /results/{ref.token} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        with socket.create_connection(_address(kept)) as s:
            began = time.monotonic()
            s.settimeout(0.25)
            cut = None
            for byte in request:  # a byte every 0.25 s: each read is quick, the whole request would take 14 s
                try:
                    s.sendall(bytes([byte]))
                    if s.recv(1) == b"":
                        cut = time.monotonic() - began
                        break
                except TimeoutError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    cut = time.monotonic() - began
                    break
        assert cut is not None and 1.4 < cut < 4, cut  # at the deadline for the whole request, not per read
        assert kept.store.stats()["results"] == 1  # nothing was served to it
        assert httpx.get(f"{ref.url}/results/{ref.token}", trust_env=False).content == b"payload"
    finally:
        kept.close()


def test_one_address_holds_at_most_its_share_of_the_slots():
    kept = DirectResults(ResultSettings(min_bytes=1, max_connections=8), "127.0.0.1")  # a share of 8 // 4 = 2
    try:
        host, port = _address(kept)
        neighbour = [socket.create_connection((host, port), source_address=("127.0.0.2", 0)) for _ in range(6)]
        try:
            wait_until(lambda: kept.connections()["evicted"] == 4, 10, what="its older connections to give way")
            assert kept.connections()["peers"] == {"127.0.0.2": 2}
            # Each of its new connections took the slot of its own oldest: the first four are closed, two are held.
            assert [_closed_by_server(s, 0.3) for s in neighbour] == [True] * 4 + [False] * 2
            ref = kept.hold(b"payload", ttl=60)
            assert direct.fetch_result_sync(_ref(ref), "small", attempts=1) == b"payload"  # another address: room
        finally:
            for s in neighbour:
                s.close()
    finally:
        kept.close()


class SlowLoris:
    """Connections from `addresses` that each send one byte of a request every `every` seconds and never finish it,
    reconnecting as soon as the listener closes one: a neighbour trying to hold every slot of the listener."""

    def __init__(self, target: tuple[str, int], addresses: list[str], per_address: int, every: float = 3.0) -> None:
        self.target, self.addresses, self.per_address, self.every = target, addresses, per_address, every
        self.stop = threading.Event()
        self.connects = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self, address: str) -> socket.socket | None:
        try:
            s = socket.create_connection(self.target, timeout=2, source_address=(address, 0))
        except OSError:
            return None
        s.setblocking(False)
        self.connects += 1
        return s

    def _run(self) -> None:
        held: list[tuple[str, socket.socket | None]] = [(a, None) for a in self.addresses for _ in range(self.per_address)]
        sent = 0
        last = 0.0
        while not self.stop.is_set():
            drip = time.monotonic() - last >= self.every
            if drip:
                last, sent = time.monotonic(), sent + 1
            for i, (address, s) in enumerate(held):
                if s is not None:
                    try:
                        if s.recv(1) == b"":  # closed by the listener
                            s.close()
                            s = None
                    except BlockingIOError:
                        pass
                    except OSError:
                        s.close()
                        s = None
                if s is None:
                    s = self._open(address)
                elif drip:
                    try:
                        s.send(b"GET /results/"[sent % 13:sent % 13 + 1] or b"x")
                    except OSError:
                        pass
                held[i] = (address, s)
            self.stop.wait(0.02)
        for _, s in held:
            if s is not None:
                s.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def test_a_slow_loris_holding_many_connections_does_not_stop_a_fetch():
    kept = DirectResults(ResultSettings(min_bytes=1), "127.0.0.1")  # 16 slots, 4 per address, 10 s per request
    try:
        # 40 connections from five addresses, the fetching process's own included (a body on the flow's host).
        loris = SlowLoris(_address(kept), [f"127.0.0.{i}" for i in range(1, 6)], per_address=8)
        try:
            wait_until(lambda: kept.connections()["connections"] == 16, 20, what="the slow loris to fill every slot")
            for _ in range(3):
                data = os.urandom(2 * MiB)
                ref = _ref(kept.hold(data, ttl=60))
                began = time.monotonic()
                assert direct.fetch_result_sync(ref, "big") == data
                assert time.monotonic() - began < 3
                assert kept.connections()["connections"] >= 15  # it still holds the rest: the attack went on
            assert loris.connects > 40  # it kept reconnecting
            assert set(kept.connections()["peers"].values()) <= {1, 2, 3, 4}  # no address above its share
        finally:
            loris.close()
    finally:
        kept.close()


def test_a_result_announced_at_another_size_than_recorded_is_refused_before_any_of_it_is_read():
    """Something answering for the worker announces 10 GB for a 1 MiB result and keeps the connection open: the flow
    refuses at the header, holding none of it (before, it read all it announced, then compared)."""
    server = socket.create_server(("127.0.0.1", 0))
    served = threading.Event()

    def answer() -> None:
        conn, _ = server.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.0 200 OK\r\ncontent-length: 10000000000\r\n\r\n" + b"x" * 1024)
        served.wait(60)  # held open, never finished: a reader that read on would wait out its timeout
        conn.close()

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    ref = DirectResult(url=f"http://127.0.0.1:{server.getsockname()[1]}", token="t" * 43, digest="0" * 64, size=MiB,
                       expires_at=0.0)
    try:
        with pytest.raises(ResultMismatch, match="announced 10000000000 bytes.*not the 1048576.*nothing of it was read"):
            direct.fetch_result_sync(ref, "big", attempts=1)
    finally:
        served.set()
        t.join()
        server.close()
