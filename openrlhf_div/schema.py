"""The one schema of a run's settings: one engine-neutral name per setting, with its type,
default, one line of help and the engines that honour it.

The tree is :class:`openrlhf_div.engines.local.config.TrainConfig` (the local engine's config and
the experiment files' neutral sections): its sections ``model``, ``data``, ``rollout``, ``optim``,
``eval``, ``checkpoint``, ``logging`` and ``presample`` are declared here (no torch import: the
launchers read experiment files in fresh processes through :func:`render_file`).

An experiment file (``configs/openrlhf/*.yaml``) writes its settings in these names
(``rollout.group_size: 8``); :data:`OPENRLHF_FLAGS` is the one table from our names to OpenRLHF
0.11.2's flags, through which the Ray and Megatron engines receive them (``rollout.group_size`` ->
``--rollout.n_samples_per_prompt``), and from which the local engine's translation reads them
back. ``openrlhf:`` keeps only what the schema does not own (placement, ZeRO, vLLM, packing, the
step count in episodes, the schedule's names). A setting the file spells in OpenRLHF's name under
``openrlhf:`` still loads, with one line naming our key (:func:`render_file`);
``openrlhf-div config convert FILE`` rewrites such a file. ``openrlhf-div config fields`` prints
every field (docs/config_reference.md is that output).
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from openrlhf_div._config_base import ConfigError, expand_env

def _f(default=None, help: str = "", factory=None):
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    path: Optional[str] = _f(None, "Hugging Face model directory of the initial (base) policy. null: build a "
                                   "tiny Qwen2 from the tiny_* options below.")
    tiny_vocab: Optional[str] = _f(None, "Characters of the tiny model's character-level vocabulary (used only "
                                         "when path is null).")
    tiny_hidden_size: int = _f(64, "Hidden width of the tiny model.")
    tiny_layers: int = _f(2, "Transformer layers of the tiny model.")
    tiny_heads: int = _f(4, "Attention heads of the tiny model.")
    tiny_kv_heads: int = _f(2, "Key/value heads of the tiny model (grouped-query attention).")
    tiny_max_positions: int = _f(512, "Context length of the tiny model (max_position_embeddings: prompt + response "
                                      "tokens; rotary positions, so the weights do not depend on it).")
    init_seed: Optional[int] = _f(None, "Seed of the tiny model's initial weights (null: the run's seed).")
    dtype: str = _f("auto", "Parameter dtype: auto, float32, bfloat16 or float16 (checkpoints are saved in it). "
                            "auto: a short timed matmul probe of the model's own shapes picks bfloat16 with float32 "
                            "master weights where it is faster (AMX / AVX512-BF16 CPUs, bf16 GPUs), else float32; "
                            "tiny models (hidden < 256) stay float32. The choice is printed and kept in "
                            "run_info.json and the run's config.yaml.")
    master_weights: bool = _f(False, "With dtype bfloat16: the optimizer updates float32 master copies of the "
                                     "weights (float32 moments) while forward/backward run in bfloat16; small "
                                     "updates are not rounded away (checkpoints keep the float32 copies).")
    gradient_checkpointing: bool = _f(False, "Recompute activations in the backward pass (less memory, ~30% more "
                                             "time).")
    lora_rank: int = _f(0, "LoRA rank (peft); 0: train every weight.")
    lora_alpha: Optional[float] = _f(None, "LoRA alpha (null: 2 x lora_rank).")
    lora_dropout: float = _f(0.0, "LoRA dropout.")
    lora_target_modules: Optional[List[str]] = _f(None, "Modules that get adapters (null: all linear layers).")


@dataclass
class DataConfig:
    train: Optional[str] = _f(None, "Training examples: a .jsonl / .json / .parquet file or a `save_to_disk` folder "
                                    "(the loader `openrlhf-div eval` uses: GSM8K `####`, MATH `\\boxed{}`, "
                                    "Countdown and BIRD/Spider layouts detected; a row without a label is an error).")
    eval: Optional[str] = _f(None, "Held-out examples for periodic pass@k, same formats (null: no evaluation).")
    split: Optional[str] = _f(None, "Split of data.train when it is a DatasetDict folder with several splits.")
    eval_split: Optional[str] = _f(None, "Split of data.eval when it is a DatasetDict folder with several splits.")
    prompt_field: Optional[str] = _f(None, "Question field name (dotted for nested) when not a usual one "
                                           "(prompt, question, problem, ...).")
    label_field: Optional[str] = _f(None, "Answer/label field name (dotted for nested) when not a usual one.")
    id_field: Optional[str] = _f(None, "Id field name (default: id, idx, unique_id, ...; else the row number).")
    duplicate_ids: str = _f("error", "A repeated id: `error` (names both lines) or `rename` (id#1, id#2, ...).")
    prompt_template: Optional[str] = _f(None, "User message with {prompt} where the question goes, replacing the "
                                              "task's own template (the tokenizer's chat template still applies).")
    system_prompt: Optional[str] = _f(None, "System message replacing the task's (\"\": none).")
    chat_template: bool = _f(True, "Render the prompt's messages through the tokenizer's chat template (when it has one). "
                                   "false: the model reads the prompt text as it is (prompt_template filled in, no "
                                   "chat template, no system message), as OpenRLHF without --data.apply_chat_template "
                                   "does (`openrlhf-div run` sets it from the experiment file).")
    max_prompt_tokens: Optional[int] = _f(None, "Longest prompt in tokens; a longer one is an error naming its "
                                                "file and line (null: the model's context minus the response "
                                                "length).")
    anchor: Optional[str] = _f(None, "D_pef JSONL from `openrlhf-div presample` (anchor samples with stored base "
                                     "log-probs). Read only when the method needs an anchor batch.")
    presample_dir: Optional[str] = _f(None, "The pre-sampling output folder (d_pef.jsonl, d_exp.jsonl, summary.json), "
                                            "one name for both sides: the pre-sampling stage writes it (`openrlhf-div "
                                            "presample`, the Ray stage's --presample.out) and training reads it: for "
                                            "methods that need an anchor batch it supplies d_pef.jsonl (unless `anchor` "
                                            "is set) and, with train_on_exp, the training prompts d_exp.jsonl. Other "
                                            "methods ignore it. `openrlhf-div run` pre-samples into it when it holds no "
                                            "d_pef.jsonl yet (`--toy` pre-samples its own, into the run folder).")
    train_on_exp: bool = _f(True, "Anchor methods train on D_exp prompts only (DPH-RL's online stage).")


@dataclass
class RolloutConfig:
    prompts_per_step: int = _f(16, "B: prompts sampled per RL step.")
    group_size: int = _f(8, "G: responses sampled per prompt (the group of the advantage estimator).")
    max_new_tokens: int = _f(16, "Longest response (tokens, <eos> included).")
    temperature: float = _f(1.0, "Sampling temperature T; log-probs everywhere are of softmax(logits / T).")
    top_p: float = _f(1.0, "Nucleus sampling mass (1.0: off). Log-probs ignore the truncation.")
    dynamic_sampling_max_tries: int = _f(4, "Methods with dynamic sampling refill the batch with new prompts at "
                                            "most this many generation rounds per step.")
    recompute_old_log_probs: bool = _f(True, "Old (behaviour) log-probs from the training forward under no_grad "
                                             "(true) or the sampler's own log-probs (false). hf: equal up to float "
                                             "rounding. vllm: vLLM's kernels differ from the trainer's forward by "
                                             "~1e-5..1e-3 per token (more in bfloat16), and that difference enters "
                                             "the importance ratio (clipped like any off-policy drift); false saves "
                                             "one no-grad forward per step.")
    on_policy_shortcut: bool = _f(True, "With one optimizer pass over one mini-batch per rollout batch "
                                        "(optim.ppo_epochs=1, optim.mini_batches=1), old log-probs are the training "
                                        "forward's own, detached: no separate old-log-prob forward (the weights have "
                                        "not moved, so the values are the same). Switches itself off otherwise, and "
                                        "for methods whose rollout side reads old log-probs (unlikeliness, DS).")
    generation_batch_size: Optional[int] = _f(None, "Rows per generation call (null: all B*G at once; the vllm "
                                                    "backend schedules its own batches).")
    decode_step: str = _f("dynamic", "hf backend, Qwen2/Llama models: the lean decoder's token step. `dynamic`: "
                                     "attention over the filled cache columns (the default). `static`: fixed shapes, "
                                     "the whole preallocated cache under a device-side mask, no host synchronisation "
                                     "(same samples on the tiny model, log-probs within ~1e-7, not bit-exact: "
                                     "docs/benchmarks.md). `graph`: that step replayed as a CUDA graph (CUDA only).")
    backend: str = _f("auto", "Sampler of train, presample and the trainer's evaluation: `vllm` (an in-process vLLM "
                              "engine next to the trainer, weights pushed after every optimizer step), `hf` (the "
                              "local KV-cache sampler over the Hugging Face model), or `auto`: vllm when vLLM imports "
                              "and supports the model (architecture, head size on CPU, no LoRA) and its engine "
                              "starts, else hf with one log line saying why.")
    vllm_gpu_memory_utilization: float = _f(0.3, "vllm backend on a GPU: the fraction of the card vLLM takes (weights "
                                                 "+ KV cache); the trainer has the rest.")
    vllm_kv_cache_gb: Optional[float] = _f(1.0, "vllm backend on CPU: KV-cache size in GiB.")
    vllm_enforce_eager: bool = _f(False, "vllm backend: true = no torch.compile / CUDA graphs. false (vLLM's default): "
                                         "the engine compiles its model graph at start (CPU: 2-3 min on SmolLM2 "
                                         "here, every start: vLLM 0.29's CPU cache does not reload) and generates faster "
                                         "(SmolLM2: 2.2x hf vs 1.8x eager, docs/benchmarks.md); weight updates "
                                         "reach the compiled engine (tested). true suits short runs and tests.")
    vllm_sleep: bool = _f(True, "vllm backend on a GPU: sleep mode level 2 between rollouts (KV cache and weights "
                                "freed while the trainer runs; weights come back with the next push). Ignored on CPU.")
    vllm_seeding: str = _f("batch", "vllm backend: how the trainer's seed reaches vLLM's sampler. `batch`: one seed "
                                    "per generation call seeds vLLM's batched sampler (same seed + same run = same "
                                    "samples; a sample also depends on the other requests of the call). `request`: "
                                    "every sample its own seeded request (a sample depends on its seed only; vLLM then "
                                    "samples row by row: ~1.4x the time per generated token on SmolLM2 here, "
                                    "docs/benchmarks.md).")


@dataclass
class OptimConfig:
    steps: int = _f(100, "RL steps (rollout rounds) to train.")
    learning_rate: float = _f(1e-4, "AdamW peak learning rate.")
    lr_schedule: str = _f("constant", "Learning-rate schedule after the warm-up: constant or cosine.")
    warmup_steps: int = _f(0, "RL steps of linear learning-rate warm-up.")
    min_lr_ratio: float = _f(0.0, "Cosine schedule: final learning rate / peak.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    adam_betas: List[float] = _f(factory=lambda: [0.9, 0.999], help="AdamW betas.")
    adam_eps: float = _f(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _f(1.0, "Gradient clipping by global norm (<= 0: off).")
    ppo_epochs: int = _f(1, "Passes over each rollout batch.")
    mini_batches: int = _f(1, "Optimizer steps per pass (the rollout batch is split into this many mini-batches).")
    micro_batch_size: int = _f(128, "Online rows per forward/backward (gradient accumulation inside a mini-batch).")
    length_buckets: bool = _f(True, "Micro-batches of rows of similar length, each cut to its own longest row, in "
                                    "training and in the no-grad log-prob forwards: less padding, same loss. Off "
                                    "by itself where the loss depends on which rows share a micro-batch "
                                    "(micro-batch-token-mean, Clip-Cov, KL-Cov).")
    anchor_ratio: float = _f(8.0, "Online samples per D_pef anchor sample in each optimizer step (DPH-RL: "
                                  "128 x 16 : 256 = 8).")
    anchor_batch_size: Optional[int] = _f(None, "D_pef anchor samples per rollout step, split evenly over its "
                                                "mini-batches (null: anchor_ratio decides: each mini-batch's "
                                                "online rows / anchor_ratio, rounded up).")
    log_z_lr: Optional[float] = _f(None, "Learning rate of FlowRL's log Z head (null: learning_rate).")
    stop_after_degenerate_steps: int = _f(10, "Stop the run after this many consecutive steps in which every group's "
                                              "rewards were equal (all truncated / all 0: zero advantages, nothing "
                                              "learned); 0: never stop.")


@dataclass
class EvalConfig:
    every: int = _f(0, "Evaluate every N steps (0: only before training and at the end).")
    at_start: bool = _f(True, "Evaluate the initial policy before the first step.")
    n_samples: int = _f(8, "Samples per held-out prompt (n of pass@k).")
    k: List[int] = _f(factory=lambda: [1, 4, 8], help="k values of pass@k (those > n_samples are skipped).")
    max_prompts: Optional[int] = _f(64, "Held-out prompts used (null: all).")
    temperature: Optional[float] = _f(None, "Eval sampling temperature (null: rollout.temperature).")
    top_p: Optional[float] = _f(None, "Eval nucleus sampling mass (null: rollout.top_p).")
    max_new_tokens: Optional[int] = _f(None, "Eval response length (null: rollout.max_new_tokens).")


@dataclass
class CheckpointConfig:
    every: int = _f(50, "Write a checkpoint every N steps (0: only at the end and on Ctrl-C).")
    keep: int = _f(2, "Checkpoints kept (older ones are deleted).")
    max_weight_growth: float = _f(100.0, "Stop the run (before checkpointing) when the weights' global L2 norm "
                                         "exceeds this multiple of its value at the start or resume of the run "
                                         "(exploding weights); non-finite weights always stop it. 0: finiteness only.")


@dataclass
class LoggingConfig:
    tensorboard: bool = _f(True, "Also write TensorBoard scalars under RUN_DIR/tb.")
    progress: bool = _f(True, "Show a tqdm progress bar.")
    entropy: bool = _f(True, "Log the policy entropy (computed without gradient when the method does not need it).")


@dataclass
class PresampleConfig:
    n_pre: int = _f(8, "Responses sampled per training prompt from the base policy.")
    tau: Optional[int] = _f(None, "Near-perfect threshold: #correct >= tau (null: n_pre).")
    drop_unsolved: bool = _f(False, "Drop prompts with 0 correct from D_exp (the paper does for math).")
    resample_anchor_responses: bool = _f(False, "Draw each near-perfect prompt's anchor response afresh (one "
                                                "sample, kept only if correct) instead of reusing its first "
                                                "correct pre-sample, as seamoke/DPH-RL's generate_sft pass does.")
    chunk_size: int = _f(32, "Prompts per resumable chunk.")
    output_dir: Optional[str] = _f(None, "The local `openrlhf-div presample`'s write-side override: where d_pef.jsonl, "
                                         "d_exp.jsonl and summary.json go (null: data.presample_dir, the folder "
                                         "training reads, when set; else OUTPUT_DIR/presample).")
    max_new_tokens: Optional[int] = _f(None, "Response length (null: rollout.max_new_tokens).")



#: words read as None by a nullable number (``--div.dual_clip none``) and as true / false by a bool
NONE_WORDS = ("none", "null", "off")
TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class BadValue(ValueError):
    """``convert_scalar`` could not read the value as its type (the caller words the error)."""


def convert_scalar(kind: Any, value: Any, *, none_words: bool = True) -> Any:
    """The one coercion of a value to a setting's type, for every reader: the schema's fields
    (:func:`coerce`), the method hyperparameters (``algorithms.registry.coerce_hparam``, which the
    ``--div.<name>`` flags' argparse type and ``Method.with_overrides`` call), YAML files and
    ``key=value`` overrides alike. ``kind``: ``bool``, ``int``, ``float``, ``str`` or ``"pair"``
    (two numbers). ``None`` stays ``None``; with ``none_words`` a number or pair given as
    ``none`` / ``null`` / ``off`` is ``None`` too. An int accepts ``1e3`` and ``8.0``, not ``8.5``;
    a bool is never a number. Raises :class:`BadValue`."""
    if value is None:
        return None
    if kind is bool:
        if isinstance(value, bool):
            return value
        word = str(value).strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
        raise BadValue(value)
    if kind is str:
        return str(value)
    if none_words and isinstance(value, str) and value.strip().lower() in NONE_WORDS:
        return None
    if kind == "pair":
        if none_words and isinstance(value, (list, tuple)) and len(value) == 1 \
                and str(value[0]).strip().lower() in NONE_WORDS:
            return None
        if isinstance(value, (list, tuple)) and len(value) == 2 and not any(isinstance(v, bool) for v in value):
            try:
                return (float(value[0]), float(value[1]))
            except (TypeError, ValueError):
                pass
        raise BadValue(value)
    if kind in (int, float) and not isinstance(value, bool):
        try:
            f = float(value)
            if kind is float:
                return f
            if f == int(f):
                return int(f)
        except (TypeError, ValueError, OverflowError):
            pass
    raise BadValue(value)


def coerce(key: str, hint: Any, val: Any) -> Any:
    """A schema field's value converted to its type (``hint``: the dataclass field's annotation) by
    :func:`convert_scalar`, or :class:`ConfigError` naming the key, the type and the value. A
    nullable (``Optional``) number also takes ``none`` / ``null``; other types pass as they are."""
    text = str(hint)
    nullable = "Optional" in text or "None" in text
    if val is None:
        if nullable:
            return None
        raise ConfigError(f"config key {key!r} may not be null")
    for typ, name in ((bool, "bool"), (int, "int"), (float, "float")):
        if text in (name, f"Optional[{name}]", f"{name} | None", f"typing.Optional[{name}]"):
            break
    else:
        return val
    try:
        return convert_scalar(typ, val, none_words=nullable)
    except BadValue:
        raise ConfigError(f"config key {key!r} expects {name}, got {val!r}") from None


# ---------------------------------------------------------------------- the engines' names
#: our name -> OpenRLHF 0.11.2's flag (without ``--``): the one table through which the Ray and
#: Megatron engines receive a setting of the schema (``openrlhf_div.engines.experiment.to_local`` reads
#: the same flags back for the local engine). A setting absent here is honoured by the local engine
#: only, and refused on the Ray engines (never dropped).
OPENRLHF_FLAGS: Dict[str, str] = {
    "seed": "train.seed",
    "model.path": "actor.model_name_or_path",
    "data.train": "data.prompt_dataset",
    "data.eval": "eval.dataset",
    "data.prompt_field": "data.input_key",
    "data.label_field": "data.label_key",
    "rollout.prompts_per_step": "rollout.batch_size",
    "rollout.group_size": "rollout.n_samples_per_prompt",
    "rollout.max_new_tokens": "rollout.max_new_tokens",
    "rollout.temperature": "rollout.temperature",
    "rollout.top_p": "rollout.top_p",
    "optim.learning_rate": "actor.adam.lr",
    "optim.adam_betas": "actor.adam.betas",
    "optim.weight_decay": "actor.adam.weight_decay",
    "optim.max_grad_norm": "actor.max_norm",
    "optim.ppo_epochs": "train.max_epochs",
    "eval.every": "eval.steps",
    "eval.n_samples": "eval.n_samples_per_prompt",
    "eval.temperature": "eval.temperature",
    "checkpoint.every": "ckpt.save_steps",
}
#: OpenRLHF's flag -> our name (the old spelling under ``openrlhf:``)
OUR_NAME: Dict[str, str] = {flag: key for key, flag in OPENRLHF_FLAGS.items()}
#: our name -> the Ray drivers' own ``--div.<key>`` (rendered into the experiment's ``div:``)
DIV_FLAGS: Dict[str, str] = {
    "optim.anchor_ratio": "anchor_ratio",
    "optim.anchor_batch_size": "anchor_batch_size",
    "eval.top_p": "eval_top_p",
    "optim.log_z_lr": "log_z_lr",
    "data.presample_dir": "anchor_data",  # the folder training reads; the Ray pre-sampling stage writes it
}
#: ``div:``'s key -> our name (the old spelling under ``div:``)
OUR_NAME_DIV: Dict[str, str] = {flag: key for key, flag in DIV_FLAGS.items()}
#: ``presample:``'s key -> our name (the old spelling under ``presample:``): the Ray pre-sampling stage's
#: ``--presample.out`` is the folder training reads, ``data.presample_dir`` (:func:`presample_folder`)
OUR_NAME_PRESAMPLE: Dict[str, str] = {"out": "data.presample_dir"}
_OLD_NAMES = {"openrlhf": OUR_NAME, "div": OUR_NAME_DIV, "presample": OUR_NAME_PRESAMPLE}

#: the sections (and the scalar ``seed``) an experiment file writes in the schema's names
NEUTRAL_SECTIONS: Tuple[str, ...] = ("seed", "model", "data", "rollout", "optim", "eval", "checkpoint")

_SECTION_CLASSES = {"model": ModelConfig, "data": DataConfig, "rollout": RolloutConfig, "optim": OptimConfig,
                    "eval": EvalConfig, "checkpoint": CheckpointConfig}
_NOTED: set = set()


def field_of(key: str) -> dataclasses.Field:
    """The dataclass field of a neutral key (``rollout.group_size``, ``seed``), or :class:`ConfigError`
    naming the closest keys."""
    from openrlhf_div._config_base import unknown_key

    if key == "seed":
        return _SEED_FIELD
    section, _, name = key.partition(".")
    cls = _SECTION_CLASSES.get(section)
    if cls is None or not name:
        raise unknown_key(key, neutral_keys(), what="setting")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if name not in fields:
        raise unknown_key(key, [f"{section}.{n}" for n in fields], what="setting")
    return fields[name]


def neutral_keys() -> List[str]:
    """Every key an experiment file may write in the schema's names."""
    return ["seed"] + [f"{s}.{f.name}" for s, cls in _SECTION_CLASSES.items() for f in dataclasses.fields(cls)]


