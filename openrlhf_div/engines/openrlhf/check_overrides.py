"""``python -m openrlhf_div.engines.openrlhf.check_overrides CONFIG [driver flags...]``: the Ray
launcher's check (``examples/scripts/run.sh``) before it starts a Ray head, a pre-sampling stage or a
job: exit 0 when every ``section.key=value`` override among the flags is read by something, else one
line (``error: ...``) and exit 2 (:mod:`openrlhf_div.engines.overrides`, with the Ray driver's flags)."""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from . import presample  # noqa: F401 - registers the Ray driver's option names with engines.overrides


def main(argv: Optional[Sequence[str]] = None) -> int:
    from openrlhf_div.engines.experiment import load
    from openrlhf_div.engines.overrides import overrides_of
    from openrlhf_div.plugins import load_plugins, split_plugin_args

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("python -m openrlhf_div.engines.openrlhf.check_overrides CONFIG [driver flags...]")
        return 0 if argv else 2
    path, rest = argv[0], argv[1:]
    try:
        plugins, rest = split_plugin_args(rest)
        over = overrides_of(rest)
        if over:  # the plug-ins' methods and tasks are valid names (imported only when there is something to check)
            load_plugins(plugins, export=False)
            load(path, over)  # merges them, then check_overrides
    except (ValueError, FileNotFoundError) as exc:  # ConfigError, PluginError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
