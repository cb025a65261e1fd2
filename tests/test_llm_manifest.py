"""A run folder is enough to write the paper's table (issue "Second outside review" §3): config.json
records the code and library versions, the git commit, the command line, the data files' hashes, the
method's resolved options and step sizes, and every client's rows (for ``by_key`` which key went where)."""
import hashlib
import json
import sys

import numpy as np
import pytest

from fedlora.llm.runtime import FederatedRun
from test_llm_runtime import tiny_config

pytest.importorskip("transformers")


def _keyed_csv(tmp_path):
    f = tmp_path / "topics.csv"
    rows = ["text,label,user"] + [f"message {i} about {'cats' if i % 2 else 'dogs'},{'pet' if i % 3 else 'other'},"
                                  f"user{i % 5}" for i in range(60)]
    f.write_text("\n".join(rows) + "\n")
    return f


def test_config_json_records_versions_commit_command_data_hashes_and_split_indices(tmp_path, monkeypatch):
    import torch
    import transformers

    f = _keyed_csv(tmp_path)
    monkeypatch.setattr(sys, "argv", ["fedlora", "run", "my.yaml", "--set", "seed=0"])
    cfg = tiny_config(tmp_path, "pf2lora", data={"path": str(f), "test_fraction": 0.25},
                      federation={"clients": 5, "partition": "by_key(user)", "sample_fraction": 1.0,
                                  "val_fraction": 0.2},
                      train={"rounds": 1, "local_steps": 1, "batch_size": 4})
    run = FederatedRun(cfg).prepare()
    validated = []  # the row sets every evaluation validates on, client by client (clients 0..K-1, in passes)
    predict = run.slots._predict

    def spy(enc, row_sets, params):
        if enc is run.enc_train:
            validated.extend(np.asarray(r).tolist() for r in row_sets)
        return predict(enc, row_sets, params)

    run.slots._predict = spy
    run.run()
    r = json.loads((tmp_path / "run" / "config.json").read_text())["resolved"]
    m = r["manifest"]
    from importlib.metadata import version

    assert m["versions"]["torch"] == version("torch") and torch.__version__.startswith(version("torch").split("+")[0])
    assert m["versions"]["transformers"] == transformers.__version__ and m["versions"]["fedlora"] == version("fedlora")
    assert m["command"] == ["fedlora", "run", "my.yaml", "--set", "seed=0"]
    assert m["data_files"] == {str(f): hashlib.sha256(f.read_bytes()).hexdigest()}
    git = m["git"]
    assert git is None or (len(git["commit"]) == 40 and isinstance(git["dirty"], bool))
    # PF2LoRA's effective options, including those the config did not give
    o = r["method_options"]
    assert (o["lower_lr"], o["upper_optimizer"], o["hypergradient"], o["batches"]) == (0.01, "adamw", "exact", 2)
    assert r["step_sizes"]["lower_lr"] == {"optimizer": "sgd", "lr": 0.01}
    # every client's rows, and for by_key which user went to which client — the split the run trained on
    split = r["split_indices"]
    assert len(split["clients"]) == 5
    for k, c in enumerate(split["clients"]):
        assert c["train"] == run.clients[k].train.tolist() and c["test"] == run.clients[k].test.tolist()
    keys = run.train_data.keys
    for k, c in enumerate(split["clients"]):  # every row a client trained or validated on is of a key mapped to it
        assert c["train"] and all(split["key_to_client"][keys[i]] == k for i in c["train"] + c["val"])
    assert sorted(split["key_to_client"]) == [f"user{i}" for i in range(5)]
    assert sorted(split["key_to_client"].values()) == list(range(5))
    # the recorded validation rows are those each client was validated on (before training and after round 1) ...
    assert len(validated) == 2 * 5 and validated[:5] == validated[5:]
    assert [c["val"] for c in split["clients"]] == validated[:5]
    # ... and the split computed here: client k holds every training row of its user, of which
    # max(1, round(0.2 n_k)) (federation.val_fraction 0.2) are held out for validation, disjoint from its train rows
    shares = []
    for k, c in enumerate(split["clients"]):
        mine = [i for i, key in enumerate(keys) if split["key_to_client"][key] == k]
        assert sorted(c["train"] + c["val"]) == mine and not set(c["train"]) & set(c["val"])
        assert len(c["val"]) == max(1, round(0.2 * len(mine))), (k, len(mine))
        shares.append(len(mine))
    assert any(round(0.2 * n) != int(0.2 * n) for n in shares), shares  # rounding, not truncation, is checked


def test_by_key_takes_its_column_from_the_spec_and_refuses_two_different_ones(tmp_path):
    f = _keyed_csv(tmp_path)
    cfg = tiny_config(tmp_path, "fedavg", data={"path": str(f), "test_fraction": 0.25},
                      federation={"clients": 5, "partition": "by_key(user)"})
    run = FederatedRun(cfg, write=False)
    run._load_data()
    assert len(run.clients) == 5
    for c in run.clients:  # one user per client
        assert len({run.train_data.keys[i] for i in np.concatenate([c.train, c.val])}) == 1
    from fedlora.errors import ConfigError

    cfg = tiny_config(tmp_path, "fedavg", data={"path": str(f), "client_column": "text"},
                      federation={"clients": 5, "partition": "by_key(user)"})
    with pytest.raises(ConfigError, match="names the key column 'user' but data.client_column is 'text'"):
        FederatedRun(cfg, write=False)._load_data()
