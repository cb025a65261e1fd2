"""How ``make test`` orders and groups the suite for pytest-xdist: the hooks tests/conftest.py registers, in a module
of their own that imports neither torch nor fedlora, so tests/test_xdist_groups.py can run them in a small suite of its
own without paying for the real suite's imports in each of its workers."""
import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Tests marked ``long`` (a Flower deployment, a real model: tens of seconds each) run first, then the
    groups (tests sharing an expensive fixture: a group is one unit of work, often a minute), then the rest, each
    part in its collected order. ``make test`` spreads the suite over the cores (pytest-xdist), which hands tests
    out in this order: a two-minute unit handed out last would keep one worker busy while the others sit idle.

    Under ``--dist loadgroup`` the tests of one ``xdist_group`` (those sharing an expensive module fixture)
    must reach one worker. xdist 3.8 says so by suffixing ``@group`` to ``item._nodeid``, which pytest 9 no
    longer reads (a node's id is ``item._id``): every group would be ignored and each worker would build the
    fixture again. The suffix is set where pytest 9 reads it (tests/test_xdist_groups.py checks it)."""
    items.sort(key=lambda item: (item.get_closest_marker("long") is None, xdist_group(item) is None))  # stable
    if getattr(config.option, "loadgroup", False):
        for item in items:
            group = xdist_group(item)
            if group and not item.nodeid.endswith(f"@{group}"):
                item._id = type(item._id).parse(f"{item.nodeid}@{group}")


def xdist_group(item) -> str | None:
    """The ``@pytest.mark.xdist_group`` name(s) of ``item`` as xdist joins them, or None."""
    names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
    return "_".join(sorted(names)) or None
