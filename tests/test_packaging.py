"""One import name (issue 18 §2): the only top-level name fedlora installs is ``fedlora``.

The folders stay at the root as the user laid them out and install as ``fedlora.kernels`` (kernels/),
``fedlora.llm`` (llm/), ``fedlora.synthetic`` (synthetic/) — pyproject.toml's ``package-dir``. So
``import kernels`` is HuggingFace's ``kernels`` (which transformers looks up) and ``import llm`` PyPI's
``llm``; both are in requirements/ci.txt, so these tests run beside them.

* The wheel, built from a copy of this checkout (``pip wheel --no-build-isolation``: no download):
  its top-level names are ``fedlora`` and its dist-info only; every module of every package, the
  bundled configs and data set are in it under ``fedlora/``; its entry points are pyproject's.
* The wheel installed into a throwaway venv that reuses this environment's packages (a ``.pth`` to
  its site-packages: HuggingFace's ``kernels`` and PyPI's ``llm`` beside it), used from outside the
  repo as a user would: ``fedlora synthetic --help``, a one-round ``fedlora run tiny-smoke``, what
  ``import kernels`` / ``import llm`` give, and what transformers believes ``kernels`` is; and from
  the repo root, a rank-recovery run with a worker process (the child must not import the source
  folder ``fedlora/`` that the current folder puts first on its path).
* The editable install these tests run on maps the names onto the folders, from any folder.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from fnmatch import fnmatch
from importlib import metadata
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
VERSION = PYPROJECT["project"]["version"]
#: import name → folder, and folder → import name
FOLDER_OF = dict(SETUPTOOLS["package-dir"])
PACKAGE_OF = {folder: name for name, folder in FOLDER_OF.items()}
LAYERS = {"fedlora.kernels": "kernels", "fedlora.llm": "llm", "fedlora.synthetic": "synthetic"}
#: other projects' distributions whose top-level names our folders used to claim
OTHERS = {"kernels": "kernels", "llm": "llm"}


def _env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: no PYTHONPATH (nothing of the repo on sys.path), offline hub."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **extra)
    return env


def _run(argv, cwd, timeout=300, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                       env=_env(), **kw)
    assert r.returncode == 0, f"{' '.join(map(str, argv))} → {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _source_packages() -> dict[str, Path]:
    """Every package the folders hold (a folder with __init__.py under a package-dir root): name → folder."""
    out = {}
    for name, folder in FOLDER_OF.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder).parts
            if all((ROOT / folder / Path(*rel[:i]) / "__init__.py").is_file() for i in range(len(rel) + 1)):
                out[".".join((name, *rel))] = init.parent
    return out


def _checkout_files() -> list[Path]:
    """This checkout's files as git knows them (tracked, or new and not ignored); without git, a walk
    that leaves out what is never part of the source."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True, timeout=60).stdout
        files = [ROOT / p for p in out.split("\0") if p]
        if files:
            return [f for f in files if f.is_file()]
    except (OSError, subprocess.SubprocessError):
        pass
    skip = {".git", ".venv", "build", "dist", "runs", "__pycache__", ".hypothesis", ".benchmarks", ".pytest_cache"}
    return [p for p in ROOT.rglob("*") if p.is_file() and not (set(p.relative_to(ROOT).parts) & skip)
            and not any(part.endswith(".egg-info") for part in p.parts)]


# ---------------------------------------------------------------------------------------------
# the configuration

def test_every_package_of_the_folders_is_listed():
    """A new subpackage (a folder with __init__.py) that is not in pyproject's ``packages`` would be
    left out of the wheel while an editable install still finds it."""
    assert sorted(_source_packages()) == sorted(SETUPTOOLS["packages"])
    assert set(LAYERS.items()) <= set(FOLDER_OF.items())
    assert {n.split(".")[0] for n in SETUPTOOLS["packages"]} == {"fedlora"}


# ---------------------------------------------------------------------------------------------
# the wheel

