"""``python tests/tools/convert_div_spelling.py FILE...``: the mechanical conversion of an experiment
file from the deprecated ``div:`` spelling, in place (used once on every file of configs/, issue 31).
The method keys / task / layout keys of a config's top-level `div:` block move to `method:` (name + hyperparameters), top-level `task:` and `layout:`; driver keys stay in `div:`.
Comments travel with their key (a standalone comment line with the key after it, or the one before it
when it ends the block)."""
import os, re, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from openrlhf_div.engines.flags import METHOD_KEYS_IN_DIV
from openrlhf_div.engines.layout import LAYOUT_KEYS
MK = METHOD_KEYS_IN_DIV()

def convert(text):
    lines = text.split("\n")
    start = [i for i, l in enumerate(lines) if re.match(r"^div:\s*$", l)]
    if not start:
        return None
    assert len(start) == 1
    s = start[0]
    e = s + 1
    while e < len(lines) and (lines[e].startswith("  ") or lines[e].strip() == ""):
        e += 1
    while lines[e - 1].strip() == "":
        e -= 1
    block = lines[s + 1:e]
    # group: [pending comments..., key line]
    items, pending = [], []
    for l in block:
        if l.strip().startswith("#"):
            pending.append(l)
            continue
        m = re.match(r"^  ([A-Za-z_][A-Za-z0-9_]*):(.*)$", l)
        assert m, l
        items.append([m.group(1), pending + [l]])
        pending = []
    if pending:
        items[-1][1] += pending
    task, method, engine, div = [], [], [], []
    for key, ls in items:
        if key == "task":
            task += [l[2:] if not l.strip().startswith("#") else l.strip() for l in ls]
        elif key == "method":
            method = [l.replace("  method:", "  name:", 1) if re.match(r"^  method:", l) else l for l in ls] + method
        elif key in MK:
            method += ls
        elif key in LAYOUT_KEYS:
            engine += ls
        else:
            div += ls
    for sec, add in (("method:", method), ("layout:", engine), ("engine:", engine), ("task:", task)):
        assert not (add and any(l.startswith(sec) for l in lines)), (sec, "already present: merge by hand")
    if not (task or method or engine):
        return None
    out = task[:]
    if method:
        out += ["method:"] + method
    if engine:
        out += ["layout:"] + engine
    if div:
        out += ["div:"] + div
    return "\n".join(lines[:s] + out + lines[e:])

if __name__ == "__main__":
    for p in sys.argv[1:]:
        new = convert(open(p).read())
        if new is not None:
            open(p, "w").write(new)
            print("converted", p)
