"""Bearer-token authentication of control, checkpoint and (optionally) inference routes.

One shared secret (``PERSIA_API_TOKEN`` / ``PERSIA_API_TOKEN_FILE`` or ``api.token`` /
``api.token_file``): a request without ``Authorization: Bearer <token>`` gets 401 with
``WWW-Authenticate: Bearer``, one with a different token gets 403. Tokens are compared in
constant time. With no token configured the routes are open, which
:meth:`~api.settings.ApiSettings.check_bind` allows only on a loopback address.
"""

from __future__ import annotations

import hmac

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

__all__ = ["require_token", "require_predict_token", "bearer"]

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
