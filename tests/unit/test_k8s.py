"""Kubernetes: the TF_CONFIG operators set, the manifests in examples/k8s/, and python -m psframe.k8s.

This file holds the unit tier's tests of the subject; `tests/cluster/test_k8s.py` holds the other
tiers'.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import psframe
from psframe import cli, k8s
from psframe.cluster.tf_config import cluster_from_tf_config, resolve_cluster
from psframe.errors import ClusterSpecError
from tests.conftest import ROOT

K8S = ROOT / "examples" / "k8s"
DATA_DIR = "/opt/psframe/data"  # where the Dockerfile puts MNIST


def load(name: str) -> list[dict]:
    yaml = pytest.importorskip("yaml")  # the test extra has it
    with open(K8S / name) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def operator_tf_config(
    job: dict, rtype: str, index: int, namespace: str = "default", with_evaluator: bool = True
) -> str:
    """The TF_CONFIG Kubeflow's training operator sets in a TFJob's pod, as its Go code marshals it.

    Every replica type becomes a job named by its lower-cased type, each replica
    ``<job name>-<type>-<i>.<namespace>.svc:<tfjob-port>``; Go sorts a map's keys.
    Older operators leave the Evaluator out of the cluster (``with_evaluator=False``).
    """
    cluster = {}
    for replica_type, spec in job["spec"]["tfReplicaSpecs"].items():
        rt = replica_type.lower()
        if rt == "evaluator" and not with_evaluator:
            continue
        container = next(c for c in spec["template"]["spec"]["containers"] if c["name"] == "tensorflow")
        port = next((p["containerPort"] for p in container.get("ports", []) if p.get("name") == "tfjob-port"), 2222)
        cluster[rt] = [f"{job['metadata']['name']}-{rt}-{i}.{namespace}.svc:{port}" for i in range(spec["replicas"])]
    config = {
        "cluster": dict(sorted(cluster.items())),
        "task": {"type": rtype.lower(), "index": index},
        "environment": "cloud",
    }
    return json.dumps(config, separators=(",", ":"))


# ---------------------------------------------------------------- TF_CONFIG as operators set it

# Literally what the training operator sets for a TFJob "mnist" in namespace "ml" with
# 1 Chief, 2 PS, 2 Worker and 1 Evaluator replicas (a release that lists the evaluator).
OPERATOR_CLUSTER = (
    '{"chief":["mnist-chief-0.ml.svc:2222"],"evaluator":["mnist-evaluator-0.ml.svc:2222"],'
    '"ps":["mnist-ps-0.ml.svc:2222","mnist-ps-1.ml.svc:2222"],'
    '"worker":["mnist-worker-0.ml.svc:2222","mnist-worker-1.ml.svc:2222"]}'
)
TRAINING_CLUSTER = psframe.ClusterSpec(
    {
        "ps": ["mnist-ps-0.ml.svc:2222", "mnist-ps-1.ml.svc:2222"],
        "worker": ["mnist-chief-0.ml.svc:2222", "mnist-worker-0.ml.svc:2222", "mnist-worker-1.ml.svc:2222"],
    }
)


@pytest.mark.parametrize(
    "task_type, index, expected",
    [
        ("chief", 0, ("worker", 0)),
        ("worker", 0, ("worker", 1)),
        ("worker", 1, ("worker", 2)),
        ("ps", 0, ("ps", 0)),
        ("ps", 1, ("ps", 1)),
    ],
)
def test_every_tfjob_pod_gets_its_task_and_the_same_cluster(task_type, index, expected):
    tf_config = (
        f'{{"cluster":{OPERATOR_CLUSTER},"task":{{"type":"{task_type}","index":{index}}},"environment":"cloud"}}'
    )
    cluster, job_name, task_index = resolve_cluster(environ={"TF_CONFIG": tf_config})
    assert cluster == TRAINING_CLUSTER  # the evaluator is no part of it
    assert (job_name, task_index) == expected


@pytest.mark.parametrize("lists_evaluator", [True, False], ids=["evaluator_listed", "evaluator_left_out"])
def test_the_evaluator_pod_is_told_it_takes_no_part(lists_evaluator, capsys, monkeypatch):
    cluster_json = json.loads(OPERATOR_CLUSTER)
    if not lists_evaluator:
        del cluster_json["evaluator"]
    tf_config = json.dumps({"cluster": cluster_json, "task": {"type": "evaluator", "index": 0}, "environment": "cloud"})
    assert cluster_from_tf_config(tf_config) == (TRAINING_CLUSTER, "evaluator", 0)
    with pytest.raises(ClusterSpecError, match=r"TF_CONFIG's evaluator, which takes no part in training"):
        resolve_cluster(environ={"TF_CONFIG": tf_config})
    monkeypatch.setenv("TF_CONFIG", tf_config)
    assert cli.main(["server", "--bind_address=127.0.0.1:0"]) == 1
    assert "psframe server: error: this process is TF_CONFIG's evaluator" in capsys.readouterr().err


def test_a_tf1_master_is_the_chief():
    tf_config = (
        '{"cluster":{"master":["m-0:2222"],"ps":["p-0:2222"],"worker":["w-0:2222"]},'
        '"task":{"type":"master","index":0},"environment":"cloud"}'
    )
    cluster, job_name, task_index = resolve_cluster(environ={"TF_CONFIG": tf_config})
    assert cluster.job_tasks("worker") == ["m-0:2222", "w-0:2222"] and (job_name, task_index) == ("worker", 0)


# ---------------------------------------------------------------- the TFJob manifest


def test_tfjob_manifest_names_what_the_operator_and_psframe_expect():
    (job,) = load("tfjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "TFJob")
    specs = job["spec"]["tfReplicaSpecs"]
    assert set(specs) == {"PS", "Chief", "Worker"}
    assert specs["Chief"]["replicas"] == 1
    images = set()
    for replica_type, spec in specs.items():
        assert spec["restartPolicy"] in ("OnFailure", "ExitCode")
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "tensorflow", "the operator sets TF_CONFIG only in the container 'tensorflow'"
        assert {"name": "tfjob-port", "containerPort": 2222} in container["ports"]
        images.add(container["image"])
        argv = container["command"] + container.get("args", [])
        assert not any(
            a.startswith(("--ps_hosts", "--worker_hosts", "--cluster_spec", "--job_name", "--task_index")) for a in argv
        ), f"{replica_type}: the cluster and task come from TF_CONFIG"
        if replica_type == "PS":
            assert argv[:2] == ["psframe", "server"]
            args = cli.build_parser().parse_args(argv[1:])
            assert args.bind_address == "0.0.0.0:2222" and args.serving_processes == 1
        else:
            assert argv[:2] == ["python", "examples/mlp_mnist_dist.py"] and (ROOT / argv[1]).is_file()
            args = _example_parser()(argv[2:])
            assert args.data_dir == DATA_DIR
    assert len(images) == 1, f"one image for every task, got {images}"

    # Every pod, given the TF_CONFIG the operator builds from this manifest, finds its own task.
    tasks = set()
    cluster = None
    for replica_type, spec in specs.items():
        for i in range(spec["replicas"]):
            found = resolve_cluster(environ={"TF_CONFIG": operator_tf_config(job, replica_type, i)})
            assert cluster in (None, found[0])
            cluster = found[0]
            tasks.add(found[1:])
    assert tasks == {("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1), ("worker", 2)}
    assert cluster.job_tasks("worker")[0] == "psframe-mnist-chief-0.default.svc:2222"


def _example_parser():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import mlp_mnist_dist
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return mlp_mnist_dist.parse_args


# ---------------------------------------------------------------- the StatefulSet manifest


def test_statefulset_manifest_agrees_with_its_service_and_psframe_k8s():
    docs = load("statefulset.yaml")
    (service,) = [d for d in docs if d["kind"] == "Service"]
    sets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert [p["port"] for p in service["spec"]["ports"]] == [2222]
    prefix = service["metadata"]["name"]
    assert set(sets) == {f"{prefix}-ps", f"{prefix}-worker"}
    images = set()
    pods: dict[str, dict[str, str]] = {}
    for name, sts in sets.items():
        spec = sts["spec"]
        assert spec["serviceName"] == prefix
        assert spec["podManagementPolicy"] == "Parallel"
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"] == labels
        assert service["spec"]["selector"].items() <= labels.items()
        (container,) = spec["template"]["spec"]["containers"]
        images.add(container["image"])
        assert [p["containerPort"] for p in container["ports"]] == [2222]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert set(env) - {"OMP_NUM_THREADS"} <= set(k8s.ENV_NAMES)
        assert env["PSFRAME_SERVICE"] == prefix and env["PSFRAME_PORT"] == "2222"
        assert {
            "name": "PSFRAME_NAMESPACE",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        } in container["env"]
        assert int(env["PSFRAME_NUM_PS"]) == sets[f"{prefix}-ps"]["spec"]["replicas"]
        assert int(env["PSFRAME_NUM_WORKERS"]) == sets[f"{prefix}-worker"]["spec"]["replicas"]
        assert container["command"] == ["python", "-m", "psframe.k8s", "--stay_after_success", "--"]
        argv = container["args"]
        if name.endswith("-ps"):
            assert argv[:2] == ["psframe", "server"]
            assert cli.build_parser().parse_args(argv[1:]).bind_address == "0.0.0.0:2222"
        else:
            assert argv[:2] == ["python", "examples/mlp_mnist_dist.py"]
            assert _example_parser()(argv[2:]).data_dir == DATA_DIR
        for i in range(spec["replicas"]):
            pods[f"{name}-{i}"] = {**{k: v for k, v in env.items() if v is not None}, "PSFRAME_NAMESPACE": "ml"}
    assert len(images) == 1

    found = {}
    for hostname, env in pods.items():
        cluster, job_name, task_index = resolve_cluster(
            environ={"TF_CONFIG": json.dumps(k8s.statefulset_tf_config(hostname, env))}
        )
        found[hostname] = (cluster, job_name, task_index)
        assert cluster.task_address(job_name, task_index) == f"{hostname}.{prefix}.ml.svc:2222"
    assert len({c for c, _, _ in found.values()}) == 1
    assert sorted((j, i) for _, j, i in found.values()) == [("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)]


def test_dockerfile_installs_the_pins_and_fills_the_data_folder():
    text = (K8S / "Dockerfile").read_text()
    assert "WORKDIR /opt/psframe" in text
    assert "-c constraints.txt ." in text
    assert f"python scripts/fetch_mnist.py --data_dir {DATA_DIR}" in text
    for line in text.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"the Dockerfile copies {source}, which is not in the repository"


# ---------------------------------------------------------------- python -m psframe.k8s

ENV = {"PSFRAME_SERVICE": "job", "PSFRAME_NUM_PS": "2", "PSFRAME_NUM_WORKERS": "3"}


def test_statefulset_tf_config_names_pods_under_the_service():
    assert k8s.statefulset_tf_config("job-worker-2", ENV) == {
        "cluster": {
            "ps": ["job-ps-0.job:2222", "job-ps-1.job:2222"],
            "worker": ["job-worker-0.job:2222", "job-worker-1.job:2222", "job-worker-2.job:2222"],
        },
        "task": {"type": "worker", "index": 2},
    }
    full = k8s.statefulset_tf_config(
        "my-job-ps-1.job.ml.svc.cluster.local",
        {
            **ENV,
            "PSFRAME_SERVICE": "svc",
            "PSFRAME_PORT": "7000",
            "PSFRAME_NAMESPACE": "ml",
            "PSFRAME_CLUSTER_DOMAIN": "cluster.local",
        },
    )
    assert full["task"] == {"type": "ps", "index": 1}
    assert full["cluster"]["ps"][1] == "my-job-ps-1.svc.ml.svc.cluster.local:7000"


@pytest.mark.parametrize(
    "hostname, env, match",
    [
        ("job-0", ENV, r"hostname 'job-0' is not a StatefulSet pod of a psframe job"),
        ("job-chief-0", ENV, r"expected NAME-ps-I or NAME-worker-I"),
        ("job-ps-x", ENV, r"hostname 'job-ps-x'"),
        ("-ps-0", ENV, r"hostname '-ps-0'"),
        ("job-ps-2", ENV, r"pod 'job-ps-2' is ps 2, but PSFRAME_NUM_PS=2 \(ordinals 0\.\.1\)"),
        ("job-ps-0", {**ENV, "PSFRAME_SERVICE": ""}, r"PSFRAME_SERVICE is not set"),
        ("job-ps-0", {"PSFRAME_SERVICE": "s", "PSFRAME_NUM_PS": "1"}, r"PSFRAME_NUM_WORKERS is not set"),
        ("job-ps-0", {**ENV, "PSFRAME_NUM_PS": "two"}, r"PSFRAME_NUM_PS must be an int >= 1, got 'two'"),
        ("job-ps-0", {**ENV, "PSFRAME_PORT": "70000"}, r"PSFRAME_PORT must be a port number \(1\.\.65535\), got 70000"),
    ],
)
def test_statefulset_tf_config_refuses(hostname, env, match):
    with pytest.raises(ClusterSpecError, match=match):
        k8s.statefulset_tf_config(hostname, env)


def _entrypoint(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    full_env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **ENV, **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "psframe.k8s", *args],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        **kwargs,
    )


def test_entrypoint_prints_tf_config_or_refuses_the_pod(capsys, monkeypatch):
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    assert k8s.main(["--hostname", "job-worker-1"]) == 0
    assert json.loads(capsys.readouterr().out)["task"] == {"type": "worker", "index": 1}
    assert k8s.main(["--hostname", "job-ps-9", "--", "true"]) == 2  # before running anything
    assert "pod 'job-ps-9' is ps 9" in capsys.readouterr().err
