"""The local engine: one process, a Hugging Face causal LM on CPU (or one GPU).

* :mod:`.models` the one place models are built (:func:`build_policy`), saved and loaded
* :mod:`.tiny` builds real tiny HF models and tokenizers from a config (no hub needed)
* :mod:`.generation` batched KV-cache sampling and the training forward
  (:func:`sequence_log_probs`)
* :mod:`.config` the ``TrainConfig`` (YAML + ``key=value`` overrides)
* :mod:`.trainer` the RL trainer (``openrlhf-div train``)
* :mod:`.presample` DPH-RL's pre-sampling stage (``openrlhf-div presample``)
* :mod:`.toy` ``toy_copy``, a tiny task for smoke tests and the example config
"""
from openrlhf_div.tasks import register_task as _register_task

_register_task("toy_copy", module="openrlhf_div.engines.local.toy")
