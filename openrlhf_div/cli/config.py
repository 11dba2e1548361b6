"""``openrlhf-div config``: the one schema of the settings.

    openrlhf-div config fields                 # every section and field: type, default, engines, help
    openrlhf-div config fields --markdown      # the same as docs/config_reference.md (generated from it)
    openrlhf-div config convert FILE...        # print an experiment file in the schema's names
    openrlhf-div config convert --write FILE   # ... rewrite it in place (comments kept)

``convert`` moves every setting the schema owns out of an experiment file's ``openrlhf:`` section
(OpenRLHF's flag names: ``rollout.n_samples_per_prompt``) into the schema's sections
(``rollout.group_size``), and the method / task / layout keys of the old ``div:`` spelling into
``method:`` / ``task:`` / the layout section, keeping each comment with its line, and refuses to write a file whose
resolved settings would change (both spellings are loaded and compared first).
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Dict, List, Tuple


def add_parser(sub):
    p = sub.add_parser("config", help="the settings' one schema: every field with its help, and the converter "
                                      "of old experiment files")
    s = p.add_subparsers(dest="config_command", metavar="ACTION")
    f = s.add_parser("fields", help="every section and field of the schema: type, default, the engines that honour "
                                    "it, the OpenRLHF flag it becomes, one line of help")
    f.add_argument("--markdown", action="store_true", help="a Markdown page (docs/config_reference.md is this output)")
    f.add_argument("--section", help="only this section (e.g. rollout)")
    c = s.add_parser("convert", help="rewrite experiment files in the schema's names (settings under openrlhf: that "
                                     "the schema owns move to its sections)")
    c.add_argument("files", nargs="+", metavar="FILE")
    c.add_argument("--write", action="store_true", help="rewrite the files in place (default: print the result)")
    p.set_defaults(func=run, _parser=p)
    return p


# the Ray drivers' own ``div:`` settings the schema has no section field for (no local counterpart):
# listed by ``config fields`` under ``[div]``; the local engine refuses each one by name, except the
# engine choice ``actor_backend``
def ray_only_keys() -> Tuple[str, ...]:
    """The refused ones (``anchor_seed`` and :data:`~openrlhf_div.engines.experiment.RAY_ONLY_DIV`), then the
    engine choice ``actor_backend``: one list, the local engine's."""
    from openrlhf_div.engines.experiment import RAY_ONLY_DIV

    return ("anchor_seed", *RAY_ONLY_DIV, "actor_backend")


def ray_only_rows() -> List[Tuple[str, str, str, str]]:
    """``(key, type, default, help)`` of :func:`ray_only_keys`, read from the drivers' own parser."""
    import argparse

    from openrlhf_div.engines.flags import add_div_arguments
    from openrlhf_div.engines.megatron.config import add_megatron_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_div_arguments(parser)
    add_megatron_arguments(parser)
    acts = {a.dest: a for a in parser._actions}
    rows = []
    for key in ray_only_keys():
        a = acts[f"div.{key}"]
        kind = "bool" if a.metavar == "BOOL" else ("int" if a.type is int else ("str" if a.choices else "float"))
        default = "null" if a.default is None else str(a.default).replace("False", "false").replace("True", "true")
        local = ("the engine choice (`run --engine megatron` / `openrlhf`)" if key == "actor_backend"
                 else "refused on the local engine")
        rows.append((f"div.{key}", kind, default, f"{(a.help or '').rstrip('.')}. Local: {local}."))
    return rows


def ray_only_text() -> str:
    lines = ["", "[div]  (the Ray drivers' own settings: no local counterpart)"]
    for key, kind, default, help_ in ray_only_rows():
        lines.append(f"  {key}: {kind} = {default}   (openrlhf, megatron; Ray driver --{key})\n      {help_}")
    return "\n".join(lines) + "\n"


def ray_only_markdown() -> str:
    out = ["", "## div (the Ray drivers' own settings)", "",
           "Settings of the Ray drivers that the local engine has no counterpart of; an experiment file writes "
           "them under `div:`. The local engine refuses each one by name when it is set (the engine choice "
           "`actor_backend` aside).", "",
           "| setting | type | default | engines | Ray driver flag | help |", "|---|---|---|---|---|---|"]
    for key, kind, default, help_ in ray_only_rows():
        out.append(f"| `{key}` | {kind} | `{default}` | openrlhf, megatron | `--{key}` | {help_.replace('|', '&#124;')} |")
    return "\n".join(out) + "\n"


