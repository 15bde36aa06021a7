"""kvpool's own exceptions.

Each carries the HTTP status the control plane answers with, so the server maps every domain error in one
place and the client turns the status and the error name back into the same exception class.
"""

from __future__ import annotations

import json
from typing import Any, NoReturn


class KvpoolError(Exception):
    """Base of every error kvpool raises on purpose."""

    status: int = 400
    #: the requests whose direct claims the pool refused, when this is raised for them (see PoolClient.confirm)
    refused: tuple[str, ...] = ()


class InvalidRequest(KvpoolError):
    """The request is well-formed JSON but asks for something that cannot be (ids out of range, ...)."""

    status = 400


class Unauthorized(KvpoolError):
    status = 401


class UnknownSession(KvpoolError):
    """The session id is not (or no longer) known: it expired, was closed, or belongs to an earlier pool."""

    status = 404


class HandoffNotFound(KvpoolError):
    status = 404


class NotOwner(KvpoolError):
    """The session holds no reference on a block it tried to free, commit or hand off."""

    status = 409


class StaleBlock(KvpoolError):
    """Block ids whose generation is not their block's current one: the block was freed or evicted (and maybe
    handed to someone else) since the call that returned them. ``stale`` names them; nothing was changed."""

    status = 409

    def __init__(self, message: str, stale: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.stale = stale


class HandoffExists(KvpoolError):
    status = 409


class HandoffRefused(KvpoolError):
    """The producer's handoff of a request was refused, so the ids its claimer may already hold are not its."""

    status = 409


class NameTaken(KvpoolError):
    """The session name is held under a name key that this session did not give: the pool keeps the name, and the
    handoffs addressed to it, for the worker that has the key."""

    status = 409


class LayoutMismatch(KvpoolError):
    """A client's model layout differs from the arena's: its views would be silently wrong."""

    status = 409


class UntrustedSocket(KvpoolError):
    """The pool's Unix socket, or a directory on its way, could be someone else's: no token was sent to it."""


class PayloadTooLarge(KvpoolError):
    status = 413


class LimitExceeded(KvpoolError):
    """A per-client bound of the pool (sessions, parked handoffs, pending claims, meta size) was reached; the
    message names the limit and the setting that raises it."""

    status = 429


class PoolExhausted(KvpoolError):
    """Not enough free or evictable blocks: the caller should free, wait, or size the pool larger."""

    status = 507


class PoolRestarted(KvpoolError):
    """The pool restarted (new epoch): the old arena and session are gone, reconnect to go on."""

    status = 410


class ArenaClosed(KvpoolError):
    """The arena views were released (client closed, or the pool restarted)."""


class PoolUnavailable(KvpoolError):
    """The pool cannot be reached or is not ready."""

    status = 503


class PoolTimeout(PoolUnavailable):
    """The pool did not answer within the client's ``timeout_s`` (it is stopped, hung or overloaded). Raised by the
    client only: the call may or may not have taken effect in the pool."""


class LeaseLapsed(KvpoolError):
    """This process cannot prove that its session's lease still runs: no renewal the pool acknowledged within the
    lease (less a margin). The pool may have ended the session and given its blocks to another engine, so nothing
    may be written into them. Raised by the client only (:meth:`kvpool.session.Session.lapsed`)."""


class PeerFailed(KvpoolError):
    """A peer pool (another node) refused, failed or went away during a remote handoff or prefix read: nothing of
    it was installed here, and the local blocks went back. The engine recomputes, or retries another peer."""

    status = 502


class PeerTimeout(PeerFailed):
    """A peer pool did not answer, or a read from it did not finish, within ``--peer-timeout-s``."""

    status = 504


ERRORS: dict[str, type[KvpoolError]] = {
    cls.__name__: cls
    for cls in (
        KvpoolError,
        InvalidRequest,
        Unauthorized,
        UnknownSession,
        HandoffNotFound,
        NotOwner,
        StaleBlock,
        HandoffExists,
        HandoffRefused,
        NameTaken,
        LayoutMismatch,
        PayloadTooLarge,
        UntrustedSocket,
        LimitExceeded,
        PoolExhausted,
        PoolRestarted,
        ArenaClosed,
        PoolUnavailable,
        PeerFailed,
        PeerTimeout,
    )
}

_BY_STATUS = {cls.status: cls for cls in reversed(list(ERRORS.values()))}


def error_body(detail: Any, error: str) -> dict[str, Any]:
    """The JSON body of every refusal, over HTTP and the fast channel alike: what was wrong, and which error."""
    return {"detail": detail, "error": error}


def body_for(exc: KvpoolError) -> dict[str, Any]:
    body = error_body(str(exc), type(exc).__name__)
    if isinstance(exc, StaleBlock):
        body["stale_ids"] = list(exc.stale)
    return body


def error_for(status: int, body: bytes) -> KvpoolError:
    """The exception the pool raised, from its error reply."""
    try:
        data = json.loads(body)
    except ValueError:
        data = {"detail": body.decode(errors="replace")}
    detail = data.get("detail") if isinstance(data, dict) else data
    if status == 422:
        return InvalidRequest(f"the pool refused the request: {detail}")
    name = data.get("error") if isinstance(data, dict) else None
    cls = ERRORS.get(name or "") or _BY_STATUS.get(status, KvpoolError)
    message = detail if isinstance(detail, str) else json.dumps(detail)
    if cls is StaleBlock:
        stale = data.get("stale_ids") if isinstance(data, dict) else None
        return StaleBlock(message, tuple(i for i in stale if isinstance(i, int)) if isinstance(stale, list) else ())
    return cls(message)


def raise_for(status: int, body: bytes) -> NoReturn:
    raise error_for(status, body)
