"""What makes an engine's KV what it is, and which of its requests may share it: the salt of every chain an engine
looks up, commits and parks.

The pool's chains are over token ids, and the same tokens give the same KV only through the same weights, dtype,
quantization, KV dtype and scales, RoPE and config overrides. So every engine salts its calls with a digest of those
(:func:`engine_facts`), whatever ``--model`` the pool was started with: engines share only interchangeable KV.

A request whose KV depends on more than its token ids is keyed by that too, exactly where vLLM's own cache keys it:
a LoRA adapter (by name and path) and a ``cache_salt``. A request with images or other multimodal inputs, or with
prompt embeddings, is kept out of the pool (:meth:`EngineIdentity.of` gives None): its placeholder token ids do not
name its KV. Both connector modes ask this one place.

A reset of the engine's prefix cache (what a weight update is followed by) moves the engine to a new epoch: from
then on it shares nothing with what was computed before, by it or by others.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import xxhash


def _digest(*parts: object) -> str:
    return xxhash.xxh3_128_hexdigest(json.dumps(parts, sort_keys=True, default=repr).encode())


def engine_facts(config: Any) -> dict[str, Any]:
    """What of a ``VllmConfig`` decides the KV its engine computes for given token ids (read by attribute, so that a
    config of any vLLM release, or a stand-in, will do)."""
    model, cache = config.model_config, config.cache_config
    hf_config = getattr(model, "hf_config", None)
    facts: dict[str, Any] = {
        "model": model.model,
        "revision": getattr(model, "revision", None),
        "code_revision": getattr(model, "code_revision", None),
        "quantization": getattr(model, "quantization", None),
        "dtype": str(getattr(model, "dtype", "")),
        "hf_overrides": getattr(model, "hf_overrides", None),
        "override_attention_dtype": getattr(model, "override_attention_dtype", None),
        "hf_config": hf_config.to_dict() if hasattr(hf_config, "to_dict") else repr(hf_config),
        "cache_dtype": str(getattr(cache, "cache_dtype", "")),
        "block_size": getattr(cache, "block_size", None),
    }
    if getattr(cache, "calculate_kv_scales", False):
        # scales measured on each engine's first batch: no two engines' fp8 KV is interchangeable
        facts["kv_scales"] = secrets.token_hex(16)
    try:
        import vllm

        facts["vllm"] = vllm.__version__
    except ImportError:
        pass
    return facts


class EngineIdentity:
    """An engine's salt (``salt``), and each request's (:meth:`of`)."""

    def __init__(self, facts: dict[str, Any]) -> None:
        self.base = _digest(facts)
        self.epoch = 0
        self.salt = self.base

    @classmethod
    def of_config(cls, config: Any) -> EngineIdentity:
        return cls(engine_facts(config))

    def renew(self) -> str:
        """A new epoch (the engine's prefix cache was reset, its weights may have changed): a salt no other engine
        has, so nothing computed before is found again, and nothing computed from now on is found by others."""
        self.epoch += 1
        self.salt = _digest(self.base, self.epoch, secrets.token_hex(16))
        return self.salt

    def of(self, request: Any) -> str | None:
        """The salt of a request's chain, or None where its KV is kept out of the pool (no token ids, multimodal
        inputs, prompt embeddings)."""
        if not request.prompt_token_ids or request.mm_features or getattr(request, "prompt_embeds", None) is not None:
            return None
        lora = request.lora_request
        cache_salt = getattr(request, "cache_salt", None)
        if lora is None and not cache_salt:
            return self.salt
        adapter = None if lora is None else (lora.lora_name, getattr(lora, "lora_path", None))
        return _digest(self.salt, adapter, cache_salt or None)