def reference_markdown() -> str:
    """docs/config_reference.md: the schema's fields, then the Ray drivers' own ``div:`` settings."""
    from openrlhf_div.engines.local.config import fields_markdown

    return fields_markdown() + ray_only_markdown()


def run(args) -> int:
    if args.config_command == "fields":
        from openrlhf_div.engines.local.config import fields_text

        if args.markdown:
            text = reference_markdown()
        elif args.section == "div":
            text = ray_only_text().lstrip("\n")
        else:
            text = fields_text(args.section) + ("" if args.section else ray_only_text())
        sys.stdout.write(text)
        return 0
    if args.config_command == "convert":
        for path in args.files:
            new, moved = convert_file(path)
            if args.write:
                if moved:
                    with open(path, "w") as fh:
                        fh.write(new)
                print(f"{path}: {len(moved)} setting(s) moved" + (f" ({', '.join(moved)})" if moved else ""),
                      file=sys.stderr)
            else:
                sys.stdout.write(new)
        return 0
    args._parser.print_help()
    return 2


# ---------------------------------------------------------------------- convert
_KEY = re.compile(r"^(\s*)([A-Za-z_][A-Za-z0-9_.]*):(.*)$")


def _block_end(lines: List[str], start: int, indent: int) -> int:
    """Index after the last line of the block opened at ``start`` (lines deeper than ``indent``,
    blank lines and comments inside it)."""
    end = start + 1
    last = start + 1
    while end < len(lines):
        line = lines[end]
        if line.strip() == "" or line.lstrip().startswith("#"):
            end += 1
            continue
        if len(line) - len(line.lstrip()) <= indent:
            break
        end += 1
        last = end
    return last


