"""Streaming writer of a Hugging Face checkpoint: sharded safetensors + index + config (+ tokenizer).

Tensors arrive one at a time (from ``MegatronEngine.iter_hf_weights``); a shard is flushed to
disk once it holds ``max_shard_bytes``, so a 32B model (64 GB in bf16) never sits in host
memory whole. Everything is written to ``<out_dir>.tmp`` and moved into place at the end, so an
interrupted export never leaves a half-written checkpoint under the final name.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Dict, List, Optional

import torch

from openrlhf_div.io import apply_umask_modes_tree

__all__ = ["ShardedSafetensorsWriter"]


class ShardedSafetensorsWriter:
    def __init__(self, out_dir: str, max_shard_bytes: int = 4 << 30):
        self.out_dir = os.path.abspath(out_dir)
        self.tmp_dir = self.out_dir.rstrip("/") + ".tmp"
        if os.path.exists(self.tmp_dir):
            shutil.rmtree(self.tmp_dir)
        os.makedirs(self.tmp_dir)
        self.max_shard_bytes = int(max_shard_bytes)
        self._buf: Dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._files: List[List[str]] = []
        self._total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._buf or any(name in f for f in self._files):
            raise ValueError(f"tensor {name!r} written twice")
        t = tensor.detach().to("cpu").contiguous().clone()
        nbytes = t.numel() * t.element_size()
        if self._buf and self._buf_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buf[name] = t
        self._buf_bytes += nbytes
        self._total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        idx = len(self._files)
        save_file(self._buf, os.path.join(self.tmp_dir, f"part-{idx:05d}.safetensors"), metadata={"format": "pt"})
        self._files.append(list(self._buf))
        self._buf, self._buf_bytes = {}, 0

    def close(self, config=None, tokenizer=None) -> str:
        if self._buf or not self._files:
            self._flush()
        n = len(self._files)
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for i, (tensors, final) in enumerate(zip(self._files, names)):
            os.replace(os.path.join(self.tmp_dir, f"part-{i:05d}.safetensors"), os.path.join(self.tmp_dir, final))
            weight_map.update({t: final for t in tensors})
        if n == 1:
            os.replace(os.path.join(self.tmp_dir, names[0]), os.path.join(self.tmp_dir, "model.safetensors"))
        else:
            with open(os.path.join(self.tmp_dir, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": self._total}, "weight_map": weight_map}, f, indent=2)
        if config is not None:
            config.save_pretrained(self.tmp_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(self.tmp_dir)
        apply_umask_modes_tree(self.tmp_dir)  # safetensors writes 0600 whatever the umask
        if os.path.exists(self.out_dir):
            old = self.out_dir.rstrip("/") + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(self.out_dir, old)
            os.replace(self.tmp_dir, self.out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.tmp_dir, self.out_dir)
        return self.out_dir

    @staticmethod
    def total_bytes(out_dir: str) -> Optional[int]:
        index = os.path.join(out_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                return int(json.load(f)["metadata"]["total_size"])
        return None
