"""Batched sampling with a KV cache, and the training forward (per-token log-probs).

Layout used everywhere in the local engine (the OpenRLHF "action" layout): one row per
sample, the prompt **left**-padded to ``P`` columns followed by the response
**right**-padded to ``R`` columns::

    input_ids      [N, P + R]   <pad> <pad> p1 p2 p3 | r1 r2 <eos> <pad>
    attention_mask [N, P + R]     0     0   1  1  1  |  1  1   1     0
    response_mask  [N, R]                            |  1  1   1     0

Position ids are ``cumsum(attention_mask) - 1`` (so left padding does not shift positions)
and are passed explicitly both when sampling and in the training forward; the two
therefore see exactly the same computation.

**Temperature.** Both the sampler's log-probs and :func:`sequence_log_probs` are log-probs
of ``softmax(logits / T)``, the distribution actually sampled from at temperature ``T``
(as OpenRLHF does: its actor divides logits by the rollout temperature in the training
forward). Use the same ``T`` for rollouts, old log-probs, the training forward and the
DPH pre-sampling log-probs. ``top_p < 1`` truncates the *sampling* distribution only; the
returned log-probs stay those of the untruncated ``softmax(logits / T)`` (with the default
``top_p = 1`` they are exactly the sampling distribution). ``temperature = 0`` is greedy
decoding; its log-probs are those of ``T = 1``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch

from ...algorithms.logprobs import log_probs_from_hidden
from ..lm_head import lm_head_returns_hidden


# ----------------------------------------------------------------------------- packing
def pack_sequences(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], pad_id: int,
                   device: Union[str, torch.device] = "cpu") -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids [N, P+R], attention_mask [N, P+R], response_mask [N, R])`` in the layout
    above, from per-sample token lists (``P``/``R`` = the longest prompt / response)."""
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"pack_sequences: {len(prompt_ids)} prompts but {len(response_ids)} responses")
    P = max((len(p) for p in prompt_ids), default=0)
    R = max((len(r) for r in response_ids), default=0)
    ids, attn = [], []
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        if len(p) == 0:
            raise ValueError(f"pack_sequences: prompt {i} is empty; a prompt needs at least one token")
        lp, lr = len(p), len(r)
        ids.append([pad_id] * (P - lp) + [int(t) for t in p] + [int(t) for t in r] + [pad_id] * (R - lr))
        attn.append([0] * (P - lp) + [1] * (lp + lr) + [0] * (R - lr))
    ids = torch.tensor(ids, dtype=torch.long).view(len(prompt_ids), P + R)
    attn = torch.tensor(attn, dtype=torch.long).view(len(prompt_ids), P + R)
    resp_mask = attn[:, P:].clone()
    return ids.to(device), attn.to(device), resp_mask.to(device)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``cumsum(mask) - 1`` clamped at 0: positions that ignore left padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# ----------------------------------------------------------------------------- forward
@dataclass
class ForwardOutput:
    log_probs: torch.Tensor                       # [N, R], zero where response_mask is 0
    entropy: Optional[torch.Tensor] = None        # [N, R] full-vocabulary entropy
    prompt_hidden: Optional[torch.Tensor] = None  # [N, hidden] mean of last-layer prompt states


