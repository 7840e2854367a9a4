"""docker-compose.yml, checked without a Docker engine (there is none here): its services,
images, volumes, commands, health checks and connections against what onceflow needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from onceflow.spark.localspark import SERVER_CLASS

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ("airflow-worker-1", "airflow-worker-2")  # Celery workers
AIRFLOW = ("airflow-api-server", "airflow-scheduler", "airflow-dag-processor",
           "airflow-triggerer", "airflow-init", *WORKERS)
SPARK_WORKERS = ("spark-worker-1", "spark-worker-2")


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_every_part_is_there(compose):
    services = compose["services"]
    assert set(services) == {"postgres", "redis", *AIRFLOW, "spark-master", *SPARK_WORKERS,
                             "spark-connect"}
    assert set(compose["volumes"]) == {"postgres-data", "onceflow-data"}


def test_health_checks_gate_what_depends_on_them(compose):
    services = compose["services"]
    assert services["postgres"]["healthcheck"]["test"][:2] == ["CMD", "pg_isready"]
    for name, service in services.items():
        for needed, how in (service.get("depends_on") or {}).items():
            assert needed in services, f"{name} depends on unknown {needed}"
            if isinstance(how, dict) and how.get("condition") == "service_healthy":
                assert "healthcheck" in services[needed], f"{needed} has no health check"


def test_airflow_gets_onceflow_connections_and_the_dag_folder(compose):
    services = compose["services"]
    for name in AIRFLOW:
        env = services[name]["environment"]
        assert env["AIRFLOW__CORE__DAGS_FOLDER"] == "/opt/onceflow/dags"
        assert "postgres" in env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        pg = json.loads(env["AIRFLOW_CONN_ONCEFLOW_PG"])
        assert pg["conn_type"] == "postgres" and pg["host"] in services
        spark = json.loads(env["AIRFLOW_CONN_SPARK_DEFAULT"])
        assert spark == {"conn_type": "spark_connect", "host": "spark-connect", "port": 15002}
        assert env["ONCEFLOW_PG_DSN"].startswith("postgresql://")
        assert env["ONCEFLOW_SEGMENTS_DIR"].startswith("/data/")
    assert (ROOT / "dags" / "onceflow_pipelines.py").exists()
    assert "onceflow init" in " ".join(services["airflow-init"]["command"])


def test_airflow_runs_tasks_on_two_celery_workers_with_redis_as_the_broker(compose):
    """The CeleryExecutor's topology (tests/test_celery_cluster.py runs it as processes)."""
    services = compose["services"]
    assert services["redis"]["image"].startswith("redis:")
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    secrets = set()
    for name in AIRFLOW:
        env = services[name]["environment"]
        assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor", name
        assert env["AIRFLOW__CELERY__BROKER_URL"] == "redis://redis:6379/0"
        # Celery's results in Airflow's metadata database, on the same server
        backend = env["AIRFLOW__CELERY__RESULT_BACKEND"]
        assert backend == "db+" + env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        secrets.add(env["AIRFLOW__API_AUTH__JWT_SECRET"])
    # one JWT key for the scheduler that signs task tokens and the API server that checks them
    assert len(secrets) == 1 and secrets.pop().startswith("${AIRFLOW_JWT_SECRET:?")
    for name in WORKERS:
        service = services[name]
        assert service["command"] == "celery worker"
        needs = service["depends_on"]
        assert needs["redis"]["condition"] == needs["spark-connect"]["condition"] \
            == needs["postgres"]["condition"] == "service_healthy"
        assert "ports" not in service  # nothing of a worker's is reached from outside
    assert "celery" in services["airflow-worker-1"]["build"]["dockerfile_inline"]
    assert "redis" in services["airflow-scheduler"]["depends_on"]


def test_spark_runs_the_cluster_and_the_warm_server_on_it(compose):
    services = compose["services"]
    master = " ".join(services["spark-master"]["command"])
    assert "org.apache.spark.deploy.master.Master" in master and "--port 7077" in master
    for name in SPARK_WORKERS:
        worker = " ".join(services[name]["command"])
        assert "org.apache.spark.deploy.worker.Worker spark://spark-master:7077" in worker
        assert services[name]["depends_on"]["spark-master"]["condition"] == "service_healthy"
    connect = " ".join(services["spark-connect"]["command"])
    assert SERVER_CLASS in connect and "--master spark://spark-master:7077" in connect
    assert "spark.connect.grpc.binding.port=15002" in connect
    # the server's driver JVM has the options of the local server onceflow starts
    from onceflow.spark.localspark import SERVER_JAVA_OPTIONS

    assert f"'spark.driver.extraJavaOptions={SERVER_JAVA_OPTIONS}' " in connect


def test_one_image_with_onceflow_and_shared_data_everywhere(compose):
    services = compose["services"]
    for name in (*AIRFLOW, "spark-master", *SPARK_WORKERS, "spark-connect"):
        service = services[name]
        assert service["image"] == "onceflow:local"
        # the data volume at the same path in every Airflow worker and Spark container
        assert "onceflow-data:/data" in service["volumes"], name
    build = services["spark-worker-1"]["build"]["dockerfile_inline"]
    # the wheels are built with a JDK (onceflow's build compiles its JVM reader), the image
    # that runs them has a JRE
    wheels, runs = build.split("\n\n")
    assert "openjdk-17-jdk-headless" in wheels and "pip wheel" in wheels
    assert "openjdk-17-jre-headless" in runs and "-jdk-" not in runs
    assert "COPY --from=wheels" in runs
    for path in ("/opt/onceflow", "/opt/onceflow/examples/tweets"):
        assert path in build
        assert (ROOT / path.removeprefix("/opt/onceflow").lstrip("/")).exists()
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv/", ".git/", ".pgdata/", ".airflow/"} <= set(ignored)
