"""Build helpers of the documentation site (mkdocs.yml names this file twice).

* As an MkDocs hook: puts the measured results that live beside the code (``llm/results``,
  ``synthetic/results``, ``bench/results``) and the bundled configs into the site under their repository
  paths, so that the docs link to the very files the commands wrote — a missing figure is a broken link,
  and a strict build fails on it — and no copy of a figure is kept in ``docs/``.
* The site's home page is the README (one text, not two): its links into ``docs/`` are made relative to
  the site.
* A method's page lists its options as its constructor has them: ``<!-- options: fedlora.methods.x.Class -->``
  becomes a table of the constructor's parameters and defaults, read by griffe at build time (never a copy
  that could fall behind the code).
* For mkdocstrings: griffe reads the code statically, but ``fedlora.llm``, ``fedlora.kernels`` and
  ``fedlora.synthetic`` live in the folders ``llm/``, ``kernels/``, ``synthetic/`` (pyproject.toml's
  ``package-dir``), which no static finder maps. :func:`stage_api_sources` lays out ``fedlora/`` as the
  installed package is (symlinks under ``build/docs-api/site-packages``: mkdocstrings labels a source
  below a ``site-packages`` folder by its path in the package, so "Source code in" reads
  ``fedlora/llm/runtime.py`` — the module's path in an installed wheel; in the repository, ``llm/runtime.py``).
"""
from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
#: where the staged package lies (mkdocs.yml: plugins.mkdocstrings.handlers.python.paths)
API_ROOT = ROOT / "build" / "docs-api" / "site-packages"
#: repository folders whose files the site serves as they are (figures, CSV, JSON, markdown tables, configs)
RESULT_DIRS = ("llm/results", "synthetic/results", "bench/results", "llm/configs")
RESULT_SUFFIXES = {".png", ".csv", ".json", ".md", ".yaml", ".svg"}


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """pyproject.toml's ``package-dir``: import name → folder."""
    cfg = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    return {name: root / folder for name, folder in cfg["tool"]["setuptools"]["package-dir"].items()}


def stage_api_sources(root: Path = ROOT, out: Path = API_ROOT) -> Path:
    """``out/fedlora`` as installed: the files of ``fedlora/`` and each mapped subpackage, as symlinks."""
    dirs = package_dirs(root)
    top = out / "fedlora"
    if top.exists():
        shutil.rmtree(top)
    top.mkdir(parents=True)
    sub = {name.split(".", 1)[1]: path for name, path in dirs.items() if name.startswith("fedlora.")}
    for entry in sorted(dirs["fedlora"].iterdir()):
        if entry.name not in sub and entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    for name, path in sub.items():
        (top / name).symlink_to(path)
    return out


# --- MkDocs hook events ------------------------------------------------------------------------------
try:
    from mkdocs.plugins import event_priority
except ImportError:  # pragma: no cover - imported outside a docs build
    def event_priority(priority):
        return lambda f: f


@event_priority(100)  # before mkdocstrings' on_config, which drops search paths that do not exist yet
def on_config(config, **kwargs):
    stage_api_sources(ROOT)
    return config


def on_files(files, config, **kwargs):
    from mkdocs.structure.files import File

    for folder in RESULT_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in RESULT_SUFFIXES and "runs" not in path.relative_to(ROOT).parts:
                rel = path.relative_to(ROOT).as_posix()
                files.append(File(rel, src_dir=str(ROOT), dest_dir=config["site_dir"],
                                  use_directory_urls=config["use_directory_urls"]))
    files.append(File.generated(config, "index.md", content=readme_as_home(ROOT)))
    return files


_OPTIONS = re.compile(r"<!-- options: ([\w.]+) -->")
_PACKAGE = {}


def options_table(path: str) -> str:
    """The constructor parameters of the class at ``path`` (e.g. ``fedlora.methods.rolora.RoLoRA``), as a table."""
    import griffe

    if "fedlora" not in _PACKAGE:
        _PACKAGE["fedlora"] = griffe.load("fedlora", search_paths=[str(API_ROOT)], resolve_aliases=True,
                                          resolve_external=False)
    cls = _PACKAGE["fedlora"][path.split(".", 1)[1]]
    init = cls.all_members["__init__"]
    rows = ["| option | default |", "|---|---|"]
    for param in init.parameters:
        if param.name in ("self", "cls") or param.kind.value in ("variadic positional", "variadic keyword"):
            continue
        default = "(required)" if param.default is None else f"`{param.default}`"
        rows.append(f"| `{param.name}` | {default} |")
    head = (f"**Head policy** (the class's `default_head` and `head_modes`): `model.head: auto` gives "
            f"`{_class_value(cls, 'default_head')}`; the method supports `{_class_value(cls, 'head_modes')}`.")
    return "\n".join(rows) + "\n\n" + head


def _class_value(cls, name: str) -> str:
    """A class attribute's value as written, from the class or the nearest base that assigns it."""
    for klass in [cls, *cls.mro()]:
        member = klass.members.get(name)
        if member is not None and not member.is_alias:
            return str(member.value).strip("'")
    raise KeyError(f"{cls.path}.{name}")


def on_page_markdown(markdown, page, config, files, **kwargs):
    return _OPTIONS.sub(lambda m: options_table(m.group(1)), markdown)


def readme_as_home(root: Path = ROOT) -> str:
    """README.md with its links into ``docs/`` made relative to the site's root."""
    text = (root / "README.md").read_text(encoding="utf-8")
    return re.sub(r"\]\(docs/", "](", text)


# --- griffe extension (mkdocs.yml: mkdocstrings' extensions) -----------------------------------------------
_ROLE = re.compile(r":(?:py:)?(?:mod|func|class|meth|attr|data|exc|obj):`(~?)([^`]+)`")


def plain_roles(text: str) -> str:
    """Sphinx cross-reference roles (``:func:`x```) as the inline code they stand for (``x``; ``~a.b`` → ``b``)."""
    return _ROLE.sub(lambda m: "`" + (m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2)) + "`", text)


try:
    import griffe
except ImportError:  # pragma: no cover - only the docs build loads the extension
    griffe = None

if griffe is not None:
    class SphinxRoles(griffe.Extension):
        """Docstrings written with Sphinx roles read as Markdown code (the docs are Markdown, not reST)."""

        def on_package(self, *, pkg, **kwargs) -> None:
            seen = set()

            def walk(obj) -> None:
                if obj.is_alias or id(obj) in seen:
                    return
                seen.add(id(obj))
                if obj.docstring is not None and ":" in obj.docstring.value:
                    obj.docstring.value = plain_roles(obj.docstring.value)
                for member in obj.members.values():
                    walk(member)

            walk(pkg)