def response_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                     *, temperature: float = 1.0, return_entropy: Union[bool, str] = False,
                     return_prompt_hidden: bool = False) -> ForwardOutput:
    """The training forward: one pass over prompt + response.

    ``lp_t = log softmax(z_{t-1} / T)[y_t]`` for every response position ``t`` (the logits at
    the previous position predict token ``t``), ``H_t = -sum_v p_v log p_v`` over the full
    vocabulary of the same tempered distribution, and optionally the mean-pooled last-layer
    hidden states of the prompt tokens (for FlowRL's log Z head). Only the last ``R + 1``
    positions reach the LM head, and never as ``[N, R, V]`` logits: the model's head is bypassed
    (:func:`~openrlhf_div.engines.lm_head.lm_head_returns_hidden`) and log-probs and entropy come
    from :func:`~openrlhf_div.algorithms.log_probs_from_hidden`, chunk by chunk, in float32.
    ``return_entropy="detached"`` returns the entropy without a gradient (for logging only).
    """
    R = response_mask.shape[1]
    if R == 0:
        raise ValueError("response_forward: the response region is empty (response_mask has 0 columns)")
    P = input_ids.shape[1] - R
    if P < 1:
        raise ValueError(f"response_forward: input_ids has {input_ids.shape[1]} columns, fewer than "
                         f"response_mask's {R} + 1 prompt token")
    T = float(temperature) if temperature and temperature > 0 else 1.0
    with lm_head_returns_hidden(model) as head:  # out.logits: the last R + 1 hidden states, no logits
        out = model(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids_from_mask(attention_mask), use_cache=False,
                    logits_to_keep=R + 1, output_hidden_states=return_prompt_hidden)
    targets = input_ids[:, P:]
    m = response_mask.to(torch.float32)
    lp, ent = log_probs_from_hidden(out.logits[:, :-1, :], head.weight, targets, bias=head.bias, temperature=T,
                                    return_entropy=bool(return_entropy))
    lp = lp * m
    if ent is not None:
        ent = (ent.detach() if return_entropy == "detached" else ent) * m
    hid = None
    if return_prompt_hidden:
        h = out.hidden_states[-1][:, :P, :].float()
        pm = attention_mask[:, :P].to(h.dtype).unsqueeze(-1)
        hid = (h * pm).sum(1) / pm.sum(1).clamp(min=1.0)
    return ForwardOutput(lp, ent, hid)


def sequence_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                       return_entropy: bool = False, temperature: float = 1.0):
    """Per-token log-probs ``[N, R]`` of the response tokens under ``softmax(logits / T)``
    (and the full-vocabulary entropy ``[N, R]`` when ``return_entropy``).

    The one forward used for training, old (behaviour) log-probs and DPH pre-sampling; the
    response is the last ``R = response_mask.shape[1]`` columns of ``input_ids``. Gradients
    flow unless the caller wraps it in ``torch.no_grad()``. Masked positions are 0.
    """
    o = response_forward(model, input_ids, attention_mask, response_mask, temperature=temperature,
                         return_entropy=return_entropy)
    return (o.log_probs, o.entropy) if return_entropy else o.log_probs


