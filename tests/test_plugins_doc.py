"""docs/plugins.md's worked examples are real plug-ins (issue 30): each ```python block of the page
is written to a file and imported through the plug-in hook (openrlhf_div.plugins.load_plugins, what
``--plugin`` does), then what it registered is used: the method resolves and computes a loss, the
estimator's advantages match a hand computation, the task scores, the reward file scores a batch."""
import os
import re

import pytest
import torch

from openrlhf_div import plugins
from openrlhf_div.algorithms import get_method
from openrlhf_div.algorithms.registry import ESTIMATORS
from openrlhf_div.tasks import get_task

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "plugins.md")


def _blocks():
    text = open(DOC).read()
    out = {}
    for code in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        name = re.match(r"# (\w+\.py)", code).group(1)
        out[name] = code
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    d = tmp_path_factory.mktemp("plugins")
    files = {}
    for name, code in _blocks().items():
        (d / name).write_text(code)
        files[name] = str(d / name)
    old = os.environ.get(plugins.ENV_VAR)
    os.environ[plugins.ENV_VAR] = files["my_task.py"]  # what the reward file's load_plugins() reads
    try:
        plugins.load_plugins([files["my_method.py"], files["my_estimator.py"], files["my_task.py"]], export=False)
        plugins.load_plugins([files["my_task_reward.py"]], env=False, export=False)
        yield files
    finally:
        if old is None:
            os.environ.pop(plugins.ENV_VAR, None)
        else:
            os.environ[plugins.ENV_VAR] = old


def test_the_page_has_the_examples():
    assert set(_blocks()) == {"my_method.py", "my_estimator.py", "my_task.py", "my_task_reward.py"}


def test_method_example(loaded):
    m = get_method("grpo_ds_strong")
    ds = get_method("ds_grpo")
    assert m.hparams["gamma_p"] == 2 * ds.hparams["gamma_p"]
    assert (m.estimator, m.adv_reshaping, m.policy_loss) == (ds.estimator, ds.adv_reshaping, ds.policy_loss)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    old = torch.full((4, 3), -1.0)
    out = m.rollout(rewards, 2, old_log_probs=old, mask=torch.ones(4, 3))
    assert out.advantages.shape == (4, 3)


def test_estimator_example(loaded):
    assert "rloo_scaled" in ESTIMATORS
    m = get_method("rloo_scaled_ppo", rloo_scale=2.0)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])  # two groups of 3
    adv = ESTIMATORS["rloo_scaled"].fn(r, 3, r > 0, rloo_scale=2.0)
    # by hand: group 1 (1, 0, 0): baselines 0, .5, .5 -> 1, -.5, -.5; group 2 (1, 1, 1): 0, 0, 0
    assert adv.tolist() == pytest.approx([2.0, -1.0, -1.0, 0.0, 0.0, 0.0])
    assert m.hparams["rloo_scale"] == 2.0


def test_task_and_reward_file_examples(loaded):
    t = get_task("last_int")
    assert t.score("so 3 + 4 = 7", "7").correct and not t.score("7 or 8", "7").correct
    assert t.score("none", "7").reason == "no number"
    mod = next(m for k, m in __import__("sys").modules.items() if k.startswith("openrlhf_div_plugin_")
               and k.endswith("my_task_reward"))
    out = mod.reward_func(["Q: 1+1? 2", "Q: 1+1? 3"], ["Q: 1+1?", "Q: 1+1?"], ["2", "2"])
    assert out["rewards"].tolist() == [1.0, 0.0]
