"""Unit tests for psframe.cluster: cluster specs, TF_CONFIG, flag resolution, device strings."""

from __future__ import annotations

import copy
import doctest
import json
import pickle
import re

import pytest

from psframe.cluster import (
    JOBS,
    ClusterSpec,
    parse_address,
)
from psframe.cluster import address as address_mod
from psframe.cluster import device_spec as device_spec_mod
from psframe.cluster import spec as cluster_mod
from psframe.cluster import tf_config as tf_config_mod
from psframe.cluster.device_spec import DeviceSpec
from psframe.cluster.tf_config import cluster_from_tf_config, resolve_cluster
from psframe.errors import ClusterSpecError, PsframeError

PS = ["h0:2222", "h0:2223"]
WORKERS = ["h1:2224", "h1:2225"]
SPEC = "ps|h0:2222;h0:2223,worker|h1:2224;h1:2225"


@pytest.fixture
def cluster() -> ClusterSpec:
    return ClusterSpec({"ps": PS, "worker": WORKERS})


def test_jobs_constant():
    assert JOBS == ("ps", "worker")


def test_errors_are_psframe_and_value_errors():
    with pytest.raises(PsframeError):
        parse_address("h0")
    with pytest.raises(ValueError):
        parse_address("h0")


@pytest.mark.parametrize("module", [cluster_mod, address_mod, tf_config_mod, device_spec_mod], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0
    assert result.failed == 0


# ---------------------------------------------------------------- parse_address


@pytest.mark.parametrize(
    "address, expected",
    [
        ("h0:2222", ("h0", 2222)),
        ("1.2.3.4:2222", ("1.2.3.4", 2222)),
        ("[::1]:2222", ("::1", 2222)),
        ("[fe80::1%eth0]:1", ("fe80::1%eth0", 1)),
        ("my-host.example.com:65535", ("my-host.example.com", 65535)),
        ("  h0:2222\t", ("h0", 2222)),
        ("ps_0.svc:8", ("ps_0.svc", 8)),
    ],
)
def test_parse_address(address, expected):
    assert parse_address(address) == expected


@pytest.mark.parametrize(
    "address, match",
    [
        ("h0", r"'h0' has no port"),
        ("h0:abc", r"'h0:abc' has port 'abc'.*1\.\.65535"),
        ("h0:0", r"'h0:0' has port '0'.*1\.\.65535"),
        ("h0:70000", r"'h0:70000' has port '70000'"),
        ("h0:65536", r"'h0:65536' has port '65536'"),
        ("h0:-1", r"'h0:-1' has port '-1'"),
        ("h0:+1", r"'h0:\+1' has port '\+1'"),
        ("h0:", r"'h0:' has port ''"),
        ("h0:²", r"has port '²'"),
        (":2222", r"':2222' has an empty host"),
        ("", r"'' is empty"),
        ("   ", r"'   ' is empty"),
        ("h 0:2222", r"'h 0:2222' contains whitespace"),
        ("h0: 2222", r"'h0: 2222' contains whitespace"),
        ("::1:2222", r"'::1:2222' has more than one ':'.*brackets"),
        ("[::1]", r"'\[::1\]' has no port"),
        ("[::1]2222", r"'\[::1\]2222' has no port"),
        ("[::1:2222", r"'\[::1:2222' opens '\['"),
        ("[]:2222", r"'\[\]:2222' has an empty host"),
        ("[h0]:2222", r"'h0' in brackets; expected an IPv6"),
        ("h0|x:2222", r"host 'h0\|x'"),
        ("h0;h1:2222", r"host 'h0;h1'"),
        ("h0,h1:2222", r"host 'h0,h1'"),
        ("h0/x:2222", r"host 'h0/x'"),
        (2222, r"got int 2222"),
        (None, r"got NoneType None"),
    ],
)
def test_parse_address_errors(address, match):
    with pytest.raises(ClusterSpecError, match=match):
        parse_address(address)


# ---------------------------------------------------------------- ClusterSpec


def test_accessors(cluster):
    assert cluster.jobs == ["ps", "worker"]
    assert cluster.num_ps == 2
    assert cluster.num_workers == 2
    assert cluster.num_tasks("ps") == 2
    assert cluster.num_tasks("worker") == 2
    assert cluster.job_tasks("ps") == PS
    assert cluster.job_tasks("worker") == WORKERS
    assert cluster.task_address("ps", 1) == "h0:2223"
    assert cluster.task_address("worker", 0) == "h1:2224"
    assert cluster.as_dict() == {"ps": PS, "worker": WORKERS}
    assert cluster.to_string() == SPEC
    assert str(cluster) == SPEC
    assert repr(cluster) == f"ClusterSpec('{SPEC}')"


def test_uneven_jobs():
    c = ClusterSpec({"worker": ["w:1", "w:2", "w:3"], "ps": ["p:1"]})
    assert (c.num_ps, c.num_workers) == (1, 3)
    assert c.jobs == ["ps", "worker"]  # JOBS order, whatever the input order
    assert c.to_string() == "ps|p:1,worker|w:1;w:2;w:3"
    assert c.task_address("worker", 2) == "w:3"


def test_tuples_and_index_dicts_are_accepted():
    from_dicts = ClusterSpec({"ps": {1: "h0:2223", 0: "h0:2222"}, "worker": {0: "h1:2224", 1: "h1:2225"}})
    from_tuples = ClusterSpec({"ps": tuple(PS), "worker": tuple(WORKERS)})
    assert from_dicts.job_tasks("ps") == PS  # ordered by index, not by insertion
    assert from_dicts == from_tuples == ClusterSpec({"ps": PS, "worker": WORKERS})


def test_addresses_are_stripped():
    c = ClusterSpec({"ps": [" h0:2222 "], "worker": ["\th1:2224\n"]})
    assert c.as_dict() == {"ps": ["h0:2222"], "worker": ["h1:2224"]}


def test_copy_constructor(cluster):
    other = ClusterSpec(cluster)
    assert other == cluster and other is not cluster


def test_is_immutable(cluster):
    d = cluster.as_dict()
    d["ps"].append("h9:1")
    cluster.job_tasks("worker").append("h9:2")
    cluster.jobs.append("x")
    assert cluster.as_dict() == {"ps": PS, "worker": WORKERS}
    with pytest.raises(AttributeError, match="immutable"):
        cluster._tasks = {}  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cluster.num_ps = 3  # type: ignore[misc]


def test_input_is_copied():
    jobs = {"ps": ["h0:2222"], "worker": ["h1:2224"]}
    c = ClusterSpec(jobs)
    jobs["ps"].append("h0:2223")
    assert c.num_ps == 1


def test_pickle_and_copy(cluster):
    for other in (pickle.loads(pickle.dumps(cluster)), copy.copy(cluster), copy.deepcopy(cluster)):
        assert other == cluster
        assert other.fingerprint == cluster.fingerprint


def test_equality_and_hash(cluster):
    same = ClusterSpec.from_string(SPEC)
    assert cluster == same and hash(cluster) == hash(same)
    assert len({cluster, same}) == 1
    swapped = ClusterSpec({"ps": PS[::-1], "worker": WORKERS})
    assert cluster != swapped
    assert cluster != ClusterSpec({"ps": PS, "worker": WORKERS[:1]})
    assert cluster != cluster.as_dict()  # not equal to a plain dict
    assert cluster != SPEC


def test_fingerprint(cluster):
    fp = cluster.fingerprint
    assert re.fullmatch(r"[0-9a-f]{16}", fp)
    assert ClusterSpec.from_string(SPEC).fingerprint == fp
    assert ClusterSpec.from_hosts(",".join(PS), ",".join(WORKERS)).fingerprint == fp
    assert ClusterSpec({"ps": PS[::-1], "worker": WORKERS}).fingerprint != fp
    assert ClusterSpec({"ps": PS, "worker": ["h1:2224", "h1:2226"]}).fingerprint != fp
    # ps and worker swapped must not collide
    a = ClusterSpec({"ps": ["a:1"], "worker": ["b:1"]})
    b = ClusterSpec({"ps": ["b:1"], "worker": ["a:1"]})
    assert a.fingerprint != b.fingerprint


def test_task_name():
    assert ClusterSpec.task_name("ps", 1) == "/job:ps/task:1"
    assert ClusterSpec.task_name("worker", 0) == "/job:worker/task:0"
    with pytest.raises(ClusterSpecError, match="unknown job 'chief'"):
        ClusterSpec.task_name("chief", 0)
    with pytest.raises(ClusterSpecError, match=">= 0, got -1"):
        ClusterSpec.task_name("ps", -1)


def test_validate_task_accepts_valid(cluster):
    for job in JOBS:
        for i in range(cluster.num_tasks(job)):
            cluster.validate_task(job, i)  # no error


class _Index:
    """An int-like object (like numpy.int64) that only implements __index__."""

    def __index__(self) -> int:
        return 1


def test_task_address_accepts_index_like(cluster):
    assert cluster.task_address("ps", _Index()) == "h0:2223"


@pytest.mark.parametrize(
    "job, index, match",
    [
        ("worker", 2, r"task_index 2 is out of range for job 'worker' with 2 tasks \(expected 0\.\.1\)"),
        ("ps", -1, r"task_index -1 is out of range for job 'ps' with 2 tasks \(expected 0\.\.1\)"),
        ("ps", 99, r"task_index 99 is out of range"),
        ("ps", "1", r"task_index must be an int, got str '1'"),
        ("ps", 1.0, r"task_index must be an int, got float 1\.0"),
        ("ps", True, r"task_index must be an int, got bool True"),
        ("ps", None, r"task_index must be an int, got NoneType None"),
        ("chief", 0, r"unknown job 'chief'.*'ps' and 'worker'.*cluster_from_tf_config"),
        ("evaluator", 0, r"unknown job 'evaluator'; psframe knows only 'ps' and 'worker'"),
        (None, 0, r"job name must be a string.*got NoneType None"),
    ],
)
def test_validate_task_errors(cluster, job, index, match):
    with pytest.raises(ClusterSpecError, match=match):
        cluster.validate_task(job, index)
    with pytest.raises(ClusterSpecError, match=match):
        cluster.task_address(job, index)


def test_single_task_message_is_singular():
    c = ClusterSpec({"ps": ["h0:1"], "worker": ["h1:1"]})
    with pytest.raises(ClusterSpecError, match=r"with 1 task \(expected 0\.\.0\)"):
        c.validate_task("ps", 1)


@pytest.mark.parametrize("method", ["num_tasks", "job_tasks"])
def test_job_accessors_reject_unknown_job(cluster, method):
    with pytest.raises(ClusterSpecError, match=r"unknown job 'chief'"):
        getattr(cluster, method)("chief")


@pytest.mark.parametrize(
    "jobs, match",
    [
        (
            {"ps": ["h0:1"], "worker": ["h1:1"], "chief": ["h2:1"]},
            r"unknown job 'chief'; psframe knows only 'ps' and 'worker'",
        ),
        ({"ps": ["h0:1"], "workers": ["h1:1"]}, r"unknown job 'workers'; psframe knows only 'ps' and 'worker'"),
        ({"ps": ["h0:1"], 1: ["h1:1"]}, r"job name must be a string.*got int 1"),
        ({"ps": ["h0:1"]}, r"no 'worker' job; expected both 'ps' and 'worker', got \['ps'\]"),
        ({"worker": ["h1:1"]}, r"no 'ps' job; expected both"),
        ({}, r"no 'ps' job"),
        ({"ps": [], "worker": ["h1:1"]}, r"job 'ps' has no tasks"),
        ({"ps": ["h0:1"], "worker": []}, r"job 'worker' has no tasks"),
        ({"ps": ["h0:1"], "worker": {}}, r"job 'worker' has no tasks"),
        ({"ps": "h0:1", "worker": ["h1:1"]}, r"job 'ps' must map to a list.*got str 'h0:1'"),
        ({"ps": None, "worker": ["h1:1"]}, r"job 'ps' must map to a list.*got NoneType None"),
        ({"ps": ["h0"], "worker": ["h1:1"]}, r"'h0' has no port"),
        ({"ps": ["h0:1"], "worker": ["h1:99999"]}, r"'h1:99999' has port '99999'"),
        ({"ps": ["h0:1"], "worker": [7]}, r"got int 7"),
        (
            {"ps": {0: "h0:1", 2: "h0:2"}, "worker": ["h1:1"]},
            r"job 'ps' has task indices \[0, 2\]; expected every index 0\.\.1 \(missing \[1\]\)",
        ),
        ({"ps": {1: "h0:1"}, "worker": ["h1:1"]}, r"job 'ps' has task indices \[1\].*missing \[0\]"),
        ({"ps": {"0": "h0:1"}, "worker": ["h1:1"]}, r"job 'ps' maps task indices.*expected int keys, got str '0'"),
        (
            {"ps": ["h0:2222"], "worker": ["h1:1", "h0:2222"]},
            r"'h0:2222' is given twice, to /job:ps/task:0 and /job:worker/task:1",
        ),
        ({"ps": ["h0:1", " h0:1"], "worker": ["h1:1"]}, r"given twice, to /job:ps/task:0 and /job:ps/task:1"),
        ({"ps": ["H0:1"], "worker": ["h0:1"]}, r"'h0:1' is given twice, to /job:ps/task:0 and /job:worker/task:0"),
        (["ps", "worker"], r"a cluster must be a mapping.*got list"),
        (None, r"a cluster must be a mapping.*got NoneType None"),
        ("ps|h0:1,worker|h1:1", r"a cluster must be a mapping.*got str"),
    ],
)
def test_cluster_spec_errors(jobs, match):
    with pytest.raises(ClusterSpecError, match=match):
        ClusterSpec(jobs)


def test_same_host_different_ports_is_fine():
    c = ClusterSpec({"ps": ["localhost:1"], "worker": ["localhost:2", "[::1]:1"]})
    assert c.num_workers == 2


# ---------------------------------------------------------------- from_hosts / from_string


def test_from_hosts_strings_and_lists(cluster):
    assert ClusterSpec.from_hosts("h0:2222,h0:2223", "h1:2224,h1:2225") == cluster
    assert ClusterSpec.from_hosts(PS, WORKERS) == cluster
    assert ClusterSpec.from_hosts(" h0:2222 , h0:2223", tuple(WORKERS)) == cluster


@pytest.mark.parametrize(
    "ps_hosts, worker_hosts, match",
    [
        ("", "h1:1", r"job 'ps' has no tasks"),
        ("h0:1", "  ", r"job 'worker' has no tasks"),
        ("h0:1,", "h1:1", r"--ps_hosts='h0:1,' has an empty address at position 1"),
        ("h0:1", "h1:1,,h1:2", r"--worker_hosts='h1:1,,h1:2' has an empty address at position 1"),
        ("h0:1;h0:2", "h1:1", r"'h0:1;h0:2' has more than one ':'"),
        ("h0:1", "h0:1", r"given twice, to /job:ps/task:0 and /job:worker/task:0"),
        ("h0", "h1:1", r"'h0' has no port"),
        (None, "h1:1", r"--ps_hosts must be comma-separated.*got NoneType None"),
        ("h0:1", 5, r"--worker_hosts must be comma-separated.*got int 5"),
    ],
)
def test_from_hosts_errors(ps_hosts, worker_hosts, match):
    with pytest.raises(ClusterSpecError, match=match):
        ClusterSpec.from_hosts(ps_hosts, worker_hosts)


@pytest.mark.parametrize(
    "spec, expected",
    [
        (SPEC, {"ps": PS, "worker": WORKERS}),
        ("worker|h1:2224;h1:2225,ps|h0:2222;h0:2223", {"ps": PS, "worker": WORKERS}),
        (" ps | h0:2222 ; h0:2223 , worker|h1:2224;h1:2225 ", {"ps": PS, "worker": WORKERS}),
        ("ps|[::1]:1,worker|[::1]:2", {"ps": ["[::1]:1"], "worker": ["[::1]:2"]}),
    ],
)
def test_from_string(spec, expected):
    c = ClusterSpec.from_string(spec)
    assert c.as_dict() == expected
    assert c.to_string() == ",".join(f"{j}|{';'.join(expected[j])}" for j in JOBS)


@pytest.mark.parametrize(
    "jobs",
    [
        {"ps": PS, "worker": WORKERS},
        {"ps": ["a:1"], "worker": ["b:1", "c:1", "d:1"]},
        {"ps": ["[::1]:1", "[fe80::2%eth0]:3"], "worker": ["10.0.0.1:5"]},
    ],
)
def test_round_trips(jobs):
    c = ClusterSpec(jobs)
    assert ClusterSpec.from_string(c.to_string()) == c
    assert ClusterSpec(c.as_dict()) == c
    assert ClusterSpec.from_hosts(",".join(jobs["ps"]), ",".join(jobs["worker"])) == c
    assert repr(c) == f"ClusterSpec({c.to_string()!r})"


@pytest.mark.parametrize(
    "spec, match",
    [
        ("ps:h0:1,worker|h1:1", r"has 'ps:h0:1' without '\|'"),
        ("ps|h0:1,worker", r"has 'worker' without '\|'"),
        ("ps|h0:1,worker|h1:1,", r"has '' without '\|'"),
        ("|h0:1,worker|h1:1", r"has '\|h0:1' with an empty job name"),
        ("ps|h0:1,ps|h0:2,worker|h1:1", r"gives job 'ps' twice"),
        ("ps|,worker|h1:1", r"gives job 'ps' no addresses; expected 'ps\|host:port;host:port'"),
        ("ps|h0:1,worker| ", r"gives job 'worker' no addresses"),
        ("ps|h0:1;;h0:2,worker|h1:1", r"empty address at position 1 of job 'ps'"),
        ("ps|h0:1;,worker|h1:1", r"empty address at position 1 of job 'ps'"),
        ("ps|h0:1,worker|h1:1,chief|h2:1", r"unknown job 'chief'"),
        ("ps|h0:1", r"no 'worker' job"),
        ("ps|h0:1,worker|h1", r"'h1' has no port"),
        ("ps|h0:1,worker|h0:1", r"given twice, to /job:ps/task:0 and /job:worker/task:0"),
        ("", r"cluster spec '' is empty"),
        (None, r"must be a string.*got NoneType None"),
    ],
)
def test_from_string_errors(spec, match):
    with pytest.raises(ClusterSpecError, match=match):
        ClusterSpec.from_string(spec)


# ---------------------------------------------------------------- TF_CONFIG


def _tf(cluster: dict, task: dict | None = None) -> str:
    config: dict = {"cluster": cluster}
    if task is not None:
        config["task"] = task
    return json.dumps(config)


@pytest.mark.parametrize("as_text", [True, False])
def test_tf_config_plain(as_text):
    config = {"cluster": {"ps": PS, "worker": WORKERS}, "task": {"type": "worker", "index": 1}}
    cluster, job, index = cluster_from_tf_config(json.dumps(config) if as_text else config)
    assert cluster == ClusterSpec({"ps": PS, "worker": WORKERS})
    assert (job, index) == ("worker", 1)


def test_tf_config_ps_task():
    _, job, index = cluster_from_tf_config(_tf({"ps": PS, "worker": WORKERS}, {"type": "ps", "index": 1}))
    assert (job, index) == ("ps", 1)


@pytest.mark.parametrize("task", [None, {}])
def test_tf_config_without_task(task):
    config = {"cluster": {"ps": PS, "worker": WORKERS}}
    if task is not None:
        config["task"] = task
    assert cluster_from_tf_config(json.dumps(config)) == (ClusterSpec({"ps": PS, "worker": WORKERS}), None, None)


@pytest.mark.parametrize(
    "task, expected",
    [
        ({"type": "chief", "index": 0}, ("worker", 0)),
        ({"type": "worker", "index": 0}, ("worker", 1)),
        ({"type": "worker", "index": 1}, ("worker", 2)),
        ({"type": "ps", "index": 1}, ("ps", 1)),
    ],
)
def test_tf_config_chief_is_worker_zero(task, expected):
    text = _tf({"chief": ["c:1"], "ps": PS, "worker": WORKERS}, task)
    cluster, job, index = cluster_from_tf_config(text)
    assert cluster.as_dict() == {"ps": PS, "worker": ["c:1", *WORKERS]}
    assert (job, index) == expected
    assert (
        cluster.task_address(job, index)
        == {"chief": "c:1", "worker": WORKERS[task["index"]], "ps": PS[task["index"]]}[task["type"]]
    )


def test_tf_config_chief_only():
    cluster, job, index = cluster_from_tf_config(_tf({"chief": ["c:1"], "ps": PS}, {"type": "chief", "index": 0}))
    assert cluster.job_tasks("worker") == ["c:1"]
    assert (job, index) == ("worker", 0)


def test_tf_config_from_env(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _tf({"ps": PS, "worker": WORKERS}, {"type": "ps", "index": 0}))
    assert cluster_from_tf_config() == (ClusterSpec({"ps": PS, "worker": WORKERS}), "ps", 0)
    monkeypatch.setenv(
        "TF_CONFIG", _tf({"chief": ["c:1"], "ps": PS, "worker": WORKERS}, {"type": "worker", "index": 1})
    )
    cluster, job, index = cluster_from_tf_config()
    assert (cluster.num_workers, job, index) == (3, "worker", 2)


def test_tf_config_unset(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ClusterSpecError, match="TF_CONFIG is not set"):
        cluster_from_tf_config()


def test_tf_config_empty_env(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "  ")
    with pytest.raises(ClusterSpecError, match=r"TF_CONFIG is empty \('  '\)"):
        cluster_from_tf_config()


@pytest.mark.parametrize(
    "tf_config, match",
    [
        ("", r"TF_CONFIG is empty"),
        ("{not json", r"TF_CONFIG is not valid JSON.*'\{not json'"),
        ("[1, 2]", r"TF_CONFIG must be a JSON object.*got list \[1, 2\]"),
        ('{"task": {"type": "ps", "index": 0}}', r"TF_CONFIG has no \"cluster\" key; found keys \['task'\]"),
        ('{"cluster": ["h0:1"]}', r"\"cluster\" must be an object.*got list"),
        (_tf({"ps": PS}), r"TF_CONFIG: the cluster has no 'worker' job"),
        (_tf({"ps": PS, "worker": WORKERS, "tpu_worker": ["e:1"]}), r"TF_CONFIG: unknown job 'tpu_worker'"),
        (_tf({"ps": ["h0"], "worker": WORKERS}), r"TF_CONFIG: task address 'h0' has no port"),
        (
            _tf({"chief": ["c:1", "c:2"], "ps": PS, "worker": WORKERS}),
            r"'chief' must list exactly one address.*'c:1', 'c:2'",
        ),
        (_tf({"chief": [], "ps": PS, "worker": WORKERS}), r"'chief' must list exactly one address, got list \[\]"),
        (_tf({"chief": "c:1", "ps": PS, "worker": WORKERS}), r"'chief' must list exactly one address, got str 'c:1'"),
        (
            _tf({"chief": ["c:1"], "ps": PS, "worker": "w:1"}),
            r"job 'worker' must be a list of addresses, got str 'w:1'",
        ),
        (
            _tf({"chief": ["h1:2224"], "ps": PS, "worker": WORKERS}),
            r"given twice, to /job:worker/task:0 and /job:worker/task:1",
        ),
        (
            _tf({"ps": PS, "worker": WORKERS}, {"type": "chief", "index": 0}),
            r"task type 'chief' is not a job of the cluster; expected one of \['ps', 'worker', 'evaluator'\]",
        ),
        (
            _tf({"ps": PS, "worker": WORKERS, "evaluator": ["e:1"]}, {"type": "evaluator", "index": 1}),
            r"task index 1 is out of range for job 'evaluator' with 1 task",
        ),
        (
            _tf({"ps": PS, "worker": WORKERS}, {"type": "evaluator", "index": -1}),
            r"task index -1 of the evaluator must be >= 0",
        ),
        (_tf({"chief": ["c:1"], "master": ["m:1"], "ps": PS, "worker": WORKERS}), r"both a 'chief' and a 'master' job"),
        (_tf({"master": ["m:1", "m:2"], "ps": PS, "worker": WORKERS}), r"job 'master' must list exactly one address"),
        (
            _tf({"master": ["m:1"], "ps": PS, "worker": WORKERS}, {"type": "chief", "index": 0}),
            r"task type 'chief' is not a job of the cluster; expected one of \['master', 'ps', 'worker', 'evaluator'\]",
        ),
        (
            '{"sparseCluster": {"ps": ["h0:1"], "worker": {"1": "h1:1"}}, "task": {"type": "worker", "index": 1}}',
            r"\"sparseCluster\".*enableDynamicWorker",
        ),
        (_tf({"ps": PS, "worker": WORKERS}, {"index": 0}), r"task type None is not a job"),
        (_tf({"ps": PS, "worker": WORKERS}, {"type": "worker"}), r"has no \"index\""),
        (
            _tf({"ps": PS, "worker": WORKERS}, {"type": "worker", "index": "1"}),
            r"task index must be an int, got str '1'",
        ),
        (
            _tf({"ps": PS, "worker": WORKERS}, {"type": "worker", "index": True}),
            r"task index must be an int, got bool True",
        ),
        (
            _tf({"ps": PS, "worker": WORKERS}, {"type": "worker", "index": 2}),
            r"task index 2 is out of range for job 'worker' with 2 tasks \(expected 0\.\.1\)",
        ),
        (
            _tf({"ps": PS, "worker": WORKERS}, {"type": "ps", "index": -1}),
            r"task index -1 is out of range for job 'ps'",
        ),
        (
            _tf({"chief": ["c:1"], "ps": PS, "worker": WORKERS}, {"type": "worker", "index": 2}),
            r"task index 2 is out of range for job 'worker' with 2 tasks",
        ),
        (
            _tf({"chief": ["c:1"], "ps": PS, "worker": WORKERS}, {"type": "chief", "index": 1}),
            r"task index 1 is out of range for job 'chief' with 1 task \(expected 0\.\.0\)",
        ),
        (_tf({"ps": PS, "worker": WORKERS}, "worker:0"), r"\"task\" must be an object.*got str 'worker:0'"),
        (42, r"TF_CONFIG must be a JSON object.*got int 42"),
    ],
)
def test_tf_config_errors(tf_config, match):
    with pytest.raises(ClusterSpecError, match=match):
        cluster_from_tf_config(tf_config)


def test_tf_config_json_error_is_chained():
    with pytest.raises(ClusterSpecError) as info:
        cluster_from_tf_config("{")
    assert isinstance(info.value.__cause__, json.JSONDecodeError)


# ---------------------------------------------------------------- resolve_cluster

TF_ENV = {"TF_CONFIG": _tf({"ps": ["t0:1", "t0:2"], "worker": ["t1:1", "t1:2"]}, {"type": "worker", "index": 1})}
EXPECTED = ClusterSpec({"ps": PS, "worker": WORKERS})


def test_resolve_from_hosts():
    assert resolve_cluster(",".join(PS), ",".join(WORKERS), job_name="ps", task_index=1, environ={}) == (
        EXPECTED,
        "ps",
        1,
    )


def test_resolve_from_cluster_spec():
    assert resolve_cluster(cluster_spec=SPEC, job_name="worker", task_index=0, environ={}) == (EXPECTED, "worker", 0)


def test_resolve_from_tf_config():
    cluster, job, index = resolve_cluster(environ=TF_ENV)
    assert cluster.as_dict() == {"ps": ["t0:1", "t0:2"], "worker": ["t1:1", "t1:2"]}
    assert (job, index) == ("worker", 1)


def test_resolve_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", TF_ENV["TF_CONFIG"])
    assert resolve_cluster()[1:] == ("worker", 1)


def test_resolve_flags_win_over_tf_config():
    # The cluster and the task both come from the flags; TF_CONFIG is not even read.
    assert resolve_cluster(cluster_spec=SPEC, job_name="ps", task_index=0, environ=TF_ENV) == (EXPECTED, "ps", 0)
    assert resolve_cluster(",".join(PS), ",".join(WORKERS), job_name="worker", task_index=1, environ=TF_ENV) == (
        EXPECTED,
        "worker",
        1,
    )
    bad_env = {"TF_CONFIG": "{not json"}
    assert resolve_cluster(cluster_spec=SPEC, job_name="ps", task_index=0, environ=bad_env)[0] == EXPECTED


def test_resolve_flags_do_not_take_task_from_tf_config():
    with pytest.raises(ClusterSpecError, match=r"no job name; give --job_name.*cluster from --cluster_spec"):
        resolve_cluster(cluster_spec=SPEC, environ=TF_ENV)


@pytest.mark.parametrize(
    "job_name, task_index, expected",
    [
        ("ps", None, ("ps", 1)),  # job from the flag, index from TF_CONFIG
        (None, 0, ("worker", 0)),  # job from TF_CONFIG, index from the flag
        ("ps", 0, ("ps", 0)),
        ("", None, ("worker", 1)),  # argparse default '' counts as not given
    ],
)
def test_resolve_explicit_task_overrides_tf_config(job_name, task_index, expected):
    _, job, index = resolve_cluster(job_name=job_name, task_index=task_index, environ=TF_ENV)
    assert (job, index) == expected


def test_resolve_explicit_task_is_validated_against_tf_cluster():
    env = {"TF_CONFIG": _tf({"ps": ["t0:1"], "worker": ["t1:1", "t1:2"]}, {"type": "worker", "index": 1})}
    with pytest.raises(ClusterSpecError, match=r"task_index 1 is out of range for job 'ps' with 1 task"):
        resolve_cluster(job_name="ps", environ=env)


def test_resolve_tf_config_chief():
    env = {"TF_CONFIG": _tf({"chief": ["c:1"], "ps": PS, "worker": WORKERS}, {"type": "chief", "index": 0})}
    cluster, job, index = resolve_cluster(environ=env)
    assert (job, index, cluster.task_address(job, index)) == ("worker", 0, "c:1")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(ps_hosts="h0:1", job_name="ps", task_index=0), r"--ps_hosts was given without --worker_hosts"),
        (dict(worker_hosts="h1:1", job_name="ps", task_index=0), r"--worker_hosts was given without --ps_hosts"),
        (
            dict(ps_hosts="h0:1", worker_hosts="h1:1", cluster_spec=SPEC, job_name="ps", task_index=0),
            r"either --ps_hosts/--worker_hosts or --cluster_spec, not both.*--cluster_spec='ps\|",
        ),
        (
            dict(job_name="ps", task_index=0),
            r"no cluster is defined; give --ps_hosts and --worker_hosts, or --cluster_spec, or set TF_CONFIG",
        ),
        (dict(ps_hosts="", worker_hosts="", cluster_spec="", job_name="ps", task_index=0), r"no cluster is defined"),
        (dict(cluster_spec=SPEC, task_index=0), r"no job name; give --job_name \('ps' and 'worker'\)"),
        (dict(cluster_spec=SPEC, job_name="worker"), r"no task index for job 'worker'; give --task_index"),
        (
            dict(cluster_spec=SPEC, job_name="worker", task_index=2),
            r"task_index 2 is out of range for job 'worker' with 2 tasks",
        ),
        (dict(cluster_spec=SPEC, job_name="worker", task_index=-1), r"task_index -1 is out of range"),
        (dict(cluster_spec=SPEC, job_name="chief", task_index=0), r"unknown job 'chief'"),
        (dict(cluster_spec=SPEC, job_name="worker", task_index="0"), r"task_index must be an int, got str '0'"),
        (dict(cluster_spec="ps|h0:1", job_name="ps", task_index=0), r"no 'worker' job"),
        (dict(ps_hosts="h0:1", worker_hosts="h0:1", job_name="ps", task_index=0), r"given twice"),
    ],
)
def test_resolve_errors(kwargs, match):
    with pytest.raises(ClusterSpecError, match=match):
        resolve_cluster(environ={}, **kwargs)


