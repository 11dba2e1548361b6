"""The package's import graph: no circles between modules and no arrow running up the layers.

Every ``import`` / ``from ... import`` of ``openrlhf_div`` inside the package is read with an AST
walk (module level, function level and ``TYPE_CHECKING`` blocks alike: a lazy import is still a
dependency) and checked against the layer order below, lowest first. A module may import its
own layer or any layer below; a new top-level module or package must be given a layer here.
Pure AST, no import of the package: well under a second.
"""
from __future__ import annotations

import ast
import os
from collections import defaultdict
from typing import Dict, List, Set

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "openrlhf_div")

#: lowest first; a module belongs to the longest prefix listed
LAYERS: List[List[str]] = [
    # foundations: no algorithm, no model
    ["openrlhf_div", "openrlhf_div.io", "openrlhf_div.progress", "openrlhf_div.config", "openrlhf_div.compat",
     "openrlhf_div.plugins", "openrlhf_div.shipped"],
    ["openrlhf_div.algorithms"],                      # pure-torch losses, estimators, the registry
    ["openrlhf_div.tasks"],                           # prompts, verifiers, data loading
    ["openrlhf_div.eval", "openrlhf_div.bandit"],     # metrics, results, reports: no model, no engine
    ["openrlhf_div.engines"],                         # engine-neutral: contract, flags, anchor data, lm head
    ["openrlhf_div.engines.local"],                   # one process; owns models, samplers, run directories
    ["openrlhf_div.engines.megatron"],                # the Megatron-core actors
    ["openrlhf_div.engines.openrlhf"],                # the Ray driver and actors (picks the Megatron backend)
    ["openrlhf_div.demo"],
    ["openrlhf_div.cli"],
]


def _modules() -> Dict[str, str]:
    out = {}
    base = os.path.dirname(ROOT)
    for dp, dns, fns in os.walk(ROOT):
        dns[:] = [d for d in dns if d != "__pycache__"]
        for fn in fns:
            if fn.endswith(".py"):
                path = os.path.join(dp, fn)
                mod = os.path.relpath(path, base)[:-3].replace(os.sep, ".")
                out[mod[:-len(".__init__")] if mod.endswith(".__init__") else mod] = path
    return out


def _edges(mods: Dict[str, str]) -> Dict[str, Set[str]]:
    """module -> the package modules it imports (the longest existing module of each name)."""
    def known(name: str) -> str:
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in mods else ""

    edges: Dict[str, Set[str]] = defaultdict(set)
    for mod, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        for node in ast.walk(tree):
            names: List[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    parts = parts[:len(parts) - (node.level - 1)]
                    src = ".".join(parts + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                names = [src] + [f"{src}.{a.name}" for a in node.names]
            for n in names:
                if n.startswith("openrlhf_div"):
                    target = known(n)
                    if target and target != mod:
                        edges[mod].add(target)
    return edges


def layer_of(mod: str) -> int:
    best, rank = -1, -1
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (mod == prefix or mod.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    return rank


def _cycles(edges: Dict[str, Set[str]], nodes) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in _modules() if layer_of(m) < 0)
    assert not unplaced, f"give these modules a layer in tests/test_layering.py: {unplaced}"


def test_no_import_circles():
    mods = _modules()
    cycles = _cycles(_edges(mods), mods)
    assert not cycles, "import circles (each list imports itself through the others):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_no_arrow_runs_up_the_layers():
    mods = _modules()
    up = sorted(f"{a} (layer {layer_of(a)}) -> {b} (layer {layer_of(b)})"
                for a, bs in _edges(mods).items() for b in bs if layer_of(b) > layer_of(a))
    assert not up, "imports from a higher layer:\n" + "\n".join(up)


def test_the_checker_sees_lazy_imports_and_circles():
    """The walk itself: a function-level import is an edge, and a two-module circle is found."""
    edges = _edges(_modules())
    # a function-level import (cli.compare imports the local engine's evaluation inside run())
    assert "openrlhf_div.engines.local.evaluation" in edges["openrlhf_div.cli.compare"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, "abcd") == [["a", "b", "c"]]
    assert layer_of("openrlhf_div.engines.local.trainer") > layer_of("openrlhf_div.engines.anchor_data") > \
        layer_of("openrlhf_div.eval.results")
