"""Outputs follow the umask (0644 files / 0755 folders under 0022), including files written
atomically through temporary files (mkstemp / mkdtemp / safetensors create them owner-only)."""
from __future__ import annotations

import os
import stat

import pytest
import torch

from openrlhf_div.io import atomic_write_json, atomic_write_text


def _mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.fixture(params=[0o022, 0o027])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def test_atomic_writes_follow_the_umask(tmp_path, umask):
    atomic_write_text(str(tmp_path / "a.txt"), "x")
    atomic_write_json(str(tmp_path / "sub" / "b.json"), {"a": 1})
    assert _mode(tmp_path / "a.txt") == 0o666 & ~umask
    assert _mode(tmp_path / "sub" / "b.json") == 0o666 & ~umask
    assert _mode(tmp_path / "sub") == 0o777 & ~umask


def test_saved_models_follow_the_umask(tmp_path, umask):
    from openrlhf_div.engines.local.models import save_model
    from openrlhf_div.engines.local.tiny import build_tiny_model
    from openrlhf_div.engines.megatron.hf_io import ShardedSafetensorsWriter

    model, tok = build_tiny_model("ab=", seed=0, hidden_size=16, num_layers=1)
    save_model(model, tok, str(tmp_path / "m"))
    w = ShardedSafetensorsWriter(str(tmp_path / "mg"))
    w.add("x", torch.zeros(3))
    w.close()
    for root in (tmp_path / "m", tmp_path / "mg"):
        assert _mode(root) == 0o777 & ~umask
        files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
        assert any(f.endswith(".safetensors") for f in files)
        assert {f: oct(_mode(f)) for f in files if _mode(f) != 0o666 & ~umask} == {}
