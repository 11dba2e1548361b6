"""Every registered method on OpenRLHF 0.11.2's Ray topology.

Modules (import cost grows down the list; the first two need neither Ray, vLLM nor a GPU):

* :mod:`.advantages` — the experience maker's advantage path as a pure function;
* :mod:`.launch` — the driver's ``main`` and ``run`` (re-exports the names below); its jobs:
  :mod:`.upstream` (OpenRLHF's parser and validation, from its own source), :mod:`.render` (an
  experiment file as flags), :mod:`.plan` (the checked plan, dry run), :mod:`.failures` (the one
  line a failed or stopped run ends with);
* :mod:`.loss` — the actor loss through OpenRLHF's ``aggregate_loss`` (needs openrlhf);
* :mod:`.anchors` — ``D_pef`` rows in OpenRLHF's ``Experience`` layout;
* :mod:`.experience_maker`, :mod:`.actor`, :mod:`.trainer` — the Ray-side classes (import vLLM);
* :mod:`.presample` — the DPH pre-sampling stage at scale.

Shared with the Megatron actor, one level up: :mod:`openrlhf_div.engines.flags` (the ``--div.*``
flags, method -> OpenRLHF flags, unsupported combinations; no Ray, vLLM or OpenRLHF import) and
:mod:`openrlhf_div.engines.anchor_data` (the ``D_pef`` / ``D_exp`` format, split rule and anchor
sampler).
"""
