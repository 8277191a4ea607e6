"""``deploy/kubernetes/`` checked offline, as no cluster runs here: every
manifest against the Kubernetes API schemas (``kubernetes-validate``, strict:
an unknown field fails), every farm container's arguments parsed by the real
CLI, every ``NDIF_*`` name one the code reads, every secret from a Secret
(none written in the recipe), probes on ``/ping``, GPUs requested, and the
autoscaler reading a metric the farm exports.
"""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from ndif_celery import config
from ndif_celery.monitoring import metrics
from tests.support.stacks.deploy_recipes import ROOT, config_variables, load_settings, parse_cli

FOLDER = ROOT / "deploy" / "kubernetes"
#: The API version the manifests are checked against (any cluster from it on serves them).
KUBERNETES = "1.30.0"
#: The Secrets the recipe reads and never writes.
SECRETS = {"ndif-farm-env", "ndif-services"}
#: What config.py reads that must never be written in a manifest.
SECRET_SETTINGS = {"NDIF_REDIS_URL", "NDIF_DATABASE_URL", "NDIF_OBJECT_STORE_ACCESS_KEY",
                   "NDIF_OBJECT_STORE_SECRET_KEY", "NDIF_SECRET_KEY", "NDIF_METRICS_TOKEN"}


def documents() -> list[tuple[Path, dict]]:
    found = []
    for path in sorted(FOLDER.glob("*.yaml")):
        found += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def by_kind(kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for _, doc in documents() if doc["kind"] == kind}


def containers(doc: dict) -> list[dict]:
    return doc["spec"]["template"]["spec"]["containers"]


def farm_containers() -> dict[str, dict]:
    """The containers that run this project's image, by Deployment."""
    return {name: container for name, doc in by_kind("Deployment").items() for container in containers(doc)
            if container["image"].startswith("ndif-celery:")}


@pytest.mark.parametrize("path, doc", documents(), ids=lambda v: v.name if isinstance(v, Path) else v["kind"])
def test_each_manifest_is_valid_against_the_kubernetes_schemas(path, doc):
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_validation_used_here_refuses_what_kubernetes_refuses():
    deployment = by_kind("Deployment")["ndif-web"]
    wrong = {**deployment, "spec": {**deployment["spec"], "replica": 2}}  # a misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, KUBERNETES, strict=True)


def test_the_farm_runs_each_of_its_services_with_arguments_the_cli_takes():
    found = farm_containers()
    assert set(found) == {"ndif-web", "ndif-worker", "ndif-beat", "ndif-flower"}
    for name, container in found.items():
        assert parse_cli(container["args"]).command.name == name.removeprefix("ndif-")
    assert parse_cli(found["ndif-worker"]["args"]).params["gpus"] == "0"


def test_every_ndif_variable_is_one_the_code_reads_and_the_settings_load(tmp_path):
    known = config_variables()
    used = set(re.findall(r"\bNDIF_[A-Z0-9_]+", "".join(p.read_text() for p in FOLDER.glob("*.yaml"))))
    assert used and used - known == set()
    shared = by_kind("ConfigMap")["ndif-config"]["data"]
    settings = load_settings({**shared, "NDIF_SECRET_KEY": "from-the-secret"}, tmp_path)
    assert settings.auth is True, "keys are required"
    assert settings.object_store_url == "http://minio:9000"


def test_secrets_come_from_secrets_the_recipe_never_writes():
    assert not by_kind("Secret"), "the operator makes the Secrets; the recipe holds no secret value"
    for _, doc in documents():
        if doc["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        for container in containers(doc):
            for source in container.get("envFrom", []):
                assert "secretRef" not in source or source["secretRef"]["name"] in SECRETS
            for env in container.get("env", []):
                secretish = env["name"] in SECRET_SETTINGS or re.search(r"PASSWORD|SECRET|ACCESS_KEY|ROOT_USER", env["name"])
                if secretish:
                    assert "value" not in env, f"{doc['metadata']['name']} writes {env['name']} in the recipe"
                    assert env["valueFrom"]["secretKeyRef"]["name"] in SECRETS
    shared = by_kind("ConfigMap")["ndif-config"]["data"]
    assert not set(shared) & SECRET_SETTINGS


def test_the_web_is_probed_on_ping_and_the_workers_ask_for_a_gpu_each():
    web = farm_containers()["ndif-web"]
    assert web["readinessProbe"]["httpGet"]["path"] == "/ping" and web["livenessProbe"]["httpGet"]["path"] == "/ping"
    assert web["readinessProbe"]["httpGet"]["port"] == int(
        {e["name"]: e["value"] for e in web["env"]}["NDIF_API_PORT"])
    worker = by_kind("Deployment")["ndif-worker"]
    assert containers(worker)[0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    # A worker finishes its job on SIGTERM: the grace period outlasts a job's deadline.
    timeout = int(by_kind("ConfigMap")["ndif-config"]["data"]["NDIF_EXECUTION_TIMEOUT_S"])
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > timeout


def test_the_workers_scale_on_a_queue_metric_the_farm_exports():
    scaler = by_kind("HorizontalPodAutoscaler")["ndif-worker"]
    assert scaler["spec"]["scaleTargetRef"]["name"] in by_kind("Deployment")
    metric = scaler["spec"]["metrics"][0]["external"]["metric"]["name"]
    assert metric == metrics.queue_depth({}).name
    assert scaler["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300


def test_every_service_selects_the_pods_of_its_workload():
    workloads = {**by_kind("Deployment"), **by_kind("StatefulSet")}
    labels = [doc["spec"]["template"]["metadata"]["labels"] for doc in workloads.values()]
    for name, service in by_kind("Service").items():
        selector = service["spec"]["selector"]
        assert any(selector.items() <= pod.items() for pod in labels), f"Service {name} selects no pods"
    assert config.load({"NDIF_HOME": "/nonexistent"}).api_port == 8001  # the Service's port is the default
