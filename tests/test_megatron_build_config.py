"""How the Megatron engine configures megatron-core (no process group needed): the host
optimizer as megatron-core expects it, and no fused kernels without Transformer Engine."""
import pytest
import torch

pytest.importorskip("megatron.core")

from openrlhf_div.engines.megatron import model as M  # noqa: E402
from openrlhf_div.engines.megatron.config import MegatronConfig  # noqa: E402
from openrlhf_div.engines.megatron.engine import OptimSettings, optimizer_config  # noqa: E402
from openrlhf_div.engines.megatron.weights import GPTLayout  # noqa: E402

LAYOUT = GPTLayout(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=128,
                   vocab_size=100, padded_vocab_size=128, tie_embeddings=False, qkv_bias=True, norm_eps=1e-6,
                   rope_theta=1e6, max_position_embeddings=256, model_type="qwen2")


def test_host_optimizer_is_precision_aware(monkeypatch):
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import optimizer_config as mcore_ocfg

    if mcore_utils.get_te_version() is None:          # CPU image: no transformer_engine
        with pytest.raises(RuntimeError, match="needs transformer_engine"):
            optimizer_config(MegatronConfig(tp=8, optimizer_cpu_offload=True), OptimSettings())
        # the rest of the check with TE's version answered as the GPU image's (2.x) would
        monkeypatch.setattr(mcore_utils, "get_te_version", lambda: "2.9")
        monkeypatch.setattr(mcore_ocfg, "is_te_min_version", lambda v, **k: True)
    cfg = optimizer_config(MegatronConfig(tp=8, sp=True, optimizer_cpu_offload=True), OptimSettings())
    assert cfg.optimizer_cpu_offload and cfg.use_precision_aware_optimizer and cfg.use_distributed_optimizer
    # megatron-core's switch for "the distributed optimizer keeps no fp32 main params on the GPU"
    assert cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    assert cfg.optimizer_offload_fraction == 1.0 and cfg.main_params_dtype == torch.float32
    on_gpu = optimizer_config(MegatronConfig(tp=8), OptimSettings())
    assert not on_gpu.optimizer_cpu_offload and not on_gpu.use_precision_aware_optimizer
    assert on_gpu.optimizer_offload_fraction == 0.0
    with pytest.raises(ValueError, match="needs Adam"):
        optimizer_config(MegatronConfig(optimizer_cpu_offload=True), OptimSettings(optimizer="sgd"))


def test_no_fused_softmax_without_transformer_engine(monkeypatch):
    """On a GPU without TE the local spec must not ask for the fused softmax kernel (the
    megatron-core wheel does not ship it: the first attention call would crash)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(M, "_te_available", lambda: False)
    cfg = M.transformer_config(LAYOUT, MegatronConfig(tp=1, bf16=False))
    assert not M.use_transformer_engine(MegatronConfig())
    assert not cfg.masked_softmax_fusion and not cfg.persist_layer_norm
    monkeypatch.setattr(M, "_te_available", lambda: True)
    assert M.use_transformer_engine(MegatronConfig())
    assert not M.transformer_config(LAYOUT, MegatronConfig(transformer_impl="local", bf16=False)).masked_softmax_fusion