@pytest.mark.parametrize("value", ["", "   "])
def test_resolve_empty_tf_config_means_no_cluster(value):
    with pytest.raises(ClusterSpecError, match=r"no cluster is defined.*set TF_CONFIG"):
        resolve_cluster(job_name="ps", task_index=0, environ={"TF_CONFIG": value})


def test_resolve_bad_tf_config_is_reported():
    with pytest.raises(ClusterSpecError, match=r"TF_CONFIG is not valid JSON"):
        resolve_cluster(environ={"TF_CONFIG": "{"})
    env = {"TF_CONFIG": _tf({"ps": PS, "worker": WORKERS})}  # no task, none given
    with pytest.raises(ClusterSpecError, match=r"no job name.*cluster from TF_CONFIG"):
        resolve_cluster(environ=env)


# ---------------------------------------------------------------- DeviceSpec


@pytest.mark.parametrize(
    "spec, expected, canonical",
    [
        ("", DeviceSpec(), ""),
        ("/job:ps", DeviceSpec(job="ps"), "/job:ps"),
        ("/job:ps/task:1", DeviceSpec(job="ps", task=1), "/job:ps/task:1"),
        (
            "/job:worker/replica:0/task:0/device:GPU:0",
            DeviceSpec("worker", 0, 0, "GPU", 0),
            "/job:worker/replica:0/task:0/device:GPU:0",
        ),
        ("/task:3/job:ps", DeviceSpec(job="ps", task=3), "/job:ps/task:3"),
        (
            "/gpu:1/job:worker/task:0",
            DeviceSpec(job="worker", task=0, device_type="GPU", device_index=1),
            "/job:worker/task:0/device:GPU:1",
        ),
        ("/cpu:0", DeviceSpec(device_type="CPU", device_index=0), "/device:CPU:0"),
        ("/CPU:2", DeviceSpec(device_type="CPU", device_index=2), "/device:CPU:2"),
        ("/cuda:1", DeviceSpec(device_type="GPU", device_index=1), "/device:GPU:1"),
        ("/device:gpu:3", DeviceSpec(device_type="GPU", device_index=3), "/device:GPU:3"),
        ("/device:cuda:0", DeviceSpec(device_type="GPU", device_index=0), "/device:GPU:0"),
        ("/device:CPU:*", DeviceSpec(device_type="CPU"), "/device:CPU"),
        ("/device:CPU", DeviceSpec(device_type="CPU"), "/device:CPU"),
        ("/gpu:*", DeviceSpec(device_type="GPU"), "/device:GPU"),
        ("/replica:2", DeviceSpec(replica=2), "/replica:2"),
        ("/task:10", DeviceSpec(task=10), "/task:10"),
        ("/job:localhost/task:0", DeviceSpec(job="localhost", task=0), "/job:localhost/task:0"),
    ],
)
def test_device_parse(spec, expected, canonical):
    parsed = DeviceSpec.parse(spec)
    assert parsed == expected
    assert parsed.to_string() == canonical
    assert str(parsed) == canonical
    assert DeviceSpec.parse(canonical) == parsed  # round trip


