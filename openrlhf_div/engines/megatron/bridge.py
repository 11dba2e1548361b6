"""megatron-bridge adapter: load / export Hugging Face weights with NVIDIA's converter.

Used when ``megatron.bridge`` is importable (the GPU image: it needs Python 3.12 and
transformer-engine) and ``--megatron.weights`` is ``auto`` or ``bridge``; otherwise the engine
uses the documented built-in mapping (:mod:`.weights`). The model is built by
:func:`.model.build_gpt_model` either way (standard Megatron-core parameter names, which the
bridge's Qwen2 / Llama mappings address); the bridge only moves weights:

* ``AutoBridge.from_hf_pretrained(path).load_hf_weights([model], hf_path=path)``
* ``AutoBridge.export_hf_weights([model], cpu=False, show_progress=False)`` yields
  ``(hf_name, full tensor)`` on every rank (gathered over TP / PP).

Written against Megatron-Bridge's ``AutoBridge`` API; not exercised in this repository's CPU
tests (the package cannot be installed on Python 3.11).
"""
from __future__ import annotations

from typing import Dict, Iterator, Tuple

import torch

__all__ = ["load_hf_with_bridge", "export_hf_with_bridge"]

_BRIDGES: Dict[int, object] = {}


def load_hf_with_bridge(model, pretrain: str) -> None:
    from megatron.bridge import AutoBridge

    if pretrain is None:
        raise ValueError("megatron-bridge loads from a Hugging Face checkpoint directory; pretrain is None")
    bridge = AutoBridge.from_hf_pretrained(pretrain)
    bridge.load_hf_weights([model], hf_path=pretrain)
    _BRIDGES[id(model)] = bridge


def export_hf_with_bridge(model) -> Iterator[Tuple[str, torch.Tensor]]:
    bridge = _BRIDGES.get(id(model))
    if bridge is None:
        raise RuntimeError("export_hf_with_bridge: this model was not loaded with megatron-bridge")
    for item in bridge.export_hf_weights([model], cpu=False, show_progress=False):
        name, tensor = item[0], item[1]
        yield name, tensor
