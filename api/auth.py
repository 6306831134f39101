"""Bearer-token authentication of control, checkpoint and (optionally) inference routes.

One shared secret (``PERSIA_API_TOKEN`` / ``PERSIA_API_TOKEN_FILE`` or ``api.token`` /
``api.token_file``): a request without ``Authorization: Bearer <token>`` gets 401 with
``WWW-Authenticate: Bearer``, one with a different token gets 403. Tokens are compared in
constant time. With no token configured the routes are open, which
:meth:`~stream_persia.api.settings.ApiSettings.check_bind` allows only on a loopback address.

The OpenAPI document says what this instance enforces (:func:`document_security`):
``security: [{"bearerAuth": []}]`` and 401/403 on routes that check the token, and an
optional token (``[{"bearerAuth": []}, {}]``) without 401/403 on routes that do not (the
inference routes unless ``PERSIA_API_PREDICT_AUTH=1``; every route without a token).
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

__all__ = ["require_token", "require_predict_token", "bearer", "document_security",
           "PREDICT_AUTH_MARK"]

bearer = HTTPBearer(auto_error=False, scheme_name="bearerAuth",
                    description="the API token (PERSIA_API_TOKEN or PERSIA_API_TOKEN_FILE)")


def _check(request: Request, credentials: HTTPAuthorizationCredentials | None) -> None:
    expected = request.app.state.settings.token
    if expected is None:
        return
    if credentials is None or not credentials.credentials:
        raise HTTPException(401, "this route needs 'Authorization: Bearer <token>'",
                            headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(credentials.credentials.encode(), expected.encode()):
        raise HTTPException(403, "the bearer token is not valid for this API")


async def require_token(request: Request,
                        credentials: HTTPAuthorizationCredentials | None = Depends(bearer)
                        ) -> None:
    """Dependency of control and checkpoint routes."""
    _check(request, credentials)


async def require_predict_token(request: Request,
                                credentials: HTTPAuthorizationCredentials | None = Depends(bearer)
                                ) -> None:
    """Dependency of inference routes: checks the token only when configured to."""
    if request.app.state.settings.predict_requires_token:
        _check(request, credentials)


#: an operation-level OpenAPI key marking the inference routes (removed from the document)
PREDICT_AUTH_MARK = "x-predict-auth"


def document_security(spec: dict[str, Any], token: str | None,
                      predict_requires_token: bool) -> dict[str, Any]:
    """Make ``spec`` (an OpenAPI document, changed in place) tell which operations of this
    instance check the token: FastAPI marks every route depending on :data:`bearer` as
    requiring it, whatever the settings.

    Args:
        spec: the generated document; inference operations carry :data:`PREDICT_AUTH_MARK`.
        token: the configured token (None: no route checks one).
        predict_requires_token: whether the inference routes check it.

    Returns:
        ``spec``.
    """
    for item in spec.get("paths", {}).values():
        for op in item.values():
            if not isinstance(op, dict):
                continue
            inference = bool(op.pop(PREDICT_AUTH_MARK, False))
            if {"bearerAuth": []} not in op.get("security", []):
                continue
            if token is not None and (predict_requires_token or not inference):
                op["security"] = [{"bearerAuth": []}]
            else:
                op["security"] = [{"bearerAuth": []}, {}]   # a token is accepted, not needed
                for code in ("401", "403"):
                    op.get("responses", {}).pop(code, None)
    return spec