@dataclass
class _Seed:
    seed: int = _f(0, "Seed of every random stream (prompt order, sampling, anchors, tiny-model init).")


_SEED_FIELD = dataclasses.fields(_Seed)[0]


def check_value(key: str, value: Any) -> None:
    """``value`` must be of ``key``'s type (checked on the value with ``${VAR:-default}`` expanded;
    an unset variable is left to the engine that expands it)."""
    f = field_of(key)
    v = value
    if isinstance(v, str) and "${" in v:
        try:
            v = expand_env(v)
        except ConfigError:
            return
    coerce(key, f.type, v)


def _flat(section: str, value: Any, where: str) -> Dict[str, Any]:
    if section == "seed":
        return {"seed": value}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: section `{section}` must be a mapping (e.g. `{section}:` then indented "
                          f"`key: value` lines), got {value!r}")
    out: Dict[str, Any] = {}
    for k, v in value.items():
        if isinstance(v, dict) and "." not in str(k):
            raise ConfigError(f"{where}: `{section}.{k}` is a setting, not a section")
        out[f"{section}.{k}"] = v
    return out


def note_old_spelling(flag: str, where: str, section: str = "openrlhf") -> None:
    """One stderr line per process and key: ``openrlhf.<flag>`` (or ``div.<key>``, ``presample.out``) is
    our name."""
    ours = _OLD_NAMES[section][flag]
    if (section, flag) in _NOTED:
        return
    _NOTED.add((section, flag))
    hint = f"`openrlhf-div config convert {where}` rewrites the file" if where.endswith((".yaml", ".yml")) \
        else f"write {ours}=VALUE"
    print(f"note: {where}: {section}.{flag} is spelt {ours} now (the old spelling still loads; {hint})",
          file=sys.stderr)


