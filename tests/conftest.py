"""Shared fixtures: one real Prefect test server and one real GPU-aware Dask cluster per session."""

from __future__ import annotations

import os
import uuid

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("DO_NOT_TRACK", "1")
# The suite's clusters run every tenant's bodies as the worker's user (its bodies write markers the tests read);
# tests/test_isolation.py starts isolated workers of its own (dask_gpu.isolation).
os.environ.setdefault("DASK_DASK_GPU__ISOLATION__MODE", "shared")
# Warm bodies are off on the suite's shared control planes: an inference run's body waiting warm for 5 minutes would
# hold its device share and its budget room into the next test. tests/test_warm_bodies.py (and the example flows'
# test) run planes with them on.
os.environ.setdefault("AISCHED_MAX_KEEP_WARM_SECONDS", "0")
# Every Dask process the suite starts (and their subprocesses, through the environment) keeps its scratch files in a
# folder of this test process's own, never the host-wide `dask-scratch-space` in the system's temporary directory,
# whose leftovers (another user's, or a 3,000-deep tree Dask fails to purge) must not fail the suite.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

if "DASK_TEMPORARY_DIRECTORY" not in os.environ:
    os.environ["DASK_TEMPORARY_DIRECTORY"] = tempfile.mkdtemp(prefix="aisched-tests-dask-")
    atexit.register(shutil.rmtree, os.environ["DASK_TEMPORARY_DIRECTORY"], True)

import logging

import pytest
import sqlalchemy as sa

logging.getLogger("distributed").setLevel(logging.WARNING)

# Two H100 hosts and one A10 host, declared: the same code path real GPUs take above NVML.
CLUSTER_SPEC = "2 workers x 2 GPUs, 80 GB, H100; 1 worker x 1 GPU, 24 GB, A10"
QUEUE_SYNC_SECONDS = 2.0  # the session plane sets the queue's weights again this often (tests/test_cluster_queue.py)
SESSION_LEASE_SECONDS = 8.0  # a flow process that stops polling is gone after this (tests/test_lifecycle.py)
POSTGRES_URL = os.environ.get("AISCHED_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="session")
def prefect_api():
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    # Each xdist worker starts its own server, all at once on a 2-core machine: give start-up room.
    with prefect_test_harness(server_startup_timeout=180):
        with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield


@pytest.fixture(scope="session")
def plane_home(tmp_path_factory):
    """The test control plane's home: its signing key exists before the cluster, whose workers trust it."""
    from aisched_prefect.control.service import load_or_make_key

    home = tmp_path_factory.mktemp("control-plane")
    load_or_make_key(home / "control.key")
    return home


@pytest.fixture(scope="session")
def plane_public_key(plane_home) -> str:
    from aisched_prefect.control.service import load_or_make_key
    from dask_gpu.tickets import TicketSigner

    return TicketSigner(load_or_make_key(plane_home / "control.key")).public_key.hex()


@pytest.fixture(scope="session")
def cluster_tls(plane_home):
    """The session cluster's TLS files: only the control plane (and this test harness, its operator) hold a client cert."""
    from dask_gpu.security import ClusterTLS

    return ClusterTLS.create(plane_home / "tls")


@pytest.fixture(scope="session")
def gpu_cluster(plane_public_key, cluster_tls):
    from dask_gpu import LocalGPUCluster

    with LocalGPUCluster(declared=CLUSTER_SPEC, trusted_keys=[plane_public_key], tls=cluster_tls) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def control_plane(prefect_api, gpu_cluster, plane_home, dask_client):
    """One real control plane (`aisched serve`, its own process) on the session's cluster; tests take slices of it.

    It starts once every worker registered (`dask_client` waits for them): a first admission never meets "no workers".
    """
    from tests.controlplane import ControlPlaneProcess

    plane = ControlPlaneProcess(plane_home, dask_address=gpu_cluster.scheduler_address, dask_tls=plane_home / "tls",
                                env={"AISCHED_QUEUE_SYNC_SECONDS": str(QUEUE_SYNC_SECONDS),
                                     "AISCHED_SESSION_LEASE_SECONDS": str(SESSION_LEASE_SECONDS)}).start()
    yield plane
    plane.stop()


@pytest.fixture(scope="session")
def dask_client(gpu_cluster, cluster_tls):
    from distributed import Client

    with Client(gpu_cluster.scheduler_address, set_as_default=False, security=cluster_tls.security("client")) as client:
        client.wait_for_workers(3, timeout=60)
        yield client


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.db'}"


def _postgres_available() -> bool:
    try:
        engine = sa.create_engine(POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1))
        with engine.connect():
            pass
        engine.dispose()
        return True
    except Exception:
        return False


@pytest.fixture
def postgres_url() -> str:
    """A fresh schema in the test database, dropped afterwards."""
    if not _postgres_available():
        if os.environ.get("CI") or os.environ.get("AISCHED_TEST_POSTGRES_URL"):
            pytest.fail(f"Postgres at {POSTGRES_URL} does not answer; .ci/run should have started it")
        pytest.skip(f"Postgres at {POSTGRES_URL} does not answer")
    schema = f"t_{uuid.uuid4().hex[:10]}"
    engine = sa.create_engine(POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in POSTGRES_URL else "?"
    yield f"{POSTGRES_URL}{sep}options=-csearch_path%3D{schema}"
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_url(request) -> str:
    return request.getfixturevalue(f"{request.param}_url")
