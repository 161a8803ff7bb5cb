"""A server on port 0 reports its port; a cluster's ps tasks serving in this process.

In-process gRPC on ports the OS picked: ``psframe.Server`` given port 0,
``psframe.local_cluster`` (a Trainer against it matches local torch exactly,
and its servers are stopped on leaving ``with`` and at interpreter exit), and
the ``security=`` argument of ``Server`` and ``Trainer``.

This file holds the unit tier's tests of the subject; `tests/service/test_local_cluster.py`,
`tests/cluster/test_local_cluster.py` hold the other tiers'.
"""

from __future__ import annotations

import pytest

import psframe
from psframe.errors import ClusterSpecError, SecurityConfigError
from tests.service.test_trainer import make_model


def test_a_cluster_address_with_port_0_asks_for_any_free_port():
    cluster = psframe.ClusterSpec({"ps": ["h0:0", "h0:2222"], "worker": ["h1:0", "h1:0"]})  # not "given twice"
    assert cluster.tasks_on_any_port("ps") == [0] and cluster.tasks_on_any_port("worker") == [0, 1]
    bound = cluster.with_task_address("ps", 0, "h0:40123")
    assert bound.to_string() == "ps|h0:40123;h0:2222,worker|h1:0;h1:0"
    assert bound.fingerprint != cluster.fingerprint and cluster.task_address("ps", 0) == "h0:0"
    with pytest.raises(ClusterSpecError, match="given twice"):
        cluster.with_task_address("ps", 0, "h0:2222")


def test_only_a_ps_tasks_own_address_may_have_port_0():
    cluster = psframe.ClusterSpec({"ps": ["127.0.0.1:0", "127.0.0.1:0"], "worker": ["127.0.0.1:0"]})
    with pytest.raises(ClusterSpecError, match=r"/job:ps/task:1 has address '127.0.0.1:0'.*own address"):
        psframe.Server(cluster, "ps", 0, serving_processes=1)


def test_a_worker_given_a_ps_address_with_port_0_is_told_at_once():
    cluster = psframe.ClusterSpec({"ps": ["127.0.0.1:0"], "worker": ["127.0.0.1:0"]})
    with pytest.raises(ClusterSpecError, match=r"/job:ps/task:0 has address '127.0.0.1:0'.*server.*cluster"):
        psframe.Trainer(make_model(), cluster)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_ps": 0}, r"num_ps must be an int >= 1, got 0"),
        ({"num_workers": 1.5}, r"num_workers must be an int >= 1, got 1.5"),
        ({"bind_address": "[::]:0"}, r"sets bind_address itself"),
    ],
)
def test_a_local_cluster_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        psframe.local_cluster(**kwargs)


@pytest.mark.parametrize("owner", ["Server", "Trainer"])
def test_security_of_another_type_is_an_error_and_loose_settings_are_no_arguments(owner, tls_files):
    cluster = psframe.ClusterSpec.from_string("ps|127.0.0.1:0,worker|127.0.0.1:2224")
    with pytest.raises(TypeError, match="unexpected keyword argument 'tls_ca_file'"):
        if owner == "Server":
            psframe.Server(cluster, "ps", 0, serving_processes=1, tls_ca_file=tls_files.ca)
        else:
            psframe.Trainer(make_model(), cluster.with_task_address("ps", 0, "h0:2222"), tls_ca_file=tls_files.ca)
    with pytest.raises(SecurityConfigError, match=rf"{owner}\(security=...\) must be a psframe.Security, got dict"):
        if owner == "Server":
            psframe.Server(cluster, "ps", 0, serving_processes=1, security={"auth_token": "x"})
        else:
            psframe.Trainer(make_model(), cluster.with_task_address("ps", 0, "h0:2222"), security={"auth_token": "x"})
