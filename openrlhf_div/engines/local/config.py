"""The local engine's configuration: one dataclass per section, each option documented
where it is declared (TRL style), loaded by the one config loader (:mod:`openrlhf_div.config`: YAML, ``extends:``,
``key=value`` overrides).

    cfg = load_config("configs/local_example.yaml", ["method.name=dph_js", "optim.steps=50"])

Overrides use dotted keys (``section.option=value``); values are parsed as YAML
(``true``, ``1e-3``, ``[1, 4]``, ``null``). The ``method`` section holds ``name`` plus any
hyperparameter of that method (validated by the method registry), e.g.
``method.name=dph_js method.anchor_eta=0.1``. An unknown key is an error that names the
key and the closest valid ones.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import yaml

from openrlhf_div.config import ConfigError, deep_merge, load, parse_overrides, renamed_sections, unknown_key

from ..layout import LAYOUT_KEYS, EngineLayout, refuse_on_local

__all__ = ["ConfigError", "TrainConfig", "config_from_dict", "config_help", "dump_config", "load_config",
           "parse_overrides"]

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
    presample_dir: Optional[str] = _f(None, "Output directory of `openrlhf-div presample`. For methods that need an "
                                            "anchor batch it supplies d_pef.jsonl (unless `anchor` is set) and, with "
                                            "train_on_exp, the training prompts d_exp.jsonl. Other methods ignore it.")
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
    output_dir: Optional[str] = _f(None, "Where d_pef.jsonl, d_exp.jsonl and summary.json go "
                                         "(null: OUTPUT_DIR/presample).")
    max_new_tokens: Optional[int] = _f(None, "Response length (null: rollout.max_new_tokens).")


@dataclass
class LayoutConfig:
    """Micro-batch layout (:mod:`openrlhf_div.engines.layout`): the OpenRLHF / Megatron engines' micro-batch
    layout under aggregation micro-batch-token-mean (section ``layout:``; the old name ``engine:`` still
    loads, with one stderr line). The local engine lays micro-batches out with
    ``optim.micro_batch_size`` / ``optim.mini_batches`` and refuses anything but the defaults here."""

    step_layout: str = _f(LAYOUT_KEYS["step_layout"][0], LAYOUT_KEYS["step_layout"][1]
                          + " (source: " + LAYOUT_KEYS["step_layout"][2] + ")")
    micro_batch_tokens: Optional[int] = _f(LAYOUT_KEYS["micro_batch_tokens"][0], LAYOUT_KEYS["micro_batch_tokens"][1]
                                           + " (source: " + LAYOUT_KEYS["micro_batch_tokens"][2] + ")")
    authors_world_size: Optional[int] = _f(LAYOUT_KEYS["authors_world_size"][0], LAYOUT_KEYS["authors_world_size"][1]
                                           + " (source: " + LAYOUT_KEYS["authors_world_size"][2] + ")")
    mixed_micro_batches: str = _f(LAYOUT_KEYS["mixed_micro_batches"][0], LAYOUT_KEYS["mixed_micro_batches"][1]
                                  + " (source: " + LAYOUT_KEYS["mixed_micro_batches"][2] + ")")

    def to_layout(self) -> EngineLayout:
        try:
            return EngineLayout(step_layout=self.step_layout, micro_batch_tokens=self.micro_batch_tokens,
                                authors_world_size=self.authors_world_size,
                                mixed_micro_batches=self.mixed_micro_batches)
        except ValueError as e:
            raise ConfigError(f"config section `layout`: {e}") from e


@dataclass
class TrainConfig:
    """Everything a local-engine run needs. Sections: model, data, method, rollout, optim,
    eval, checkpoint, logging, presample."""

    experiment: Optional[str] = _f(None, "Name of the experiment file this run came from (`openrlhf-div run EXPERIMENT`; "
                                         "recorded in run_info.json), or null.")
    task: Optional[str] = _f(None, "Registered task name (openrlhf_div.tasks.get_task).")
    plugins: List[str] = _f(factory=list, help="Modules or .py files (relative to the config file) that register "
                                                "methods, components or tasks; imported before the method and task "
                                                "are resolved (openrlhf_div.plugins).")
    task_options: Dict[str, Any] = _f(factory=dict, help="Keyword arguments of the task factory.")
    seed: int = _f(0, "Seed of every random stream (prompt order, sampling, anchors, tiny-model init).")
    output_dir: str = _f("runs/local", "Run directory: config, metrics, checkpoints, TensorBoard.")
    device: str = _f("auto", "cpu, cuda, or auto (cuda when available).")
    num_threads: Optional[int] = _f(None, "torch intra-op threads (null: the cores available to this process; the "
                                           "demo uses 1, its tiny model is fastest single-threaded).")
    method: Dict[str, Any] = _f(factory=lambda: {"name": "grpo"},
                                help="`name` of a registered method plus any of its hyperparameters (each with its help and "
                                     "source: `openrlhf-div methods --hparams`, docs/hyperparameters.md).")
    model: ModelConfig = _f(factory=ModelConfig, help="The initial policy.")
    data: DataConfig = _f(factory=DataConfig, help="Datasets.")
    rollout: RolloutConfig = _f(factory=RolloutConfig, help="Sampling.")
    optim: OptimConfig = _f(factory=OptimConfig, help="Optimisation.")
    eval: EvalConfig = _f(factory=EvalConfig, help="Periodic pass@k.")
    checkpoint: CheckpointConfig = _f(factory=CheckpointConfig, help="Checkpoints.")
    logging: LoggingConfig = _f(factory=LoggingConfig, help="Metrics output.")
    presample: PresampleConfig = _f(factory=PresampleConfig, help="DPH pre-sampling (`openrlhf-div presample`).")
    layout: LayoutConfig = _f(factory=LayoutConfig, help="Micro-batch layout (the OpenRLHF / Megatron engines'; the "
                                                         "local engine keeps the defaults). Old name: engine.")

    # ------------------------------------------------------------------ helpers
    def build_method(self):
        """The registry method named by ``method.name`` with the section's other keys as overrides."""
        from openrlhf_div.algorithms import get_method
        from openrlhf_div.plugins import load_plugins

        load_plugins([self.plugins] if isinstance(self.plugins, str) else list(self.plugins or ()))  # + OPENRLHF_DIV_PLUGINS
        opts = dict(self.method)
        name = opts.pop("name", None)
        if not name:
            raise ConfigError("method.name is required (see `openrlhf-div methods`)")
        try:
            method = get_method(str(name), **opts)
        except ValueError as e:  # name the config section the bad key came from
            raise ConfigError(f"config section `method`: {e}") from e
        return method

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> "TrainConfig":
        if not self.task:
            raise ConfigError("`task` is required: the name of a registered task (openrlhf_div.tasks.list_tasks())")
        r, o = self.rollout, self.optim
        for name, val, lo in (("rollout.prompts_per_step", r.prompts_per_step, 1), ("rollout.group_size", r.group_size, 1),
                              ("rollout.max_new_tokens", r.max_new_tokens, 1), ("optim.ppo_epochs", o.ppo_epochs, 1),
                              ("optim.mini_batches", o.mini_batches, 1), ("optim.micro_batch_size", o.micro_batch_size, 1),
                              ("optim.steps", o.steps, 0), ("eval.n_samples", self.eval.n_samples, 1),
                              ("presample.n_pre", self.presample.n_pre, 1), ("presample.chunk_size", self.presample.chunk_size, 1),
                              ("rollout.dynamic_sampling_max_tries", r.dynamic_sampling_max_tries, 1)):
            if int(val) < lo:
                raise ConfigError(f"{name} must be >= {lo}, got {val}")
        from .sampler_registry import backend_choices  # the sampler registry names the backends

        if r.backend not in backend_choices():
            raise ConfigError(f"rollout.backend must be one of {', '.join(backend_choices())}, got {r.backend!r}")
        if r.decode_step not in ("dynamic", "static", "graph"):
            raise ConfigError(f"rollout.decode_step must be dynamic, static or graph, got {r.decode_step!r}")
        if r.vllm_seeding not in ("batch", "request"):
            raise ConfigError(f"rollout.vllm_seeding must be batch or request, got {r.vllm_seeding!r}")
        if not 0 < r.vllm_gpu_memory_utilization < 1:
            raise ConfigError(f"rollout.vllm_gpu_memory_utilization must be in (0, 1), got "
                              f"{r.vllm_gpu_memory_utilization}")
        if r.backend != "hf" and not r.recompute_old_log_probs and r.top_p < 1:
            raise ConfigError("rollout.recompute_old_log_probs=false with rollout.top_p < 1 needs rollout.backend=hf: "
                              "vLLM's log-probs are renormalised over the nucleus, the trainer's are not, so the "
                              "importance ratio would be off by the nucleus mass; recompute them (true) or use hf")
        if not r.temperature >= 0:
            raise ConfigError(f"rollout.temperature must be >= 0, got {r.temperature}")
        if o.anchor_ratio <= 0:
            raise ConfigError(f"optim.anchor_ratio must be > 0, got {o.anchor_ratio}")
        if self.optim.lr_schedule not in ("constant", "cosine"):
            raise ConfigError(f"optim.lr_schedule must be constant or cosine, got {self.optim.lr_schedule!r}")
        if self.optim.warmup_steps < 0 or not 0.0 <= self.optim.min_lr_ratio <= 1.0:
            raise ConfigError("optim.warmup_steps must be >= 0 and optim.min_lr_ratio in [0, 1]")
        if self.model.lora_rank < 0:
            raise ConfigError(f"model.lora_rank must be >= 0, got {self.model.lora_rank}")
        if self.data.duplicate_ids not in ("error", "rename"):
            raise ConfigError(f"data.duplicate_ids must be error or rename, got {self.data.duplicate_ids!r}")
        if not self.data.chat_template and self.data.system_prompt:
            raise ConfigError("data.system_prompt needs data.chat_template=true (without the chat template the model "
                              "reads the prompt text as it is: put the text into data.prompt_template)")
        if self.data.prompt_template is not None and "{prompt}" not in str(self.data.prompt_template):
            raise ConfigError(f"data.prompt_template must contain {{prompt}}, got {self.data.prompt_template!r}")
        if self.data.max_prompt_tokens is not None and int(self.data.max_prompt_tokens) < 1:
            raise ConfigError(f"data.max_prompt_tokens must be >= 1, got {self.data.max_prompt_tokens}")
        if self.model.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"model.dtype must be auto, float32, bfloat16 or float16, got {self.model.dtype!r}")
        if self.model.master_weights and self.model.dtype not in ("bfloat16", "auto"):
            raise ConfigError(f"model.master_weights needs model.dtype=bfloat16 (got {self.model.dtype}): with float32 "
                              f"the weights are their own master copy, and float16 would also need loss scaling, "
                              f"which the local engine does not do")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ConfigError(f"device must be cpu, cuda[:N] or auto, got {self.device!r}")
        method = self.build_method()  # validates method.name and its hyperparameters
        # the section holds what the method holds: each hyperparameter converted once, by the
        # registry's coerce_hparam (as on the Ray and Megatron drivers), so the saved config.yaml
        # and run_info.json show the value the run used (a pair as a list: YAML has no tuple)
        self.method = {k: (list(method.hparams[k]) if isinstance(method.hparams.get(k), tuple) else method.hparams[k])
                       if k in method.hparams else v for k, v in self.method.items()}
        refused = refuse_on_local(self.layout.to_layout())
        if refused:
            raise ConfigError(refused)
        from .guards import check_group_size

        err = check_group_size(method, r.group_size)
        if err:
            raise ConfigError(err)
        if method.aggregation == "micro-batch-token-mean":
            k = int(method.hparams["micro_batch_seqs"])
            if o.micro_batch_size % k:
                raise ConfigError(f"aggregation micro-batch-token-mean groups micro_batch_seqs={k} sequences: "
                                  f"optim.micro_batch_size ({o.micro_batch_size}) must be a multiple of it")
        return self


