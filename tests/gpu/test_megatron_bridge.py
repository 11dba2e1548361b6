"""megatron-bridge vs the built-in HF <-> Megatron mapping (GPU image with megatron-bridge only).

The engine loads Hugging Face weights with megatron-bridge when it is installed
(``--megatron.weights auto|bridge``) and keeps ``engines/megatron/weights.py`` as the fallback.
This test loads one tiny Qwen2 both ways at TP=1 and checks that the Megatron parameters and the
exported HF tensors agree exactly. It cannot run in the CPU image: megatron-bridge 0.6.2 needs
transformer-engine and pins transformers <= 5.12.1, while openrlhf 0.11.2 pins 5.15.0 (see
docker/Dockerfile). Not run yet.
"""
import os
import socket

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core")
pytest.importorskip("megatron.bridge")

pytestmark = pytest.mark.gpu


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bridge_and_builtin_mapping_agree(tmp_path):
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from openrlhf_div.engines.megatron.config import MegatronConfig
    from openrlhf_div.engines.megatron.engine import MegatronEngine, init_megatron_parallel

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    init_megatron_parallel(MegatronConfig(tp=1), seed=1)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    engines = {w: MegatronEngine(MegatronConfig(tp=1, bf16=True, weights=w), pretrain=str(tmp_path), train=False)
               for w in ("builtin", "bridge")}
    assert engines["bridge"].weights_path == "bridge" and engines["builtin"].weights_path == "builtin"
    a = {k: v for k, v in engines["builtin"].gpt.state_dict().items() if not k.endswith("_extra_state")}
    b = {k: v for k, v in engines["bridge"].gpt.state_dict().items() if not k.endswith("_extra_state")}
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ea, eb = engines["builtin"].hf_state_dict(), engines["bridge"].hf_state_dict()
    assert sorted(ea) == sorted(eb)
    for k in ea:
        assert torch.equal(ea[k], eb[k]), k
