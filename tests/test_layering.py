"""The package's layering, read from its imports (docs/how-it-works/architecture.md draws it).

Every import counts, at module level or inside a function: a lazy import is still a
dependency, and a cycle through one is still a cycle.
"""

from __future__ import annotations

import ast
import os
import re
from collections import defaultdict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "megatron_weipipe"
MAX_LINES = 500


def _modules() -> dict[str, str]:
    """module name -> file path, for every module of the package."""
    out = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(module: str, path: str) -> set[str]:
    """Modules of the package (and top-level scripts) that ``module`` imports, anywhere in it."""
    tree = ast.parse(open(path).read(), path)
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
            # "from pkg import module" names a module; "from module import name" names the module.
            found.update(n for n in names if n in MODULES)
            if not any(n in MODULES for n in names):
                found.add(target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {_owner(t) for t in found if _owner(t)} - {module}


def _owner(name: str) -> str | None:
    """The package module (or top-level script) an imported name lives in."""
    if name.split(".")[0] in ("pretrain_gpt",):
        return "pretrain_gpt"
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _folder(module: str) -> str:
    """A package folder (megatron_weipipe.schedules) or a top-level module (megatron_weipipe.config)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                cycle = visit(m)
                if cycle:
                    return cycle
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            cycle = visit(n)
            if cycle:
                return cycle
    return None


def test_graph_sees_known_imports():
    # a test of the test: the reader finds imports of every kind
    assert "megatron_weipipe.config" in GRAPH["megatron_weipipe.arguments"]
    assert "megatron_weipipe.training.pretrain" in GRAPH["megatron_weipipe.cli"]  # a lazy import
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_module_over_500_lines():
    long = {m: n for m, p in MODULES.items() if (n := sum(1 for _ in open(p))) > MAX_LINES}
    assert not long, f"split these by job: {long}"


def test_no_import_cycle_between_files():
    graph = {m: {d for d in deps if d in MODULES} for m, deps in GRAPH.items()}
    # a package's __init__ re-exporting its own modules is not a cycle of design
    graph = {m: {d for d in deps if not (m in d and MODULES[m].endswith("__init__.py"))} for m, deps in graph.items()}
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph))


def test_no_import_cycle_between_folders():
    graph: dict[str, set[str]] = defaultdict(set)
    for m, deps in GRAPH.items():
        for d in deps:
            if d in MODULES and _folder(d) != _folder(m):
                graph[_folder(m)].add(_folder(d))
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph))


BELOW_TRAINING = ("schedules", "model", "fpdt", "simulator", "platform", "parallel", "initialize")
FORBIDDEN = (
    [(low, "training", "nothing below the training loop imports it") for low in BELOW_TRAINING]
    + [("fpdt", "schedules", "FPDT is a set of kernels and modules, usable under any schedule"),
       ("data", "model", "data knows nothing of the model"),
       ("config", "schedules", "schedules read the config, not the other way round")]
)


def _in(module: str, part: str) -> bool:
    return module == f"{PACKAGE}.{part}" or module.startswith(f"{PACKAGE}.{part}.")


@pytest.mark.parametrize("low,high,why", FORBIDDEN, ids=[f"{a}->{b}" for a, b, _ in FORBIDDEN])
def test_forbidden_imports(low, high, why):
    bad = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() if _in(m, low) for d in deps if _in(d, high))
    assert not bad, f"{why}: {bad}"


def test_nothing_in_the_package_imports_the_entry_points():
    entry = {"pretrain_gpt", f"{PACKAGE}.cli", f"{PACKAGE}.launch"}
    bad = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps & entry if m != "pretrain_gpt")
    assert not bad, bad


def test_cuda_is_probed_only_by_the_platform():
    bad = [m for m, p in MODULES.items() if "torch.cuda.is_available" in open(p).read()
           and m != f"{PACKAGE}.platform"]
    assert not bad, f"device rules belong in platform.py: {bad}"


def test_configuration_and_simulator_import_no_torch():
    """The flags, their rules and the projection are plain Python: a laptop without torch
    (or a login node) can check a launch command and project it."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from megatron_weipipe.arguments import build_parser\n"
        "from megatron_weipipe.simulator.cli import costs_for, parse_command\n"
        "from megatron_weipipe.simulator.project import simulate_run\n"
        "a, c, specs = parse_command('--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 1024 "
        "--global-batch-size 8 --pipeline-model-parallel-size 2 --bf16'.split())\n"
        "[simulate_run(s, c, costs_for(a, s, c)) for s in specs]\n"
        "print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


LAYER_DOC = os.path.join(ROOT, "docs", "how-it-works", "architecture.md")


def _read_layers(path: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The table under the doc's ``## Layers`` heading, top to bottom: each row's layer name
    and the package modules and folders in backticks in its second column (paths outside
    the package, such as ``pretrain_gpt.py`` or ``tools/``, are entry points the graph
    does not hold)."""
    lines = open(path).read().split("\n")
    start = lines.index("## Layers")
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or cells[0] in ("layer", "") or set(cells[0]) <= set("-: "):
            continue
        parts = []
        for token in re.findall(r"`([^`]+)`", cells[1]):
            token = token.strip().rstrip("/")
            token = token[len(PACKAGE) + 1:] if token.startswith(PACKAGE + "/") else token
            token = token[:-3] if token.endswith(".py") else token
            name = token.replace("/", ".")
            if f"{PACKAGE}.{name}" in MODULES or any(m.startswith(f"{PACKAGE}.{name}.") for m in MODULES):
                parts.append(name)
        rows.append((cells[0], tuple(parts)))
    return tuple(rows)


# The layers, top to bottom, as the doc's table gives them; a module may import its own
# layer and the layers below it.
LAYERS = _read_layers(LAYER_DOC)


def test_the_layer_table_is_read_from_its_one_doc():
    names = [name for name, _ in LAYERS]
    assert names[0] == "entry points" and names[-1] == "services" and len(names) >= 8, names
    assert all(parts for name, parts in LAYERS if name != "entry points"), LAYERS
    copies = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith((".git", ".venv", "node_modules"))]
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".md") and path != LAYER_DOC and re.search(r"^\|\s*layer\s*\|", open(path).read(), re.M):
                copies.append(os.path.relpath(path, ROOT))
    assert not copies, f"the layer table lives in {os.path.relpath(LAYER_DOC, ROOT)} only; link to it from {copies}"


def _layer(module: str) -> int:
    """Index of the layer holding ``module`` (the most specific entry wins: data.config is configuration)."""
    best, depth = None, -1
    for index, (_, parts) in enumerate(LAYERS):
        for part in parts:
            if _in(module, part) and part.count(".") > depth:
                best, depth = index, part.count(".")
    if module == PACKAGE:
        return len(LAYERS) - 1
    assert best is not None, f"{module} is in no layer of {os.path.relpath(LAYER_DOC, ROOT)}"
    return best


def test_each_layer_imports_only_itself_and_the_layers_below():
    upward = sorted(f"{m} ({LAYERS[_layer(m)][0]}) -> {d} ({LAYERS[_layer(d)][0]})"
                    for m, deps in GRAPH.items() for d in deps
                    if d in MODULES and _layer(d) < _layer(m))
    assert not upward, upward


MAX_FUNCTION_LINES = 80


def test_no_function_over_80_lines():
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{module}:{node.name} ({lines} lines)")
    assert not long, f"split these by job: {sorted(long)}"


def test_no_path_edits_anywhere():
    """Tools, benchmarks and tests import the package and each other as packages
    (``python -m tools.simulate``); none edits the import path."""
    needle = "sys.path." + "insert"
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith((".git", ".venv", "__pycache__"))]
        for name in files:
            if name.endswith((".py", ".sh")):
                path = os.path.join(folder, name)
                if needle in open(path, errors="replace").read():
                    found.append(os.path.relpath(path, ROOT))
    assert not found, found


# A config.py (the typed flags of one capability) and a cli.py (the command line of one)
# do the same job in each folder that has one.
SHARED_NAMES = {"__init__", "config", "cli"}


def test_no_two_modules_share_a_name():
    by_name = defaultdict(list)
    for module in MODULES:
        if MODULES[module].endswith("__init__.py"):
            continue
        by_name[module.rpartition(".")[2]].append(module)
    repeated = {n: ms for n, ms in by_name.items() if len(ms) > 1 and n not in SHARED_NAMES}
    assert not repeated, f"one name, different jobs: {repeated}"
