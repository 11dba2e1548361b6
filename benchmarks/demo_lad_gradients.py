"""Why LAD-JS behaves as it does in the demo: its gradient next to GRPO's on one rollout batch.

On-policy (the first pass over a batch, r_t = 1) the LAD loss exp(z) f(x), z = A / eta,
x = r exp(-z), has d loss / d lp = r f'(x); for JS, f'(x) = 0.5 log(2x / (x + 1)). So:

* small |z| (large eta): r f'(x) ~ -A / (4 eta): GRPO's policy gradient scaled by 1/(4 eta),
  a scale that Adam divides out -> LAD ~ GRPO;
* large positive z (eta = 0.25, a rare success in a group: A up to ~2.6, z ~ 10):
  weight ~ 0.5 (z - log 2) -- linear in A with a slope 2, and the target ratio exp(z) ~ e^10
  that would stop it is never reached in one or a few passes;
* negative z: weight -> 0.5 log 2 ~ 0.35 at most, whatever |A| (GRPO: |A| up to 2.6).

This script measures, on one batch of the demo's base model, the per-sample weights and the
cosine between each method's parameter gradient and GRPO's.

    python benchmarks/demo_lad_gradients.py [--base DIR] [--prompts 64]
"""
from __future__ import annotations

import argparse
import json

import torch

from openrlhf_div.algorithms import LossInputs, get_method
from openrlhf_div.demo.pipeline import load_demo_config
from openrlhf_div.demo.warmup import WarmupConfig, base_model_dir
from openrlhf_div.engines.local.generation import generate, sequence_log_probs
from openrlhf_div.engines.local.models import load_model
from openrlhf_div.tasks import get_task
from openrlhf_div.tasks.demo import STYLES, make_splits, style_of


def grads(model, method, inp, attn, rmask, old, adv, correct):
    model.zero_grad(set_to_none=True)
    lp = sequence_log_probs(model, inp, attn, rmask)
    mask = rmask.float()
    loss, _ = method.loss(online=LossInputs(log_probs=lp, old_log_probs=old, advantages=adv, mask=mask,
                                            correct=correct))
    loss.backward()
    g = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    # per-sample weight w_i = -d loss / d lp_t (mean over tokens), times the token count
    lp_leaf = lp.detach().clone().requires_grad_(True)
    l2, _ = method.loss(online=LossInputs(log_probs=lp_leaf, old_log_probs=old, advantages=adv, mask=mask,
                                          correct=correct))
    (dl,) = torch.autograd.grad(l2, lp_leaf)
    w = -(dl * mask).sum(1) / mask.sum(1) * mask.sum()
    return g, w


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=None, help="base model dir (default: the demo's cached base)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.base is None:  # the demo's cached base model (build it with `openrlhf-div demo` first)
        args.base = base_model_dir(WarmupConfig.from_dict(load_demo_config()["warmup"]))
    model, tok = load_model(args.base)
    task = get_task("demo")
    train = make_splits()["train"][: args.prompts]
    G = 8
    gen = generate(model, tok, [e["prompt"] for e in train], n_samples=G, max_new_tokens=10,
                   generator=torch.Generator().manual_seed(args.seed))
    rewards = torch.tensor([task.reward(t, train[i // G]["label"]) for i, t in enumerate(gen.texts)])
    with torch.no_grad():
        old = sequence_log_probs(model, gen.input_ids, gen.attention_mask, gen.response_mask)
    mask = gen.response_mask.float()
    correct = rewards >= 1
    ref = get_method("grpo")
    adv = ref.advantages(rewards, G, old_log_probs=old, mask=mask)
    g0, w0 = grads(model, ref, gen.input_ids, gen.attention_mask, gen.response_mask, old, adv, correct)
    seq_adv = adv.sum(1) / mask.sum(1)
    informative = seq_adv.abs() > 1e-6
    out = {"batch": {"prompts": args.prompts, "group": G, "pass_rate": float(rewards.mean()),
                     "informative_samples": int(informative.sum())}}
    pos, neg = informative & correct, informative & ~correct
    rows = []
    for name, kw in (("grpo", {}), ("lad_js", {"lad_eta": 0.25}), ("lad_js", {"lad_eta": 1.0}),
                     ("lad_js", {"lad_eta": 4.0}), ("lad_js", {"lad_eta": 16.0})):
        m = get_method(name, **kw)
        g, w = grads(model, m, gen.input_ids, gen.attention_mask, gen.response_mask, old, adv, correct)
        cos = float(torch.nn.functional.cosine_similarity(g, g0, dim=0))
        # weight relative to GRPO's weight |A| on the same samples
        rows.append({"method": name, **kw, "cos_with_grpo": round(cos, 4),
                     "grad_norm_ratio": round(float(g.norm() / g0.norm()), 4),
                     "mean_weight_correct": round(float(w[pos].mean()), 4),
                     "mean_weight_wrong": round(float(w[neg].mean()), 4),
                     "max_weight_correct": round(float(w[pos].max()), 4),
                     "max_abs_weight_wrong": round(float(w[neg].abs().max()), 4),
                     "ratio_correct_to_wrong": round(float(w[pos].mean() / w[neg].abs().mean()), 3)})
        # The gradient on the style-marker logits (first response token), per style s:
        #   g_s = (1/N) [ sum_{i in s} w_i - p_s sum_i w_i ]   (softmax: d lp_i / d logit_s = 1[s_i = s] - p_s),
        # p_s ~ the style's share of the batch. Shown relative to sum_s |g_s| (Adam removes the scale):
        # g_s < 0 drains style s.
        styles_i = [style_of(t) for t in gen.texts]
        share = {st: sum(x == st for x in styles_i) / len(w) for st in STYLES}
        g_s = {st: float(w[[x == st for x in styles_i]].sum() - share[st] * w.sum()) / len(w) for st in STYLES}
        tot = sum(abs(v) for v in g_s.values()) or 1.0
        rows[-1]["style_logit_grad"] = {st: round(v / tot, 3) for st, v in g_s.items()}
    out["rows"] = rows
    out["style_accuracy_in_batch"] = {st: round(float(rewards[[style_of(t) == st for t in gen.texts]].mean()), 3)
                                      for st in STYLES}
    print(json.dumps(out, indent=1))
    print(f"\n{'method':<8} {'eta':>5} {'cos(g,g_grpo)':>14} {'|g|/|g_grpo|':>13} {'w correct':>10} "
          f"{'w wrong':>8} {'max w correct':>14} {'correct:wrong':>14}")
    for r in rows:
        print(f"{r['method']:<8} {r.get('lad_eta', '-')!s:>5} {r['cos_with_grpo']:>14.3f} {r['grad_norm_ratio']:>13.3f} "
              f"{r['mean_weight_correct']:>10.3f} {r['mean_weight_wrong']:>8.3f} {r['max_weight_correct']:>14.3f} "
              f"{r['ratio_correct_to_wrong']:>14.2f}")
    print("\ndirection of the update on the style-marker logits (normalised; < 0 drains the style)")
    print("style accuracy in this batch: " + ", ".join(f"{k} {v:.2f}" for k, v in out["style_accuracy_in_batch"].items()))
    for r in rows:
        print(f"{r['method']:<8} {r.get('lad_eta', '-')!s:>5}  " + "  ".join(f"{k} {v:+.3f}" for k, v in r["style_logit_grad"].items()))


if __name__ == "__main__":
    main()
