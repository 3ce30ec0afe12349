"""Guards for the layering: every import of ours (function-level and TYPE_CHECKING ones too) follows the
package order written below and makes no cycle; trainers never imports ray; model files hold no
distributed code; every module imports on its own."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("trainers", "raytrain_ext", "search")

# ----------------------------------------------------------------------------------- the package order

# Lowest first. A module may import modules of its own layer and of the layers below it, never of one
# above. A module's layer is that of the longest pattern matching it: "a.b" is that module alone, "a.b.*"
# the module or package a.b and everything under it. A module no pattern matches is an error: a new
# module gets its place here.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # what every layer shares, importing none of ours: ConfigError, strict pydantic models, dotted keys,
    # the byte sizes users write (parse_bytes); a run's progress on the console (a bar or plain lines); the
    # private names of torch and of DeepSpeed we use
    ("base", ("trainers._base", "trainers.progress", "trainers.torch_compat", "trainers.deepspeed_compat")),
    # files, local or in a bucket, behind one interface
    ("storage", ("trainers.storage",)),
    # the names of a run dir's files, read and written through storage
    ("run_dir", ("trainers.run_dir",)),
    # each component's section of the run YAML, and what a section needs to validate itself (models.config
    # fills itself from an init_from folder's config.json: hf.config_json); profiling's section lives with
    # its profiler
    (
        "sections",
        (
            "trainers.models.config",
            "trainers.data.config",
            "trainers.tracking.config",
            "trainers.profiling",
            "trainers.hf.config_json",
        ),
    ),
    # the run config: one YAML validated into the sections, with the cross-section rules (the parallel
    # layout's rules that need no world size among them)
    ("config", ("trainers.config",)),
    # what a run is made of, each reading its part of the config: the model, the data, the loss,
    # Hugging Face folders, checkpoints and the run's records, tracking, optimizer and precision, and the
    # checks of the inputs on disk before any worker starts (preflight)
    (
        "components",
        (
            "trainers.models.*",
            "trainers.data.*",
            "trainers.loss",
            "trainers.host_memory",
            "trainers.hf.*",
            "trainers.checkpoint",
            "trainers.checkpoint_files",
            "trainers.checksums",
            "trainers.metrics",
            "trainers.report",
            "trainers.run_lock",
            "trainers.resume",
            "trainers.tracking.*",
            "trainers.optim",
            "trainers.precision",
            "trainers.preflight",
        ),
    ),
    # the parallel layout pp x dp x tp (x ep): its rules at a world size, the ranks, the meshes, the
    # pipeline's split into stages
    ("layout", ("trainers.layout",)),
    # the engines that run a step over the layout (DDP, FSDP2, pipeline, DeepSpeed) and what they apply
    ("parallel", ("trainers.parallel.*",)),
    # memory arithmetic before anything starts, and memory.fit: auto, which asks it
    ("plan", ("trainers.plan", "trainers.autofit")),
    # one run: the training loop, and the export of its checkpoints as a Hugging Face folder
    ("trainer", ("trainers.trainer", "trainers.hf.export")),
    # starting runs without Ray: one process or torchrun
    ("launch", ("trainers.launch", "trainers.__main__")),
    # the trainers package's public names (its __init__, loaded on first use); raytrain_ext's and search's
    # __init__ hold theirs in their own layers (raytrain_ext.api, search.api)
    ("trainers API", ("trainers",)),
    # Ray Train: the CLI, the launcher, the workers, clusters
    ("raytrain_ext", ("raytrain_ext.*",)),
    # Ray Tune: searches over runs
    ("search", ("search.*",)),
]

# Edges against the order that are known and kept on purpose, each with why and until when. An entry no
# import needs any more is an error (test_allowed_back_edges_are_still_needed).
ALLOWED_BACK_EDGES: dict[tuple[str, str], str] = {}  # (importer, imported): why; none is needed now


@dataclass
class ImportReport:
    """What `check_imports` found; empty lists when the tree keeps the order."""

    back_edges: list[str] = field(default_factory=list)  # "file:line: a (layer) imports b (higher layer)"
    cycles: list[list[str]] = field(default_factory=list)  # each a set of modules that import each other
    ray_in_trainers: list[str] = field(default_factory=list)  # "file:line: module imports ray..."
    unplaced: list[str] = field(default_factory=list)  # modules no pattern of the order matches
    edges: dict[tuple[str, str], str] = field(default_factory=dict)  # (a, b) -> "file:line" of one import


def module_files(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages (a package is its __init__.py)."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports_in(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """Every module `name` imports, anywhere in its file (top level, functions, TYPE_CHECKING blocks), as
    (absolute dotted name, line): relative imports resolved; `from pkg import sub` names the submodule when
    pkg.sub is one of ours, else pkg. `__import__("a.b")` and `import_module("a.b")` (importlib's) with a
    literal name count as imports of it; a name computed at run time (a user's callback module) cannot be read."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and _dynamic_import(node) is not None:
            out.append((_dynamic_import(node), node.lineno))
        elif isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub if sub in modules else base, node.lineno))
    return out


