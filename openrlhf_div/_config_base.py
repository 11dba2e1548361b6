"""The config errors' base (no other import of the package): :class:`ConfigError`, the
environment's ``${VAR:-default}`` (:func:`expand_env`) and the unknown-key error. The loader
(:mod:`openrlhf_div.config`) and the schema (:mod:`openrlhf_div.schema`) both use them; both re-export
nothing new: ``openrlhf_div.config.ConfigError`` is this class."""
from __future__ import annotations

import difflib
import os
import re
from typing import Dict, Optional, Sequence


class ConfigError(ValueError):
    """A bad config file, key or value; the message says which and what to do."""


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(value: str, environ: Optional[Dict[str, str]] = None) -> str:
    """``${VAR}`` and ``${VAR:-default}`` from the environment; an unset variable without a
    default is an error."""
    env = os.environ if environ is None else environ

    def sub(m):
        name, default = m.group(1), m.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        raise ConfigError(f"config refers to ${{{name}}}, which is not set (export it or write ${{{name}:-default}})")
    return _VAR.sub(sub, value)


def unknown_key(key: str, valid: Sequence[str], where: str = "", what: str = "config key") -> ConfigError:
    """The error of an unknown key: the closest valid ones, then all of them."""
    close = difflib.get_close_matches(key.split(".")[-1], list(valid), n=3, cutoff=0.5)
    prefix = where + "." if where else ""
    hint = f" Did you mean {', '.join(repr(prefix + c) for c in close)}?" if close else ""
    return ConfigError(f"unknown {what} {key!r}.{hint} Valid keys{' in ' + where if where else ''}: "
                       f"{', '.join(sorted(valid))}")
