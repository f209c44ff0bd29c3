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

import httpx
import pytest

from aisched_prefect import direct
from aisched_prefect.control import outcomes
from aisched_prefect.control.outcomes import direct_reply, result_evidence
from aisched_prefect.errors import ResultLost, ResultMismatch
from aisched_prefect.wire import DirectResult, Reply
from dask_gpu import results
from dask_gpu.results import DirectResults, ResultSettings, ResultStore
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
    for module in (results, direct, outcomes):
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


def test_a_flood_of_idle_connections_is_refused_not_queued():
    kept = DirectResults(ResultSettings(min_bytes=1, max_connections=2), "127.0.0.1")
    try:
        ref = kept.hold(b"payload", ttl=60)
        host, port = kept.base_url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port))) for _ in range(2)]  # hold every slot, send nothing
        try:
            def slots_taken() -> bool:
                with socket.create_connection((host, int(port))) as extra:
                    extra.settimeout(5)
                    return extra.recv(1) == b""  # closed at once, no thread for it
            assert slots_taken()
        finally:
            for s in idle:
                s.close()

        def served() -> bytes | None:  # the idle ones' threads end once we closed them
            try:
                return httpx.get(f"{ref.url}/results/{ref.token}", trust_env=False).content
            except httpx.HTTPError:
                return None

        assert wait_until(served, 20, what="the listener serving again") == b"payload"
    finally:
        kept.close()
