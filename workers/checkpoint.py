"""Reading a local Hugging Face-format checkpoint's tensors with ``safetensors``, sharded or not.

Only local files are read: a worker must start the same way on a machine with no network, and a model directory
is something the operator puts in place (``huggingface-cli download`` or a volume), not something a worker
fetches behind their back.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

INDEX = "model.safetensors.index.json"


def checkpoint_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint: those its index names, else every one in the directory."""
    root = Path(path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root} is not a checkpoint directory: it has no config.json")
    index = root / INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [root / n for n in names]
    else:
        files = sorted(root.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise FileNotFoundError(f"{root}: safetensors files missing: {missing or '*.safetensors'}")
    return files


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, on the CPU, in its stored dtype."""
    tensors: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = f.get_tensor(name)
    return tensors
