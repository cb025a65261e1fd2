"""Numbers as researchers write them: ``1e-3`` in a YAML file or in ``--set`` is a float, not text.

PyYAML reads YAML 1.1, where a float needs a dot and a signed exponent: ``1e-3``, ``1E-3``, ``5e+2``
were strings and ``method.lr: 1e-3`` was refused. The config layer reads YAML 1.2 floats
(``fedlora.io.yaml_load``) and a numeric field given text that is a number of its type takes it
(``fedlora.llm.config.coerce_number``: TOML strings, dicts from Python). Text that is no number is still a
one-line error, which says the value was read as text.
"""
import json

import pytest

from fedlora.errors import ConfigError
from fedlora.io import yaml_load
from fedlora.llm.config import RunConfig, load_config, method_options

FORMS = {"1e-3": 1e-3, "1E-3": 1e-3, "5e+2": 500.0, ".5": 0.5, "1_000": 1000, "2.0e-3": 2e-3, "-1e5": -1e5}


@pytest.mark.parametrize("text,value", FORMS.items())
def test_yaml_reads_the_usual_number_forms(text, value):
    assert yaml_load(text) == value and not isinstance(yaml_load(text), str)


@pytest.mark.parametrize("text", ["1e", "e3", "1e-3x", "abc", "1.2.3", "0.5.", "1e-"])
def test_yaml_keeps_non_numbers_as_text(text):
    assert yaml_load(text) == text


def test_yaml_keeps_yaml_1_1_meanings_of_other_scalars():
    assert yaml_load("true") is True and yaml_load("null") is None and yaml_load("3") == 3
    assert yaml_load("[1e-3, 2]") == [1e-3, 2] and yaml_load("{lr: 1E-3}") == {"lr": 1e-3}


@pytest.mark.parametrize("text,value", [(t, v) for t, v in FORMS.items() if v > 0])
def test_every_form_works_in_a_yaml_file_and_in_set(tmp_path, text, value):
    f = tmp_path / "run.yaml"
    f.write_text(f"method: {{name: pf2lora, lr: {text}, options: {{lower_lr: {text}}}}}\n"
                 f"data: {{test_fraction: 0.25}}\n")
    cfg = load_config(f)
    assert cfg.method.lr == value and cfg.method.options["lower_lr"] == value
    cfg = load_config("tiny-smoke", [f"method.lr={text}", f"model.lora_alpha={text}"])
    assert cfg.method.lr == value and cfg.model.lora_alpha == value
    # the value reaches the method: PF2LoRA's main step size is its upper level's
    assert method_options(load_config(f))["upper_lr"] == value


def test_int_fields_take_underscored_ints_in_files_and_set(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("train: {rounds: 1_000}\n")
    assert load_config(f).train.rounds == 1000
    assert load_config("tiny-smoke", ["train.rounds=1_000"]).train.rounds == 1000


def test_numbers_given_as_text_take_their_value_by_field_type(tmp_path):
    """TOML has no YAML quirk, but a quoted number is text; a dict from Python may hold text too."""
    f = tmp_path / "run.toml"
    f.write_text('[method]\nname = "pf2lora"\nlr = "1e-3"\n[method.options]\nlower_lr = "5e-4"\n'
                 '[train]\nrounds = "7"\n[federation]\nsample_fraction = ".5"\n')
    cfg = load_config(f)
    assert (cfg.method.lr, cfg.train.rounds, cfg.federation.sample_fraction) == (1e-3, 7, 0.5)
    assert method_options(cfg)["lower_lr"] == 5e-4  # a method option takes its constructor's type
    d = RunConfig().to_dict()
    d["method"]["lr"], d["train"]["batch_size"] = "1E-3", "16"
    cfg = RunConfig.from_dict(d)
    assert cfg.method.lr == 1e-3 and cfg.train.batch_size == 16


@pytest.mark.parametrize("override,field", [("method.lr=abc", "method.lr"), ("method.lr=1e-3x", "method.lr"),
                                            ("train.rounds=ten", "train.rounds"),
                                            ("train.batch_size=1.5e", "train.batch_size"),
                                            ("federation.sample_fraction=half", "federation.sample_fraction")])
def test_text_that_is_no_number_is_a_one_line_error_saying_so(override, field):
    with pytest.raises(ConfigError) as e:
        load_config("tiny-smoke", [override])
    msg = str(e.value)
    assert msg.startswith(field + ":") and "read as text" in msg and "\n" not in msg


def test_an_int_field_refuses_a_float_written_as_text():
    with pytest.raises(ConfigError, match=r"train.rounds: must be an integer ≥ 1, got 2.5"):
        load_config("tiny-smoke", ["train.rounds=2.5"])


def test_the_cli_takes_1e_3(capsys):
    from fedlora.cli import main

    assert main(["run", "tiny-smoke", "--dry-run", "--set", "method.lr=1e-3"]) == 0
    assert json.loads(capsys.readouterr().out)["method"]["lr"] == 1e-3
