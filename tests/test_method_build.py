"""One method factory: ``fedlora.methods.build(name, options, *, seed, client_weights)``, the one reader of
constructor signatures (``method_parameters``), used by the LLM config, the testbed, compare and rank recovery."""
import pathlib
import re

import pytest

from fedlora.errors import ConfigError
from fedlora.methods import available_methods, build, get_method, method_parameters, resolve_options

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_unknown_name_is_one_line_naming_the_methods():
    with pytest.raises(ConfigError) as e:
        build("fedavgg", {})
    msg = str(e.value)
    assert "\n" not in msg and "unknown method 'fedavgg' (did you mean 'fedavg'?)" in msg
    assert f"available: {', '.join(available_methods())}" in msg


def test_unknown_option_is_one_line_naming_the_allowed():
    with pytest.raises(ConfigError) as e:
        build("fedavg", {"momentum": 0.9, "lr": 0.1})
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == f"fedavg: unknown option(s) 'momentum'; allowed: {', '.join(method_parameters('fedavg'))}"
    with pytest.raises(ConfigError, match=r"rolora: per-client rank budgets \(client_ranks\) are not supported.*"
                                          r"methods with heterogeneous ranks: .*hetlora"):
        build("rolora", {"client_ranks": [1, 2]})


def test_run_facts_go_where_the_constructor_takes_them():
    """``seed`` and ``client_weights`` fill the option of that name if the method has one and the options leave
    it out; a method without such an option is built without it (no error); an explicit option wins."""
    assert build("h2tune", {}, seed=5).seed == 5
    assert build("flora", {"seed": 3}, seed=9).seed == 3
    assert build("flora", {}, seed=[4, 6]).seed == [4, 6]
    assert not hasattr(build("fedavg", {}, seed=5, client_weights=[1.0, 3.0]), "seed")
    assert build("centralized", {}, client_weights=[1.0, 3.0]).client_weights == [1.0, 3.0]
    assert build("centralized", {}).client_weights is None
    assert resolve_options("fedavg", {"lr": 0.1}, seed=1, client_weights=[1.0]) == {"lr": 0.1}
    assert resolve_options("h2tune", {"lr": 0.1}, seed=1) == {"lr": 0.1, "seed": 1}


def test_method_parameters_are_the_constructor_options():
    for name in available_methods():
        params = method_parameters(name)
        assert "self" not in params
        assert params == method_parameters(get_method(name))
    assert list(method_parameters("fedavg"))[:1] == ["rank"]


def _sources():
    for folder in ("fedlora", "synthetic", "llm"):
        for p in sorted((ROOT / folder).rglob("*.py")):
            yield p.relative_to(ROOT).as_posix(), p.read_text()


def test_one_reader_of_constructor_signatures_and_one_factory():
    """Only ``fedlora/methods/base.py`` reads a method's signature (``fedlora/partition.py`` reads its
    partitioners'); outside ``fedlora/methods/`` no method class is constructed by its class name."""
    readers = [path for path, text in _sources() if "inspect.signature(" in text]
    assert readers == ["fedlora/methods/base.py", "fedlora/partition.py"], readers
    part = (ROOT / "fedlora/partition.py").read_text()
    assert "__init__" not in "".join(line for line in part.splitlines() if "inspect.signature(" in line)
    classes = sorted({get_method(n).__name__ for n in available_methods()})
    direct = re.compile(r"\b(" + "|".join(classes) + r")\(")
    found = [f"{path}: {m.group(0)}" for path, text in _sources() if not path.startswith("fedlora/methods/")
             for m in direct.finditer(text)]
    assert not found, found
