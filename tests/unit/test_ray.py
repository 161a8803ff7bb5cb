"""psframe.ray: a psframe cluster as Ray actors, on a local Ray instance bound to loopback.

This file holds the unit tier's tests of the subject; `tests/engines/test_ray.py` holds the other
tiers'.
"""

from __future__ import annotations

import pytest

import psframe
from psframe.ray import RayConfigError, TaskContext, run
from tests.support import ray_tasks


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_ps": 0}, r"num_ps must be an int >= 1, got 0"),
        ({"num_workers": True}, r"num_workers must be an int >= 1, got True"),
        ({"placement_strategy": "spread"}, r"placement_strategy must be one of \['SPREAD', 'PACK'.*got 'spread'"),
        ({"resources_per_worker": {}}, r"resources_per_worker must be a non-empty mapping"),
        ({"resources_per_worker": {"CPU": -1}}, r"resources_per_worker\['CPU'\] must be a number >= 0, got -1"),
        ({"resources_per_ps": {"CPU": 0}}, r"resources_per_ps must ask for some resource"),
        ({"timeout": 0}, r"timeout must be a number of seconds > 0, got 0"),
        ({"startup_timeout": float("inf")}, r"startup_timeout must be a number of seconds > 0, got inf"),
    ],
)
def test_bad_arguments_are_refused_before_ray_is_touched(kwargs, match):
    with pytest.raises(RayConfigError, match=match):
        run(ray_tasks.sleep, {"seconds": 0}, **kwargs)


def test_task_context():
    cluster = psframe.ClusterSpec({"ps": ["h0:1"], "worker": ["h1:1", "h1:2"]})
    chief, other, ps = (
        TaskContext(cluster, "worker", 0),
        TaskContext(cluster, "worker", 1),
        TaskContext(cluster, "ps", 0),
    )
    assert (chief.is_chief, other.is_chief, ps.is_chief) == (True, False, False)
    assert (chief.address, other.address, ps.address) == ("h1:1", "h1:2", "h0:1")
