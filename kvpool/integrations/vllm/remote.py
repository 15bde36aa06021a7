"""A decode engine's claim of a prefill parked in another node's pool, and a prefix another node's pool holds
(docs/across-nodes.md).

The proxy names that pool in the request's ``kv_transfer_params`` (``kvpool_peer``: its URL as this engine's pool
lists it in ``--peers``). The claim then goes to this engine's own pool (``POST /remote/claim``), which claims the
handoff at the peer, reads its blocks into its own arena with NIXL and answers with its own block ids, the refs held
by this engine's session: from there they are checked and installed as a local claim's are. A peer that failed,
stalled, or holds no such handoff gives nothing to load: the engine computes the prompt, and the pool has given the
blocks of the read back already.

A prefix: with ``peer_prefix_blocks`` set, a prompt whose lookup in this engine's pool leaves more than that many of
its full blocks unfound is asked again through ``POST /remote/lookup``: the pool reads the longest further hit a
peer holds into its arena, checks the peer's chain against its own hashes of the prompt, indexes the blocks and
answers with its own ids. The engine takes whichever answer is longer and gives the other's refs back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from kvpool.errors import KvpoolError, PoolRestarted, PoolUnavailable, UnknownSession
from kvpool.remote_protocol import (
    RemoteClaimRequest,
    RemoteClaimResponse,
    RemoteLookupRequest,
    RemoteLookupResponse,
)
from kvpool.tokens import pack_tokens

log = logging.getLogger("vllm.kvpool")

#: kv_transfer_params key: the pool the prefill engine parked in, if not this engine's own
PEER_KEY = "kvpool_peer"
#: past a claim's own wait, how long this engine's pool may take to answer a remote claim before the pool counts as
#: lost: its calls to the peer and the read each end within its --peer-timeout-s (10 s unless set), four at most
ANSWER_MARGIN_S = 60.0


#: a prompt a claim's handoff holds, and its salt: with it, this pool indexes the blocks it reads
Prompt = tuple[Sequence[int], str | None]


def claim_many(
    client: Any, asks: Sequence[tuple[str, Any]], timeout_s: float, prompts: Sequence[Prompt | None] | None = None
) -> list[Any | None]:
    """The claim of each ``(key, peer)`` in order, ``None`` where there is nothing to load: those parked in this
    engine's own pool (``peer`` empty) in one call, as before, then each parked at a peer through this pool, which
    indexes what it read under the prompt at the same place in ``prompts`` (if any)."""
    out: list[Any | None] = [None] * len(asks)
    local = [i for i, (_, peer) in enumerate(asks) if not peer]
    if local:
        for i, got in zip(local, client.claim_many([asks[i][0] for i in local], timeout_s), strict=True):
            out[i] = got
    for i, (key, peer) in enumerate(asks):
        if peer:
            out[i] = claim(client, key, peer, timeout_s, prompts[i] if prompts is not None else None)
    return out


def claim(
    client: Any, key: str, peer: Any, timeout_s: float, prompt: Prompt | None = None
) -> RemoteClaimResponse | None:
    """The handoff ``key`` parked at ``peer``, read into this engine's pool; None if it could not be (the peer
    failed, stalled or lacks it, is no peer of this pool, or this pool has no room for it). An error about this
    engine's own session or pool raises, as a local claim's does. With ``prompt``, the pool indexes the blocks it
    read under its chain, as far as the peer's index vouches for them, so that later requests on this node hit them."""
    tokens, salt = (list(prompt[0]), prompt[1]) if prompt is not None else (None, None)
    try:  # the peer comes from the request's kv_transfer_params, which a client can set to anything
        req = RemoteClaimRequest(session_id=client.session_id, request_id=key, timeout_s=timeout_s, peer=str(peer),
                                 token_ids=tokens, salt=salt)  # fmt: skip
    except ValidationError as exc:
        log.warning("kvpool: a handoff's peer %.80r is no pool URL (%s); the decode engine computes the prompt itself",
                    peer, exc.errors()[0]["msg"])  # fmt: skip
        return None
    try:
        got = client.transport.request("POST", "/remote/claim", req, wait_s=timeout_s + ANSWER_MARGIN_S)
    except (PoolUnavailable, UnknownSession, PoolRestarted):
        raise
    except KvpoolError as exc:
        log.warning("kvpool: the handoff parked at %s could not be read here (%s: %s); the decode engine computes the "
                    "prompt itself", peer, type(exc).__name__, exc)  # fmt: skip
        return None
    return RemoteClaimResponse.model_validate(got)


def lookup_many(
    client: Any, prompts: Sequence[Sequence[int]], hits: Sequence[Any], salts: Sequence[str | None], more_than: int,
    block_size: int,
) -> list[Any]:  # fmt: skip
    """``hits`` (this pool's answers for ``prompts``), each that leaves more than ``more_than`` of its prompt's full
    blocks unfound replaced by the pool's remote lookup where that holds more; the refs of the answer not taken are
    given back, in one call."""
    out, spare = list(hits), []
    for i, (tokens, salt, hit) in enumerate(zip(prompts, salts, hits, strict=True)):
        if len(tokens) // block_size - len(hit.block_ids) <= more_than:
            continue
        got = lookup(client, tokens, salt)
        if got is None:
            continue
        if got.num_tokens > hit.num_tokens:
            spare += hit.block_ids
            out[i] = got
        else:
            spare += got.block_ids
    if spare:
        client.free(spare)
    return out


def lookup(client: Any, tokens: Sequence[int], salt: str | None) -> RemoteLookupResponse | None:
    """The pool's hit for ``tokens`` with what its peers hold further read into it; None if the pool could not ask
    them (this pool has no peers, or cannot serve this prompt). An error about this engine's own session or pool
    raises, as a local lookup's does."""
    packed = pack_tokens(list(tokens))
    form: dict[str, Any] = {"tokens": packed} if packed is not None else {"token_ids": list(tokens)}
    try:
        req = RemoteLookupRequest(session_id=client.session_id, salt=salt, **form)
        got = client.transport.request("POST", "/remote/lookup", req, wait_s=ANSWER_MARGIN_S)
    except (PoolUnavailable, UnknownSession, PoolRestarted):
        raise
    except (KvpoolError, ValidationError) as exc:
        log.warning("kvpool: the pool could not ask its peers for a prompt's prefix (%s: %s); the engine computes "
                    "what its own pool lacks", type(exc).__name__, exc)  # fmt: skip
        return None
    answer = RemoteLookupResponse.model_validate(got)
    for url, why in answer.peer_errors.items():
        log.info("kvpool: peer %s gave no prefix: %s", url, why)
    return answer
