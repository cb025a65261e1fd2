"""Layering of the command line and of the one import name: dependencies point
fedlora.kernels ← fedlora ← fedlora.synthetic, fedlora.llm.

* The folders install under one name (pyproject.toml's ``package-dir``: ``kernels/`` is ``fedlora.kernels``,
  ``llm/`` ``fedlora.llm``, ``synthetic/`` ``fedlora.synthetic``). Read from the source with ``ast``
  (imports inside functions and relative imports included): no module of the core (the folder
  ``fedlora/``) imports ``fedlora.llm`` or ``fedlora.synthetic``; no module of ``kernels/`` imports
  anything of ``fedlora`` but ``fedlora.kernels`` (the package ``fedlora`` itself is run by any import
  of ``fedlora.kernels``: it must stay light, which ``test_importing_fedlora_loads_no_layer`` checks);
  and no module anywhere imports the old top-level names ``kernels``/``llm``/``synthetic`` — those are
  HuggingFace's and PyPI's projects now.
* The import graph of every folder (imports inside functions included): no import cycle inside a folder, and
  no import between the sibling folders ``kernels/``, ``llm/``, ``synthetic/`` (they meet in ``fedlora/``). The
  checks are functions of the graph (module → modules it imports), tried on planted graphs and files; what
  still breaks them is listed (``KNOWN_CYCLES``, ``KNOWN_SIBLING_IMPORTS``), and a listed one that is gone
  fails the test too, so the lists only shrink.
* The ``fedlora`` command discovers its subcommands through the entry-point group ``fedlora.commands``:
  pyproject.toml's table, the dispatcher's built-in fallback and (when the distribution is installed)
  the installed metadata agree, and every entry point resolves and adds its command.
* A plugin that fails costs only its own command: one line naming it, exit status 2, no traceback.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from fedlora import cli
from fedlora.cli import BUILTIN_COMMANDS, COMMANDS_GROUP, command_entry_points, main

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

#: folder → the import name it installs as (pyproject.toml's package-dir)
PACKAGE_OF = {folder: name for name, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items()}

#: the top-level names the layers had before issue 18: other projects' (HuggingFace's kernels, PyPI's llm)
OLD_NAMES = ("kernels", "llm", "synthetic")

#: folder → (names its modules must not import, nor anything under them; names under those that they may)
RULES = {
    "fedlora": (("fedlora.llm", "fedlora.synthetic", *OLD_NAMES), ()),
    "kernels": (("fedlora", *OLD_NAMES), ("fedlora.kernels",)),
}

#: files that name the old top-level packages on purpose (the other projects' packages)
MAY_IMPORT_OLD_NAMES = {"tests/test_packaging.py"}


# ---------------------------------------------------------------------------------------------
# no upward imports

def _imports(path: Path, module: str):
    """(line, absolute module name) for every import in ``path`` (the module ``module``): ``import``
    and ``from … import`` statements anywhere in the file, relative ones resolved, ``from a import b``
    also as ``a.b`` (b may be a submodule), and ``importlib.import_module`` / ``__import__`` of a literal."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module
            yield node.lineno, name
            for alias in node.names:
                yield node.lineno, f"{name}.{alias.name}"
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            yield node.lineno, node.args[0].value


def _modules(folder: str):
    """(path, dotted module name as installed) of every .py file of ``folder``."""
    for path in sorted((ROOT / folder).rglob("*.py")):
        parts = path.relative_to(ROOT / folder).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        yield path, ".".join((PACKAGE_OF[folder], *parts))


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations(folder: str, modules) -> list[str]:
    """The imports of ``modules`` (path, module name) that ``RULES[folder]`` forbids. The bare package
    ``fedlora`` (``from fedlora import kernels``) is not the core's code: importing any ``fedlora.*`` runs it."""
    forbidden, allowed = RULES[folder]
    bad = []
    for path, module in modules:
        for line, name in _imports(path, module):
            if name != "fedlora" and _under(name, forbidden) and not _under(name, allowed):
                bad.append(f"{path.name}:{line} imports {name}")
    return bad


