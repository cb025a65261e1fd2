"""A method of your own (README "Writing your own method"): the public base API is enough to write
FedProx-LoRA, and such a method is found by ``package.module:Class`` or through the ``fedlora.methods``
entry-point group; a broken plugin is one line, and only when asked for."""
import json
import sys
import textwrap

import pytest
import torch

from fedlora.adapter import LoRALinear
from fedlora.errors import ConfigError
from fedlora.methods import base, create_method, get_method
from fedlora.simulator import Federation, run_rounds

FEDPROX = textwrap.dedent('''
    from fedlora.methods import FactorLoRA


    class FedProxLoRA(FactorLoRA):
        name = "fedprox-lora"

        def __init__(self, rank=8, lr=5e-4, optimizer="adamw", weight_decay=0.0, mu=0.01):
            super().__init__(rank, lr, optimizer, weight_decay)
            self.mu = float(mu)

        def begin_round(self, round_idx):
            self.anchor = {n: self.params[n].detach().clone() for n in self.a_names + self.b_names + self.heads}

        def local_step(self, objective, sample):
            def proximal(params, batch):
                prox = sum(((params[n] - a) ** 2).flatten(1).sum(1) for n, a in self.anchor.items())
                return objective(params, batch) + self.mu / 2 * prox
            self.train_step(proximal, sample, list(self.anchor))

        def upload(self, replica):
            return self.upload_params(replica, self.a_names + self.b_names + self.shared_head_names())


    class Shadow(FedProxLoRA):  # a plugin claiming a built-in's name
        name = "fedavg"
''')


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """``mylab_fedprox.py`` importable, and a fake installed distribution declaring entry points."""
    (tmp_path / "mylab_fedprox.py").write_text(FEDPROX)
    dist = tmp_path / "mylab_fedprox-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mylab-fedprox\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[fedlora.methods]\nfedprox-lora = mylab_fedprox:FedProxLoRA\n"
                                           "broken = mylab_missing:Nothing\nfedavg = mylab_fedprox:Shadow\n"
                                           "fedprox = mylab_fedprox:FedProxLoRA\n")  # class name: fedprox-lora
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.setattr(base, "_PLUGIN_ERRORS", {})
    monkeypatch.setattr(base, "_plugins_loaded", False)
    yield tmp_path
    sys.modules.pop("mylab_fedprox", None)


def _run(method, K=4, rounds=3):
    d, n = 6, 30
    g = torch.Generator().manual_seed(0)
    X, W = torch.randn(K, n, d, generator=g), torch.randn(K, d, d, generator=g)
    Y = X @ W
    fed = Federation(n_groups=1, n_clients=K, client_weights=[n] * K)
    torch.manual_seed(0)
    layer = LoRALinear(d, d, stack=fed.n_replicas, **method.adapter_kwargs())
    method.setup(layer, fed.replica_clients)
    run_rounds(method, fed, lambda p, b: ((layer.forward_with(p, b[0]) - b[1]) ** 2).mean((-2, -1)), lambda: (X, Y),
               rounds=rounds, local_steps=4)
    return {n: p.detach().clone() for n, p in layer.named_parameters()}


def test_fedprox_with_mu_0_is_fedavg_and_mu_pulls_clients_to_the_global_model(plugin_dir):
    cls = get_method("mylab_fedprox:FedProxLoRA")
    fedavg = _run(create_method("fedavg", rank=2, lr=0.05))
    prox0 = _run(cls(rank=2, lr=0.05, mu=0.0))
    for k in fedavg:
        assert torch.equal(fedavg[k], prox0[k]), k
    strong = _run(cls(rank=2, lr=0.05, mu=100.0), rounds=1)
    weak = _run(cls(rank=2, lr=0.05, mu=0.0), rounds=1)
    # B starts at 0: a strong pull to the round's starting model keeps the trained B small
    assert float(strong["lora_B"].norm()) < 0.2 * float(weak["lora_B"].norm())


def test_an_entry_point_plugin_is_a_method_by_name_and_cannot_replace_a_builtin(plugin_dir):
    assert "fedprox-lora" in base.available_methods()
    assert get_method("fedprox-lora").__module__ == "mylab_fedprox"
    assert get_method("fedavg").__module__ == "fedlora.methods.fedavg"
    with pytest.raises(ConfigError) as e:
        get_method("broken")
    msg = str(e.value)
    assert "method 'broken' is unavailable: its plugin 'mylab_missing:Nothing' failed to load" in msg
    assert "\n" not in msg


def test_an_entry_point_whose_name_is_not_its_classs_name_is_refused(plugin_dir, capsys):
    """``fedprox = mylab_fedprox:FedProxLoRA`` whose class says ``name = "fedprox-lora"``: a run asked for
    ``fedprox`` would record ``fedprox-lora`` (summary, config.json, compare), so the entry point is refused,
    in one line naming both names; the method stays available under the entry point that agrees."""
    from fedlora.cli import main

    assert "fedprox" not in base.available_methods() and "fedprox-lora" in base.available_methods()
    with pytest.raises(ConfigError) as e:
        get_method("fedprox")
    msg = str(e.value)
    assert ("method 'fedprox' is unavailable: its plugin 'mylab_fedprox:FedProxLoRA' failed to load: TypeError: "
            "the entry point is named 'fedprox' but mylab_fedprox:FedProxLoRA.name is 'fedprox-lora'") in msg, msg
    assert "\n" not in msg
    assert main(["run", "tiny-smoke", "--dry-run", "--set", "method.name=fedprox"]) == 2
    err = capsys.readouterr().err
    assert "the entry point is named 'fedprox'" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("name", ["fedprox-lora", "mylab_fedprox:FedProxLoRA"])
def test_fedlora_run_takes_a_method_of_your_own(plugin_dir, capsys, name):
    from fedlora.cli import main

    out = plugin_dir / "run"
    assert main(["run", "tiny-smoke", "--out", str(out), "--no-progress", "--set", f"method.name={name}",
                 "--set", "method.options={mu: 0.1}", "--set", "train.rounds=1"]) == 0, capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["method"] == "fedprox-lora"
    resolved = json.loads((out / "config.json").read_text())["resolved"]
    assert resolved["method_options"]["mu"] == 0.1


@pytest.mark.parametrize("name,msg", [("mylab_fedprox:Nope", "cannot import 'Nope' from 'mylab_fedprox'"),
                                      ("json:dumps", "dumps is not a Method subclass"),
                                      ("broken", "failed to load"), ("fedprox-lorra", "did you mean 'fedprox-lora'")])
def test_a_bad_method_name_is_one_line(plugin_dir, capsys, name, msg):
    from fedlora.cli import main

    assert main(["run", "tiny-smoke", "--dry-run", "--set", f"method.name={name}"]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1, err
