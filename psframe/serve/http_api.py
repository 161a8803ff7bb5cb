"""The HTTP/JSON API of ``psframe serve``: a Starlette app over the versions a follower publishes.

Routes (``docs/guides/serve.md`` has examples of each, from the tested file):

=========================  ====================================================================
``GET /v1/status``         the version served (step, base step, deltas applied, age and lag),
                           how far behind the directory it is, the last checkpoint refused
``POST /v1/lookup``        ``{"table": NAME, "ids": [INT, ...]}``: rows of a dynamic table; an
                           id the version does not hold is ``null`` in ``rows`` and listed in
                           ``missing`` (the model's own lookups give it its initial row)
``GET /v1/params``         the names, shapes and dtypes of the parameters and tables served
``POST /v1/dense``         ``{"name": NAME, "rows": [INT, ...]}`` (``rows`` optional): a
                           parameter's values, whole or those rows of it
``POST /v1/predict``       ``{"inputs": ...}``: the model's outputs (``psframe serve --model``;
                           :mod:`psframe.serve.model` has the contract)
=========================  ====================================================================

Every answer names the ``version`` and ``step`` it was read from: a request takes the served
version once (:meth:`psframe.serve.versions.VersionHolder.current`) and reads only it. Values are
JSON numbers (a float32 or bfloat16 value is a double exactly, so it reads back bit for bit;
NaN and infinities are written ``NaN``, ``Infinity``, as Python's ``json`` reads them).
Errors are ``{"error": MESSAGE}`` naming what was expected: 400 for a malformed request, 404
for an unknown route, table or parameter (or ``/v1/predict`` without a model), 405 for another
method, 413 for a request past the limits below, 503 before the first version is loaded.

Why Starlette: a well-kept, small ASGI toolkit (pure Python, on anyio; FastAPI is built on it)
that gives routing, requests and responses and leaves the checks to us. FastAPI would add
pydantic and answer malformed bodies with its own generic 422s; five routes whose errors must
say what was expected, as every psframe error does, are clearer checked by hand. Lookups and
predictions run in Starlette's thread pool, so that torch work never blocks the event loop.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from psframe.errors import ServeRequestError
from psframe.serve.follower import CheckpointFollower
from psframe.serve.model import InputError
from psframe.serve.versions import ServedVersion

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
"""The largest request body taken (413 past it)."""
MAX_IDS = 100_000
"""The most ids one lookup takes (413 past it)."""
MAX_VALUES = 1 << 22
"""The most values one dense read answers (413 past it: ask for ``rows``)."""
_INT64 = (-(2**63), 2**63 - 1)


def _refused(status: int, message: str) -> ServeRequestError:
    """The error a request is answered with: HTTP ``status`` and ``{"error": message}``."""
    return ServeRequestError(message, status)


class _Json(JSONResponse):
    """JSON as Python writes it, NaN and infinities included (Starlette's refuses them)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def make_app(follower: CheckpointFollower) -> Starlette:
    """The Starlette app answering the API over ``follower``'s versions (and its status)."""
    holder, models = follower.holder, follower.models

    def served() -> ServedVersion:
        version = holder.current()
        if version is None:
            raise _refused(503, f"no version is served yet: waiting for a checkpoint in {follower.checkpoint_dir}")
        return version

    async def status(request: Request) -> Response:
        return _Json(follower.status())

    async def lookup(request: Request) -> Response:
        body = await _body(request, {"table": "a table's name", "ids": "a list of int64 ids"})
        table = _string(body, "table")
        ids = _ints(body, "ids", MAX_IDS)
        return _Json(await run_in_threadpool(_lookup, served(), table, ids))

    async def params(request: Request) -> Response:
        version = served()
        snapshot = version.snapshot
        return _Json(
            {
                **_of(version),
                "dense": {name: _kind(value) for name, value in sorted(snapshot.dense.items())},
                "tables": {
                    name: {
                        "rows": len(table),
                        "row_shape": list(table.rows.shape[1:]),
                        "dtype": "float32" if table.scales is not None else _dtype_name(table.rows),
                    }
                    for name, table in sorted(snapshot.tables.items())
                },
            }
        )

    async def dense(request: Request) -> Response:
        body = await _body(request, {"name": "a parameter's name", "rows": "a list of row indices (optional)"})
        name = _string(body, "name")
        rows = _ints(body, "rows", MAX_VALUES) if "rows" in body else None
        return _Json(await run_in_threadpool(_dense, served(), name, rows))

    async def predict(request: Request) -> Response:
        if models is None:
            raise _refused(404, "this server serves no model: start psframe serve with --model FILE.py:NAME")
        body = await _body(request, {"inputs": "the model's inputs"})
        if "inputs" not in body:
            raise _refused(400, 'the body must be {"inputs": ...}: the model\'s inputs are missing')
        version = served()
        assert version.model is not None  # the follower built one with every version
        model = version.model
        outputs = await run_in_threadpool(models.predict, model, body["inputs"])
        return _Json({**_of(version), "outputs": outputs})

    api = (
        ("GET", "/v1/status", status),
        ("POST", "/v1/lookup", lookup),
        ("GET", "/v1/params", params),
        ("POST", "/v1/dense", dense),
        ("POST", "/v1/predict", predict),
    )
    routes = [Route(path, _answered(endpoint), methods=[method]) for method, path, endpoint in api]
    known = ", ".join(f"{method} {path}" for method, path, _ in api)

    async def not_routed(request: Request, exc: Exception) -> Response:
        code = exc.status_code if isinstance(exc, HTTPException) else 500
        what = "no such route" if code == 404 else f"{request.method} is not allowed here"
        return _Json({"error": f"{what}: {request.method} {request.url.path}; the API is {known}"}, status_code=code)

    return Starlette(routes=routes, exception_handlers={HTTPException: not_routed})


def _answered(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """``endpoint`` with its failures answered as ``{"error": ...}``: an :class:`ServeRequestError` with its
    status, refused inputs with 400, anything else (a bug) with 500 and a logged traceback."""

    async def answer(request: Request) -> Response:
        try:
            return await endpoint(request)
        except ServeRequestError as e:
            return _Json({"error": e.message}, status_code=e.status)
        except InputError as e:
            return _Json({"error": str(e)}, status_code=400)
        except Exception as e:
            log.exception("psframe serve: %s %s failed", request.method, request.url.path)
            return _Json({"error": f"the server failed: {type(e).__name__}: {e}"}, status_code=500)

    return answer


# ---- the work of each route (in the thread pool)


def _lookup(version: ServedVersion, name: str, ids: list[int]) -> dict[str, Any]:
    table = version.snapshot.tables.get(name)
    if table is None:
        raise _refused(404, f"no dynamic table {name!r}; the tables served are {sorted(version.snapshot.tables)}")
    wanted = torch.tensor(ids, dtype=torch.int64)
    held = torch.zeros(wanted.numel(), dtype=torch.bool)
    at = torch.zeros(wanted.numel(), dtype=torch.int64)
    if len(table) and wanted.numel():
        at = torch.searchsorted(table.ids, wanted).clamp_(max=len(table) - 1)
        held = table.ids[at] == wanted
    found = table.values()[at[held]].tolist()
    rows: list[Any] = [None] * wanted.numel()
    for position, row in zip(held.nonzero().flatten().tolist(), found):
        rows[position] = row
    return {**_of(version), "table": name, "rows": rows, "missing": wanted[~held].tolist()}


def _dense(version: ServedVersion, name: str, rows: list[int] | None) -> dict[str, Any]:
    value = version.snapshot.dense.get(name)
    if value is None:
        names = sorted(version.snapshot.dense)
        shown = names if len(names) <= 20 else [*names[:20], f"... ({len(names)} in all)"]
        raise _refused(404, f"no parameter {name!r}; the parameters served are {shown}")
    if rows is not None:
        if value.dim() == 0:
            raise _refused(400, f"parameter {name!r} is a scalar: it has no rows; leave out 'rows'")
        bad = [r for r in rows if not 0 <= r < value.shape[0]]
        if bad:
            raise _refused(400, f"rows {bad[:5]} are out of range: parameter {name!r} has rows 0..{value.shape[0] - 1}")
        value = value[torch.tensor(rows, dtype=torch.int64)]
    if value.numel() > MAX_VALUES:
        raise _refused(
            413, f"parameter {name!r} has {value.numel()} values, more than {MAX_VALUES} in one answer: ask for 'rows'"
        )
    return {**_of(version), "name": name, **_kind(value), "values": value.tolist()}


# ---- reading a request


async def _body(request: Request, fields: dict[str, str]) -> dict[str, Any]:
    """The request's JSON object, checked to hold no field but ``fields`` (name: what it is)."""
    expected = "{" + ", ".join(f'"{name}": {what}' for name, what in fields.items()) + "}"
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise _refused(413, f"the body is {length} bytes; at most {MAX_BODY_BYTES} are taken")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise _refused(413, f"the body is {len(raw)} bytes; at most {MAX_BODY_BYTES} are taken")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _refused(400, f"the body must be a JSON object {expected}; it is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise _refused(400, f"the body must be a JSON object {expected}, got a JSON {type(body).__name__}")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise _refused(400, f"unknown fields {unknown}: the body must be {expected}")
    return body


def _string(body: dict[str, Any], field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value:
        got = "nothing" if field not in body else json.dumps(value)[:80]
        raise _refused(400, f"{field!r} must be a non-empty string, got {got}")
    return value


def _ints(body: dict[str, Any], field: str, limit: int) -> list[int]:
    value = body.get(field)
    if not isinstance(value, list):
        got = "nothing" if field not in body else f"a JSON {type(value).__name__}"
        raise _refused(400, f"{field!r} must be a list of integers (int64), got {got}")
    if len(value) > limit:
        raise _refused(413, f"{field!r} holds {len(value)} values; at most {limit} in one request")
    for i, x in enumerate(value):
        if type(x) is not int or not _INT64[0] <= x <= _INT64[1]:
            raise _refused(400, f"{field!r} must be a list of integers (int64); {field}[{i}] is {json.dumps(x)}")
    return value


# ---- writing an answer


def _of(version: ServedVersion) -> dict[str, int]:
    return {"version": version.number, "step": version.step}


def _kind(value: torch.Tensor) -> dict[str, Any]:
    return {"dtype": _dtype_name(value), "shape": list(value.shape)}


def _dtype_name(value: torch.Tensor) -> str:
    return str(value.dtype).removeprefix("torch.")


__all__ = ["MAX_BODY_BYTES", "MAX_IDS", "MAX_VALUES", "ServeRequestError", "make_app"]
