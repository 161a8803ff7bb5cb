"""The CTR example on a stream (``examples/ctr_stream.py``): its events' bytes, its serving factory,
and its flags in the guide.

This file holds the unit tier's tests of the subject; `tests/cluster/test_ctr_stream.py` holds the
other tiers'.
"""

from __future__ import annotations

import ast
import re
import sys

import numpy
import pytest
import torch

import psframe
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "examples"))

import ctr_stream
from ctr_data import CATEGORICAL, DENSE, click_log
from ctr_dist import WideAndDeep


def test_an_event_is_272_bytes_of_numpy_records_that_read_back_bit_for_bit():
    log = click_log(64, buckets=None, seed=0, split=2)
    times = numpy.linspace(1.7e9, 1.7e9 + 1, 64)
    values = ctr_stream.encode(times, log.clicks, log.dense, log.ids)
    assert ctr_stream.EVENT.itemsize == 272 and all(len(v) == 272 for v in values) and len(values) == 64
    assert numpy.frombuffer(values[3][:8], "<f8")[0] == times[3]  # the time first, little-endian: no pickle
    dense, ids, clicks, read_times = ctr_stream.decode(values)
    assert torch.equal(dense, log.dense) and torch.equal(ids, log.ids) and torch.equal(clicks, log.clicks)
    assert dense.dtype == torch.float32 and ids.dtype == torch.int64 and numpy.array_equal(read_times, times)
    assert ids.min() >= 0 and ids.max() > 2**32  # hashed ids kept whole, for the dynamic tables


def test_a_record_that_is_no_event_is_refused_naming_its_size():
    (value,) = ctr_stream.encode(numpy.zeros(1), torch.zeros(1), torch.zeros(1, DENSE), torch.zeros(1, CATEGORICAL))
    with pytest.raises(ValueError, match=r"a click event is 272 bytes; records of \[5\] bytes are not events"):
        ctr_stream.decode([value, b"hello"])


def test_the_serving_factory_serves_the_trained_model_s_parameters_as_click_probabilities():
    log = click_log(16, buckets=None, seed=0, split=1)
    served, to_inputs = ctr_stream.serving(["--embedding_dim=4"])
    trained = ctr_stream.build_model(ctr_stream.parse_args(["--embedding_dim=4"]))
    assert isinstance(served, ctr_stream.ClickProbability) and type(trained) is WideAndDeep
    assert served.state_dict().keys() == trained.state_dict().keys()  # a checkpoint of one loads into the other
    for model in (served, trained):  # rows made here as a ps task makes them: the same for both
        psframe.DynamicTables(model, psframe.optim.Adagrad(lr=0.1))
    with torch.no_grad():
        probabilities = served(*to_inputs({"dense": log.dense.tolist(), "ids": log.ids.tolist()}))
        assert torch.equal(probabilities, torch.sigmoid(trained(log.dense, log.ids)))
    assert probabilities.shape == (16,) and ((probabilities > 0) & (probabilities < 1)).all()
    assert served.deep.embedding_dim == 4  # the factory took the flags after --


@pytest.mark.parametrize(
    "inputs",
    [
        {"dense": [[0.0] * DENSE], "ids": [[1] * (CATEGORICAL - 1)]},
        {"dense": [[0.0] * (DENSE + 1)], "ids": [[1] * CATEGORICAL]},
        {"dense": [[0.0] * DENSE] * 2, "ids": [[1] * CATEGORICAL]},
    ],
    ids=["ids short", "dense long", "rows differ"],
)
def test_a_request_of_the_wrong_shape_is_refused_saying_what_is_expected(inputs):
    with pytest.raises(ValueError, match=r"dense must be n lists of 13 numbers and ids n lists of 26 integers"):
        ctr_stream.to_inputs(inputs)


def test_the_online_guide_lists_every_flag_of_the_stream_example():
    flags = []
    for node in ast.walk(ast.parse((ROOT / "examples" / "ctr_stream.py").read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags += [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
    assert {"--role", "--events_per_second", "--delta_secs", "--idle_timeout"} <= set(flags)
    page = (ROOT / "docs" / "guides" / "online.md").read_text()
    rows = " ".join(line.split("|")[1] for line in page.splitlines() if line.startswith("| `--"))
    missing = [flag for flag in flags if not re.search(rf"`{re.escape(flag)}[`= ]", rows)]
    assert not missing, f"docs/guides/online.md's table of the stream example's flags lacks {missing}"
