"""psframe serve through its HTTP API, on a real server (uvicorn on a free loopback port, in this
process) following checkpoints that real training runs write.

Oracles: the rows and parameters served after following N deltas are bit for bit
:func:`psframe.export.export_checkpoint` of the checkpoint at that step; a prediction is the
forward of the model loaded from the checkpoint with :func:`psframe.worker.model_state.load_model_state`;
lookups while versions switch never see rows of two versions (every row of a version equals its
step); a damaged delta is refused and said in the status while the last good version serves on;
a server started again on the same folder serves the same bits.

This file holds the service tier's tests of the subject; `tests/unit/test_serve.py` and
`tests/cluster/test_serve.py` hold the other tiers'.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
import torch

import psframe
from psframe.export import export_checkpoint
from psframe.serve.model import ModelFactory
from psframe.serve.process import ServeProcess
from psframe.worker.model_state import load_model_state
from tests.conftest import free_cluster
from tests.support.serve_jobs import (
    COUNTED_IDS,
    Counter,
    Ranker,
    Saved,
    batch,
    call,
    committed,
    count_step,
    publish,
    ranker,
    status_at,
    train_ranker,
    wait_for,
)

POLL_SECONDS = 0.02


@pytest.fixture(scope="module")
def ranker_run(tmp_path_factory) -> list[Saved]:
    """A run on two ps tasks (gRPC, this process): a full checkpoint and deltas, twice over, and a full one."""
    train_dir = str(tmp_path_factory.mktemp("serve") / "train")
    cluster = free_cluster(2, 1)
    servers = [psframe.Server(cluster, "ps", i, serving_processes=1) for i in range(2)]
    try:
        model = Ranker()
        checkpointing = psframe.Checkpointing(train_dir, save_steps=10**6, keep=10)
        with psframe.Trainer(model, cluster, optimizer=psframe.optim.SGD(lr=0.5), checkpointing=checkpointing) as t:
            for step in range(11):
                train_ranker(t, model, range(step, step + 1))
                if step in (1, 6, 10):
                    t.save_checkpoint()
                elif step > 1:
                    t.save_delta()
    finally:
        for server in servers:
            server.stop(grace=0.1)
    saved = committed(train_dir)
    assert [s.kind for s in saved] == ["full", *["delta"] * 4, "full", *["delta"] * 3, "full"]
    return saved


def rows_of(url: str, table: str, ids: list[int]) -> dict:
    code, answer = call(url, "/v1/lookup", {"table": table, "ids": ids})
    assert code == 200, answer
    return answer


def served_as_snapshot_of(url: str, expected: psframe.export.Snapshot) -> None:
    """Every parameter and row the server answers is ``expected``'s, bit for bit (floats through JSON)."""
    code, params = call(url, "/v1/params")
    assert code == 200 and params["step"] == expected.step
    assert sorted(params["dense"]) == sorted(expected.dense) and sorted(params["tables"]) == sorted(expected.tables)
    for name, value in expected.dense.items():
        code, answer = call(url, "/v1/dense", {"name": name})
        assert code == 200 and answer["step"] == expected.step and answer["shape"] == list(value.shape)
        assert torch.equal(torch.tensor(answer["values"], dtype=value.dtype), value), name
    for name, table in expected.tables.items():
        absent = [7, 11]  # never trained: no row
        answer = rows_of(url, name, [*table.ids.tolist(), *absent])
        assert answer["step"] == expected.step and answer["missing"] == absent
        assert answer["rows"][len(table) :] == [None, None]
        got = torch.tensor(answer["rows"][: len(table)], dtype=table.rows.dtype).reshape(table.rows.shape)
        assert torch.equal(got, table.rows), name


def test_a_server_follows_full_and_delta_checkpoints_serving_their_exports_bit_for_bit(ranker_run, tmp_path):
    served_dir = tmp_path / "served"
    served_dir.mkdir()
    train_dir = ranker_run[0].manifest.url
    with ServeProcess(str(served_dir), models=ModelFactory.of(ranker()), poll_seconds=POLL_SECONDS) as served:
        code, answer = call(served.url, "/v1/lookup", {"table": "users", "ids": [1]})
        assert code == 503 and "no version is served yet" in answer["error"]
        for k, saved in enumerate(ranker_run):
            publish(saved, served_dir)
            status = wait_for(f"serving step {saved.step}", status_at(served.url, saved.step))
            base = max(i for i in range(k + 1) if ranker_run[i].kind == "full")
            assert (status["version"], status["base_step"], status["deltas_applied"]) == (
                k + 1,
                ranker_run[base].step,
                k - base,
            )
            assert (status["behind"], status["lag_seconds"], status["refused"]) == (0, 0.0, 0)
            served_as_snapshot_of(served.url, export_checkpoint(train_dir, saved.step))
            # A prediction is the forward of the model loaded from the checkpoint itself.
            expected = Ranker()
            load_model_state(expected, psframe.checkpoint.load(train_dir, saved.step))
            expected.eval()
            users, items, _ = batch(saved.step + 100)  # ids held and ids not held (their initial rows)
            code, answer = call(
                served.url, "/v1/predict", {"inputs": {"users": users.tolist(), "items": items.tolist()}}
            )
            assert code == 200 and answer["step"] == saved.step, answer
            with torch.no_grad():
                assert answer["outputs"] == expected(users, items).tolist()


