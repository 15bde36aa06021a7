"""One typed configuration object for the pool manager.

Past 400 lines on purpose: the one settings object holds every flag, its variable and its help (the house rule), and
checks them together.

Precedence: command-line flags over ``KVPOOL_*`` environment variables over defaults. The settings object is
built once at the edge (the CLI) and its fields are passed down; nothing deeper reads the environment.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import ByteSize, Field, SecretStr, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvpool.address import DEFAULT_PORT, default_socket
from kvpool.layout import DTYPE_ALIASES, DType, KVLayout, Order

#: the arena's size in blocks when none of --num-blocks, --arena-bytes and --gpu-memory-fraction is given
DEFAULT_NUM_BLOCKS = 1024


def pins_of(names: str) -> dict[str, int]:
    """``--names`` (``NAME=UID,...``) as a map of name (or prefix ending in ``*``) to uid; ValueError saying what is
    wrong."""
    pins: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in names.split(","))):
        name, eq, uid = item.partition("=")
        name, uid = name.strip(), uid.strip()
        if not eq or not name or not uid.isdigit() or len(name) > 128:
            raise ValueError(f"--names takes NAME=UID pairs separated by commas (like decode-0=1000), got {item!r}")
        if name in pins:
            raise ValueError(f"--names pins {name!r} twice")
        pins[name] = int(uid)
    return pins


def parse_size(value: str | int) -> int:
    """Bytes from ``123``, ``64MiB``, ``8GiB``, ``1.5G`` (binary units with ``i``, decimal without)."""
    try:
        return int(TypeAdapter(ByteSize).validate_python(value))
    except ValidationError:
        raise ValueError(f"cannot read {value!r} as a size (examples: 1073741824, 512MiB, 8GiB)") from None


class PoolSettings(BaseSettings):
    """Settings of ``kvpool serve``; every field is also a ``KVPOOL_<NAME>`` variable and a ``--<name>`` flag."""

    model_config = SettingsConfigDict(env_prefix="KVPOOL_", env_ignore_empty=True, extra="ignore", frozen=True)

    host: str = Field("127.0.0.1", description="TCP address to bind; loopback by default")
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="TCP port; 0 disables TCP")
    socket: Path | None = Field(
        default_factory=default_socket, description="Unix socket of the HTTP API; none turns it off"
    )
    socket_mode: int = Field(0o660, description="permissions of the Unix sockets, octal (owner and group)")
    fast_channel: bool = Field(True, description="also serve the binary fast channel at <socket>.fast")

    backend: Literal["auto", "cuda", "cpu"] = Field("auto", description="cuda when present, else cpu")
    device: int = Field(0, ge=0, description="CUDA device ordinal of the arena")
    devices: str | None = Field(None, description="one arena per listed device, e.g. 0,1 (overrides device)")
    num_blocks: int | None = Field(
        None,
        ge=1,
        description="arena size in blocks",
        json_schema_extra={"shown_default": f"{DEFAULT_NUM_BLOCKS} when no size is given"},
    )
    arena_bytes: ByteSize | None = Field(None, ge=1, description="arena size in bytes (512MiB, 8GiB, ...)")
    gpu_memory_fraction: float | None = Field(None, gt=0, le=0.98, description="arena size: share of free GPU memory")
    shm_dir: Path = Field(Path("/dev/shm"), description="where the cpu backend creates its arena file")
    arena_handle: Literal["auto", "vmm", "legacy"] = Field(
        "auto",
        description="how workers map the CUDA arena: vmm (an fd over the fast channel's Unix socket), "
        "legacy (a CUDA IPC handle in /arena; needs a shared PID namespace), auto (vmm where possible; legacy on a "
        "pool with --peers, whose NIXL reads between GPUs need it)",
    )
    host_blocks: int | None = Field(
        None, ge=1, description="host tier size in blocks: evicted prefix blocks are kept in host memory (off: none)"
    )
    host_bytes: ByteSize | None = Field(None, ge=1, description="host tier size in bytes (64GiB, ...)")
    peer_copy: bool = Field(
        True,
        description="with several arenas (--devices): a lookup that another GPU's arena serves further gets those "
        "blocks copied into its own arena (one peer copy) and indexed there",
    )

    peers: str | None = Field(
        None,
        description="pools on other nodes this pool reads handoffs and prefixes from, by URL, comma-separated "
        "(needs --token, the same on every pool, and NIXL: kvpool[nixl]; docs/across-nodes.md)",
    )
    peer_timeout_s: float = Field(10.0, gt=0, description="a peer's answer, or a read from it, must end within this")

    # the default layout is the one the workers' default --random-model needs
    num_layers: int = Field(4, ge=1, le=1024, description="layers of the model whose KV the arena holds")
    num_kv_heads: int = Field(2, ge=1, le=1024, description="KV heads per layer")
    head_dim: int = Field(32, ge=1, le=4096, description="size of one attention head")
    block_size: int = Field(16, ge=1, le=4096, description="tokens per block")
    dtype: DType = Field("float16", description="KV dtype (fp16, bf16, fp32 and fp8 are accepted too)")
    order: Order = Field(
        "layer_major",
        description="layer_major: contiguous per-layer views; block_major: contiguous blocks; kv_packed: vLLM's own "
        "layout, each layer one span (resident vLLM engines; block 0 is kept as vLLM's null block)",
    )
    model: str = Field("", description="model name mixed into prefix hashes, so models never share KV")
    prefix_hash: Literal["xxh3", "sha256"] = Field(
        "xxh3", description="hash of prefix chains: xxh3 (fast), or sha256 where tenants must not craft collisions"
    )

    lease_ttl_s: float = Field(10.0, gt=0, description="a session without heartbeat for this long expires")
    handoff_ttl_s: float = Field(60.0, gt=0, description="an unclaimed handoff is released after this long")
    lapsed_sessions: Literal["quarantine", "kill"] = Field(
        "quarantine",
        description="a session whose lease ran out while its process (known over the Unix socket) lives: its "
        "uncommitted blocks stay quarantined until that process exits, or the pool kills it (SIGKILL) first",
    )
    token: SecretStr | None = Field(None, description="bearer token required on every endpoint but /health")
    max_body_bytes: ByteSize = Field(ByteSize(16 << 20), ge=1024, description="largest accepted request body")
    max_sessions: int = Field(1024, ge=1, description="live sessions at once; more are refused with 429")
    max_sessions_per_peer: int = Field(
        256,
        ge=1,
        description="live sessions of one peer (a user on the Unix socket, an address on TCP, loopback as one)",
    )
    max_handoffs: int = Field(65536, ge=1, description="parked handoffs at once, all sessions together")
    max_handoffs_per_peer: int = Field(
        16384,
        ge=1,
        description="parked handoffs that the sessions of one peer parked (a peer as for max_sessions_per_peer)",
    )
    names: str = Field(
        "",
        description="session names pinned to a Unix user, as NAME=UID separated by commas (a NAME ending in * pins "
        "every name it starts): only that user's processes, over the Unix socket, may open them",
    )
    max_handoffs_per_session: int = Field(
        4096, ge=1, description="handoffs a live session has parked, and handoffs addressed to it, at once"
    )
    max_meta_bytes: int = Field(16 << 10, ge=2, description="largest handoff meta, as compact JSON")
    max_claims_per_session: int = Field(64, ge=1, description="claims of one session waiting in the pool at once")
    max_fast_connections: int = Field(4096, ge=1, description="fast-channel connections open at once")
    max_http_connections: int = Field(
        1024, ge=1, description="HTTP connections open at once, per listener (TCP and the Unix socket each)"
    )
    max_requests_per_peer: int = Field(
        1,
        ge=1,
        description="HTTP requests without the token (/health, refusals) of one peer (a user on the Unix socket, an "
        "address on TCP, loopback as one) read or answered at once; each connection parses one request at a time",
    )
    hello_timeout_s: float = Field(10.0, gt=0, description="a fast-channel connection must say hello within this")
    read_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a connection must send the rest of a request (HTTP headers and body, a fast-channel frame) "
        "within this of its first byte, and a new HTTP connection its first request; else it is closed",
    )
    max_fast_buffer_bytes: ByteSize = Field(
        ByteSize(256 << 20),
        ge=1024,
        description="bytes of fast-channel frames being read or answered, all connections together",
    )
    slabs: bool = Field(
        False,
        description="serve reservation slabs and a slab table in shared memory, so that "
        "alloc, free and handoffs between live sessions skip the round trip (docs/operations.md)",
    )
    slab_regions: int = Field(256, ge=1, le=1 << 16, description="sessions that may hold a slab at once")
    slab_max_blocks: int = Field(
        4096,
        ge=1,
        le=1 << 20,
        description="most blocks one session's slab holds, handed blocks not yet settled included",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="log level")

    # KV events in vLLM's format, for KV-aware routers (docs/kv-events.md)
    kv_events_endpoint: str | None = Field(
        None,
        description="ZeroMQ address of the pool's KV events PUB socket (tcp://*:5557, "
        "ipc:///run/kvpool/events; see --kv-events-mode); none: off",
    )
    kv_events_mode: Literal["auto", "bind", "connect"] = Field(
        "auto",
        description="bind the KV events endpoint, or connect to a subscriber that binds (llm-d's central "
        "indexer); auto, as vLLM does: bind a wildcard host (tcp://*:5557), ipc:// or inproc://, else connect",
    )
    kv_events_replay_endpoint: str | None = Field(
        None, description="ZeroMQ ROUTER address the pool binds to replay missed KV event batches; none: off"
    )
    kv_events_topic: str = Field("", max_length=256, description="topic frame of every KV events message")
    kv_events_buffer_steps: int = Field(10_000, ge=1, description="KV event batches kept for replay")
    kv_events_queue_size: int = Field(100_000, ge=1, description="KV events waiting to be sent; more are dropped")
    kv_events_hwm: int = Field(100_000, ge=0, description="ZeroMQ high-water mark of the PUB socket, in messages")
    kv_events_hashes: Literal["int", "bytes"] = Field(
        "int", description="block hashes in events: int, a key's last 8 bytes (vLLM's default), or the whole key"
    )
    kv_events_form: Literal["map", "array"] = Field(
        "map", description="events as tagged maps (vLLM 0.26) or tagged arrays (earlier vLLM releases)"
    )

    @field_validator("socket_mode", mode="before")
    @classmethod
    def _octal(cls, value: Any) -> Any:
        return int(value, 8) if isinstance(value, str) else value

    @field_validator("socket", mode="before")
    @classmethod
    def _no_socket(cls, value: Any) -> Any:
        return None if isinstance(value, str) and value.lower() in {"", "none", "off"} else value

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint", mode="before")
    @classmethod
    def _endpoint(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lower() in {"", "none", "off"}:
            return None
        if isinstance(value, str) and not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"a ZeroMQ address starts with tcp://, ipc:// or inproc://, got {value!r}")
        return value

    @field_validator("devices")
    @classmethod
    def _devices(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = [p.strip() for p in value.split(",") if p.strip()]
        if not parts or not all(p.isdigit() for p in parts) or len(set(parts)) != len(parts):
            raise ValueError(f"devices must be distinct ordinals separated by commas (like 0,1), got {value!r}")
        return ",".join(parts)

    @property
    def arena_handle_for_peers(self) -> Literal["auto", "vmm", "legacy"]:
        """``auto`` on a pool with ``--peers`` is legacy CUDA IPC: NIXL's UCX reads a peer GPU's memory through legacy
        IPC handles, which VMM memory lacks, so a VMM arena is read through the host (two H200s of one host:
        0.4 GB/s against 303 GB/s for cudaMalloc arenas, docs/across-nodes.md)."""
        if self.arena_handle == "auto" and self.peers and self.backend != "cpu":
            return "legacy"
        return self.arena_handle

    @field_validator("peers")
    @classmethod
    def _peers(cls, value: str | None) -> str | None:
        if value is None or value.lower() in {"", "none", "off"}:
            return None
        urls = [u.strip().rstrip("/") for u in value.split(",") if u.strip()]
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"a peer is an http:// or https:// URL of a pool, got {bad[0]!r}")
        return ",".join(urls)

    @field_validator("names")
    @classmethod
    def _names(cls, value: str) -> str:
        pins_of(value)
        return value

    @property
    def pins(self) -> dict[str, int]:
        return pins_of(self.names)

    @property
    def peer_list(self) -> list[str]:
        return self.peers.split(",") if self.peers else []

    @property
    def device_list(self) -> list[int]:
        return [int(p) for p in self.devices.split(",")] if self.devices else [self.device]

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> Any:
        return KVLayout.model_validate({"dtype": value}).dtype if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_size(self) -> PoolSettings:
        given = [n for n in ("num_blocks", "arena_bytes", "gpu_memory_fraction") if getattr(self, n) is not None]
        if len(given) > 1:
            flags = " and ".join("--" + n.replace("_", "-") for n in given)
            raise ValueError(f"give the arena size one way only, not {flags}")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint: replay serves what it publishes")
        events, replay = self.kv_events_endpoint, self.kv_events_replay_endpoint
        if events is not None and events == replay and not events.endswith(":*"):  # :* binds a free port
            raise ValueError("--kv-events-endpoint and --kv-events-replay-endpoint must be different addresses")
        if self.host_blocks is not None and self.host_bytes is not None:
            raise ValueError("give the host tier's size one way only, not --host-blocks and --host-bytes")
        if self.max_fast_buffer_bytes < self.max_body_bytes:
            raise ValueError(
                f"--max-fast-buffer-bytes ({self.max_fast_buffer_bytes}) must be at least --max-body-bytes "
                f"({self.max_body_bytes}), or a frame of the largest size could never be read"
            )
        if self.peers is not None and self.token is None:
            raise ValueError("--peers needs --token: pools on other nodes present it to each other")
        if self.port == 0 and self.socket is None:
            raise ValueError("nothing to listen on: give a TCP port or a Unix socket")
        if self.arena_handle == "vmm" and self.fast_socket is None:
            raise ValueError(
                "--arena-handle vmm passes the arena's fd over the fast channel's Unix socket: give --socket and "
                "keep --fast-channel on, or use --arena-handle legacy (or auto)"
            )
        return self

    @property
    def layout(self) -> KVLayout:
        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
            order=self.order,
        )

    @property
    def fast_socket(self) -> Path | None:
        if not self.fast_channel or self.socket is None:
            return None
        return self.socket.with_name(self.socket.name + ".fast")

    @property
    def url(self) -> str:
        """Where local clients should connect: the Unix socket when there is one."""
        if self.socket is not None:
            return f"unix://{self.socket}"
        return f"http://{self.host}:{self.port}"


def _choices(name: str, annotation: Any) -> list[str] | None:
    if name == "dtype":
        return sorted(DTYPE_ALIASES)
    if typing.get_origin(annotation) is Literal:
        return [str(a) for a in typing.get_args(annotation)]
    return None


#: ``kvpool serve --help``'s sections, each field in one; a field in none is listed under "other"
GROUPS: dict[str, tuple[str, ...]] = {
    "arena and layout": (
        "backend", "device", "devices", "num_blocks", "arena_bytes", "gpu_memory_fraction", "shm_dir", "arena_handle",
        "num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "order", "model",
    ),
    "network and security": ("host", "port", "socket", "socket_mode", "fast_channel", "token"),
    "across nodes (docs/across-nodes.md)": ("peers", "peer_timeout_s"),
    "prefix cache and host tier": ("prefix_hash", "host_blocks", "host_bytes", "peer_copy"),
    "sessions and limits": (
        "lease_ttl_s", "handoff_ttl_s", "lapsed_sessions", "max_body_bytes", "max_sessions", "max_sessions_per_peer",
        "max_handoffs", "max_handoffs_per_peer", "max_handoffs_per_session", "names", "max_meta_bytes",
        "max_claims_per_session", "max_fast_connections", "hello_timeout_s", "max_http_connections",
        "max_requests_per_peer", "read_timeout_s", "max_fast_buffer_bytes",
    ),
    "slabs (docs/operations.md)": ("slabs", "slab_regions", "slab_max_blocks"),
    "KV events (docs/kv-events.md)": (
        "kv_events_endpoint", "kv_events_mode", "kv_events_replay_endpoint", "kv_events_topic",
        "kv_events_buffer_steps", "kv_events_queue_size", "kv_events_hwm", "kv_events_hashes", "kv_events_form",
    ),
    "logging": ("log_level",),
}  # fmt: skip


def backend_problem(settings: PoolSettings, cuda_available: Callable[[], bool]) -> str | None:
    """A setting only a CUDA arena can use, on a pool whose arena will be in host memory: said (with what to use
    instead) before anything starts, not after the pool has logged that it listens and then stopped."""
    if settings.backend == "cpu":
        why = "--backend cpu"
    elif cuda_available():
        return None
    elif settings.backend == "cuda":
        return "--backend cuda (KVPOOL_BACKEND): torch sees no CUDA device here: use --backend cpu (or auto)"
    else:
        why = "torch sees no CUDA device, so --backend auto puts it there"
    if settings.gpu_memory_fraction is not None:
        return (
            "--gpu-memory-fraction (KVPOOL_GPU_MEMORY_FRACTION) sizes an arena in GPU memory, and this pool's is in "
            f"host memory ({why}): give --num-blocks N or --arena-bytes SIZE instead"
        )
    return None


def _metavar(name: str, annotation: Any) -> str:
    """A short placeholder for the flag's value: what kind of value it is, not the flag's name again."""
    if name.endswith("_s"):
        return "SECONDS"
    if name.endswith("_endpoint"):
        return "ADDRESS"
    kinds = {int: "N", float: "X", str: "TEXT", Path: "PATH", ByteSize: "SIZE", SecretStr: "TOKEN"}
    for arg in (annotation, *typing.get_args(annotation)):
        if arg in kinds:
            return kinds[arg]
    return "VALUE"


def _shown(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20 and value % (1 << 20) == 0:
        return ByteSize(value).human_readable()
    return "none" if value is None else '""' if value == "" else str(value)


def add_settings_arguments(
    parser: argparse.ArgumentParser,
    settings_cls: type[BaseSettings],
    groups: dict[str, tuple[str, ...]] | None = None,
) -> None:
    """Add a ``--flag`` for every settings field, its help, choices, default and variable read from the field, in
    the sections ``groups`` names (a field in none goes under "other").

    The flags default to SUPPRESS, so a flag not given is absent and the variable or the field's default applies.
    """
    prefix = settings_cls.model_config.get("env_prefix", "")
    sections: dict[str, Any] = {}
    section_of = {field: title for title, fields in (groups or {}).items() for field in fields}
    for title in groups or {}:
        sections[title] = parser.add_argument_group(title)
    for name, info in settings_cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = info.get_default(call_default_factory=True)
        if name == "socket_mode":
            default = f"{default:o}"
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        shown = extra.get("shown_default") or _shown(default)
        help_text = f"{info.description} [{shown}; {prefix}{name.upper()}]"
        if info.annotation is bool or set(typing.get_args(info.annotation)) == {bool, type(None)}:
            kwargs: dict[str, Any] = {"action": argparse.BooleanOptionalAction}
        else:
            choices = _choices(name, info.annotation)
            kwargs = {"choices": choices} if choices else {"metavar": _metavar(name, info.annotation)}
            if name == "dtype":
                kwargs["metavar"] = "{" + ",".join(typing.get_args(DType)) + "}"
        where = parser
        if groups is not None:
            title = section_of.get(name, "other")
            if title not in sections:
                sections[title] = parser.add_argument_group(title)
            where = sections[title]
        where.add_argument(flag, default=argparse.SUPPRESS, help=help_text.replace("%", "%%"), **kwargs)


def settings_from_args(args: argparse.Namespace, settings_cls: type[PoolSettings] = PoolSettings) -> PoolSettings:
    given = {k: v for k, v in vars(args).items() if k in settings_cls.model_fields and v is not None}
    return settings_cls(**given)


def describe_error(exc: ValidationError, settings_cls: type[BaseSettings] = PoolSettings) -> str:
    """One line per bad setting, naming its flag and variable, without pydantic's links."""
    prefix = settings_cls.model_config.get("env_prefix", "")
    parts = []
    for error in exc.errors(include_url=False):
        field = str(error["loc"][0]) if error["loc"] else ""
        msg = error["msg"].removeprefix("Value error, ")
        if field in settings_cls.model_fields:
            got = error.get("input")
            shown = "" if isinstance(got, dict) or field == "token" else f", got {got!r}"
            parts.append(f"--{field.replace('_', '-')} ({prefix}{field.upper()}): {msg}{shown}")
        else:
            parts.append(msg)
    return "; ".join(parts)