def _dynamic_import(call: ast.Call) -> str | None:
    """The literal module name of an `__import__(...)` or `[importlib.]import_module(...)` call, else None."""
    func = call.func
    called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    if called not in ("__import__", "import_module") or not call.args:
        return None
    first = call.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def _ours(target: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that importing `target` runs (the longest of its prefixes that is ours)."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> int | None:
    """Index in `layers` of the longest pattern matching `module`; None when none does."""
    best, found = -1, None
    for index, (_, patterns) in enumerate(layers):
        for pattern in patterns:
            stem = pattern.removesuffix(".*")
            wide = pattern.endswith(".*")
            if (module == stem or wide and module.startswith(stem + ".")) and len(stem) > best:
                best, found = len(stem), index
    return found


def _cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan), each sorted."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(out)


def check_imports(
    root: Path,
    packages: tuple[str, ...] = PACKAGES,
    layers: list[tuple[str, tuple[str, ...]]] = LAYERS,
    allowed: dict[tuple[str, str], str] | None = None,
) -> ImportReport:
    """Read every import of every module under `packages` from the AST and check it against `layers`:
    no edge from a lower layer to a higher one (but those in `allowed`), no cycle among our modules (the
    allowed edges count), no import of ray from trainers, every module placed."""
    allowed = ALLOWED_BACK_EDGES if allowed is None else allowed
    modules = module_files(root, packages)
    report = ImportReport()
    for name, path in modules.items():
        where = path.relative_to(root)
        for target, line in imports_in(name, path, modules):
            if name.split(".")[0] == "trainers" and (target == "ray" or target.startswith("ray.")):
                report.ray_in_trainers.append(f"{where}:{line}: {name} imports {target}")
            ours = _ours(target, modules)
            if ours is not None and ours != name:
                report.edges.setdefault((name, ours), f"{where}:{line}")
    for name in modules:
        if layer_of(name, layers) is None:
            report.unplaced.append(name)
    for (a, b), where in sorted(report.edges.items()):
        la, lb = layer_of(a, layers), layer_of(b, layers)
        if la is not None and lb is not None and la < lb and (a, b) not in allowed:
            report.back_edges.append(
                f"{where}: {a} (layer {layers[la][0]}) imports {b} (layer {layers[lb][0]}, higher)"
            )
    report.cycles = _cycles(set(report.edges))
    return report


def test_every_import_follows_the_package_order():
    report = check_imports(ROOT)
    assert report.unplaced == [], f"modules with no place in LAYERS (add them): {report.unplaced}"
    assert report.back_edges == [], "imports against the package order:\n" + "\n".join(report.back_edges)


def test_no_import_cycles_function_level_included():
    report = check_imports(ROOT)
    assert report.cycles == [], f"import cycles: {report.cycles}"


def test_trainers_never_imports_ray():
    assert check_imports(ROOT).ray_in_trainers == []


def test_allowed_back_edges_are_still_needed():
    edges = check_imports(ROOT).edges
    stale = [edge for edge in ALLOWED_BACK_EDGES if edge not in edges]
    assert stale == [], f"no import needs these any more; remove them from ALLOWED_BACK_EDGES: {stale}"


