"""Hugging Face <-> Megatron weight mapping: exact round trips and layout checks (pure torch).

The round trips (HF -> TP shards -> HF) would also pass for a wrong but invertible layout, so
the layout itself is checked independently here (a rank's fused qkv rows applied to an input
give exactly the query/key/value heads of that rank's key/value groups; a rank's fc1 computes
its slice of the SwiGLU intermediate) and end to end in test_megatron_engine_cpu.py (Megatron's
own GPTModel forward on these shards equals Hugging Face's logits).
"""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from openrlhf_div.engines.megatron.weights import (
    GPTLayout,
    fuse_qkv,
    hf_to_megatron,
    megatron_names,
    megatron_to_hf,
    padded_vocab_size,
    split_qkv,
)

COMMON = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=8,
              num_key_value_heads=4)


def _model(kind, tied):
    torch.manual_seed(0)
    if kind == "qwen2":
        cfg = Qwen2Config(tie_word_embeddings=tied, **COMMON)
        m = Qwen2ForCausalLM(cfg)
    else:
        cfg = LlamaConfig(tie_word_embeddings=tied, **COMMON)
        m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    if tied:
        sd.pop("lm_head.weight")
    return cfg, sd


@pytest.mark.parametrize("kind,tied", [("qwen2", False), ("qwen2", True), ("llama", True), ("llama", False)])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("te_names", [False, True])
def test_round_trip_exact(kind, tied, tp, te_names):
    cfg, sd = _model(kind, tied)
    layout = GPTLayout.from_hf_config(cfg, tp_size=tp, vocab_divisor=8)
    shards = [hf_to_megatron(sd, layout, tp, r, te_names=te_names) for r in range(tp)]
    back = megatron_to_hf(shards, layout, te_names=te_names)
    assert sorted(back) == sorted(sd)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k
    # shard shapes: what Megatron allocates per rank
    s0 = shards[0]
    h, d = layout.hidden_size, layout.head_dim
    assert s0["embedding.word_embeddings.weight"].shape == (layout.padded_vocab_size // tp, h)
    assert s0["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (layout.qkv_rows // tp, h)
    assert s0["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * layout.ffn_hidden_size // tp, h)
    assert s0["decoder.layers.0.mlp.linear_fc2.weight"].shape == (h, layout.ffn_hidden_size // tp)
    assert s0["decoder.layers.0.self_attention.linear_proj.weight"].shape == (h, layout.num_heads * d // tp)
    assert ("output_layer.weight" in s0) == (not tied)
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in s0) == (kind == "qwen2")
    norm = ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" if te_names
            else "decoder.layers.0.input_layernorm.weight")
    assert norm in s0


def test_vocab_padding_rows_are_zero_and_dropped():
    cfg, sd = _model("qwen2", False)
    layout = GPTLayout.from_hf_config(cfg, tp_size=2, vocab_divisor=8)
    assert layout.padded_vocab_size == 128 == padded_vocab_size(101, 2, 8)      # multiple of 8 * lcm(2, 8)
    # the same padded vocabulary at every TP dividing 8 (checkpoints reshard across them)
    assert {padded_vocab_size(152064, tp, 128) for tp in (1, 2, 4, 8)} == {152576}
    assert padded_vocab_size(101, 3, 8) == 192                                   # lcm(3, 8) = 24
    shards = [hf_to_megatron(sd, layout, 2, r) for r in range(2)]
    emb = torch.cat([s["embedding.word_embeddings.weight"] for s in shards])
    assert torch.equal(emb[:101], sd["model.embed_tokens.weight"])
    assert torch.all(emb[101:] == 0)
    out = torch.cat([s["output_layer.weight"] for s in shards])
    assert torch.equal(out[:101], sd["lm_head.weight"])


def test_qkv_shard_computes_its_groups_heads():
    """Rank r's fused qkv rows produce the q/k/v heads of kv-groups [r*g/tp, (r+1)*g/tp)."""
    cfg, sd = _model("qwen2", False)
    tp = 2
    layout = GPTLayout.from_hf_config(cfg, tp_size=tp, vocab_divisor=8)
    x = torch.randn(5, layout.hidden_size)
    pre = "model.layers.1.self_attn."
    d, g = layout.head_dim, layout.num_kv_heads
    per = layout.num_heads // g
    q = (x @ sd[pre + "q_proj.weight"].T + sd[pre + "q_proj.bias"]).view(5, layout.num_heads, d)
    k = (x @ sd[pre + "k_proj.weight"].T + sd[pre + "k_proj.bias"]).view(5, g, d)
    v = (x @ sd[pre + "v_proj.weight"].T + sd[pre + "v_proj.bias"]).view(5, g, d)
    for r in range(tp):
        s = hf_to_megatron(sd, layout, tp, r)
        w = s["decoder.layers.1.self_attention.linear_qkv.weight"]
        b = s["decoder.layers.1.self_attention.linear_qkv.bias"]
        out = (x @ w.T + b).view(5, g // tp, per + 2, d)    # Megatron's view: [groups, (q.. k v), d]
        for j in range(g // tp):
            grp = r * (g // tp) + j
            torch.testing.assert_close(out[:, j, :per], q[:, grp * per:(grp + 1) * per])
            torch.testing.assert_close(out[:, j, per], k[:, grp])
            torch.testing.assert_close(out[:, j, per + 1], v[:, grp])


def test_fc1_shard_computes_its_swiglu_slice():
    cfg, sd = _model("llama", False)
    tp = 4
    layout = GPTLayout.from_hf_config(cfg, tp_size=tp, vocab_divisor=8)
    x = torch.randn(3, layout.hidden_size)
    pre = "model.layers.2.mlp."
    inter = torch.nn.functional.silu(x @ sd[pre + "gate_proj.weight"].T) * (x @ sd[pre + "up_proj.weight"].T)
    f = layout.ffn_hidden_size // tp
    full = torch.zeros(3, layout.hidden_size)
    for r in range(tp):
        s = hf_to_megatron(sd, layout, tp, r)
        h = x @ s["decoder.layers.2.mlp.linear_fc1.weight"].T
        a, bb = h.chunk(2, dim=-1)                          # Megatron's glu: silu(first) * second
        torch.testing.assert_close(torch.nn.functional.silu(a) * bb, inter[:, r * f:(r + 1) * f])
        full += (torch.nn.functional.silu(a) * bb) @ s["decoder.layers.2.mlp.linear_fc2.weight"].T
    torch.testing.assert_close(full, inter @ sd[pre + "down_proj.weight"].T, rtol=1e-4, atol=1e-5)


def test_fuse_split_inverse_and_kv_replication_layout():
    cfg, _ = _model("llama", False)
    layout = GPTLayout.from_hf_config(cfg)
    d = layout.head_dim
    q, k, v = torch.randn(8 * d, 5), torch.randn(4 * d, 5), torch.randn(4 * d, 5)
    f = fuse_qkv(q, k, v, layout)
    for a, b in zip(split_qkv(f, layout), (q, k, v)):
        assert torch.equal(a, b)
    # first group's block: 2 query heads, then its key head, then its value head
    assert torch.equal(f[: 2 * d], q[: 2 * d]) and torch.equal(f[2 * d: 3 * d], k[:d])
    assert torch.equal(f[3 * d: 4 * d], v[:d]) and torch.equal(f[4 * d: 6 * d], q[2 * d: 4 * d])


def test_pipeline_stage_names_and_layer_map():
    cfg, sd = _model("qwen2", True)
    layout = GPTLayout.from_hf_config(cfg, tp_size=1, vocab_divisor=8)
    last = hf_to_megatron(sd, layout, layers={0: 2}, pre_process=False, post_process=True)
    assert "embedding.word_embeddings.weight" not in last
    # tied model: the last stage keeps a copy of the embedding as its output layer
    assert torch.equal(last["output_layer.weight"][:101], sd["model.embed_tokens.weight"])
    assert torch.equal(last["decoder.layers.0.mlp.linear_fc2.weight"], sd["model.layers.2.mlp.down_proj.weight"])
    back = megatron_to_hf([last], layout, layers={0: 2})
    assert "lm_head.weight" not in back and "model.layers.2.mlp.down_proj.weight" in back
    assert len(megatron_names(layout, {0: 0, 1: 1}, post_process=False)) == 1 + 2 * 7  # 7 tensors a layer


def test_unsupported_configs_are_refused():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="model_type"):
        GPTLayout.from_hf_config(GPT2Config())
    cfg, _ = _model("qwen2", False)
    layout = GPTLayout.from_hf_config(cfg, tp_size=3, vocab_divisor=8)
    with pytest.raises(ValueError, match="tensor-parallel size 3"):
        layout.check_tp(3)
    with pytest.raises(KeyError, match="no tensor"):
        hf_to_megatron({}, GPTLayout.from_hf_config(cfg))