def test_device_fields_and_hashable():
    d = DeviceSpec.parse("/job:ps/replica:1/task:2/device:GPU:3")
    assert (d.job, d.replica, d.task, d.device_type, d.device_index) == ("ps", 1, 2, "GPU", 3)
    assert DeviceSpec.parse("") == DeviceSpec(None, None, None, None, None)
    assert len({d, DeviceSpec.parse("/device:GPU:3/task:2/replica:1/job:ps")}) == 1
    with pytest.raises(AttributeError):
        d.task = 5  # type: ignore[misc]


def test_device_constructor_normalises():
    assert DeviceSpec(device_type="cuda", device_index=0).device_type == "GPU"
    assert DeviceSpec(device_type="cpu").device_type == "CPU"
    assert DeviceSpec(task=_Index()).task == 1
    assert type(DeviceSpec(task=_Index()).task) is int


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(task=-1), r"device task must be >= 0, got -1"),
        (dict(replica="0"), r"device replica must be an int, got str '0'"),
        (dict(device_type="GPU", device_index=True), r"device device_index must be an int, got bool True"),
        (dict(device_type="TPU"), r"device type must be 'CPU' or 'GPU'.*got str 'TPU'"),
        (dict(device_type=0), r"device type must be 'CPU' or 'GPU'.*got int 0"),
        (dict(device_index=0), r"device_index 0 needs a device_type"),
        (dict(job=""), r"device job must be a name.*got str ''"),
        (dict(job="p/s"), r"device job must be a name.*got str 'p/s'"),
        (dict(job=1), r"device job must be a name.*got int 1"),
    ],
)
def test_device_constructor_errors(kwargs, match):
    with pytest.raises(ClusterSpecError, match=match):
        DeviceSpec(**kwargs)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("job:ps/task:0", r"device 'job:ps/task:0' must start with '/'"),
        ("ps", r"device 'ps' must start with '/'"),
        ("/job:ps/tsk:0", r"unknown component 'tsk:0'"),
        ("/tpu:0", r"unknown component 'tpu:0'"),
        ("/job:ps/", r"unknown component ''"),
        ("//job:ps", r"unknown component ''"),
        ("/", r"unknown component ''"),
        ("/job:ps/task:x", r"has 'task:x'; expected a non-negative integer, got 'x'"),
        ("/job:ps/task:-1", r"has 'task:-1'; expected a non-negative integer, got '-1'"),
        ("/replica:1.5", r"has 'replica:1\.5'; expected a non-negative integer"),
        ("/task:*", r"has 'task:\*'; expected a non-negative integer"),
        ("/gpu:a", r"has 'gpu:a'; expected a non-negative integer, got 'a'"),
        ("/device:GPU:-1", r"has 'device:GPU:-1'; expected a non-negative integer, got '-1'"),
        ("/device:TPU:0", r"device type 'TPU'; expected 'CPU' or 'GPU'"),
        ("/job:", r"has 'job:' without a value"),
        ("/task", r"has 'task' without a value"),
        ("/device", r"has 'device' without a value"),
        ("/job:ps/job:worker", r"gives the job twice \(again in 'job:worker'\)"),
        ("/task:0/task:0", r"gives the task twice"),
        ("/replica:0/replica:1", r"gives the replica twice"),
        ("/cpu:0/device:GPU:0", r"gives the device twice \(again in 'device:GPU:0'\)"),
        ("/gpu:0/gpu:1", r"gives the device twice"),
        ("/job:p s", r"device job must be a name.*'p s'"),
        (None, r"must be a string.*got NoneType None"),
    ],
)
def test_device_parse_errors(spec, match):
    with pytest.raises(ClusterSpecError, match=match):
        DeviceSpec.parse(spec)


@pytest.mark.parametrize(
    "spec",
    ["", "/job:ps", "/job:ps/task:1", "/job:worker/task:1/device:GPU:0", "/cpu:0", "/job:worker/replica:0/task:0"],
)
def test_device_validate_ok(cluster, spec):
    DeviceSpec.parse(spec).validate(cluster)  # no error


@pytest.mark.parametrize(
    "spec, match",
    [
        ("/job:ps/task:2", r"'/job:ps/task:2': task 2 is out of range for job 'ps' with 2 tasks \(expected 0\.\.1\)"),
        ("/job:worker/task:9", r"task 9 is out of range for job 'worker'"),
        ("/job:chief/task:0", r"names job 'chief'; the cluster has jobs \['ps', 'worker'\]"),
        ("/job:localhost", r"names job 'localhost'"),
        ("/task:0", r"'/task:0' names a task but no job; expected e\.g\. '/job:ps/task:0'"),
    ],
)
def test_device_validate_errors(cluster, spec, match):
    with pytest.raises(ClusterSpecError, match=match):
        DeviceSpec.parse(spec).validate(cluster)