def test_the_checker_catches_a_planted_violation(tmp_path):
    """A test of the test: a tree with a back-edge hidden in a function, a cycle made by a relative
    function-level import, ray imported by trainers in a function, and a module with no place."""
    files = {
        "trainers/__init__.py": "",
        "trainers/_base.py": "def size():\n    from trainers.plan import parse_bytes\n    return parse_bytes\n",
        "trainers/plan.py": "from trainers._base import size\n",
        "trainers/models/__init__.py": "",
        "trainers/models/llama.py": "from .moe import MoE\n",
        "trainers/models/moe.py": "class MoE:\n    def f(self):\n        from . import llama\n",
        "trainers/loss.py": "def f():\n    import ray.train\n",
        "trainers/brand_new.py": "import trainers.config\n",
        "trainers/config.py": "from trainers.models.config import ModelConfig\n",  # the package is ours
        # imports by name: a literal one is read, one computed at run time cannot be
        "trainers/run_dir.py": "import importlib\ndef f(m):\n    importlib.import_module(m)\n"
                               "    return __import__('trainers.loss', fromlist=['x'])\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    report = check_imports(tmp_path, packages=("trainers",))
    assert report.back_edges == [
        "trainers/_base.py:2: trainers._base (layer base) imports trainers.plan (layer plan, higher)",
        "trainers/config.py:1: trainers.config (layer config) imports trainers.models (layer components, higher)",
        "trainers/run_dir.py:4: trainers.run_dir (layer run_dir) imports trainers.loss (layer components, higher)",
    ]
    assert report.cycles == [["trainers._base", "trainers.plan"], ["trainers.models.llama", "trainers.models.moe"]]
    assert report.ray_in_trainers == ["trainers/loss.py:2: trainers.loss imports ray.train"]
    assert report.unplaced == ["trainers.brand_new"]
    # an allowed edge is not a back-edge, but it still counts for cycles
    allowed = {("trainers._base", "trainers.plan"): "planted"}
    report = check_imports(tmp_path, packages=("trainers",), allowed=allowed)
    assert [e.split(": ", 1)[1] for e in report.back_edges] == [
        "trainers.config (layer config) imports trainers.models (layer components, higher)",
        "trainers.run_dir (layer run_dir) imports trainers.loss (layer components, higher)",
    ]
    assert ["trainers._base", "trainers.plan"] in report.cycles


def test_moved_names_stay_importable_where_they_were():
    """Issue 28 moved these down the order; their old homes still give the same objects."""
    moved = {
        ("trainers.plan", "parse_bytes"): "trainers._base",
        ("trainers.plan", "format_bytes"): "trainers._base",
        ("trainers.layout", "check_config"): "trainers.config",  # as check_layout
        ("trainers.layout", "num_stages"): "trainers.config",
        ("trainers.layout", "SPLIT_BACKWARD_SCHEDULES"): "trainers.config",
        ("trainers.hf.format", "model_section_from_hf"): "trainers.hf.config_json",
        ("trainers.hf.format", "read_small"): "trainers.hf.config_json",
        ("trainers.parallel.native", "apply_fsdp"): "trainers.parallel.parallelize",
        ("trainers.parallel.pipeline", "split_stages"): "trainers.layout",
        ("trainers.parallel.pipeline", "block_costs"): "trainers.layout",
    }
    for (old, name), new in moved.items():
        here = getattr(importlib.import_module(new), "check_layout" if name == "check_config" else name)
        assert getattr(importlib.import_module(old), name) is here, (old, name)


def _modules(package: str) -> list[str]:
    pkg_dir = ROOT / package
    return [package] + [
        f"{package}.{m.name}" for m in pkgutil.walk_packages([str(pkg_dir)]) if not m.name.startswith("_")
    ]


def test_importing_trainers_imports_no_ray():
    code = (
        "import sys, importlib\n"
        f"for m in {_modules('trainers')!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "", f"trainers pulled in ray modules: {out.stdout[:300]}"


def test_model_files_hold_no_distributed_code():
    pattern = re.compile(r"torch\.distributed|DeviceMesh|fully_shard")
    offenders = [p for p in (ROOT / "trainers" / "models").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


# One process imports the heavy third-party libraries once, then forks a child per module of ours that
# imports that module first: each of our modules still imports alone (no other of ours loaded before it,
# so a cycle or a missing import shows), without paying torch's import per module (a minute per package).
_FORK_EACH = """
import importlib, os, sys, traceback
import numpy, pyarrow, pydantic, torch, yaml  # third-party only: none of ours
if {ray}:
    import ray, ray.train, ray.tune
failed = []
for name in {modules!r}:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failed.append(name)
print("FAILED:" + ",".join(failed))
"""


@pytest.mark.parametrize("package", ["trainers", "raytrain_ext", "search"])
def test_each_module_imports_alone(package):
    code = _FORK_EACH.format(modules=_modules(package), ray=package != "trainers")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "FAILED:\n" in out.stdout + "\n", out.stdout[-2000:] + out.stderr[-3000:]
