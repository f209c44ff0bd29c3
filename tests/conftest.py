"""Shared fixtures: one real Prefect test server and one real GPU-aware Dask cluster per session."""

from __future__ import annotations

import os
import uuid

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("DO_NOT_TRACK", "1")

import logging

import pytest
import sqlalchemy as sa

logging.getLogger("distributed").setLevel(logging.WARNING)

# Two H100 hosts and one A10 host, declared: the same code path real GPUs take above NVML.
CLUSTER_SPEC = "2 workers x 2 GPUs, 80 GB, H100; 1 worker x 1 GPU, 24 GB, A10"
POSTGRES_URL = os.environ.get("AISCHED_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="session")
def prefect_api():
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=60):
        with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield


@pytest.fixture(scope="session")
def gpu_cluster():
    from dask_gpu import LocalGPUCluster

    with LocalGPUCluster(declared=CLUSTER_SPEC) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def dask_client(gpu_cluster):
    from distributed import Client

    with Client(gpu_cluster, set_as_default=False) as client:
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
