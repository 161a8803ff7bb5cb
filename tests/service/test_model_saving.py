"""A model trained by a Trainer is saved as the user's own: ``torch.save(model)`` and its
``state_dict()`` work at any moment (while the trainer is connected too), and the file holds no
psframe object -- the table modules' lookups through the ps tasks are not part of the model."""

from __future__ import annotations

import copy
import pickle
import pickletools

import torch

import psframe
from tests.service.test_tables import Recommender, loss_of


def _pickled_globals(obj: object) -> set[str]:
    """The modules of every class or function a pickle of ``obj`` names: what ``torch.save`` and
    ``copy.deepcopy`` take of it (protocol 2: each is a GLOBAL opcode, ``"module name"``)."""
    data = pickle.dumps(obj, protocol=2)
    return {arg.split(" ")[0] for opcode, arg, _ in pickletools.genops(data) if opcode.name == "GLOBAL"}


def test_a_model_with_tables_saves_and_loads_while_its_trainer_is_connected(local_cluster, tmp_path):
    model = Recommender()
    trainer = psframe.Trainer(model, local_cluster(num_ps=2, num_workers=1), optimizer=psframe.optim.Adagrad(lr=0.1))
    with trainer:
        trainer.step(loss_of(model, 0))
        path = tmp_path / "model.pt"
        torch.save(model, path)
        torch.save(model.state_dict(), tmp_path / "state.pt")
        names = _pickled_globals(model)
        assert "torch.nn.modules.sparse" in names, names  # it reads the model's classes
        assert not any(name.startswith("psframe") for name in names), names
        copied = copy.deepcopy(model)  # the same path: a copy is the user's model, unattached
        trainer.step(loss_of(model, 1))  # and the trainer goes on as before
    loaded = torch.load(path, weights_only=False)
    state = torch.load(tmp_path / "state.pt")
    for saved in (loaded.state_dict(), state, copied.state_dict()):
        assert saved.keys() == model.state_dict().keys()
    assert torch.equal(loaded.emb.weight, state["emb.weight"])
    # The loaded model is a plain torch model: its tables look up their own weights.
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(loaded.emb(ids), torch.nn.functional.embedding(ids, loaded.emb.weight))
    assert "forward" not in vars(loaded.emb) and "forward" not in vars(copied.emb)


def test_a_dynamic_table_saves_its_module_without_the_trainer_s_lookups(local_cluster, tmp_path):
    model = torch.nn.Sequential(psframe.DynamicEmbedding(4), torch.nn.Linear(4, 1))
    trainer = psframe.Trainer(model, local_cluster(num_ps=1, num_workers=1), optimizer=psframe.optim.Adagrad(lr=0.1))
    with trainer:
        trainer.step(model(torch.tensor([5, 7, 11])).sum())
        names = _pickled_globals(model)
        torch.save(model, tmp_path / "model.pt")
    # The module's own class and the classes of its settings, and nothing of the trainer's (no
    # client, caller or pull).
    table = model[0]
    own = {type(x).__module__ for x in (table, table.spec, *vars(table.spec).values())}
    assert {name for name in names if name.startswith("psframe")} <= own, names
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert isinstance(loaded[0], psframe.DynamicEmbedding)