# ---------------------------------------------------------------------- loading
# YAML, extends and overrides: openrlhf_div.config (the one loader); the schema is this module's.
def _coerce(key: str, hint: Any, val: Any) -> Any:
    """Convert ``val`` to a scalar field's type (a quoted ``"1e-3"`` is a string, for one)."""
    text = str(hint)
    if val is None:
        if "Optional" in text or "None" in text:
            return None
        raise ConfigError(f"config key {key!r} may not be null")
    for typ, name in ((bool, "bool"), (int, "int"), (float, "float")):
        if text in (name, f"Optional[{name}]", f"{name} | None", f"typing.Optional[{name}]"):
            break
    else:
        return val
    if typ is bool:
        if isinstance(val, bool):
            return val
        if str(val).lower() in ("true", "yes", "1", "on"):
            return True
        if str(val).lower() in ("false", "no", "0", "off"):
            return False
    else:
        try:
            if typ is int:
                f = float(val)
                if f == int(f) and not isinstance(val, bool):
                    return int(f)
            else:
                if not isinstance(val, bool):
                    return float(val)
        except (TypeError, ValueError):
            pass
    raise ConfigError(f"config key {key!r} expects {name}, got {val!r}")


def _from_dict(cls, data: Dict[str, Any], where: str = ""):
    if not isinstance(data, dict):
        raise ConfigError(f"config section {where or '<top>'} must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        full = f"{where}.{k}" if where else k
        if k not in fields:
            raise unknown_key(full, list(fields), where)
        ftype = fields[k].default_factory if fields[k].default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(ftype):
            kwargs[k] = _from_dict(ftype, v or {}, full)
        else:
            kwargs[k] = _coerce(full, hints[k], v)
    return cls(**kwargs)


def _merge(base: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    """The loader's deep merge with this schema's two exceptions: switching ``method.name``
    drops the old method's hyperparameters (they would not apply to the new one), and
    ``task_options`` is replaced whole (they are one task factory's keyword arguments)."""
    base = dict(base)
    m, old = extra.get("method"), base.get("method")
    old_name = old.get("name") if isinstance(old, dict) else old
    if isinstance(m, str) or (isinstance(m, dict) and "name" in m and m.get("name") != old_name):
        base["method"] = {}
    if "task_options" in extra:
        base["task_options"] = {}
    return deep_merge(base, extra)


def config_from_dict(data: Dict[str, Any], overrides: Sequence[str] = ()) -> TrainConfig:
    data = renamed_sections(data or {})  # a saved run's config.yaml of an earlier release: engine: is layout:
    merged = _merge(data, parse_overrides(overrides)) if overrides else dict(data)
    cfg = _from_dict(TrainConfig, merged)
    if isinstance(cfg.method, str):
        cfg.method = {"name": cfg.method}
    if not isinstance(cfg.method, dict):
        raise ConfigError(f"method must be a mapping with a `name`, got {cfg.method!r}")
    if isinstance(cfg.eval.k, int):
        cfg.eval.k = [cfg.eval.k]
    return cfg.validate()


def load_config(path: Optional[str], overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML config (``extends:`` followed; the defaults when ``path`` is None), apply
    ``key=value`` overrides and validate."""
    data = load(path, overrides, merge=_merge)
    if path and data.get("plugins"):  # relative .py paths are the config file's
        from openrlhf_div.plugins import config_plugins

        data["plugins"] = config_plugins(data["plugins"], path)
    return config_from_dict(data)


def dump_config(cfg: TrainConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def config_help() -> str:
    """Every option with its default and help text (``openrlhf-div train --help-config``)."""
    lines = []

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(sub):
                lines.append(f"\n[{prefix}{f.name}] {f.metadata.get('help', '')}")
                walk(sub, prefix + f.name + ".")
            else:
                default = f.default if f.default is not dataclasses.MISSING else (sub() if sub else None)
                lines.append(f"  {prefix}{f.name} = {default!r}\n      {f.metadata.get('help', '')}")
    walk(TrainConfig, "")
    return "\n".join(lines)
