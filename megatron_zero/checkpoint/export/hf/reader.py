"""Read a local Hugging Face model directory tensor by tensor: config.json plus safetensors or .bin weights,
one file or sharded with an index. Nothing is loaded before it is asked for.

safetensors files are opened with the `safetensors` library (`safe_open`: each `get_tensor` reads one
tensor); `.bin` files with `torch.load(weights_only=True, mmap=True)`, so only data is unpickled and a
tensor's pages are read when it is used. Pages read through a mapping stay resident while it lives, so
safetensors files are opened afresh for each tensor and a .bin is re-mapped every BIN_REMAP_BYTES:
memory stays about one tensor (at most BIN_REMAP_BYTES more for a .bin), never the model.
Base-model files (GPT2Model, LlamaModel: no `transformer.` or `model.` prefix) are read by the same names.
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, Iterable, List

import torch
from safetensors import safe_open

from ...errors import CheckpointError

BIN_REMAP_BYTES = 256 << 20  # a .bin's mapping is dropped (and made afresh) after this much has been read
WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                "pytorch_model.bin")


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable JSON file ({e})") from None


class HFModelDir:
    """`.config` (config.json as a dict), `.names` (every tensor), `get(name)` -> CPU tensor."""

    def __init__(self, directory: str):
        if not os.path.isdir(directory):
            raise CheckpointError(f"--input-dir {directory} is not a directory")
        self.directory = directory
        self._handles: Dict[str, object] = {}  # at most one memory-mapped .bin
        self._bin_bytes = 0
        self.config = read_json(os.path.join(directory, "config.json"))
        found = next((f for f in WEIGHT_FILES if os.path.isfile(os.path.join(directory, f))), None)
        if found is None:
            raise CheckpointError(f"{directory} holds none of {', '.join(WEIGHT_FILES)}")
        if found.endswith(".index.json"):
            index = read_json(os.path.join(directory, found)).get("weight_map")
            if not isinstance(index, dict):
                raise CheckpointError(f"{os.path.join(directory, found)} has no weight_map")
            self.file_of: Dict[str, str] = dict(index)
        else:
            self.file_of = {n: found for n in self._open(found).keys()}
        self.names = list(self.file_of)

    def _open(self, filename: str):
        """A safetensors handle (opened afresh each time: a handle maps its whole file, and the pages read
        through it stay resident until it closes), or the .bin's memory-mapped dict (kept for BIN_REMAP_BYTES)."""
        if filename in self._handles:
            return self._handles[filename]
        path = os.path.join(self.directory, filename)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing (named by the weight index)")
        try:
            if filename.endswith(".safetensors"):
                return safe_open(path, framework="pt", device="cpu")
            self._handles = {filename: torch.load(path, map_location="cpu", weights_only=True, mmap=True)}
            self._bin_bytes = 0
            return self._handles[filename]
        except Exception as e:  # safetensors and torch raise their own types for damaged files
            raise CheckpointError(f"{path} is not a readable weights file ({type(e).__name__}: {e})") from None

    def resolve(self, name: str) -> str:
        """The stored name of `name` (which may lack its `transformer.`/`model.` prefix in base-model files)."""
        if name in self.file_of:
            return name
        stripped = name.split(".", 1)[1] if "." in name else name
        if stripped in self.file_of:
            return stripped
        raise CheckpointError(f"{self.directory} has no tensor {name}, which a "
                              f"{', '.join(self.config.get('architectures') or ['model'])} of this config.json has")

    def get(self, name: str) -> torch.Tensor:
        stored = self.resolve(name)
        filename = self.file_of[stored]
        handle = self._open(filename)
        try:
            if hasattr(handle, "get_tensor"):
                return handle.get_tensor(stored)
            t = handle[stored]
            self._bin_bytes += t.numel() * t.element_size()
            if self._bin_bytes > BIN_REMAP_BYTES:  # unmap, so that the pages read so far leave this process
                self._handles = {}
            return t
        except Exception as e:  # a truncated or damaged file fails here, in the library's own types
            raise CheckpointError(f"{os.path.join(self.directory, filename)}: tensor {stored} cannot be read "
                                  f"({type(e).__name__}: {e})") from None

    def unused(self, used: Iterable[str], skipped: Iterable[str]) -> List[str]:
        """Tensors neither used nor matching a `skipped` pattern (a model this mapping does not describe)."""
        done = {self.resolve(n) for n in used}
        patterns = [re.compile(p) for p in skipped]
        return [n for n in self.names if n not in done and not any(p.search(n) for p in patterns)]

    def close(self):
        self._handles.clear()