@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of a copy of this checkout (a build in the checkout itself would leave build/ and
    egg-info there, and could pick up a stale build/lib)."""
    src = tmp_path_factory.mktemp("src") / "fedlora"
    for f in _checkout_files():
        dest = src / f.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest)
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", out, src], cwd=out)
    wheels = list(out.glob("fedlora-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.mark.long
@pytest.mark.xdist_group("packaging_wheel")
def test_the_wheel_claims_only_fedlora(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    info = f"fedlora-{VERSION}.dist-info"
    assert {n.split("/")[0] for n in names} == {"fedlora", info}
    z = zipfile.ZipFile(wheel)
    if f"{info}/top_level.txt" in names:
        assert z.read(f"{info}/top_level.txt").decode().split() == ["fedlora"]
    # every module of every package, where its import name says
    want = set()
    for name, folder in _source_packages().items():
        want |= {"/".join((*name.split("."), p.name)) for p in folder.glob("*.py")}
    assert want - set(names) == set()
    for layer in LAYERS:
        assert f"{layer.replace('.', '/')}/__init__.py" in names
    assert "fedlora/kernels/lora_linear.py" in names and "fedlora/llm/runtime.py" in names
    # the package data: the bundled configs and data set, as pyproject's patterns name them
    for package, patterns in SETUPTOOLS["package-data"].items():
        folder = _source_packages()[package]
        files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
        data = {f for f in files for pat in patterns if fnmatch(f, pat)}
        assert data, f"{package}: no file matches {patterns}"
        prefix = package.replace(".", "/")
        assert {f"{prefix}/{f}" for f in data} - set(names) == set()
    configs = {Path(n).name for n in names if fnmatch(n, "fedlora/llm/configs/*.yaml")}
    assert configs >= {"tiny-smoke.yaml", "minilm-debian.yaml"} and configs == {p.name for p in (ROOT / "llm/configs").glob("*.yaml")}
    assert {"fedlora/llm/datasets/debian_sections/train.jsonl", "fedlora/llm/datasets/debian_sections/test.jsonl",
            "fedlora/llm/datasets/debian_sections/README.md", "fedlora/llm/datasets/debian_describe/train.jsonl",
            "fedlora/llm/datasets/debian_describe/test.jsonl", "fedlora/llm/datasets/debian_describe/README.md"} <= set(names)
    # the command and its subcommands, as pyproject declares them
    eps = z.read(f"{info}/entry_points.txt").decode()
    group = PYPROJECT["project"]["entry-points"]["fedlora.commands"]
    assert "[fedlora.commands]" in eps and all(f"{k} = {v}" in eps for k, v in group.items())
    assert "fedlora = fedlora.cli:main" in eps


# ---------------------------------------------------------------------------------------------
# the wheel installed beside HuggingFace's kernels and PyPI's llm

def _reused_paths() -> list[str]:
    """This interpreter's package folders: its site-packages and whatever its .pth files added (a .pth
    in the throwaway venv adds them, but does not run the .pth files inside them), without the
    standard library (the venv has its own, of the same base interpreter) and nothing of the checkout."""
    std = {Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib")}
    out = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        where = Path(entry).resolve()
        if where == ROOT or ROOT in where.parents or where in std or any(s in where.parents for s in std):
            continue
        out.append(entry)
    return list(dict.fromkeys(out))


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A venv with the wheel installed, reusing this environment's packages through a .pth file (its
    dependencies, HuggingFace's kernels and PyPI's llm among them; the editable finder of this
    checkout is not: .pth files of a folder added that way are not run). Returns the venv's bin/."""
    for dist in OTHERS.values():
        try:
            metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            pytest.fail(f"the distribution {dist!r} is not installed: `make env` (requirements/ci.txt) installs it")
    venv = tmp_path_factory.mktemp("venv") / "v"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=venv.parent)
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / ("python.exe" if os.name == "nt" else "python")
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        cwd=venv).stdout.strip())
    (purelib / "_fedlora_test_reuse.pth").write_text("\n".join(_reused_paths()) + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
         cwd=venv)
    return bindir


