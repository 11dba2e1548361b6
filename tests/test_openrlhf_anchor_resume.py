"""D_pef anchor draws resume where they stopped (issue 9): the sampler's position travels in the
checkpoint's client states. Before the fix a resumed run re-drew anchors from the pool's start.

OpenRLHF's own ``save_logs_and_checkpoints`` / ``init_checkpoint_states`` (which hand the client
states to the actor's DeepSpeed checkpoint and back) are replaced by a dict round trip here; the
real round trip runs in tests/e2e (rkl resume)."""
from types import SimpleNamespace

from openrlhf_div.compat import install_flash_attn_standin, install_vllm_stub

install_flash_attn_standin()
install_vllm_stub()  # this test must not start vLLM: it only needs the trainer class importable

from openrlhf_div.engines.openrlhf import trainer as tr  # noqa: E402
from openrlhf_div.engines.anchor_data import AnchorRecord, AnchorSampler  # noqa: E402


def _records(n=7):
    return [AnchorRecord([1, 2], [3, 4], [-0.1, -0.2], id=str(i)) for i in range(n)]


def test_resumed_trainer_draws_the_next_anchors(monkeypatch):
    saved = {}
    base = tr.PPOTrainer.__ray_actor_class__
    monkeypatch.setattr(base, "save_logs_and_checkpoints",
                        lambda self, step, logs=None, client_states=None: saved.update(client_states))
    monkeypatch.setattr(base, "init_checkpoint_states", lambda self: dict(saved))
    # the run folder's metrics (runfolder.py) need the real args; this test is about the anchors
    monkeypatch.setattr(tr._DivPPOTrainer, "_div_folder", lambda self: SimpleNamespace(log_step=lambda *a: None))

    first = object.__new__(tr._DivPPOTrainer)
    first.experience_maker = SimpleNamespace(anchor_pool=AnchorSampler(_records(), seed=3))
    drawn = [r.id for r in first.experience_maker.anchor_pool.draw(5)]  # step 1..k of the first job
    first.save_logs_and_checkpoints(2, {}, {"global_step": 2})
    expected = [r.id for r in first.experience_maker.anchor_pool.draw(6)]  # what an unbroken run draws next

    resumed = object.__new__(tr._DivPPOTrainer)
    resumed.experience_maker = SimpleNamespace(anchor_pool=AnchorSampler(_records(), seed=3))
    states = resumed.init_checkpoint_states()
    assert states["global_step"] == 2 and tr.ANCHOR_POOL_STATE in states
    assert [r.id for r in resumed.experience_maker.anchor_pool.draw(6)] == expected
    assert expected[:2] != drawn[:2] or expected != drawn[:6]  # not a restart from the pool's start


def test_methods_without_anchors_are_untouched(monkeypatch):
    base = tr.PPOTrainer.__ray_actor_class__
    monkeypatch.setattr(base, "init_checkpoint_states", lambda self: {"global_step": 0})
    t = object.__new__(tr._DivPPOTrainer)
    t.experience_maker = SimpleNamespace(anchor_pool=None)
    assert t.init_checkpoint_states() == {"global_step": 0}
