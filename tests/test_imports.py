"""No import circles and no import back up: a static check of headmix's imports (``ast``), at module level and
counting the imports inside functions too (the circles once hidden there, ``evaluation`` <-> ``tasks``,
``runs.load`` <-> ``runs.run``, ``study.runner`` <-> ``study.timing``, stay gone); the packages stand on the
floors of :data:`FLOORS`, each importing only from floors below its own; and the packages imported in fresh
interpreters, in both orders."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import headmix

SRC = Path(headmix.__file__).resolve().parent.parent


def module_names(src: Path, package: str = "headmix") -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of ``package`` under ``src``."""
    names = {}
    for file in sorted((src / package).rglob("*.py")):
        parts = list(file.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = file
    return names


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, inside_functions: bool, type_checking: bool = False):
    """The import statements that run when the module is imported (not in function bodies, unless
    ``inside_functions``, nor under ``if TYPE_CHECKING``); class bodies and ``if``/``try`` blocks count."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and not inside_functions:
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
            continue
        else:
            todo.extend(ast.iter_child_nodes(node))


def import_graph(src: Path, package: str = "headmix", inside_functions: bool = False,
                 type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules its import runs first. ``from a.b import c`` reaches ``a.b.c`` when it
    is a module, else ``a.b``; importing ``a.b.c`` also runs the packages ``a`` and ``a.b`` (``__init__``),
    except the importing module's own parent packages (already being imported)."""
    modules = module_names(src, package)
    graph: dict[str, set[str]] = {}
    for name, file in modules.items():
        own_package = name if file.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _imports(ast.parse(file.read_text(), str(file)), inside_functions, type_checking):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = own_package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                candidates = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                candidates = [alias.name for alias in node.names]
            for target in candidates:
                if target not in modules:
                    continue
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    ancestor = ".".join(parts[:i])
                    if ancestor in modules and not (name == ancestor or name.startswith(ancestor + ".")):
                        targets.add(ancestor)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself), each
    sorted (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    found.append(sorted(component))
    return found


def test_no_module_level_import_circle():
    graph = import_graph(SRC)
    assert {"headmix.evaluation", "headmix.runs"} <= graph["headmix.tasks.translation"]  # the graph sees imports
    assert cycles(graph) == []


def test_the_checker_finds_a_circle(tmp_path):
    """The static check on a small package: a circle through a package's ``__init__`` and one through
    a relative import are found; imports inside functions and under ``TYPE_CHECKING`` are not followed."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .low import f\n")
    (pkg / "sub" / "low.py").write_text("from ..top import g\n\ndef f():\n    pass\n")
    (pkg / "top.py").write_text("import pkg.sub\n\ndef g():\n    from .late import h\n")
    (pkg / "late.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .top import g\n"
                                 "from . import top\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.sub.low"] == {"pkg.top"}
    assert cycles(graph) == [["pkg.sub", "pkg.sub.low", "pkg.top"]]
    assert cycles(import_graph(tmp_path, "pkg", inside_functions=True)) == [
        ["pkg.late", "pkg.sub", "pkg.sub.low", "pkg.top"]]


def test_no_circle_even_through_imports_inside_functions():
    """Counting the imports inside functions too, no module is in a circle: evaluation and tasks, runs.load and
    runs.run, study.runner and study.timing (``interpolate`` is in ``study.stats``) once were."""
    graph = import_graph(SRC, inside_functions=True)
    assert "headmix.evaluation" in graph["headmix.tasks.translation"]
    assert "headmix.runs.run" in graph["headmix.runs.load"]
    assert "headmix.study.timing" in graph["headmix.study.runner"]
    assert cycles(graph) == []


def test_no_circle_even_through_type_checking_imports():
    """Counting the imports inside functions and those under ``if TYPE_CHECKING`` too, no module is in a circle:
    a circle that only the type checker sees still ties two modules to each other (``training.config`` and
    ``training.tokens`` once were)."""
    graph = import_graph(SRC, inside_functions=True, type_checking=True)
    assert "headmix.training.tokens" in graph["headmix.training.config"]
    assert cycles(graph) == []


#: The floors of the house, from the ground up: a package imports only packages on floors below its own (not
#: its neighbours on the same floor), counting imports inside functions. ``headmix`` is the package's face
#: (its ``__init__``: the layers). A new package must be given a floor here.
FLOORS = [
    {"storage", "process", "provenance", "devices"},  # atomic files; process-wide settings; which machine and code
                                                      # ran; which device a --device names
    {"kernels", "routing", "data"},              # kernels, the router, corpora and tokenizers
    {"attention"},                               # the layers
    {"headmix", "models"},                       # the face; models, presets, counting, matching, generation
    {"runs", "evaluation", "interop"},           # run folders, scoring, the peers' models
    {"distillation"},                            # the KL, the parent, the loop's term, the Trainer route
    {"tasks", "hf"},                             # what a task trains and scores, token packs; Hugging Face export
    {"training", "serving"},                     # the trainer and the demo; serving with vLLM
    {"study", "bench", "analysis"},              # comparisons at equal MACs, speed, looking inside
    {"cli"},                                     # the headmix command
]


def package_of(module: str) -> str:
    """``headmix.study.runner`` -> ``study``; ``headmix`` -> ``headmix``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def arrows_back_up(graph: dict[str, set[str]], floors: list[set[str]]) -> list[str]:
    """``"A -> B"`` for each import of ``graph`` between packages whose target is not on a lower floor."""
    floor = {package: i for i, packages in enumerate(floors) for package in packages}
    return sorted(f"{source} -> {target}" for source, targets in graph.items() for target in targets
                  if package_of(source) != package_of(target)
                  and floor[package_of(target)] >= floor[package_of(source)])


def test_every_import_runs_down_the_floors():
    graph = import_graph(SRC, inside_functions=True)
    packages = {package_of(module) for module in graph}
    placed = set().union(*FLOORS)
    assert packages - placed == set(), "give these packages a floor in FLOORS"
    assert placed - packages == set(), "FLOORS names packages that do not exist"
    assert "headmix.models.matching" in graph["headmix.training.demo"]  # the graph sees the demo's solver
    assert arrows_back_up(graph, FLOORS) == []


def test_the_floor_check_finds_an_arrow_back_up_and_one_between_neighbours():
    graph = {"headmix.training.demo": {"headmix.study.matching", "headmix.models"},
             "headmix.study.runner": {"headmix.bench.timing", "headmix.training"}}
    assert arrows_back_up(graph, FLOORS) == ["headmix.study.runner -> headmix.bench.timing",
                                             "headmix.training.demo -> headmix.study.matching"]


def test_packages_import_in_fresh_interpreters_in_both_orders():
    """Every package imported in a fresh interpreter, in sorted and in reverse order (each pair of packages
    meets in both orders, the first of each list imports alone), and the former circles' pairs both ways."""
    packages = sorted(name for name, file in module_names(SRC).items() if file.name == "__init__.py")
    # every package first once; each pair of the former circles in both orders (runs imports neither
    # evaluation nor tasks, so the two pairs share interpreters)
    orders = [packages, packages[::-1],
              ["headmix.runs.load", "headmix.runs.run", "headmix.evaluation", "headmix.tasks"],
              ["headmix.runs.run", "headmix.runs.load", "headmix.tasks", "headmix.evaluation"]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    runs = [subprocess.Popen([sys.executable, "-c", script, *order], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for order in orders]
    failures = []
    for order, proc in zip(orders, runs):
        _, err = proc.communicate(timeout=300)
        if proc.returncode:
            failures.append(f"{' then '.join(order)}: {err.strip().splitlines()[-1]}")
    assert not failures, failures


def imported_names(file: Path, package: str = "headmix") -> list[tuple[str, str]]:
    """``(module, name)`` for every import in ``file``, inside functions too, relative imports resolved against
    the file's package: ``from ..training.config import pick_device`` in ``headmix/bench/x.py`` is
    ``("headmix.training.config", "pick_device")``, ``import headmix.training.demo`` is
    ``("headmix.training.demo", "")``."""
    own_package = list(file.relative_to(SRC).parts[:-1])
    found = []
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(own_package[:len(own_package) - node.level + 1] + ([base] if base else []))
            found += [(base, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
    return [(module, name) for module, name in found if module == package or module.startswith(package + ".")]


#: What :mod:`headmix.provenance` owns: the machine and the code a measurement ran on.
PROVENANCE = {"cpu_model", "machine_record", "load_average", "describe_machine", "source_commit"}


def provenance_from_training(files) -> list[str]:
    """``"file: module.name"`` for each import of a provenance helper (or of a module ``machine``) from
    ``headmix.training``."""
    return sorted(f"{file.relative_to(SRC)}: {module}.{name}" for file in files
                  for module, name in imported_names(file)
                  if (module == "headmix.training" or module.startswith("headmix.training."))
                  and (name in PROVENANCE or name == "machine" or module.endswith(".machine")))


def test_bench_and_study_take_provenance_from_below_training():
    """The commit and the machine a measurement ran on come from :mod:`headmix.provenance`, below ``training``,
    ``study`` and ``bench`` (issue 60): no module under ``bench/`` or ``study/`` imports them from ``training``,
    and ``training`` keeps no copy of them (no ``machine`` module, no function of that name)."""
    import headmix.provenance as provenance

    assert PROVENANCE <= set(vars(provenance))
    files = sorted((SRC / "headmix" / "bench").rglob("*.py")) + sorted((SRC / "headmix" / "study").rglob("*.py"))
    assert ("headmix.provenance", "source_commit") in imported_names(SRC / "headmix" / "bench" / "compute.py")
    assert provenance_from_training(files) == []
    training = sorted((SRC / "headmix" / "training").rglob("*.py"))
    assert not (SRC / "headmix" / "training" / "machine.py").exists()
    defined = {node.name for file in training for node in ast.walk(ast.parse(file.read_text()))
               if isinstance(node, ast.FunctionDef)}
    assert defined & PROVENANCE == set()


def test_the_provenance_check_finds_an_import_from_training(tmp_path, monkeypatch):
    """The check above on files that import a provenance helper from ``training``: at module level, inside a
    function, relative and absolute, and the module itself."""
    bench = tmp_path / "headmix" / "bench"
    bench.mkdir(parents=True)
    (bench / "a.py").write_text("from ..training.machine import cpu_model\nfrom ..provenance import load_average\n")
    (bench / "b.py").write_text("def f():\n    from headmix.training import source_commit\n")
    (bench / "c.py").write_text("import headmix.training.machine\nfrom ..training.config import pick_device\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    assert provenance_from_training(sorted(bench.glob("*.py"))) == [
        "headmix/bench/a.py: headmix.training.machine.cpu_model",
        "headmix/bench/b.py: headmix.training.source_commit",
        "headmix/bench/c.py: headmix.training.machine."]


#: What ``bench/`` takes from ``training``: only what it benchmarks of training itself, the demo's two models
#: (``headmix bench models --size demo``). The device parser, provenance and distillation live below both.
BENCH_FROM_TRAINING = {("headmix/bench/models.py", "headmix.training.demo", "demo_models"),
                       ("headmix/bench/models.py", "headmix.training.demo", "describe_attention")}


def imports_from_training(files) -> set[tuple[str, str, str]]:
    """``(file, module, name)`` for each import from ``headmix.training`` in ``files``."""
    return {(str(file.relative_to(SRC)), module, name) for file in files for module, name in imported_names(file)
            if module == "headmix.training" or module.startswith("headmix.training.")}


def test_bench_imports_from_training_only_the_demo_models_it_times():
    """``pick_device`` (and ``check_device_name``) live in :mod:`headmix.devices`, below ``training``, ``study``
    and ``bench`` (issue 60): ``bench/`` imports nothing from ``training`` but the demo's models, and no module
    outside ``training`` takes the device parser from there."""
    import headmix.devices
    import headmix.training.config

    assert headmix.training.config.pick_device is headmix.devices.pick_device  # the old import path still works
    assert imports_from_training(sorted((SRC / "headmix" / "bench").rglob("*.py"))) == BENCH_FROM_TRAINING
    outside = [file for file in sorted((SRC / "headmix").rglob("*.py")) if "training" not in file.parts]
    assert {(file, module, name) for file, module, name in imports_from_training(outside)
            if name in ("pick_device", "check_device_name")} == set()
    assert ("headmix.devices", "pick_device") in imported_names(SRC / "headmix" / "bench" / "attention.py")