def test_bad_requests_are_answered_with_what_was_expected(ranker_run, tmp_path):
    served_dir = tmp_path / "served"
    served_dir.mkdir()
    publish(ranker_run[0], served_dir)
    with ServeProcess(str(served_dir), models=ModelFactory.of(ranker()), poll_seconds=POLL_SECONDS) as served:
        url = served.url
        wait_for("the first version", status_at(url, ranker_run[0].step))
        for path, body, code, message in (
            (
                "/v1/lookup",
                {"table": "items", "ids": [1]},
                404,
                r"no dynamic table 'items'; the tables served are \['users'\]",
            ),
            (
                "/v1/lookup",
                {"table": "users", "ids": "7"},
                400,
                "'ids' must be a list of integers \\(int64\\), got a JSON str",
            ),
            ("/v1/lookup", {"table": "users", "ids": [1, 2.5]}, 400, r"ids\[1\] is 2.5"),
            ("/v1/lookup", {"table": "users", "ids": [True]}, 400, r"ids\[0\] is true"),
            ("/v1/lookup", {"table": "users", "ids": [2**63]}, 400, r"ids\[0\] is 9223372036854775808"),
            ("/v1/lookup", {"table": "users", "id": [1]}, 400, r"unknown fields \['id'\]: the body must be"),
            ("/v1/lookup", {"ids": [1]}, 400, "'table' must be a non-empty string, got nothing"),
            ("/v1/lookup", [1], 400, "must be a JSON object .* got a JSON list"),
            ("/v1/lookup", {"table": "users", "ids": list(range(100_001))}, 413, "at most 100000 in one request"),
            ("/v1/dense", {"name": "head.w"}, 404, r"no parameter 'head.w'; the parameters served are \["),
            ("/v1/dense", {"name": "head.bias", "rows": [1]}, 400, r"rows \[1\] are out of range"),
            ("/v1/predict", {"inputs": {"users": [[1]]}}, 400, "to_inputs refused the inputs: 'items'"),
            ("/v1/predict", {"inputs": {"users": [[1]], "items": [1, 2]}}, 400, "forward refused the inputs"),
            ("/v1/predict", {}, 400, "the model's inputs are missing"),
            ("/v1/nothing", None, 404, "no such route: GET /v1/nothing; the API is GET /v1/status"),
        ):
            got, answer = call(url, path, body)
            assert got == code and set(answer) == {"error"}, (path, body, answer)
            assert re.search(message, answer["error"]), (path, answer["error"])
        got, answer = call(url, "/v1/lookup", raw=b"{not json")
        assert got == 400 and "it is not JSON" in answer["error"]
        got, answer = call(url, "/v1/status", method="DELETE")
        assert got == 405 and "DELETE is not allowed here" in answer["error"]
        got, answer = call(url, "/v1/dense", {"name": "items.weight", "rows": [3, 0]})
        assert got == 200 and answer["shape"] == [2, 4] and len(answer["values"]) == 2
    with ServeProcess(str(served_dir), poll_seconds=POLL_SECONDS) as served:  # no --model
        wait_for("the first version", status_at(served.url, ranker_run[0].step))
        got, answer = call(served.url, "/v1/predict", {"inputs": []})
        assert got == 404 and "serves no model: start psframe serve with --model" in answer["error"]


