"""One refusal type: a request the farm will not serve, and the HTTP answer to give.

Every check the web runs before it accepts a job (the envelope in ``wire``,
the model policy, the client version gate, the API key, the limits) refuses
the same way: a ``detail`` the client shows its user and the HTTP ``status``
to answer with. They all raise :class:`Refused` (or a subclass named after the
check), and the web registers one Flask error handler for it that answers
``{"detail": ...}`` with that status (``web/app.py``), as Flask's own
``HTTPException`` is one type with one handler. The nnsight client reads
``body["detail"]`` of any failed request, so the shape must not vary.

Bottom of the package: imports nothing, so every layer may raise it.
"""

from __future__ import annotations


class Refused(Exception):
    """A request refused with ``detail`` (what the client shows) and HTTP ``status``."""

    status = 400

    def __init__(self, detail: str, status: int | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        if status is not None:
            self.status = status
