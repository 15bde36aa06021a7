"""The KV layout of an arena: how one block's bytes are laid out and how per-layer views are cut from it.

The layout is the contract between the pool and every worker. It is pure data (no torch), so the server, the
allocator's tests and the HTTP models can use it without importing torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvpool.errors import LayoutMismatch

DTYPE_ALIASES: dict[str, str] = {
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float": "float32",
    "float32": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3fn": "float8_e4m3fn",
}
DTYPE_SIZES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}

DType = Literal["float16", "bfloat16", "float32", "float8_e4m3fn"]
Order = Literal["layer_major", "block_major", "kv_packed"]


class KVLayout(BaseModel):
    """Shape of the KV that an arena holds.

    ``layer_major`` stores, for each layer, all K blocks then all V blocks, so each per-layer view is
    contiguous (what paged-attention kernels like best). ``block_major`` stores each block's K and V for every
    layer contiguously, so one block is one contiguous byte range (what block copies and offloads like best).
    ``kv_packed`` is vLLM's own (0.26 and later, FlashAttention, FlashInfer and Triton backends): for each layer
    all its blocks, and in a block each token's heads with K then V side by side (``[block_size, heads, 2 *
    head_dim]``), so that a vLLM engine's KV cache tensor of a layer *is* that layer's region of the arena.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_layers: int = Field(4, ge=1, le=1024)
    num_kv_heads: int = Field(4, ge=1, le=1024)
    head_dim: int = Field(64, ge=1, le=4096)
    block_size: int = Field(16, ge=1, le=4096)
    dtype: DType = "float16"
    order: Order = "layer_major"

    @field_validator("dtype", mode="before")
    @classmethod
    def _canonical_dtype(cls, value: object) -> object:
        if isinstance(value, str):
            return DTYPE_ALIASES.get(value.lower(), value)
        return value

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def token_elems(self) -> int:
        """Elements of K (or of V) for one token of one layer."""
        return self.num_kv_heads * self.head_dim

    @property
    def block_layer_elems(self) -> int:
        """Elements of K (or of V) for one block of one layer."""
        return self.block_size * self.token_elems

    @property
    def block_nbytes(self) -> int:
        return 2 * self.num_layers * self.block_layer_elems * self.itemsize

    def view_geometry(self, num_blocks: int, layer: int, kv: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """Return (offset, shape, strides), in elements, of layer ``layer``'s K (kv=0) or V (kv=1) view.

        The shape is ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD) in both orders; only the
        block stride and the offset differ.
        """
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range: the arena has {self.num_layers} layers")
        e = self.block_layer_elems
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        inner = (self.token_elems, self.head_dim, 1)
        if self.order == "layer_major":
            offset = (2 * layer + kv) * num_blocks * e
            return offset, shape, (e, *inner)
        if self.order == "kv_packed":
            offset = 2 * layer * num_blocks * e + kv * self.head_dim
            return offset, shape, (2 * e, 2 * self.token_elems, 2 * self.head_dim, 1)
        offset = (2 * layer + kv) * e
        return offset, shape, (2 * self.num_layers * e, *inner)

    def layer_region(self, num_blocks: int, layer: int) -> tuple[int, int]:
        """(offset, size) in bytes of the span that holds layer ``layer``'s K and V of every block: what a vLLM
        engine takes as that layer's whole KV cache tensor. Only ``kv_packed`` keeps a layer in one span that
        holds nothing else."""
        if self.order != "kv_packed":
            raise LayoutMismatch(f"only a kv_packed arena holds each layer in a span of its own, not {self.order}")
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range: the arena has {self.num_layers} layers")
        size = num_blocks * 2 * self.block_layer_elems * self.itemsize
        return layer * size, size

    @property
    def reserved_blocks(self) -> int:
        """Leading blocks of each arena the pool never hands out: a ``kv_packed`` arena keeps its block 0 as the
        null block every vLLM engine writes padding into (vLLM's ``NULL_BLOCK_ID``)."""
        return 1 if self.order == "kv_packed" else 0

    def diff(self, other: KVLayout) -> dict[str, tuple[object, object]]:
        """Fields where ``other`` differs from this layout, as {field: (ours, theirs)}."""
        return {
            name: (getattr(self, name), getattr(other, name))
            for name in type(self).model_fields
            if getattr(self, name) != getattr(other, name)
        }

    def require(self, yours: KVLayout | None) -> None:
        """Refuse a model whose layout differs from this arena's: its views would be silently wrong."""
        if yours is not None and yours != self:
            diff = ", ".join(f"{k}: pool {a!r} != yours {b!r}" for k, (a, b) in self.diff(yours).items())
            raise LayoutMismatch(f"your model's KV layout does not match the arena's ({diff})")

    def namespace(self, model: str = "") -> str:
        """A string that names model and layout, so prefix hashes of different models never meet."""
        return (
            f"kvpool/v1|{model}|L{self.num_layers}|H{self.num_kv_heads}|D{self.head_dim}"
            f"|B{self.block_size}|{self.dtype}|{self.order}"
        )