def test_lookups_while_versions_switch_never_see_rows_of_two_versions(local_cluster, tmp_path):
    cluster = local_cluster(num_ps=2, num_workers=1)
    train_dir = str(tmp_path / "train")
    model = Counter()
    ids = COUNTED_IDS.tolist()
    answers: list[tuple[int, int, set[float], list[int], list[float]]] = []
    done = threading.Event()
    last: list[int] = []  # the last step trained, once done

    def read(url: str) -> None:
        for _ in range(2000):  # bounded in count; ends once the last step is seen
            code, answer = call(url, "/v1/lookup", {"table": "users", "ids": ids})
            _, bias = call(url, "/v1/dense", {"name": "bias"})
            if code == 200:
                values = {x for row in answer["rows"] if row is not None for x in row}
                answers.append(
                    (answer["version"], answer["step"], values, answer["missing"], [bias["step"], *bias["values"]])
                )
            if done.is_set() and code == 200 and answer["step"] == last[0]:
                return

    checkpointing = psframe.Checkpointing(train_dir, save_steps=8, delta_steps=1, keep=3)
    with psframe.Trainer(model, cluster, optimizer=psframe.optim.SGD(lr=1.0), checkpointing=checkpointing) as trainer:
        count_step(trainer, model)  # the first checkpoint comes with the first step
        with ServeProcess(train_dir, poll_seconds=0.01) as served:
            wait_for("a first version", lambda: call(served.url, "/v1/status")[1].get("step"))
            readers = [threading.Thread(target=read, args=(served.url,)) for _ in range(3)]
            for reader in readers:
                reader.start()
            for _ in range(24):
                count_step(trainer, model)
            trainer.save_delta()
            last.append(trainer.global_step)
            done.set()
            for reader in readers:
                reader.join(timeout=120)
            assert not any(reader.is_alive() for reader in readers)
    torn = [(v, s, values) for v, s, values, missing, _ in answers if values != {float(s)} or missing]
    assert not torn, f"rows of another version than the answer's step: {torn[:3]}"
    assert all(bias[1] == float(bias[0]) for *_, bias in answers)
    versions = {v for v, *_ in answers}
    assert len(versions) >= 2 and max(s for _, s, *_ in answers) == last[0], sorted(versions)


def test_a_damaged_delta_is_refused_serving_goes_on_and_a_restart_comes_back_from_the_files(ranker_run, tmp_path):
    served_dir = tmp_path / "served"
    served_dir.mkdir()
    train_dir = ranker_run[0].manifest.url
    first, delta, damaged, after, full = ranker_run[0], ranker_run[1], ranker_run[2], ranker_run[3], ranker_run[5]
    with ServeProcess(str(served_dir), poll_seconds=POLL_SECONDS) as served:
        publish(first, served_dir)
        publish(delta, served_dir)
        wait_for("the good delta", status_at(served.url, delta.step))
        publish(damaged, served_dir, damage="flip")

        def refused() -> dict | None:
            status = call(served.url, "/v1/status")[1]
            return status if status["last_refused"] is not None else None

        status = wait_for("the damaged delta refused", refused)
        assert (status["step"], status["refused"]) == (delta.step, 1)
        assert status["last_refused"]["step"] == damaged.step and status["last_refused"]["kind"] == "delta"
        assert "is corrupt: sha256" in status["last_refused"]["reason"]
        publish(after, served_dir)  # follows the damaged delta: the version stays, one more behind
        wait_for("the next delta seen", lambda: call(served.url, "/v1/status")[1]["behind"] == 2)
        served_as_snapshot_of(served.url, export_checkpoint(train_dir, delta.step))
        publish(full, served_dir, damage="truncate")  # a half-written full checkpoint
        wait_for("the half-written one refused", lambda: call(served.url, "/v1/status")[1]["refused"] == 2)
        status = call(served.url, "/v1/status")[1]
        assert status["step"] == delta.step and "is truncated" in status["last_refused"]["reason"]
        for saved in ranker_run[6:9]:  # deltas of the half-written full checkpoint: no chain
            publish(saved, served_dir)
        wait_for("the deltas seen", lambda: call(served.url, "/v1/status")[1]["behind"] == 6)
        served_as_snapshot_of(served.url, export_checkpoint(train_dir, delta.step))
    # A restart comes back from the files: the same version, the same refusals.
    with ServeProcess(str(served_dir), poll_seconds=POLL_SECONDS) as served:
        status = wait_for("the same version again", status_at(served.url, delta.step))
        assert (status["version"], status["base_step"], status["deltas_applied"]) == (1, first.step, 1)
        assert (status["refused"], status["behind"]) == (2, 6)
        served_as_snapshot_of(served.url, export_checkpoint(train_dir, delta.step))
        # A good full checkpoint committed since is taken.
        last = ranker_run[9]
        publish(last, served_dir)
        status = wait_for("the newest full checkpoint", status_at(served.url, last.step))
        assert (status["version"], status["base_step"], status["deltas_applied"]) == (2, last.step, 0)
        assert status["behind"] == 0
        served_as_snapshot_of(served.url, export_checkpoint(train_dir, last.step))
    with ServeProcess(str(served_dir), poll_seconds=POLL_SECONDS) as served:
        status = wait_for("the newest full checkpoint again", status_at(served.url, last.step))
        assert (status["version"], status["refused"]) == (1, 0)
        served_as_snapshot_of(served.url, export_checkpoint(train_dir, last.step))