def _convert_lines(lines: List[str]) -> Tuple[List[str], List[str]]:
    from openrlhf_div.schema import OUR_NAME

    moved_names: List[str] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)openrlhf:\s*(#.*)?$", lines[i])
        if not m:
            i += 1
            continue
        indent = len(m.group(1))
        start, end = i, _block_end(lines, i, indent)
        body = lines[start + 1:end]
        keep: List[str] = []
        moved: Dict[str, List[Tuple[str, List[str]]]] = {}
        pending: List[str] = []
        for line in body:
            if line.strip() == "" or line.lstrip().startswith("#"):
                pending.append(line)
                continue
            km = _KEY.match(line)
            flag = km.group(2) if km else None
            if km and flag in OUR_NAME and len(km.group(1)) == indent + 2:
                ours = OUR_NAME[flag]
                section, _, name = ours.partition(".")
                rest = km.group(3)
                if ours == "seed":
                    new = [" " * indent + "seed:" + rest]
                else:
                    new = [" " * (indent + 2) + name + ":" + rest]
                comments = [c for c in pending if c.strip()]
                keep += [c for c in pending if not c.strip()]
                moved.setdefault(section, []).append((ours, [" " * (indent + (0 if ours == "seed" else 2))
                                                            + c.strip() for c in comments] + new))
                moved_names.append(f"openrlhf.{flag} -> {ours}")
                pending = []
                continue
            keep += pending + [line]
            pending = []
        keep += pending
        if not moved:
            i = end
            continue
        out: List[str] = []
        for section in ("seed", "model", "data", "rollout", "optim", "eval", "checkpoint"):
            if section not in moved:
                continue
            if section == "seed":
                for _, ls in moved[section]:
                    out += ls
                continue
            out.append(" " * indent + f"{section}:")
            for _, ls in moved[section]:
                out += ls
        has_keys = any(line.strip() and not line.lstrip().startswith("#") for line in keep)
        block = ([lines[start]] + keep) if has_keys else [c for c in keep if c.strip()]
        lines[start:end] = out + block
        i = start + len(out) + len(block)
    return lines, moved_names


#: the section of the Ray engines' micro-batch layout keys
LAYOUT_SECTION = "layout"


def _convert_div(lines: List[str]) -> Tuple[List[str], List[str]]:
    """The old ``div:`` spelling (issue 31): the method's name and hyperparameters under ``div:`` move to
    ``method:``, ``div.task`` to ``task:``, layout keys to the layout section; the driver's own keys
    (anchors, actor_backend, ...) stay in ``div:``. Comments travel with the key after them (a comment
    closing the block stays with the key before it)."""
    from openrlhf_div.engines.flags import METHOD_KEYS_IN_DIV
    from openrlhf_div.engines.layout import LAYOUT_KEYS

    starts = [i for i, line in enumerate(lines) if re.match(r"^div:\s*(#.*)?$", line)]
    if not starts:
        return lines, []
    s = starts[0]
    e = _block_end(lines, s, 0)
    items: List[Tuple[str, List[str]]] = []
    pending: List[str] = []
    for line in lines[s + 1:e]:
        if line.strip() == "" or line.lstrip().startswith("#"):
            pending.append(line)
            continue
        m = re.match(r"^  ([A-Za-z_][A-Za-z0-9_]*):(.*)$", line)
        if not m:
            raise ValueError(f"div: line {line!r} is not a `key: value` line; convert this file by hand")
        items.append((m.group(1), pending + [line]))
        pending = []
    if pending and items:
        items[-1][1].extend(pending)
    from openrlhf_div.schema import OUR_NAME_DIV

    mk = METHOD_KEYS_IN_DIV()
    task, method, layout, rest, moved = [], [], [], [], []
    neutral: Dict[str, List[str]] = {}
    for key, ls in items:
        if key == "task":
            task += [x[2:] if not x.lstrip().startswith("#") else x.strip() for x in ls]
            moved.append("div.task -> task")
        elif key == "method":
            method = [re.sub(r"^  method:", "  name:", x) for x in ls] + method
            moved.append("div.method -> method.name")
        elif key in mk:
            method += ls
            moved.append(f"div.{key} -> method.{key}")
        elif key in LAYOUT_KEYS:
            layout += ls
            moved.append(f"div.{key} -> {LAYOUT_SECTION}.{key}")
        elif key in OUR_NAME_DIV:  # the drivers' flag of a schema setting (div.anchor_ratio -> optim.anchor_ratio)
            section, _, name = OUR_NAME_DIV[key].partition(".")
            neutral.setdefault(section, []).extend(re.sub(rf"^  {key}:", f"  {name}:", x) for x in ls)
            moved.append(f"div.{key} -> {OUR_NAME_DIV[key]}")
        else:
            rest += ls
    if not moved:
        return lines, []
    for sec, add in (("method:", method), (f"{LAYOUT_SECTION}:", layout), ("task:", task)):
        if add and any(x.startswith(sec) for x in lines):
            raise ValueError(f"the file has both `{sec}` and the old div: spelling of it; merge them by hand")
    out = task[:]
    out += (["method:"] + method) if method else []
    out += ([f"{LAYOUT_SECTION}:"] + layout) if layout else []
    out += (["div:"] + rest) if rest else []
    for section, ls in neutral.items():
        out += [f"{section}:"] + ls
    return lines[:s] + out + lines[e:], moved


def _merge_blocks(lines: List[str]) -> List[str]:
    """A top-level section written twice (``optim:`` from ``div:`` and from ``openrlhf:``) merged into
    its first block."""
    from openrlhf_div.schema import NEUTRAL_SECTIONS

    seen: Dict[str, int] = {}
    i = 0
    while i < len(lines):
        m = re.match(r"^([A-Za-z_]+):\s*$", lines[i])
        if not m or m.group(1) not in NEUTRAL_SECTIONS:
            i += 1
            continue
        end = _block_end(lines, i, 0)
        name = m.group(1)
        if name not in seen:
            seen[name] = i
            i = end
            continue
        body = lines[i + 1:end]
        del lines[i:end]
        first = seen[name]
        at = _block_end(lines, first, 0)
        lines[at:at] = body
        i = i + len(body) if at < i else i
    return lines


def _top_block(lines: List[str], name: str):
    """``(start, end)`` of the top-level ``name:`` block (a mapping written as indented lines), or None."""
    for i, line in enumerate(lines):
        if re.match(rf"^{name}:\s*(#.*)?$", line):
            return i, _block_end(lines, i, 0)
    return None


def _key_line(lines: List[str], start: int, end: int, indent: int, key: str):
    """Index of the ``key:`` line at ``indent`` inside ``lines[start:end]``, or None."""
    for j in range(start, end):
        if re.match(rf"^{' ' * indent}{key}:(\s|$)", lines[j]):
            return j
    return None


def _has_keys(lines: List[str]) -> bool:
    return any(line.strip() and not line.lstrip().startswith("#") for line in lines)


def _convert_presample(lines: List[str]) -> Tuple[List[str], List[str]]:
    """The pre-sampling folder's other names (after :func:`_convert_div`: ``div.anchor_data`` is already
    ``data.presample_dir``): ``presample.out`` equal to the file's ``data.presample_dir`` is dropped (the
    stage writes there by default), a lone one becomes ``data.presample_dir``; ``local.data.presample_dir``
    equal to it is dropped (the local translation reads the folder). A ``toy:`` overlay's own
    ``presample_dir`` (``null``: the toy pre-samples its own) is left as it is."""
    import yaml

    try:
        cfg = yaml.load("\n".join(lines), Loader=_loader())  # noqa: S506 - the project's safe loader
    except yaml.YAMLError:
        return lines, []
    if not isinstance(cfg, dict):
        return lines, []
    data = cfg.get("data") if isinstance(cfg.get("data"), dict) else {}
    pre = cfg.get("presample") if isinstance(cfg.get("presample"), dict) else {}
    folder = data.get("presample_dir")
    moved: List[str] = []
    blk = _top_block(lines, "presample")
    j = _key_line(lines, blk[0] + 1, blk[1], 2, "out") if blk and "out" in pre else None
    if j is not None:
        from openrlhf_div.schema import _same_folder

        if folder is not None and not _same_folder(pre["out"], folder):
            return lines, []  # two folders: the loader refuses the file, the user decides which one is meant
        line = lines.pop(j)
        if folder is None:  # a lone presample.out: the folder's one name
            folder = pre["out"]
            at = len(lines)
            while at and not lines[at - 1].strip():  # before the file's trailing blank lines
                at -= 1
            lines[at:at] = ["data:", re.sub(r"^  out:", "  presample_dir:", line)]
            moved.append("presample.out -> data.presample_dir")
        else:
            moved.append("presample.out (= data.presample_dir, the stage's default) dropped")
        start, end = _top_block(lines, "presample")
        if not _has_keys(lines[start + 1:end]):
            lines[start] = re.sub(r"^presample:", "presample: {}", lines[start])
    blk = _top_block(lines, "local")
    if blk and folder is not None:
        d = _key_line(lines, blk[0] + 1, blk[1], 2, "data")
        if d is not None and re.match(r"^  data:\s*(#.*)?$", lines[d]):
            d_end = _block_end(lines, d, 2)
            k = _key_line(lines, d + 1, d_end, 4, "presample_dir")
            local_data = ((cfg.get("local") or {}).get("data") or {}) if isinstance(cfg.get("local"), dict) else {}
            if k is not None and str(local_data.get("presample_dir")) == str(folder):
                del lines[k]
                moved.append("local.data.presample_dir (= data.presample_dir) dropped")
                if not _has_keys(lines[d + 1:_block_end(lines, d, 2)]):
                    del lines[d]
                start, end = _top_block(lines, "local")
                if not _has_keys(lines[start + 1:end]):
                    del lines[start]
    return lines, moved


def convert_text(text: str) -> Tuple[str, List[str]]:
    """Every old spelling: ``div:``'s method / task / layout keys, OpenRLHF's names of the schema's
    settings under ``openrlhf:``, and the pre-sampling folder's other names (``div.anchor_data``,
    ``presample.out``, a ``local.data.presample_dir`` equal to it): ``data.presample_dir``."""
    lines, moved_div = _convert_div(text.split("\n"))
    lines, moved = _convert_lines(lines)
    lines, moved_pre = _convert_presample(_merge_blocks(lines))
    lines, moved_toy = _convert_toy(_merge_blocks(lines))
    return "\n".join(lines), moved_div + moved + moved_pre + moved_toy


def _convert_toy(lines: List[str]) -> Tuple[List[str], List[str]]:
    """A ``toy:`` overlay (written as an indented block) is a small experiment: its ``div:`` and
    ``openrlhf:`` old spellings are converted the same way, one level down (the pre-sampling folder is
    the experiment's, never the overlay's: left as written). Reported as ``toy: <what moved>``."""
    blk = _top_block(lines, "toy")
    if blk is None:
        return lines, []
    start, end = blk
    body = lines[start + 1:end]
    while body and not body[-1].strip():  # the blank lines after the block stay outside it
        body.pop()
        end -= 1
    if any(line.strip() and not line.startswith("  ") for line in body):
        return lines, []  # a comment at column 0 inside the block: leave it to the user
    inner = [line[2:] if line.startswith("  ") else line for line in body]
    inner, moved_div = _convert_div(inner)
    inner, moved = _convert_lines(inner)
    moved_all = moved_div + moved
    if not moved_all:
        return lines, []
    inner = _merge_blocks(inner)
    return (lines[:start + 1] + [("  " + line) if line.strip() else line for line in inner] + lines[end:],
            [f"toy: {m}" for m in moved_all])


def convert_file(path: str) -> Tuple[str, List[str]]:
    """``(new text, moved settings)`` of one experiment file; refuses (ValueError) when the new
    text would load differently (the file's own mapping, rendered, before and after)."""
    import copy

    import yaml

    from openrlhf_div.config import ConfigError, read_yaml
    from openrlhf_div.schema import render_file

    with open(path) as fh:
        text = fh.read()
    new, moved = convert_text(text)
    if not moved:
        return text, moved
    before = read_yaml(path)
    try:
        after = yaml.load(new, Loader=_loader())  # noqa: S506 - the project's safe loader
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: the converted text is not valid YAML ({e}); convert this file by hand") from None
    try:  # both spellings loaded quietly (the old one would print its notes)
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
            same = _meaning(render_file(copy.deepcopy(before), path)) == _meaning(
                render_file(copy.deepcopy(after or {}), path))
    except ConfigError as e:
        raise ValueError(str(e) if str(e).startswith(path) else f"{path}: {e}") from None
    if not same:
        raise ValueError(f"{path}: the converted file would load differently; convert it by hand "
                         f"(`openrlhf-div config fields` lists the schema's names)")
    return new, moved


def _meaning(cfg):
    """What a file says, whichever spelling: the method, task and layout as the engines read them."""
    from openrlhf_div.engines.experiment import method_section, task_of
    from openrlhf_div.engines.flags import METHOD_KEYS_IN_DIV
    from openrlhf_div.engines.layout import LAYOUT_KEYS

    cfg = _one_folder(cfg)
    div = dict(cfg.get("div") or {})
    layout = dict(cfg.get(LAYOUT_SECTION) or {})
    layout.update({k: v for k, v in div.items() if k in LAYOUT_KEYS and k not in layout})
    rest = {k: v for k, v in cfg.items() if k not in ("div", "method", "task", LAYOUT_SECTION)}
    rest["div"] = {k: v for k, v in div.items() if k not in ("method", "task") and k not in METHOD_KEYS_IN_DIV()
                   and k not in LAYOUT_KEYS}
    if isinstance(rest.get("toy"), dict):  # the overlay, whichever spelling, by the same reading
        rest["toy"] = _meaning(rest["toy"])
    return rest, method_section(cfg), task_of(cfg), layout


def _one_folder(cfg):
    """``cfg`` with the pre-sampling folder under its one name: a ``presample.out`` (equal to
    ``div.anchor_data``, or alone) read as ``div.anchor_data``, a ``local.data.presample_dir`` equal to it
    left out (the local translation reads the folder)."""
    import copy

    cfg = copy.deepcopy(cfg)
    div = cfg.get("div") if isinstance(cfg.get("div"), dict) else {}
    pre = cfg.get("presample")
    if isinstance(pre, dict) and "out" in pre:
        out = pre.pop("out")
        if div.get("anchor_data") is None:
            cfg["div"] = div = dict(div, anchor_data=out)
    local = cfg.get("local")
    folder = div.get("anchor_data")
    if isinstance(local, dict) and isinstance(local.get("data"), dict) and folder is not None \
            and str(local["data"].get("presample_dir")) == str(folder):
        del local["data"]["presample_dir"]
        if not local["data"]:
            del local["data"]
        if not local:
            del cfg["local"]
    return cfg


def _loader():
    from openrlhf_div.config import _Loader

    return _Loader