@pytest.mark.parametrize("folder", list(RULES))
def test_no_module_imports_a_layer_built_on_it(folder):
    modules = list(_modules(folder))
    assert len(modules) > 3  # the walk finds the package's files
    assert _violations(folder, modules) == []


@pytest.mark.parametrize("folder, source, bad", [
    # the core must not import a layer, however it is written
    ("fedlora", "from fedlora import llm", True),
    ("fedlora", "def f():\n    import fedlora.synthetic.runner", True),
    ("fedlora", "from .llm.runtime import FederatedRun", True),
    ("fedlora", "from . import synthetic", True),
    ("fedlora", "importlib.import_module('fedlora.llm.cli')", True),
    ("fedlora", "from llm import run", True),
    ("fedlora", "from fedlora import kernels\nfrom .methods import base\nfrom fedlora.errors import ConfigError", False),
    # the kernels may import only themselves
    ("kernels", "from fedlora.adapter import LoRALinear", True),
    ("kernels", "from .. import errors", True),
    ("kernels", "from fedlora import ConfigError", True),
    ("kernels", "import fedlora.methods", True),
    ("kernels", "import kernels", True),
    ("kernels", "from fedlora import kernels\nfrom . import reference\nfrom fedlora.kernels.lora_linear import x", False),
])
def test_the_rules_catch_what_they_must(folder, source, bad, tmp_path):
    """The rules on planted modules: every way to cross a layer is caught, the allowed forms pass."""
    f = tmp_path / "m.py"
    f.write_text(source + "\n")
    assert bool(_violations(folder, [(f, f"{PACKAGE_OF[folder]}.m")])) is bad, source