def render_file(data: Dict[str, Any], where: str, *, override: bool = False) -> Dict[str, Any]:
    """One experiment file's (or one set of ``key=value`` overrides', ``override=True``) neutral
    settings rendered into ``openrlhf:`` flags through :data:`OPENRLHF_FLAGS`, each checked against
    the schema (name and type). What has no OpenRLHF flag stays in its neutral section (the local
    engine reads it; the Ray engines refuse it: :func:`refuse_on_ray`). A schema-owned flag written
    under ``openrlhf:`` loads as before, with one line naming our key; a setting written both ways in
    one file is an error. ``toy:``'s overlay is rendered the same way. Returns ``data`` (changed)."""
    if isinstance(data.get("toy"), dict):
        render_file(data["toy"], f"{where} (toy:)", override=override)
    flat: Dict[str, Any] = {}
    for section in NEUTRAL_SECTIONS:
        if section in data:
            flat.update(_flat(section, data.pop(section), where))
    ours = data.get("openrlhf") if isinstance(data.get("openrlhf"), dict) else {}
    for flag in ours:
        if flag in OUR_NAME:
            note_old_spelling(flag, where)
    div = data.get("div") if isinstance(data.get("div"), dict) else {}
    for k in div:
        if k in OUR_NAME_DIV:
            note_old_spelling(k, where, "div")
    pre = data.get("presample") if isinstance(data.get("presample"), dict) else {}
    for k in pre:
        if k in OUR_NAME_PRESAMPLE:
            note_old_spelling(k, where, "presample")
    for key, value in flat.items():
        check_value(key, value)
        if key in DIV_FLAGS:  # the drivers' own flag
            if DIV_FLAGS[key] in div:
                raise ConfigError(f"{where}: {key} and div.{DIV_FLAGS[key]} are one setting written twice; "
                                  f"write {key} only")
            data.setdefault("div", {})[DIV_FLAGS[key]] = value
            continue
        flag = OPENRLHF_FLAGS.get(key)
        if flag is None:  # local-engine only: kept in its section
            if key == "seed":
                data["seed"] = value
            else:
                section, _, name = key.partition(".")
                data.setdefault(section, {})[name] = value
            continue
        if flag in ours:
            raise ConfigError(f"{where}: {key} and openrlhf.{flag} are one setting written twice; write {key} only")
        data.setdefault("openrlhf", {})[flag] = value
    presample_folder(data, where)  # the old presample.out: the same folder as this file's data.presample_dir
    return data


