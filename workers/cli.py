"""What the worker programs share on the command line: choosing the model, logging, JSON-lines output."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from kvpool.client import PoolClient
from kvpool.layout import KVLayout
from kvpool.protocol import Role
from kvpool.workers.kvcache import check_layout, kv_dtype
from kvpool.workers.model import LlamaConfig, LlamaModel

#: the random model the demo and the tests use unless told otherwise: small enough for a CPU, big enough to
#: have several layers, grouped-query heads and a vocabulary worth sampling from.
TINY = LlamaConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    which = group.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", type=Path, help="local Hugging Face-format checkpoint directory")
    which.add_argument("--random-model", action="store_true", help="seeded random weights (see --model-config)")
    group.add_argument("--seed", type=int, default=0, help="seed of --random-model")
    group.add_argument(
        "--model-config", type=Path, default=None, help="config.json that shapes --random-model (default: tiny)"
    )
    group.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default=None,
        help="compute dtype (default: the arena's KV dtype)",
    )
    group.add_argument(
        "--batch-invariant",
        action="store_true",
        help="fixed-shape forwards on a GPU, so tokens do not depend on what shares a batch (slower; for checks)",
    )


def add_pool_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pool", default=None, help="pool URL: unix:///path/kvpool.sock or http://127.0.0.1:8470 [env KVPOOL_URL]"
    )
    parser.add_argument(
        "--name",
        default=None,
        help="session name shown in the pool's stats, and what a prefill's --handoff-to names; KVPOOL_NAME_KEY in "
        "the environment holds it for this worker across restarts",
    )
    parser.add_argument(
        "--device", type=int, default=None, help="the GPU whose arena to use, as the pool names it (default: its first)"
    )
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice, all cores)"
    )


def model_config(args: argparse.Namespace) -> LlamaConfig:
    if args.model is not None:
        return LlamaConfig.from_dir(args.model)
    if args.model_config is not None:
        return LlamaConfig.from_dict(json.loads(args.model_config.read_text()))
    return TINY


def load_model(args: argparse.Namespace, layout: KVLayout, device: torch.device) -> LlamaModel:
    """The model the flags name, on the arena's device, after checking that its KV fits the arena."""
    config = model_config(args)
    check_layout(config, layout)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # kernels launch on the current device: make it the arena's, not cuda:0
    dtype = getattr(torch, args.dtype) if args.dtype else kv_dtype(layout)
    if args.model is not None:
        model = LlamaModel.from_pretrained(args.model, device=device, dtype=dtype)
    else:
        model = LlamaModel.random(config, seed=args.seed, device=device, dtype=dtype)
    model.batch_invariant = args.batch_invariant
    return model


def connect(args: argparse.Namespace, role: Role) -> PoolClient:
    """A session with the pool; the model's layout is checked once the arena's block size is known.

    A decode worker opens an inbox, so that a prefill that addresses its handoffs to it (``--handoff-to``) hands
    them over directly.
    """
    return PoolClient(args.pool, name=args.name or f"{role}-worker", role=role, inbox=role == "decode")


def setup(args: argparse.Namespace) -> None:
    """Logging to stderr (stdout carries the JSON lines) and torch's CPU threads.

    Workers that share a machine's cores should split them (``--threads``): two processes that each spin a
    thread per core slow each other down many times over.
    """
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)


def emit(record: dict[str, Any]) -> None:
    """One JSON line on stdout, flushed at once: the workers' output is read line by line by other programs."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def synchronize(device: torch.device) -> None:
    """Wait until the kernels queued on this process's current stream of ``device`` have finished.

    The workers call it before telling the pool that blocks are written (commit, handoff) or no longer read
    (free): the pool's control path carries no GPU ordering, so this wait is what makes the next process's
    reads or writes of those blocks safe. No-op on the CPU, where every op has finished when it returns.
    """
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
