"""The connector's settings (``kv_connector_extra_config``) and the start-up check of the engine against the pool.

A pool's arena has one KV layout and one model name in its prefix hashes; an engine whose model differs would
read silently wrong KV, so the connector refuses to start with one line naming the flag to change.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvpool.errors import InvalidRequest, LayoutMismatch
from kvpool.layout import KVLayout

#: pool layout field -> the `kvpool serve` flag that sets it
POOL_FLAGS = {
    "num_layers": "--num-layers",
    "num_kv_heads": "--num-kv-heads",
    "head_dim": "--head-dim",
    "block_size": "--block-size",
    "dtype": "--dtype",
}


class ConnectorSettings(BaseModel):
    """What ``kv_connector_extra_config`` may hold."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str | None = Field(None, description="the pool (unix:///path or http://host:port); default $KVPOOL_URL")
    token: str | None = Field(None, description="the pool's bearer token; default $KVPOOL_TOKEN")
    mode: Literal["copy", "resident"] = Field(
        "copy",
        description="resident: the engine's KV cache is the pool's arena and blocks move by id, never copied (needs a "
        "pool started with --order kv_packed --slabs on this GPU, and vLLM with --num-gpu-blocks-override set to the "
        "arena's blocks); copy: the engine keeps its own KV cache and hits and saves are copied (any pool, any GPU). "
        "An engine that cannot be resident falls back to copy and says why",
    )
    slab_blocks: int = Field(
        1024,
        ge=16,
        le=1 << 20,
        description="resident mode: arena blocks the engine keeps idle in its slab, so that "
        "allocating them never waits on the pool",
    )
    load: bool = Field(True, description="load prompt prefixes that the pool holds")
    save: bool = Field(True, description="copy the prompt's full blocks into the pool and commit them")
    claim_timeout_s: float = Field(
        1.0, gt=0, le=600, description="how long a decode engine's scheduler waits for a handoff not parked yet"
    )
    free_delay_steps: int = Field(
        3, ge=1, le=64, description="scheduler steps a loaded request's pool refs outlive it (async scheduling)"
    )
    reserve_blocks: int = Field(
        1024, ge=0, le=1 << 20, description="arena blocks the worker keeps allocated to copy finished prompts into"
    )
    layerwise: bool | None = Field(
        None,
        description="load each layer's blocks on a side stream, waited for just before that layer's attention; it "
        "needs piecewise CUDA graphs (a graph break per layer), so by default only engines without full graphs use "
        "it (eager, or piecewise by choice)",
    )
    early_lookup: bool = Field(
        True,
        description="start a request's lookup (or claim) as the engine core's input thread decodes it, beside the "
        "step then running, instead of when the scheduler takes it in between steps",
    )
    lookup_threads: int = Field(
        1, ge=1, le=32, description="lookups (and claims) the scheduler runs at once, each on its own pool session"
    )
    peer_prefix_blocks: int | None = Field(
        None,
        ge=0,
        le=1 << 20,
        description="ask the pool's peers on other nodes (its --peers, POST /remote/lookup) for a prompt whose lookup "
        "in this pool leaves more than this many of its full blocks unfound; the pool reads the longest hit a peer "
        "holds into its first arena and indexes it. Null (default): never. Each ask costs calls to the peers, each "
        "bounded by the pool's --peer-timeout-s, on the lane of the lookup",
    )
    name: str = Field("vllm", min_length=1, max_length=64, description="prefix of the engine's session names")

    @classmethod
    def parse(cls, extra: dict[str, object] | None) -> ConnectorSettings:
        try:
            return cls.model_validate(dict(extra or {}))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise InvalidRequest(
                f"kv_connector_extra_config.{where}: {first['msg']} (known keys: {', '.join(cls.model_fields)})"
            ) from None


def layerwise_for(setting: bool | None, full_graphs: bool) -> bool:
    """Whether to load layer by layer. With full CUDA graphs the per-layer hook would cost them (measured on an
    H100 with vLLM 0.26: decode steps 2.3x longer on piecewise graphs), more than overlapping the loads saves."""
    return setting if setting is not None else not full_graphs


def check_engine(pool: KVLayout, engine: KVLayout, pool_model: str, engine_models: list[str]) -> None:
    """Refuse an engine whose KV does not fit the pool's arena, or whose model the pool's hashes do not name.

    The pool's ``order`` is free: both orders give the NHD per-layer views the connector copies through.
    """
    diff = {k: v for k, v in pool.diff(engine).items() if k != "order"}
    if diff:
        flags = " ".join(f"{POOL_FLAGS[k]} {theirs}" for k, (_, theirs) in diff.items())
        seen = ", ".join(f"{k} {ours} != {theirs}" for k, (ours, theirs) in diff.items())
        raise LayoutMismatch(
            f"the kvpool arena does not fit this engine's KV (pool vs engine: {seen}): "
            f"start the pool with `kvpool serve {flags}`"
            + (f" or vLLM with --block-size {pool.block_size}" if "block_size" in diff else "")
        )
    if pool_model and pool_model not in engine_models:
        raise LayoutMismatch(
            f"the kvpool pool hashes prefixes for model {pool_model!r}, this engine serves {engine_models[0]!r}: "
            f"start the pool with `kvpool serve --model {engine_models[0]}` (one pool per model)"
        )


#: vLLM releases resident mode was proven on, on a GPU (tokens against vLLM's own cache): elsewhere copy mode. The
#: scheduler side runs on the CPU against 0.26, 0.29, 0.31 and 0.33 in CI (.ci/vllm-cpu); see docs/vllm.md
RESIDENT_VLLM = ("0.26.",)
#: speculative methods that add no KV layers of their own (a drafter model does)
NO_DRAFT_KV = ("ngram", "suffix")


def unsupported(config: Any, kv_cache_config: Any) -> str | None:
    """What of this engine neither mode can hold (None: nothing): KV that is not one full-attention cache per layer
    (sliding windows, chunked local attention, sinks, MLA, state spaces: their blocks are not the pool's blocks),
    and drafters with KV layers of their own. Read by attribute, so that it runs against any vLLM's configs."""
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if (
            kind != "FullAttentionSpec"
            or getattr(spec, "sliding_window", None)
            or getattr(spec, "attention_chunk_size", None)
        ):
            return (
                f"this model's KV cache has {kind} layers (sliding window, chunked, sink, MLA or state-space "
                "attention); kvpool holds full-attention KV only: serve it without --kv-transfer-config"
            )
    draft = getattr(config, "speculative_config", None)
    method = getattr(draft, "method", None) if draft is not None else None
    if draft is not None and method not in NO_DRAFT_KV:
        return (
            f"speculative decoding with a drafter ({method}) adds KV layers kvpool does not hold: use ngram or "
            "suffix speculation, or serve without --kv-transfer-config"
        )
    return None


def why_not_resident(config: Any, vllm_version: str) -> str | None:
    """Why this engine runs in copy mode although resident mode was asked for (None: it need not)."""
    if not vllm_version.startswith(RESIDENT_VLLM):
        return (
            f"resident mode is proven on vLLM {', '.join(v + 'x' for v in RESIDENT_VLLM)} only, this is {vllm_version}"
        )
    if not config.cache_config.enable_prefix_caching:
        return "prefix caching is off: resident mode hands the pool's blocks to vLLM through its prefix cache"
    if getattr(config.model_config, "enable_sleep_mode", False):
        return "sleep mode is on: waking an engine up zeroes its KV cache, which in resident mode is every engine's"
    if config.kv_transfer_config.kv_role == "kv_producer":
        return (
            'kv_role "kv_producer": vLLM then frees blocks a step may still write, and other engines could take '
            'them; use "kv_both"'
        )
    from kvpool.integrations.vllm import generations

    return generations.of_version(vllm_version).why_not(config)