# ---- the guide's examples (docs/guides/serve.md shows these sections)


@pytest.fixture(scope="module")
def counted_dir(tmp_path_factory) -> Path:
    """A folder of two checkpoints of Counter: full at step 2, a delta at step 3 (rows and bias: the step)."""
    root = tmp_path_factory.mktemp("guide")
    cluster = free_cluster(1, 1)
    server = psframe.Server(cluster, "ps", 0, serving_processes=1)
    try:
        model = Counter()
        checkpointing = psframe.Checkpointing(str(root / "train"), save_steps=10**6)
        with psframe.Trainer(model, cluster, optimizer=psframe.optim.SGD(lr=1.0), checkpointing=checkpointing) as t:
            count_step(t, model)
            count_step(t, model)
            t.save_checkpoint()
            count_step(t, model)
            t.save_delta()
    finally:
        server.stop(grace=0.1)
    served = root / "served"
    served.mkdir()
    for saved in committed(str(root / "train"))[:2]:  # not the chief's save at the end
        publish(saved, served)
    return served


def counter_model():
    return Counter()


FIRST, SECOND = COUNTED_IDS[0].item(), COUNTED_IDS[1].item()

# --8<-- [start:lookup]
LOOKUP = {"table": "users", "ids": [-1000000000, -999992081, 5]}
LOOKED_UP = {
    "version": 1,
    "step": 3,
    "table": "users",
    "rows": [[3.0, 3.0, 3.0, 3.0], [3.0, 3.0, 3.0, 3.0], None],
    "missing": [5],
}
# --8<-- [end:lookup]
# --8<-- [start:dense]
DENSE = {"name": "bias"}
DENSE_READ = {"version": 1, "step": 3, "name": "bias", "dtype": "float32", "shape": [1], "values": [3.0]}
# --8<-- [end:dense]
# --8<-- [start:predict]
PREDICT = {"inputs": [[-1000000000, -999992081, 5]]}  # Counter's forward(ids): the sum of their rows, plus its bias
PREDICTED = {"version": 1, "step": 3, "outputs": 27.0}  # 2 rows of 4 threes, id 5's initial row (zeros), the bias
# --8<-- [end:predict]
# --8<-- [start:error]
BAD_LOOKUP = {"table": "users", "ids": "7"}
ANSWER_400 = {"error": "'ids' must be a list of integers (int64), got a JSON str"}
# --8<-- [end:error]
# --8<-- [start:status]
STATUS = {
    "checkpoint_dir": "/data/run-7/ckpt",
    "state": "serving",
    "version": 1,  # 1 for the first version this process served, one more at each switch
    "step": 3,  # the global step served
    "base_step": 2,  # the full checkpoint its chain starts at
    "deltas_applied": 1,  # the deltas applied on it
    "committed_at": 1767225600.0,  # when the served checkpoint was committed
    "loaded_at": 1767225600.4,  # when this process switched to it
    "age_seconds": 2.1,  # now - committed_at
    "lag_seconds": 0.0,  # newest committed checkpoint's commit time - committed_at
    "behind": 0,  # committed checkpoints newer than the served one
    "newest_step": 3,
    "checked_at": 1767225602.1,  # the last look at the folder
    "model": True,
    "refused": 0,  # checkpoints refused so far
    "last_refused": None,  # or {"step", "kind", "folder", "reason", "at"}
    "last_error": None,  # the last look that failed, if the folder could not be listed
}
# --8<-- [end:status]


def test_the_guide_s_examples_are_what_the_server_answers(counted_dir):
    assert [FIRST, SECOND] == LOOKUP["ids"][:2]
    with ServeProcess(str(counted_dir), models=ModelFactory.of(counter_model()), poll_seconds=POLL_SECONDS) as served:
        status = wait_for("step 3", status_at(served.url, 3))
        assert set(status) == set(STATUS)
        for key in ("state", "version", "step", "base_step", "deltas_applied", "lag_seconds", "behind", "newest_step"):
            assert status[key] == STATUS[key], key
        assert (status["model"], status["refused"], status["last_refused"], status["last_error"]) == (
            True,
            0,
            None,
            None,
        )
        for path, request, answer in (
            ("/v1/lookup", LOOKUP, LOOKED_UP),
            ("/v1/dense", DENSE, DENSE_READ),
            ("/v1/predict", PREDICT, PREDICTED),
        ):
            assert call(served.url, path, request) == (200, answer)
            assert json.loads(json.dumps(answer)) == answer  # as JSON shows it
        assert call(served.url, "/v1/lookup", BAD_LOOKUP) == (400, ANSWER_400)