@pytest.mark.long
@pytest.mark.xdist_group("packaging_wheel")
def test_the_commands_work_from_the_wheel(installed, tmp_path):
    r = _run([installed / "fedlora", "synthetic", "--help"], cwd=tmp_path)
    assert r.stdout.startswith("usage: fedlora synthetic") and "rank-recovery" in r.stdout
    out = tmp_path / "run"
    _run([installed / "fedlora", "run", "tiny-smoke", "--set", "train.rounds=1", "--set", "train.local_steps=1",
          "--out", out, "--no-progress"], cwd=tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 1


_PROBE = """
import importlib.metadata as md, importlib.util, json, sys
import kernels, llm
import fedlora, fedlora.kernels, fedlora.llm, fedlora.synthetic
from transformers.utils.import_utils import _is_package_available
dists = md.packages_distributions()
print(json.dumps({
    "kernels": kernels.__file__, "kernels_dist": dists.get("kernels"), "hf_api": hasattr(kernels, "get_kernel"),
    "llm": llm.__file__, "llm_dist": dists.get("llm"), "llm_api": hasattr(llm, "get_model"),
    "synthetic": importlib.util.find_spec("synthetic") is not None,
    "ours": {m.__name__: m.__file__ for m in (fedlora, fedlora.kernels, fedlora.llm, fedlora.synthetic)},
    "lora_linear": callable(getattr(fedlora.kernels, "lora_linear", None)),
    "fedlora_top_level": sorted(k for k, v in dists.items() if "fedlora" in v),
    "fedlora_version": md.version("fedlora"),
    "transformers_sees_kernels": list(_is_package_available("kernels", return_version=True)),
    "kernels_version": md.version("kernels"),
}))
"""


@pytest.mark.long
@pytest.mark.xdist_group("packaging_wheel")
def test_import_kernels_is_huggingfaces_beside_the_wheel(installed, tmp_path):
    r = _run([installed / "python", "-c", _PROBE], cwd=tmp_path)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    site = Path(got["ours"]["fedlora"]).parent.parent
    assert {name: Path(f).relative_to(site).as_posix() for name, f in got["ours"].items()} == {
        "fedlora": "fedlora/__init__.py", "fedlora.kernels": "fedlora/kernels/__init__.py",
        "fedlora.llm": "fedlora/llm/__init__.py", "fedlora.synthetic": "fedlora/synthetic/__init__.py"}
    assert got["lora_linear"] and got["fedlora_top_level"] == ["fedlora"] and got["fedlora_version"] == VERSION
    # the other projects' names are theirs
    assert got["kernels_dist"] == ["kernels"] and got["hf_api"]
    assert got["llm_dist"] == ["llm"] and got["llm_api"]
    for f in (got["kernels"], got["llm"]):
        assert not _in_our_folders(f) and site not in Path(f).parents
    assert not got["synthetic"]
    assert got["transformers_sees_kernels"] == [True, got["kernels_version"]] != [True, VERSION]


def _in_our_folders(f) -> bool:
    """``f`` lies in one of this checkout's layer folders (kernels/, llm/, synthetic/) — a venv inside the
    checkout (`make env` puts .venv there) is not ours."""
    p = Path(f).resolve()
    return any(p == d or d in p.parents for d in (ROOT / "kernels", ROOT / "llm", ROOT / "synthetic"))


@pytest.mark.long
@pytest.mark.xdist_group("packaging_wheel")
def test_a_worker_process_started_in_the_repo_root_imports_the_wheel(installed, tmp_path):
    """`python -m` in a child would put the current folder first on its path: from a clone's root that
    is the source folder fedlora/ (no kernels/llm/synthetic inside) instead of the installed package."""
    r = _run([installed / "fedlora", "synthetic", "rank-recovery", "--steps", "10", "--interval", "10", "--seeds", "1",
              "--jobs", "2", "--no-plot", "--out", tmp_path / "rr"], cwd=ROOT)
    assert "(worker process)" in r.stdout + r.stderr
    assert (tmp_path / "rr" / "metrics.json").is_file()


# ---------------------------------------------------------------------------------------------
# the editable install the tests run on

def _editable() -> bool:
    try:
        text = metadata.distribution("fedlora").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return False
    return bool(text) and json.loads(text).get("dir_info", {}).get("editable", False)


@pytest.mark.long
@pytest.mark.parametrize("where", ["elsewhere", "repo root"])
def test_the_editable_install_maps_the_names_onto_the_folders(where, tmp_path):
    """`make env` installs this checkout editable: fedlora.kernels is kernels/ (and so on) from any
    folder — from the repo root too, where `python -c` puts the root first on sys.path."""
    if not _editable():
        pytest.skip("fedlora is not installed editable here (`make env` does that)")
    code = ("import json, fedlora, fedlora.kernels, fedlora.llm, fedlora.synthetic as s\n"
            "print(json.dumps({m.__name__: m.__file__ for m in (fedlora, fedlora.kernels, fedlora.llm, s)}))")
    r = _run([sys.executable, "-c", code], cwd=ROOT if where == "repo root" else tmp_path)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert {k: Path(v).resolve() for k, v in got.items()} == {
        name: ROOT / FOLDER_OF[name] / "__init__.py" for name in ("fedlora", *LAYERS)}
    if where == "elsewhere":  # outside the root, the other projects' names are theirs
        r = _run([sys.executable, "-c", "import kernels, llm; print(kernels.__file__); print(llm.__file__)"], cwd=tmp_path)
        for f in r.stdout.split():
            assert not _in_our_folders(f)


@pytest.mark.long
def test_this_test_run_sees_the_other_projects():
    """The suite itself runs without the repo root on sys.path: `import kernels` here is HuggingFace's."""
    import kernels
    import llm

    for mod, dist in ((kernels, "kernels"), (llm, "llm")):
        assert not _in_our_folders(mod.__file__)
        assert metadata.packages_distributions()[mod.__name__] == [dist]
    assert str(ROOT) not in sys.path and "" not in sys.path