def _same_folder(a: Any, b: Any) -> bool:
    """Two spellings of one folder: equal as written, or equal once ``${VAR:-default}`` is expanded
    and the path normalised (an unset variable without a default: as written)."""
    import os

    if str(a) == str(b):
        return True
    try:
        return os.path.normpath(expand_env(str(a))) == os.path.normpath(expand_env(str(b)))
    except ConfigError:
        return False


def presample_folder(cfg: Dict[str, Any], where: str) -> Optional[str]:
    """The pre-sampling output folder of a rendered experiment (as written, ``${VAR}`` unexpanded):
    ``data.presample_dir`` (rendered as ``div.anchor_data``, the folder training reads), else the old
    ``presample.out``. One folder: a ``presample.out`` other than ``data.presample_dir`` is a
    :class:`ConfigError` (training would not read what the stage writes)."""
    folder = (cfg.get("div") or {}).get("anchor_data") if isinstance(cfg.get("div"), dict) else None
    out = (cfg.get("presample") or {}).get("out") if isinstance(cfg.get("presample"), dict) else None
    if out is not None and folder is not None and not _same_folder(out, folder):
        raise ConfigError(f"{where}: the pre-sampling stage would write to presample.out {out} but training reads "
                          f"data.presample_dir {folder}; remove presample.out (the stage writes to data.presample_dir)")
    return folder if folder is not None else out


def local_only(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """The neutral settings of a rendered experiment that no OpenRLHF flag carries (local engine only)."""
    out: Dict[str, Any] = {}
    for section in NEUTRAL_SECTIONS:
        if section in cfg:
            out.update(_flat(section, cfg[section], "experiment"))
    return out


def refuse_on_ray(cfg: Dict[str, Any], engine: str = "the Ray engines") -> Optional[str]:
    """One line refusing the neutral settings ``engine`` cannot honour, or None."""
    rest = local_only(cfg)
    if not rest:
        return None
    keys = ", ".join(sorted(rest))
    return (f"{keys}: honoured by the local engine only (no OpenRLHF flag carries it: `openrlhf-div config "
            f"fields`); {engine} cannot honour it: remove it, or move it under `local:` (read by the local "
            f"engine only)")
