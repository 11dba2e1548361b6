"""Issue 43 item 3: vLLM's layer-wise reload warns ``<Layer>: Failed to load weights`` for every
layer a reload session gave no tensor; under OpenRLHF's one-tensor-per-call sync that is every
other layer at every call (420 lines in two tiny Ray steps), an expected state, not a mismatch
(compat/vllm_weights.py says why). update_vllm_weights drops exactly that warning while it closes
a session. The weight-sync tests (tests/test_vllm_weights.py) count it in a real engine's update;
this file checks the filter and that vLLM still words the warning the way it filters."""
from __future__ import annotations

import inspect
import logging

import pytest

pytest.importorskip("vllm")


def test_vllm_still_emits_the_warning_the_filter_drops():
    from vllm.model_executor.model_loader.reload import layerwise

    from openrlhf_div.compat.vllm_weights import NO_TENSOR_WARNING, RELOAD_LOGGER

    assert layerwise.logger.name == RELOAD_LOGGER
    assert f'logger.warning("{NO_TENSOR_WARNING}"' in inspect.getsource(layerwise.finalize_layerwise_processing)


def test_only_that_warning_and_only_while_a_session_closes():
    from openrlhf_div.compat.vllm_weights import NO_TENSOR_WARNING, RELOAD_LOGGER, _expected_reload_warnings_quiet

    seen = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = seen.append
    log = logging.getLogger(RELOAD_LOGGER)
    log.addHandler(handler)
    try:
        with _expected_reload_warnings_quiet():
            log.warning(NO_TENSOR_WARNING, "ParallelLMHead")
            log.warning("Allocating %.1f MB of device memory", 1.0)
        log.warning(NO_TENSOR_WARNING, "ParallelLMHead")
    finally:
        log.removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["Allocating 1.0 MB of device memory",
                                              "ParallelLMHead: Failed to load weights"]
