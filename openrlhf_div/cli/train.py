"""``openrlhf-div train``: RL training with the local engine.

    openrlhf-div train --config configs/local_example.yaml [key=value ...]
    openrlhf-div train --resume runs/local_example [optim.steps=60]
    openrlhf-div train --help-config          # every option, its default and meaning
"""
from __future__ import annotations

import sys


def add_parser(sub):
    p = sub.add_parser("train", help="RL training with the local (single-process) engine",
                       description="Train a policy with any registered method. Options come from the YAML "
                                   "config, overridden by key=value pairs (dotted keys: method.name=dph_js "
                                   "method.anchor_eta=0.1 optim.steps=50).")
    p.add_argument("--config", "-c", help="YAML config (see configs/local_example.yaml)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint "
                                                       "(its config.yaml; overrides still apply)")
    p.add_argument("--help-config", action="store_true", help="list every config option and exit")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from openrlhf_div.engines.local.config import ConfigError, config_help

    if args.help_config:
        print(config_help())
        return 0
    if not args.config and not args.resume:
        print("openrlhf-div train: give --config FILE (or --resume RUN_DIR)", file=sys.stderr)
        return 2
    from openrlhf_div.engines.local.models import ModelNotFoundError
    from openrlhf_div.engines.local.checkpoint import CorruptCheckpointError, NonFiniteWeightsError
    from openrlhf_div.engines.local.runlog import WandbMissingError
    from openrlhf_div.engines.local.trainer import DegenerateRunError, EmptyAnchorError, NonFiniteLossError, train
    from openrlhf_div.tasks.datasets import DatasetError

    try:
        result = train(args.config, args.overrides, resume=args.resume)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (DatasetError, EmptyAnchorError, ModelNotFoundError, WandbMissingError) as e:
        print(f"openrlhf-div train: {e}", file=sys.stderr)
        return 2
    except DegenerateRunError as e:
        print(f"training stopped: {e}", file=sys.stderr)
        return 3
    except (FileExistsError, FileNotFoundError) as e:
        print(f"openrlhf-div train: {e}", file=sys.stderr)
        return 2
    except (NonFiniteLossError, NonFiniteWeightsError) as e:
        print(f"training stopped: {e}", file=sys.stderr)
        return 3
    except CorruptCheckpointError as e:
        print(f"openrlhf-div train: {e}", file=sys.stderr)
        return 2
    ev = result.get("eval") or {}
    scores = ", ".join(f"{k} {v:.3f}" for k, v in ev.items() if k.startswith("pass@"))
    print(f"done: {result['run_dir']}" + (f" (final eval: {scores})" if scores else ""))
    return 0
