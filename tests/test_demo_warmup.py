"""The demo's warm-up: synthetic data recipe, cache keyed by settings, reuse, atomic save."""
import json
import os
import random

import pytest
import torch

from openrlhf_div.demo import warmup as W
from openrlhf_div.tasks import get_task
from openrlhf_div.tasks.demo import style_of

TINY = dict(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, steps=3, batch_size=8, warmup_steps=1)


def test_synthetic_data_follows_the_recipe():
    cfg = W.WarmupConfig(style_weights=(0.5, 0.5, 0, 0, 0), err_easy=0.0, err_by_style=(1.0, 0.0, 0, 0, 0))
    task = get_task("demo")
    rows = W.synthetic_examples(cfg, random.Random(0), 2000)
    assert {style_of(r) for _, r in rows} == {"A", "B"}
    for p, r in rows:
        n = int(p.split()[0])
        ok = task.reward(r, str(n)) == 1.0
        # A is always wrong for N >= 300 (error rate 1), everything else always right
        assert ok == (not (style_of(r) == "A" and n >= cfg.easy_below)), (p, r)
    # expected accuracy of a perfect imitator: (1/2) * P(N < 300) + 1/2
    ns = list(range(100, 1000))
    assert W.expected_accuracy(cfg, ns) == pytest.approx(0.5 * 200 / 900 + 0.5)


def test_config_validation_and_key():
    with pytest.raises(ValueError, match="style_weights"):
        W.WarmupConfig(style_weights=(1, 2))
    with pytest.raises(ValueError, match="unknown warm-up setting"):
        W.WarmupConfig.from_dict({"stepz": 3})
    a, b = W.WarmupConfig(**TINY), W.WarmupConfig(**TINY)
    assert a.key() == b.key()
    assert W.WarmupConfig(**{**TINY, "steps": 4}).key() != a.key()
    assert W.WarmupConfig.from_dict(a.to_dict()) == a


def test_cache_reuse_and_rebuild(tmp_path, monkeypatch):
    cfg = W.WarmupConfig(**TINY)
    calls = []
    real = W.train_base_model

    def counting(c, **kw):
        calls.append(c)
        return real(c, **kw)

    monkeypatch.setattr(W, "train_base_model", counting)
    logs = []
    p1 = W.build_base_model(cfg, str(tmp_path), progress=False, log=logs.append)
    assert len(calls) == 1 and p1 == W.base_model_dir(cfg, str(tmp_path))
    meta = json.load(open(os.path.join(p1, W.META_FILE)))
    assert meta["config"] == cfg.to_dict() and meta["key"] == cfg.key()
    mtime = os.path.getmtime(os.path.join(p1, W.META_FILE))

    # same settings: reused, nothing trained, nothing rewritten
    p2 = W.build_base_model(W.WarmupConfig(**TINY), str(tmp_path), progress=False, log=logs.append)
    assert p2 == p1 and len(calls) == 1 and "cached" in logs[-1]
    assert os.path.getmtime(os.path.join(p1, W.META_FILE)) == mtime

    # changed settings: a new directory, trained once
    cfg3 = W.WarmupConfig(**{**TINY, "lr": 1e-3})
    p3 = W.build_base_model(cfg3, str(tmp_path), progress=False, log=logs.append)
    assert p3 != p1 and len(calls) == 2

    # a directory left without its metadata (a crash between model and metadata) is rebuilt
    os.remove(os.path.join(p3, W.META_FILE))
    W.build_base_model(cfg3, str(tmp_path), progress=False, log=logs.append)
    assert len(calls) == 3
    # no temporary directories left behind
    assert not [d for d in os.listdir(os.path.dirname(p1)) if d.startswith(".")]


def test_training_is_deterministic_and_loadable(tmp_path):
    from openrlhf_div.engines.local.models import load_model

    cfg = W.WarmupConfig(**TINY)
    pa = W.build_base_model(cfg, str(tmp_path / "a"), progress=False, log=lambda s: None)
    pb = W.build_base_model(cfg, str(tmp_path / "b"), progress=False, log=lambda s: None)
    ma, tok = load_model(pa)
    mb, _ = load_model(pb)
    for (ka, va), (kb, vb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    assert tok.decode(tok("537 =A537")["input_ids"]) == "537 =A537"
