"""JSON bodies of the routes with a pydantic body model, parsed strictly.

FastAPI reads such a body with ``json.loads``, which keeps the *last* value of a key given
twice without a word (``{"admit_probability": 0.5, "admit_probability": 0.0}`` applied
0.0) and takes ``NaN`` / ``Infinity``, which are not JSON (nor is ``1e999``, which it
reads as infinity). A route of a router built with
``route_class=StrictJsonRoute`` refuses both with a 422 naming the field, the way
``/v1/predict`` (:mod:`stream_persia.api.features`) does. Bodies are small there (bounded
by ``api.max_body_bytes``), so the one pass over the parsed document costs nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from stream_persia.api.errors import BadJson
from stream_persia.api.features import JsonObject, reject_constant

from stream_persia.errors import BadInput

__all__ = ["StrictJsonRoute", "loads"]


def loads(body: bytes) -> Any:
    """``json.loads`` that refuses a key given twice in one object, NaN / Infinity, and
    numbers too large for a float (``1e999``, which ``json.loads`` reads as infinity).

    Raises:
        BadInput: naming the dotted field (``body.optimizer.lr``).
        json.JSONDecodeError, UnicodeDecodeError, RecursionError: as ``json.loads``.
    """
    doc = json.loads(body, object_pairs_hook=JsonObject, parse_constant=reject_constant)
    stack: list[tuple[Any, str]] = [(doc, "body")]
    while stack:   # iterative: a deeply nested body must not recurse here
        node, path = stack.pop()
        if isinstance(node, JsonObject):
            if node.twice is not None:
                field = f"{path}.{node.twice}"
                raise BadInput(f"{field}: given twice in one object (JSON parsers disagree "
                               "on which value counts)", field=field,
                               hint="give each key once")
            stack.extend((v, f"{path}.{k}") for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{path}.{i}") for i, v in enumerate(node))
        elif isinstance(node, float) and not math.isfinite(node):   # 1e999
            raise BadInput(f"{path}: a number too large for a float (read as {node})",
                           field=path, hint="send finite numbers")
    return doc


class _StrictJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = loads(await self.body())
            except BadInput as exc:
                # An HTTPException, so FastAPI's body reader re-raises it (anything else
                # it turns into a bare 400); the app's handler answers exc's 422 body.
                raise BadJson(exc) from None
        return self._json


class StrictJsonRoute(APIRoute):
    """An ``APIRoute`` whose JSON body is parsed by :func:`loads` (FastAPI's documented
    custom-route hook)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_StrictJsonRequest(request.scope, request.receive))

        return strict
