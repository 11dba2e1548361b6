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
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from openrlhf_div.config import ConfigError, deep_merge, load, parse_overrides, renamed_sections, unknown_key

from openrlhf_div.schema import (DIV_FLAGS, OPENRLHF_FLAGS, CheckpointConfig, DataConfig, EvalConfig, LoggingConfig, ModelConfig,  # noqa: F401
                                  OptimConfig, PresampleConfig, RolloutConfig, _f, coerce as _coerce)

from ..layout import LAYOUT_KEYS, EngineLayout, refuse_on_local

__all__ = ["ConfigError", "TrainConfig", "config_from_dict", "config_help", "dump_config", "load_config",
           "parse_overrides"]

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
        """The registry method named by ``method.name`` with the section's other keys as overrides,
        built once per process (:func:`~openrlhf_div.algorithms.method_from_spec`: every config with
        this method section -- the validation, the trainer, the run record -- shares one build)."""
        from openrlhf_div.algorithms import method_from_spec
        from openrlhf_div.plugins import load_plugins

        load_plugins([self.plugins] if isinstance(self.plugins, str) else list(self.plugins or ()))  # + OPENRLHF_DIV_PLUGINS
        opts = dict(self.method)
        name = opts.pop("name", None)
        if not name:
            raise ConfigError("method.name is required (see `openrlhf-div methods`)")
        try:
            method = method_from_spec({"name": str(name), "hparams": opts})
        except ValueError as e:  # name the config section the bad key came from
            raise ConfigError(f"config section `method`: {e}") from e
        return method

    def anchors_per_mini_batch(self, online_rows: int, index: int) -> int:
        """D_pef anchors drawn for mini-batch ``index`` of a rollout step holding ``online_rows`` online
        rows: ``optim.anchor_batch_size`` split evenly over ``optim.mini_batches`` (the first ones take
        the remainder; they sum to it), else ``ceil(online_rows / optim.anchor_ratio)``."""
        from openrlhf_div.engines.anchor_data import anchor_count

        o = self.optim
        if o.anchor_batch_size is None:
            return anchor_count(online_rows, None, o.anchor_ratio, flags=("optim.anchor_batch_size", "optim.anchor_ratio"))
        q, r = divmod(int(o.anchor_batch_size), max(1, int(o.mini_batches)))
        return q + (1 if index < r else 0)

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
        if o.anchor_batch_size is not None and int(o.anchor_batch_size) < 0:
            raise ConfigError(f"optim.anchor_batch_size must be >= 0 (or null: anchor_ratio), got {o.anchor_batch_size}")
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
    """Every option with its type, default, the engines that honour it and its help
    (``openrlhf-div train --help-config`` = ``openrlhf-div config fields``: one help page)."""
    return fields_text()


# ---------------------------------------------------------------------- help on every field
@dataclass
class FieldInfo:
    key: str
    type: str
    default: Any
    help: str
    engines: Tuple[str, ...]
    openrlhf: Optional[str]


def fields() -> List[FieldInfo]:
    """Every field of the schema (:class:`TrainConfig`'s tree),
    with the engines that honour it and, where there is one, the OpenRLHF flag it is rendered to."""
    out: List[FieldInfo] = []

    def walk(cls, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            key = prefix + f.name
            if dataclasses.is_dataclass(sub):
                walk(sub, key + ".")
                continue
            default = f.default if f.default is not dataclasses.MISSING else (sub() if sub else None)
            flag = OPENRLHF_FLAGS.get(key) or (f"div.{DIV_FLAGS[key]}" if key in DIV_FLAGS else None)
            engines = ("local", "openrlhf", "megatron") if flag or key in _EVERY_ENGINE else ("local",)
            out.append(FieldInfo(key, str(f.type).replace("typing.", ""), default, str(f.metadata.get("help", "")), engines, flag))

    walk(TrainConfig, "")
    return out


#: top-level keys every engine reads under the same name (an experiment file's own sections)
_EVERY_ENGINE = ("experiment", "task", "plugins", "method")


# ---------------------------------------------------------------------- fields
def _default(v) -> str:
    if isinstance(v, str):
        return repr(v)
    return "null" if v is None else str(v).replace("True", "true").replace("False", "false")


def fields_text(section: Optional[str] = None) -> str:
    lines, last = [], None
    for f in fields():
        sec = f.key.split(".", 1)[0] if "." in f.key else "(top level)"
        if section and sec != section:
            continue
        if sec != last:
            lines.append(f"\n[{sec}]")
            last = sec
        where = ", ".join(f.engines) + (f"; Ray driver --{f.openrlhf}" if f.openrlhf else "")
        lines.append(f"  {f.key}: {f.type} = {_default(f.default)}   ({where})\n      {f.help}")
    if section and not lines:
        raise ValueError(f"no section {section!r} in the schema (`openrlhf-div config fields` lists them)")
    return "\n".join(lines).lstrip("\n") + "\n"


def fields_markdown() -> str:
    out = ["# Configuration reference (generated)", "",
           "Every setting of the one schema: its name (the local engine's `TrainConfig`, the experiment files' "
           "sections, `key=value` overrides), type, default, the engines that honour it and the OpenRLHF flag it "
           "becomes on the Ray engines (OpenRLHF's own, or the driver's `--div.*`; OpenRLHF and Megatron actors alike). A setting without a flag is honoured by the local "
           "engine only and refused on the Ray engines in one line. Generated by `openrlhf-div config fields "
           "--markdown`; `tests/test_schema.py` fails when this page and the schema drift apart. How the "
           "experiment files use it: [configs.md](configs.md).", ""]
    last = None
    for f in fields():
        sec = f.key.split(".", 1)[0] if "." in f.key else "top level"
        if sec != last:
            out += ["", f"## {sec}", "", "| setting | type | default | engines | Ray driver flag | help |",
                    "|---|---|---|---|---|---|"]
            last = sec
        help_ = f.help.replace("|", "\\|").replace("\n", " ")
        flag = f"`--{f.openrlhf}`" if f.openrlhf else ""
        out.append(f"| `{f.key}` | {f.type.replace('|', '&#124;')} | `{_default(f.default)}` | {', '.join(f.engines)} "
                   f"| {flag} | {help_} |")
    return "\n".join(out) + "\n"
