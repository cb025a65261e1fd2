"""The documentation site builds strictly, and a fault fails it (issue 16 item 3).

* ``make docs``'s command (``mkdocs build --strict``) builds the site from a clean ``site_dir`` with no
  warning at all: every link, anchor and image resolves (pages, the results folders the hook serves, the API
  reference's anchors) and griffe has nothing to say about a docstring.
* A copy of the pages with planted faults — a link to a page that does not exist, an anchor that does not
  exist, a missing figure, and the API reference of a module whose docstring documents a parameter its
  function lacks — is built with the same configuration (mkdocs.yml, its hook, mkdocstrings' options): the
  build aborts, and each fault is named in a warning.
* Every figure of the README and of the pages has its command on the same page section: a ```bash block or
  an inline ``fedlora …`` / ``python …`` / ``make …``.

The builds run the installed mkdocs in a subprocess (about 5 s each on 2 cores).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = Path(sys.executable).with_name("mkdocs")
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2.0: not a build warning

pytestmark = [pytest.mark.skipif(not MKDOCS.exists(), reason="mkdocs is not installed (make env installs "
                                                              "requirements/docs.txt)"),
              # both builds stage the API sources into the checkout's build/docs-api (tools/docs_build.py):
              # one worker runs them, one after the other
              pytest.mark.xdist_group("docs_build")]

# Builds the site of mkdocs.yml with another docs_dir and extra mkdocstrings search paths.
_DRIVER = textwrap.dedent("""
    import logging, sys
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort
    config_file, docs_dir, site_dir, extra_path = sys.argv[1:5]
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(levelname)s - %(message)s"))
    logging.getLogger("mkdocs").addHandler(handler)
    logging.getLogger("mkdocs").setLevel(logging.INFO)
    cfg = load_config(config_file, docs_dir=docs_dir, site_dir=site_dir, strict=True)
    cfg.plugins["mkdocstrings"].config["handlers"]["python"]["paths"].append(extra_path)
    try:
        build(cfg)
    except Abort as exc:
        print("ABORTED:", exc)
        sys.exit(1)
""")


def _build(tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(tmp / "site")], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.long
def test_the_site_builds_strictly_without_a_warning(tmp_path):
    shutil.rmtree(ROOT / "build" / "docs-api", ignore_errors=True)  # as in a fresh clone: the hook stages it
    res = _build(tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "WARNING" not in out and "ERROR" not in out, out[-4000:]
    site = tmp_path / "site"
    for page in ("index.html", "tutorials/your-csv.html", "methods/rolora.html", "reference/api/llm.html",
                 "design.html", "llm/results/minilm_debian.png"):
        assert (site / page).is_file(), page
    # a method's page carries its module's docstring (the paper's equations) and its source
    rolora = (site / "methods" / "rolora.html").read_text(encoding="utf-8")
    assert "eq. 3–4" in rolora and "Source code in" in rolora and "trained_names" in rolora
    # the home page is the README, its links into docs/ made relative to the site
    home = (site / "index.html").read_text(encoding="utf-8")
    assert 'href="tutorials/your-csv.html"' in home


@pytest.mark.long
def test_planted_faults_fail_the_build_and_are_named(tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    page = docs / "tutorials" / "your-csv.md"
    page.write_text(page.read_text(encoding="utf-8") + textwrap.dedent("""

        A planted broken link: [nowhere](no-such-page.md), a planted anchor: [there](qa.md#no-such-section),
        a planted figure: ![missing](../llm/results/no_such_figure.png).
        """), encoding="utf-8")
    pkg = tmp_path / "planted" / "plantedpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        """A planted module."""


        def scale(x: float, factor: float = 2.0) -> float:
            """Multiply.

            Args:
                x: the number.
                factr: a parameter the signature does not have.
            """
            return x * factor
        '''), encoding="utf-8")
    (docs / "reference" / "api" / "core.md").write_text(
        (ROOT / "docs" / "reference" / "api" / "core.md").read_text(encoding="utf-8") + "\n::: plantedpkg\n",
        encoding="utf-8")
    res = subprocess.run([sys.executable, "-c", _DRIVER, str(ROOT / "mkdocs.yml"), str(docs), str(tmp_path / "site"),
                          str(tmp_path / "planted")], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "ABORTED" in out, out[-4000:]
    warnings = [ln for ln in out.splitlines() if ln.startswith("WARNING")]
    for fault in ("no-such-page.md", "#no-such-section", "no_such_figure.png", "'factr' does not appear"):
        assert any(fault in w for w in warnings), f"{fault} not reported:\n" + "\n".join(warnings)
    assert len(warnings) == 4, "\n".join(warnings)  # the copy itself is clean: only the planted faults


# --- every figure keeps its command --------------------------------------------------------------------------
_COMMAND = re.compile(r"^```bash\n|`(?:fedlora|python|make) [^`]+`", re.M)


def _sections(text: str) -> list[str]:
    """The page cut at its headings (outside code blocks)."""
    out, cur, fence = [], [], False
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            fence = not fence
        if not fence and re.match(r"#{1,6} ", line) and cur:
            out.append("".join(cur))
            cur = []
        cur.append(line)
    out.append("".join(cur))
    return out


def test_every_figure_has_its_command_on_its_page_section():
    pages = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
    figures, bad = 0, []
    for page in pages:
        for section in _sections(page.read_text(encoding="utf-8")):
            for fig in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", section):
                figures += 1
                if not _COMMAND.search(section):
                    bad.append(f"{page.relative_to(ROOT)}: {fig}")
    assert figures >= 6
    assert not bad, "figures without the command that made them in their section:\n" + "\n".join(bad)


def test_every_registered_method_has_its_page_with_its_source():
    """One page per method (issue 16): its registered name, its module's docstring and source, its options."""
    from fedlora.methods import base, get_method

    pages = {p: p.read_text(encoding="utf-8") for p in (ROOT / "docs" / "methods").glob("*.md") if p.name != "index.md"}
    missing = []
    for name in base.available_methods():
        cls = get_method(name)
        if not cls.__module__.startswith("fedlora.methods."):
            continue  # a plugin's method
        mod = cls.__module__
        ok = [p for p, t in pages.items() if f"`{name}`" in t and f"::: {mod}\n" in t
              and f"<!-- options: {mod}.{cls.__name__} -->" in t]
        if not ok:
            missing.append(f"{name} ({mod}.{cls.__name__})")
    assert not missing, "methods without a page under docs/methods/ (name, ::: module, options marker):\n" + \
        "\n".join(missing)
