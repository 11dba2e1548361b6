"""``model.dtype: auto`` (engines/local/dtype_probe.py): the choice logic with a faked probe (no
timing in tests), the trainer following it (bfloat16 with float32 master weights), and the choice
printed in one line and kept in run_info.json and the run's config.yaml."""
from __future__ import annotations

import json
import types

import pytest
import torch

from openrlhf_div.engines.local import dtype_probe
from openrlhf_div.engines.local.config import ConfigError, load_config
from openrlhf_div.engines.local.trainer import Trainer

from helpers import local_overrides, write_copy_last_data


class Cfg:
    def __init__(self, hidden, inter=None):
        self.hidden_size, self.intermediate_size = hidden, inter


def fake(f32, bf16):
    calls = []

    def probe(hidden, inter, device):
        calls.append((hidden, inter, str(device)))
        return {"float32": f32, "bfloat16": bf16}

    probe.calls = calls
    return probe


def test_choice_logic_with_a_faked_probe(monkeypatch):
    monkeypatch.setattr(dtype_probe, "PROBE", fake(0.010, 0.003))
    c = dtype_probe.choose_dtype(Cfg(576, 1536), "cpu")
    assert (c["dtype"], c["master_weights"]) == ("bfloat16", True)
    assert c["probe_seconds"] == {"float32": 0.010, "bfloat16": 0.003}
    assert "float32 10.00 ms, bfloat16 3.00 ms" in c["reason"] and dtype_probe.PROBE.calls == [(576, 1536, "cpu")]
    # slower, or not faster by the margin: float32
    for bf16 in (0.030, 0.010 / dtype_probe.MARGIN):
        monkeypatch.setattr(dtype_probe, "PROBE", fake(0.010, bf16))
        assert dtype_probe.choose_dtype(Cfg(576, 1536), "cpu")["dtype"] == "float32"
    # no intermediate size: 4 x hidden
    monkeypatch.setattr(dtype_probe, "PROBE", fake(1.0, 0.1))
    dtype_probe.choose_dtype(Cfg(512), "cpu")
    assert dtype_probe.PROBE.calls == [(512, 2048, "cpu")]

    def boom(*a):
        raise AssertionError("a tiny model is not probed")

    monkeypatch.setattr(dtype_probe, "PROBE", boom)
    c = dtype_probe.choose_dtype(Cfg(64), "cpu")
    assert c["dtype"] == "float32" and c["probe_seconds"] is None and "tiny" in c["reason"]


def test_the_real_probe_returns_both_timings():
    t = dtype_probe.matmul_probe(32, 64, "cpu", tokens=8, reps=1)
    assert set(t) == {"float32", "bfloat16"} and all(v > 0 for v in t.values())


def test_config_accepts_auto_and_refuses_the_rest():
    assert load_config(None, ["task=toy_copy"]).model.dtype == "auto"
    load_config(None, ["task=toy_copy", "model.master_weights=true"])  # auto may choose bfloat16
    with pytest.raises(ConfigError, match="model.dtype must be auto, float32, bfloat16 or float16, got 'fp8'"):
        load_config(None, ["task=toy_copy", "model.dtype=fp8"])


@pytest.mark.parametrize("faster", ["bfloat16", "float32"])
def test_the_trainer_follows_the_choice_and_records_it(faster, tmp_path, monkeypatch, capsys):
    data = write_copy_last_data(tmp_path)
    monkeypatch.setattr(dtype_probe, "PROBE", fake(0.010, 0.002 if faster == "bfloat16" else 0.050))
    cfg = load_config(None, local_overrides(data, tmp_path / "run", extra=[
        "model.tiny_hidden_size=256", "model.tiny_layers=1", "optim.steps=1"]))
    tr = Trainer(cfg)
    line = [x for x in capsys.readouterr().out.splitlines() if "model.dtype=auto" in x]
    assert len(line) == 1 and "float32 10.00 ms" in line[0]
    want = torch.bfloat16 if faster == "bfloat16" else torch.float32
    assert {p.dtype for p in tr.model.parameters()} == {want}
    assert (tr.master is not None) == (faster == "bfloat16")
    tr.train()
    info = json.load(open(tmp_path / "run" / "run_info.json"))
    flat = json.dumps(info)
    assert f'"dtype": "{faster}"' in flat and '"probe_seconds": {"float32": 0.01' in flat
    assert f"dtype: {faster}" in (tmp_path / "run" / "config.yaml").read_text()  # a resume keeps the choice


def test_the_probe_keeps_each_dtypes_fastest_interleaved_round(monkeypatch):
    """A round slowed by another process (here float32's first and bfloat16's last) does not
    decide: each dtype's fastest round counts, the dtypes alternating within each round."""
    deltas = iter([0.050, 0.004,    # round 1: float32 slowed down, bfloat16
                   0.010, 0.004,    # round 2
                   0.011, 0.090])   # round 3: bfloat16 slowed down
    clock = {"t": 0.0, "start": True}

    def fake_perf_counter():
        if not clock["start"]:
            clock["t"] += next(deltas)
        clock["start"] = not clock["start"]
        return clock["t"]

    monkeypatch.setattr(dtype_probe, "time", types.SimpleNamespace(perf_counter=fake_perf_counter))
    t = dtype_probe.matmul_probe(32, 64, "cpu", tokens=8, reps=3)
    assert t == pytest.approx({"float32": 0.010, "bfloat16": 0.004})
