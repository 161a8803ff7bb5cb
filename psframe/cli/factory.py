"""Factories named on the command line (``FILE.py:NAME`` or ``MODULE:NAME``): found, loaded, called.

``psframe evaluate`` takes one returning ``(model, evaluate_fn)``, ``psframe serve`` one returning
the model (and how a request becomes its inputs); each checks what came back itself.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any


def made_by_factory(spec: str, argv: list[str]) -> Any:
    """What the factory ``FILE.py:NAME`` or ``MODULE:NAME`` returns.

    A file is loaded as ``python FILE`` would see its own imports (its folder first on
    ``sys.path``); a module is imported. The factory is called with no arguments, or with
    the list ``argv`` when there is one.

    Raises:
        ValueError: ``spec`` is not of that form, or names a file, module or function that is not there.
    """
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise ValueError(f"the factory must be path/to/file.py:function or package.module:function, got {spec!r}")
    if where.endswith(".py") or os.sep in where:
        path = os.path.abspath(where)
        if not os.path.isfile(path):
            raise ValueError(f"the factory's file {where!r} is not a file (looked in {os.getcwd()!r})")
        sys.path.insert(0, os.path.dirname(path))  # its own imports resolve as under `python FILE`
        loader_spec = importlib.util.spec_from_file_location(f"psframe_factory_{os.getpid()}", path)
        if loader_spec is None or loader_spec.loader is None:
            raise ValueError(f"the factory's file {where!r} cannot be loaded as Python")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[loader_spec.name] = module  # dataclasses and pickling look their module up here
        loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            if e.name is None or not (where == e.name or where.startswith(e.name + ".")):
                raise  # the module exists; something it imports does not: its bug, with a traceback
            raise ValueError(f"the factory's module {where!r} cannot be found on sys.path") from e
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"{where} has no function {name!r}")
    return factory(argv) if argv else factory()


def factory_argv(remainder: list[str]) -> list[str]:
    """The factory's arguments from argparse's ``REMAINDER`` after it: the words after ``--``."""
    return remainder[1:] if remainder[:1] == ["--"] else remainder