def test_no_file_imports_the_old_top_level_names():
    """Every module, test and benchmark imports the layers as fedlora.kernels/llm/synthetic (a branch
    written before issue 18 brings ``from llm.x import …`` back; rewrite it to ``fedlora.llm.x``)."""
    bad = []
    for folder in ("fedlora", "kernels", "llm", "synthetic", "tests", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in MAY_IMPORT_OLD_NAMES:
                continue
            module = ".".join((PACKAGE_OF[folder], *path.relative_to(ROOT / folder).with_suffix("").parts)) \
                if folder in PACKAGE_OF else path.stem
            bad += [f"{rel}:{line} imports {name}" for line, name in _imports(path, module) if _under(name, OLD_NAMES)]
    assert bad == []


def test_importing_fedlora_loads_no_layer(tmp_path):
    """``import fedlora`` (which every ``import fedlora.kernels`` runs) loads nothing but the core's errors."""
    code = "import sys, fedlora; print(sorted(m for m in sys.modules if m.split('.')[0] in ('fedlora', 'torch')))"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['fedlora', 'fedlora.errors']"


def test_the_import_reader_sees_every_form(tmp_path):
    """The reader is what the layering test stands on: every way to write an import is seen."""
    f = tmp_path / "m.py"
    f.write_text("import llm.runtime as r\nfrom synthetic import cli\ndef f():\n    from . import llm\n"
                 "    from ..synthetic.x import y\n    importlib.import_module('llm.cli')\n    __import__('synthetic')\n")
    names = [n for _, n in _imports(f, "fedlora.sub.m")]
    assert {"llm.runtime", "synthetic.cli", "fedlora.sub.llm", "fedlora.synthetic.x.y", "llm.cli", "synthetic"} <= set(names)


# ---------------------------------------------------------------------------------------------
# the import graph: no cycle inside a folder, no import between the sibling folders

#: the folders built on the core: each imports the core (``fedlora/``) and itself, never another of them
SIBLINGS = ("kernels", "llm", "synthetic")

# Violations that exist today, listed so that no new one comes in; the test also fails when a listed one is gone,
# so these lists only shrink. Both are empty: the Flower transport is fedlora.flower (a registry where llm and
# synthetic register their nodes) and the heterogeneous run an executor composed of slot executors.
#: (importer, imported) between two sibling folders
KNOWN_SIBLING_IMPORTS: set[tuple[str, str]] = set()  # none (the Flower transport lives in fedlora.flower)
#: the modules of each import cycle inside a folder: none (the last, hetero <-> runtime, went when the choice of
#: run class moved to fedlora.llm.runs)
KNOWN_CYCLES: set[frozenset[str]] = set()


def _import_graph(modules) -> dict[str, set[str]]:
    """module → the modules of ``modules`` ((path, dotted name) pairs) it imports, read by ``_imports``
    (imports inside functions included). A name resolves to the longest module it lies in (``from .data import
    x``: ``….data``). ``from P import m`` with ``m`` a module of P is an import of P.m only: the package P itself
    is imported before any of its modules anyway, by every import of them (so a package that imports its own
    modules is in no cycle with them for that); ``from P import name`` (a name defined in P) imports P."""
    names = {module for _, module in modules}

    def resolve(name: str) -> str | None:
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {module: set() for module in names}
    for path, module in modules:
        by_line: dict[int, list[str]] = {}
        for line, name in _imports(path, module):
            by_line.setdefault(line, []).append(name)
        for found in by_line.values():
            for name in found:
                if any(other.startswith(name + ".") for other in found):
                    continue  # the package of a ``from P import …`` line: its names say what is imported
                target = resolve(name)
                if target is not None and target != module:
                    graph[module].add(target)
    return graph


def _folder_of(module: str) -> str:
    """The folder a module lies in (the longest import name of ``PACKAGE_OF`` it lies under)."""
    return max((f for f, name in PACKAGE_OF.items() if _under(module, (name,))), key=lambda f: len(PACKAGE_OF[f]))


def import_cycles(graph, folder_of=_folder_of) -> set[frozenset[str]]:
    """The import cycles inside a folder of ``graph`` (module → modules it imports): the strongly connected
    components of more than one module among the imports between modules of the same folder."""
    edges = {m: sorted(t for t in ts if t in graph and folder_of(t) == folder_of(m)) for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = set()
    for root in sorted(edges):  # Tarjan's algorithm, with an explicit stack of (module, next edge)
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            m, i = work.pop()
            if i == 0:
                index[m] = low[m] = len(index)
                stack.append(m)
            if i < len(edges[m]):
                work.append((m, i + 1))
                t = edges[m][i]
                if t not in index:
                    work.append((t, 0))
                elif t in stack:
                    low[m] = min(low[m], index[t])
                continue
            if low[m] == index[m]:
                component = set()
                while True:
                    t = stack.pop()
                    component.add(t)
                    if t == m:
                        break
                if len(component) > 1:
                    cycles.add(frozenset(component))
            if work:  # back in the module that reached this one
                low[work[-1][0]] = min(low[work[-1][0]], low[m])
    return cycles


def sibling_imports(graph, folder_of=_folder_of) -> set[tuple[str, str]]:
    """(importer, imported) of ``graph`` whose folders are two different ones of ``SIBLINGS``."""
    return {(m, t) for m, ts in graph.items() for t in ts
            if folder_of(m) in SIBLINGS and folder_of(t) in SIBLINGS and folder_of(m) != folder_of(t)}


def _against_known(found: set, known: set, what: str) -> list[str]:
    """One line per violation that is not listed and per listed one that is gone (the list only shrinks)."""
    show = lambda v: " -> ".join(v) if isinstance(v, tuple) else ", ".join(sorted(v))  # noqa: E731
    return ([f"new {what}: {show(v)}" for v in sorted(found - known, key=sorted)]
            + [f"listed {what} no longer exists, remove it from the list: {show(v)}" for v in sorted(known - found, key=sorted)])


@pytest.fixture(scope="module")
def graph():
    modules = [m for folder in PACKAGE_OF for m in _modules(folder)]
    assert {_folder_of(module) for _, module in modules} == set(PACKAGE_OF)  # every folder's files are read
    return _import_graph(modules)


def test_no_import_cycle_inside_a_folder(graph):
    """No folder's modules import each other round in a circle, however hidden (imports inside functions
    count): the only ones are the listed ones, each still there."""
    assert graph["fedlora.llm.task_kinds"] >= {"fedlora.llm.classification", "fedlora.llm.tasks"}  # edges are read
    problems = _against_known(import_cycles(graph), KNOWN_CYCLES, "import cycle")
    assert not problems, "\n".join(problems)


def test_no_import_between_the_sibling_folders(graph):
    """kernels/, llm/ and synthetic/ meet only in fedlora/ (the core): the only imports between them are the
    listed ones, each still there."""
    assert ("fedlora.llm.runtime", "fedlora.llm.config") in {(m, t) for m, ts in graph.items() for t in ts}
    problems = _against_known(sibling_imports(graph), KNOWN_SIBLING_IMPORTS, "import between sibling folders")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("edges, cycles", [
    ({"fedlora.llm.a": {"fedlora.llm.b"}, "fedlora.llm.b": {"fedlora.llm.a"}}, {("a", "b")}),
    ({"fedlora.llm.a": {"fedlora.llm.b"}, "fedlora.llm.b": {"fedlora.llm.c"}, "fedlora.llm.c": {"fedlora.llm.a"},
      "fedlora.llm.d": {"fedlora.llm.a"}}, {("a", "b", "c")}),
    ({"fedlora.llm.a": {"fedlora.llm.b", "fedlora.llm.c"}, "fedlora.llm.b": {"fedlora.llm.c"}, "fedlora.llm.c": set()}, set()),
    # two cycles at once, one in the core
    ({"fedlora.x": {"fedlora.y"}, "fedlora.y": {"fedlora.x"}, "fedlora.kernels": {"fedlora.kernels.k"},
      "fedlora.kernels.k": {"fedlora.kernels"}}, {("x", "y"), ("kernels", "k")}),
    # a circle through another folder is no cycle inside one (the layering rules forbid its upward import)
    ({"fedlora.llm.a": {"fedlora.m"}, "fedlora.m": {"fedlora.llm.b"}, "fedlora.llm.b": {"fedlora.llm.a"}}, set()),
])
def test_the_cycle_check_finds_every_cycle_and_only_cycles(edges, cycles):
    found = import_cycles(edges)
    assert {tuple(sorted(m.rpartition(".")[2] for m in c)) for c in found} == {tuple(sorted(c)) for c in cycles}


@pytest.mark.parametrize("importer, imported, bad", [
    ("fedlora.llm.export", "fedlora.kernels", True),
    ("fedlora.llm.flower", "fedlora.synthetic.flower", True),
    ("fedlora.synthetic.cli", "fedlora.llm.flower_deploy", True),
    ("fedlora.kernels.aot", "fedlora.llm.inject", True),
    ("fedlora.llm.export", "fedlora.adapter", False),
    ("fedlora.adapter", "fedlora.kernels", False),
    ("fedlora.synthetic.runner", "fedlora.synthetic.data", False),
])
def test_the_sibling_check_catches_what_it_must(importer, imported, bad):
    assert bool(sibling_imports({importer: {imported}, imported: set()})) is bad


def test_planted_modules_make_the_cycle_and_the_sibling_import_found(tmp_path):
    """From files: an import inside a function closes a cycle; ``from . import m`` of a module is no import of
    the package, ``from . import name`` of a name defined there is; a sibling import is seen in a function."""
    pkg = tmp_path / "llm"
    pkg.mkdir()
    files = {"__init__": "from .a import A\n", "a": "A = 1\ndef f():\n    from .b import g\n",
             "b": "from . import a\ndef g():\n    pass\n", "c": "from . import A\n",
             "d": "def h():\n    from fedlora.synthetic.runner import run\n"}
    for name, text in files.items():
        (pkg / f"{name}.py").write_text(text)
    mods = [(pkg / f"{n}.py", "fedlora.llm" if n == "__init__" else f"fedlora.llm.{n}") for n in files]
    mods.append((tmp_path / "runner.py", "fedlora.synthetic.runner"))
    (tmp_path / "runner.py").write_text("")
    g = _import_graph(mods)
    assert g["fedlora.llm.b"] == {"fedlora.llm.a"} and g["fedlora.llm.c"] == {"fedlora.llm"}
    assert import_cycles(g) == {frozenset({"fedlora.llm.a", "fedlora.llm.b"})}
    assert sibling_imports(g) == {("fedlora.llm.d", "fedlora.synthetic.runner")}
    (pkg / "a.py").write_text("A = 1\n")  # the function's import gone: no cycle
    assert import_cycles(_import_graph(mods)) == set()
    # c ↔ __init__: c reads a name of the package, which imports c
    (pkg / "__init__.py").write_text("from .a import A\nfrom .c import C\n")
    assert import_cycles(_import_graph(mods)) == {frozenset({"fedlora.llm", "fedlora.llm.c"})}


def test_the_known_lists_only_shrink():
    """A violation not listed fails; so does a listed one that is gone."""
    known = {("fedlora.llm.flower", "fedlora.synthetic.flower")}
    assert _against_known(set(known), known, "x") == []
    new = _against_known(known | {("fedlora.llm.export", "fedlora.kernels")}, known, "x")
    assert new == ["new x: fedlora.llm.export -> fedlora.kernels"]
    gone = _against_known(set(), known, "x")
    assert gone == ["listed x no longer exists, remove it from the list: fedlora.llm.flower -> fedlora.synthetic.flower"]
    assert _against_known({frozenset({"b", "a"})}, set(), "cycle") == ["new cycle: a, b"]


# ---------------------------------------------------------------------------------------------
# entry points: pyproject.toml, the built-in fallback, the installed metadata

def _pyproject_commands() -> dict[str, str]:
    return dict(PYPROJECT["project"]["entry-points"][COMMANDS_GROUP])


def _assert_resolves_and_adds(name: str, value: str) -> None:
    register = metadata.EntryPoint(name, value, COMMANDS_GROUP).load()
    parser = cli._Parser(prog="fedlora")
    sub = parser.add_subparsers(dest="group", required=True, parser_class=cli._Parser)
    register(sub)
    assert list(sub.choices) == [name], f"entry point {name} = {value} added {list(sub.choices)}"


def test_the_builtin_fallback_is_pyprojects_table():
    assert _pyproject_commands() == BUILTIN_COMMANDS
    assert list(BUILTIN_COMMANDS) == ["synthetic", "run", "export", "plot", "compare", "flower", "aggregate"]  # the help order


@pytest.mark.parametrize("name", list(BUILTIN_COMMANDS))
def test_every_entry_point_of_pyproject_resolves_and_adds_its_command(name):
    _assert_resolves_and_adds(name, _pyproject_commands()[name])


def test_the_installed_entry_points_resolve_and_are_the_ones_used():
    try:
        dist = metadata.distribution("fedlora")
    except metadata.PackageNotFoundError:
        pytest.skip("fedlora is not installed (a source checkout): the built-in table serves")
    installed = {ep.name: ep.value for ep in dist.entry_points if ep.group == COMMANDS_GROUP}
    if not installed:
        pytest.skip("the installed fedlora predates the fedlora.commands entry points: re-run `make env`")
    assert installed == _pyproject_commands(), "the install is stale: re-run `make env` (pip install -e .)"
    for name, value in installed.items():
        _assert_resolves_and_adds(name, value)
    used = command_entry_points()[: len(installed)]
    assert [(ep.name, ep.value) for ep in used] == list(BUILTIN_COMMANDS.items())
    assert {cli._dist_name(ep) for ep in used} == {"fedlora"}  # from the metadata, not the fallback


def test_without_metadata_the_builtins_still_come(monkeypatch):
    """A clone that was never installed: no entry points at all, the same commands in the same order."""
    monkeypatch.setattr(metadata, "entry_points", lambda **kw: metadata.EntryPoints(()))
    assert [(ep.name, ep.value) for ep in command_entry_points()] == list(BUILTIN_COMMANDS.items())
    assert " ".join(cli._build_parser().format_usage().split()) == \
        "usage: fedlora [-h] [--version] {synthetic,run,export,plot,compare,flower,aggregate} ..."


def _launchers():
    yield "python -m fedlora", [sys.executable, "-m", "fedlora"]
    script = shutil.which("fedlora", path=str(Path(sys.executable).parent))
    if script:
        yield "installed fedlora script", [script]


@pytest.mark.parametrize("launcher", [argv for _, argv in _launchers()], ids=[n for n, _ in _launchers()])
def test_the_command_as_users_start_it(launcher, tmp_path):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # as installed: the repo root is never on sys.path
    r = subprocess.run([*launcher, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert " ".join(r.stdout.split()).startswith(
        "usage: fedlora [-h] [--version] {synthetic,run,export,plot,compare,flower,aggregate} ...")
    r = subprocess.run([*launcher, "synthetic", "tune", "--seeds", "0", "--out", str(tmp_path / "o")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert (r.returncode, r.stderr) == (2, "fedlora: error: --seeds: must be an integer ≥ 1, got 0\n")


SNIPPETS = {  # what a fresh interpreter must not have imported after running the snippet
    "a command loads only its own layer": (
        "rc = main(['synthetic', 'tune', '--seeds', '0', '--out', OUT]); assert rc == 2", ("fedlora.llm",)),
    "the command list loads no layer's runtime": ("_build_parser()",
                                                  ("torch", "fedlora.llm.runtime", "fedlora.synthetic.runner")),
}


@pytest.mark.parametrize("case", list(SNIPPETS))
def test_what_the_command_imports(case, tmp_path):
    snippet, absent = SNIPPETS[case]
    code = (f"import sys\nfrom fedlora.cli import _build_parser, main\nOUT = {str(tmp_path / 'o')!r}\n{snippet}\n"
            f"print(sorted(m for m in sys.modules if any(m == a or m.startswith(a + '.') for a in {absent!r})))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


# ---------------------------------------------------------------------------------------------
# other packages' commands, and broken plugins

PLUGINS = '''
def register_hello(subparsers):
    p = subparsers.add_parser("hello", help="say hello")
    p.add_argument("--name", default="world")
    p.set_defaults(handler=lambda args: print(f"hello {args.name}") or 0)

def register_crashing(subparsers):
    raise RuntimeError("boom\\nsecond line")

def register_nothing(subparsers):
    pass

def register_hijack(subparsers):
    raise AssertionError("another package replaced a built-in command")
'''

ENTRY_POINTS = """[fedlora.commands]
hello = fake_fedlora_plugins:register_hello
broken = fake_fedlora_plugins_broken:register
crashing = fake_fedlora_plugins:register_crashing
nameless = fake_fedlora_plugins:register_nothing
run = fake_fedlora_plugins:register_hijack
"""


def _install_fake_dist(site: Path, name: str, entry_points: str) -> None:
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """An installed package 'fake-fedlora-plugins' with one working command and four faulty ones."""
    site = tmp_path / "site"
    _install_fake_dist(site, "fake-fedlora-plugins", ENTRY_POINTS)
    (site / "fake_fedlora_plugins.py").write_text(PLUGINS)
    # the broken one imports its sibling first: a failed import leaves no trace in sys.modules, the sibling does
    (site / "fake_fedlora_plugins_broken.py").write_text("import fake_fedlora_plugins\nimport no_such_module_for_fedlora_tests\n")
    monkeypatch.syspath_prepend(str(site))
    for mod in ("fake_fedlora_plugins", "fake_fedlora_plugins_broken"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    yield
    for mod in ("fake_fedlora_plugins", "fake_fedlora_plugins_broken"):
        sys.modules.pop(mod, None)


def test_another_package_adds_a_command(plugins, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out  # built-ins first, in their order; then the others by name; 'run' stays ours
    assert " ".join(out.split()).startswith("usage: fedlora [-h] [--version] {synthetic,run,export,plot,compare,flower,aggregate,broken,crashing,hello,nameless} ...")
    assert "broken unavailable: its plugin failed to load (`fedlora broken` says why)" in " ".join(out.split())
    assert main(["hello", "--name", "plugin"]) == 0 and capsys.readouterr().out == "hello plugin\n"


@pytest.mark.parametrize("name, why", [
    ("broken", "failed to load: ModuleNotFoundError: No module named 'no_such_module_for_fedlora_tests'"),
    ("crashing", "failed to register it: RuntimeError: boom"),
    ("nameless", "did not add a command of that name"),
])
def test_a_broken_plugin_is_one_line_naming_it(plugins, capsys, name, why):
    for argv in ([name], [name, "--help"], [name, "--out", "x", "anything"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert err == (f"fedlora: error: command {name!r} is unavailable: its plugin "
                       f"'{ENTRY_POINTS.split(name + ' = ')[1].splitlines()[0]}' (package fake-fedlora-plugins) {why}\n")


def test_a_broken_plugin_leaves_every_other_command_working(plugins, tmp_path, capsys):
    assert main(["run", "--list-configs"]) == 0 and "tiny-smoke" in capsys.readouterr().out
    assert "fake_fedlora_plugins" not in sys.modules  # running a command loads no other plugin
    assert main(["synthetic", "tune", "--seeds", "0", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == "fedlora: error: --seeds: must be an integer ≥ 1, got 0\n"
    for path in (["synthetic"], ["synthetic", "compare"], ["run"], ["export"], ["plot"], ["hello"]):
        with pytest.raises(SystemExit) as e:
            main([*path, "--help"])
        assert e.value.code == 0 and capsys.readouterr().out.startswith(f"usage: fedlora {' '.join(path)}")


def test_a_layer_that_cannot_load_costs_only_its_commands(monkeypatch, tmp_path, capsys):
    """E.g. the LLM layer without its dependencies: `fedlora synthetic` works, `fedlora run` says why."""
    monkeypatch.setitem(sys.modules, "fedlora.llm.cli", None)  # import fedlora.llm.cli → ModuleNotFoundError
    assert main(["synthetic", "tune", "--seeds", "0", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == "fedlora: error: --seeds: must be an integer ≥ 1, got 0\n"
    for name in ("run", "export", "plot"):
        assert main([name, "tiny-smoke", "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"fedlora: error: command {name!r} is unavailable: its plugin 'fedlora.llm.cli:register_{name}'")
        assert "failed to load: ModuleNotFoundError" in err and err.count("\n") == 1


def test_the_installed_core_wins_over_the_fallback(tmp_path, monkeypatch):
    """When the metadata names the core's commands, they come from there (the table is only a fallback)."""
    site = tmp_path / "site"
    _install_fake_dist(site, "fedlora", "[fedlora.commands]\nsynthetic = fedlora.synthetic.cli:register\n")
    monkeypatch.syspath_prepend(str(site))
    assert [(ep.name, cli._dist_name(ep)) for ep in command_entry_points()] == [("synthetic", "fedlora")]