# ----------------------------------------------------------------------------- sampling
@dataclass
class GenerationOutput:
    """Samples in the layout above; rows of one prompt are contiguous (``n_samples`` each)."""

    input_ids: torch.Tensor        # [N, P + R]
    attention_mask: torch.Tensor   # [N, P + R]
    response_mask: torch.Tensor    # [N, R]
    log_probs: torch.Tensor        # [N, R] sampler log-probs of softmax(logits / T), 0 where masked
    prompt_ids: List[List[int]]
    response_ids: List[List[int]]  # generated tokens, the final <eos> included when produced
    texts: List[str]               # decoded responses, special tokens (eos) removed
    finished: torch.Tensor         # [N] bool: stopped at <eos> (False: hit max_new_tokens)

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)

    def __len__(self) -> int:
        return len(self.texts)


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering: keep the smallest prefix of the sorted vocabulary whose mass is
    ``>= top_p`` (the most likely token always survives); the rest get ``-inf``."""
    sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    cum = probs.cumsum(-1)
    remove = (cum - probs) >= top_p
    remove[..., 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)


def encode_prompts(tokenizer, prompts: Sequence[Union[str, Sequence[int]]]) -> List[List[int]]:
    """Token ids of each prompt (strings: :func:`.tokens.encode_text`, no special tokens but
    the BOS when the tokenizer adds one and the text lacks it)."""
    from .tokens import encode_text

    out = []
    for i, p in enumerate(prompts):
        ids = encode_text(tokenizer, p) if isinstance(p, str) else [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i} encodes to no tokens: {p!r}")
        out.append(list(ids))
    return out


def check_sampling_args(n_samples: int, max_new_tokens: int, top_p: float) -> None:
    """The arguments every sampler of the local engine (KV-cache or vLLM) refuses alike."""
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[Union[str, Sequence[int]]], *, n_samples: int = 1,
             max_new_tokens: int = 32, temperature: float = 1.0, top_p: float = 1.0,
             generator: Optional[torch.Generator] = None, batch_size: Optional[int] = None,
             fast: Optional[bool] = None, stop_check_every: Optional[int] = None,
             decode_step: Optional[str] = None) -> GenerationOutput:
    """Sample ``n_samples`` responses per prompt with a KV cache.

    A hand-written loop: one prefill of the left-padded prompts, then one single-token
    forward per step through a KV cache (:mod:`.fastgen`: a lean decoder for Qwen2/Llama
    models, HF's ``DynamicCache`` path otherwise or with ``fast=False``); a row stops at
    any stop id (:func:`.tokens.stop_token_ids`: every ``generation_config.eos_token_id`` and the
    tokenizer's EOS) or after ``max_new_tokens``, and the loop ends when every row has stopped.
    Finished rows keep feeding ``<pad>`` with attention 0, exactly as the training forward
    sees them. Randomness comes only from ``generator`` (``torch.multinomial``), so a seeded
    generator reproduces the samples. ``batch_size`` splits very large requests into chunks.

    ``stop_check_every`` (default: 8 on CUDA, 1 elsewhere): whether every row has stopped is read
    on the host only every that many steps (reading it is a device synchronisation each step on a
    GPU); the steps run past the last stop are dropped and the generator is set back to its state
    after the last kept step, so the samples, their log-probs and the generator's state afterwards
    are those of a check every step, bit for bit.

    ``decode_step`` (default ``"dynamic"``): the lean decoder's token step (:func:`.fastgen.make_decoder`).
    ``"static"`` runs it with fixed shapes and no host synchronisation, ``"graph"`` (CUDA only) replays
    that step as a CUDA graph. Neither is bit-exact with ``"dynamic"``: its attention sums over the
    whole preallocated cache, masked, and the kernels' summation order follows that length
    (docs/benchmarks.md, "Static-shape decode step"); each is bit-exact with itself across runs.
    """
    check_sampling_args(n_samples, max_new_tokens, top_p)
    enc = encode_prompts(tokenizer, prompts)
    rows = [p for p in enc for _ in range(n_samples)]
    if batch_size is not None and len(rows) > batch_size:
        parts = [_generate_rows(model, tokenizer, rows[i:i + batch_size], max_new_tokens, temperature, top_p,
                                generator, fast, stop_check_every, decode_step)
                 for i in range(0, len(rows), batch_size)]
        return _concat(parts, tokenizer.pad_token_id)
    return _generate_rows(model, tokenizer, rows, max_new_tokens, temperature, top_p, generator, fast,
                          stop_check_every, decode_step)


def _generate_rows(model, tokenizer, rows, max_new_tokens, temperature, top_p, generator, fast=None,
                   stop_check_every=None, decode_step=None) -> GenerationOutput:
    from .fastgen import make_decoder

    from .tokens import ensure_pad_token, stop_token_ids

    device = next(model.parameters()).device
    ensure_pad_token(tokenizer)
    pad_id = tokenizer.pad_token_id
    stop_ids = torch.tensor(stop_token_ids(model, tokenizer), dtype=torch.long, device=device)
    ids, attn, _ = pack_sequences(rows, [[] for _ in rows], pad_id, device)
    prompt_attn = attn
    n = ids.shape[0]
    greedy = temperature is None or temperature <= 0
    T = 1.0 if greedy else float(temperature)
    was_training = model.training
    model.eval()
    decoder = make_decoder(model, n, ids.shape[1] + max_new_tokens, fast, decode_step or "dynamic")
    static = getattr(decoder, "static", False)   # keeps its own key mask: gets only the new column
    pos = position_ids_from_mask(attn)
    logits = decoder.prefill(ids, attn, pos)
    next_pos = pos[:, -1] + 1
    done = torch.zeros(n, dtype=torch.bool, device=device)
    toks, lps, alive = [], [], []
    every = int(stop_check_every) if stop_check_every is not None else (8 if device.type == "cuda" else 1)
    if every < 1:
        raise ValueError(f"stop_check_every={stop_check_every}: a number of steps >= 1")
    if generator is None and not greedy:
        every = 1   # the global generator's extra draws could not be taken back
    dones: List[torch.Tensor] = []   # per step since the last check: every row stopped after it?
    states: List[torch.Tensor] = []  # the generator's state after each of those steps
    for step in range(max_new_tokens):
        logits = logits.float()
        if T != 1.0:
            logits = logits / T
        logp = torch.log_softmax(logits, dim=-1)
        if greedy:
            tok = logp.argmax(-1)
        else:
            samp = logits if top_p >= 1.0 else _top_p_filter(logits, top_p)
            tok = torch.multinomial(torch.softmax(samp, dim=-1), 1, generator=generator).squeeze(-1)
        live = ~done
        tok = torch.where(live, tok, torch.full_like(tok, pad_id))
        toks.append(tok)
        lps.append(logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1) * live)
        alive.append(live)
        done = done | torch.isin(tok, stop_ids)
        if every > 1:
            dones.append(done.all())
            if generator is not None and not greedy:
                states.append(generator.get_state())
        if every == 1:
            if bool(done.all()) or step == max_new_tokens - 1:
                break
        elif (step + 1) % every == 0 or step == max_new_tokens - 1:
            flags = torch.stack(dones).tolist()   # one host read per `every` steps
            if True in flags:   # every row stopped after step `first`: the later steps were not needed
                k = flags.index(True)
                drop = len(flags) - 1 - k
                if drop:
                    del toks[-drop:], lps[-drop:], alive[-drop:]
                if states:
                    generator.set_state(states[k])
                break
            if step == max_new_tokens - 1:
                break
            dones, states = [], []
        if static:
            logits = decoder.step(tok, live.long().unsqueeze(-1), next_pos)
        else:
            attn = torch.cat([attn, live.long().unsqueeze(-1)], dim=-1)
            logits = decoder.step(tok, attn, next_pos)
        next_pos = next_pos + 1
    if was_training:
        model.train()
    resp = torch.stack(toks, 1)
    resp_mask = torch.stack(alive, 1).long()
    log_probs = torch.stack(lps, 1)
    response_ids = [resp[i, : int(resp_mask[i].sum())].tolist() for i in range(n)]
    texts = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    full_ids = torch.cat([ids, resp], 1)
    full_attn = torch.cat([prompt_attn, resp_mask], 1)
    return GenerationOutput(full_ids, full_attn, resp_mask, log_probs, [list(r) for r in rows], response_ids,
                            texts, done)


def _concat(parts: List[GenerationOutput], pad_id: int) -> GenerationOutput:
    prompt_ids = [p for g in parts for p in g.prompt_ids]
    response_ids = [r for g in parts for r in g.response_ids]
    ids, attn, rmask = pack_sequences(prompt_ids, response_ids, pad_id, parts[0].input_ids.device)
    R = rmask.shape[1]
    lp = torch.zeros(rmask.shape, dtype=parts[0].log_probs.dtype, device=rmask.device)
    row = 0
    for g in parts:
        k, r = g.log_probs.shape
        lp[row:row + k, :r] = g.log_probs
        row += k
    return GenerationOutput(ids, attn, rmask, lp, prompt_ids, response_ids, [t for g in parts for t in g.texts],
                            torch.cat([g.finished for g in parts]))
