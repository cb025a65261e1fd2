"""Heterogeneous client models: clients that fine-tune different base models on different tasks,
federated by H²Tune ([H²Tune] §3–4; docs/design.md §4.10).

``federation.client_models`` splits the clients into groups, each with its own base model (family,
depth, width) and data (task): e.g. two clients classifying with a LLaMA-type model and one generating
text with a Gemma-type model, as H²Tune's Table 3 mixes LLaMA-3B, Gemma-2B and SmolLM-1.7B on GLUE
and MATHInstruct. The runtime keeps ONE frozen base per group (not one per client): each group's parts
are built as a homogeneous run's (``fedlora.llm.runtime.FederatedRun``: its model, data, slots and
client state records), and ``HeteroExecutor`` — one ``fedlora.llm.slots.SlotExecutor`` per group, the
run's client ids mapped to each group's own — is the client executor of ONE ``fedlora.server.Server``
over all clients: the server draws the round's participants among every client and sends each its
download (training and evaluation alike), each group trains and scores its own clients in its passes,
and the server aggregates every accepted upload. The run's driver (``fedlora.llm.driver.Driver``) is a
homogeneous run's; what is recorded per task is ``TasksReport``.

What makes this possible is H²Tune's upload: per shared module type one aligned (L_g, r_g, r_g) matrix
R_{k→g} = R_k ×_layer Ω_k (eq. 4), whatever the client's width d and depth L_k; A_k, B_k never leave
the client. So:

* the module types (a target's name with its layer index replaced by ``*``, e.g.
  ``model.layers.*.self_attn.q_proj``) must be the same in every group — LLaMA-type families (LLaMA,
  Gemma, SmolLM, Qwen2) name them alike, classifier or causal LM; a group that adapts other module
  types is refused in one line naming both sets;
* L_g (``method.options.global_layers``) defaults to the deepest group's L (docs/design.md §4.10), and
  each client's Ω_k ∈ R^{L_k×L_g} maps its own L_k = its model's adapted layers onto it;
* the first KL target (eq. 6) is the server mean of every client's initial upload, as in a homogeneous
  run (what round −1 would send), delivered to every client before round 1 (not counted: part of the
  set-up, like the seeded R);
* client-level DP (``privacy.level: client``) is a homogeneous run's: ONE plan over all K clients
  (``fedlora.llm.privacy.privacy_plan``), the one server clipping each R_{k→g} − R_g over all module types
  and noising the aligned (L_g, r_g, r_g) mean, the first round's updates taken from R_g⁰ (above); sample-level
  DP too: each group's slot executor runs H²Tune's private steps with the run's one plan (σ, each client's rate
  b/n_k, its ε in the round records), each client's batch and noise streams keyed by its run-wide id;
* evaluation scores each client on its own task; means are per task (``eval["tasks"]``), never across
  tasks whose metrics differ (accuracy beside BLEU).

Per-client method options (``densities`` β_k, ``client_layers`` L_k) are lists over all clients; each
group takes its clients' entries. Client ids are global (0..K−1); inside a group its clients are
0..K_g−1 in the order of their global ids (their seeds — data sampler, dropout, adapter init — are the
group's local ids with the run's seed).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from fedlora.errors import ConfigError
from fedlora.io import OutputDir, write_bytes_atomic
from fedlora.payload import Payload
from fedlora.server import ClientExecutor, ClientFailure, ClientUpdate, Download, Federation, Server, UploadSpec
from fedlora.state import record_nbytes

from .config import RunConfig, group_configs
from .driver import Driver, claim_run_folder, run_to_end
from .privacy import describe_plan, dry_run_plan, privacy_plan, privacy_summary, sample_dp_of
from .runtime import RUNTIMES, FederatedRun, dry_run_sizes_and_steps
from .slots import SlotExecutor

__all__ = ["HeteroRun", "HeteroExecutor", "TasksReport", "module_types"]


def module_types(targets: Sequence[str]) -> dict[str, int]:
    """Module type → number of layers: each adapted module's name with every all-digit component
    replaced by ``*`` (``model.layers.3.self_attn.q_proj`` → ``model.layers.*.self_attn.q_proj``), as
    H²Tune groups its layers (``fedlora.methods.h2tune``)."""
    out: dict[str, int] = {}
    for t in targets:
        key = ".".join("*" if part.isdigit() else part for part in t.split("."))
        out[key] = out.get(key, 0) + 1
    return out


class HeteroExecutor:
    """A ``fedlora.server.ClientExecutor`` composed of one slot executor per model group: ``groups`` are
    (the group's run-wide client ids, its ``SlotExecutor``); every call is split by group, each group's
    clients renamed to its local ids and the results named back by run-wide id. ``client_hook(client,
    rnd)``, when set, is called with run-wide ids (fault injection)."""

    live = False        # as each group's slot executor
    shared_base = True

    def __init__(self, groups: Sequence[tuple[Sequence[int], SlotExecutor]]) -> None:
        self.groups = [(list(ids), ex) for ids, ex in groups]
        self.where = {k: (g, i) for g, (ids, _) in enumerate(self.groups) for i, k in enumerate(ids)}
        self.client_hook: Callable[[int, int], None] | None = None

    def _by_group(self, clients: Sequence[int], call) -> dict[int, Any]:
        """``call(executor, local, ids)`` for each group with clients among ``clients`` — ``local``: their
        run-wide id → local id, ``ids``: the group's run-wide ids — its result ({local id: value}) keyed
        back by run-wide id."""
        by_group: list[list[int]] = [[] for _ in self.groups]
        for k in clients:
            by_group[self.where[k][0]].append(k)
        out: dict[int, Any] = {}
        for (ids, ex), ks in zip(self.groups, by_group):
            if ks:
                local = {k: self.where[k][1] for k in ks}
                res = call(ex, local, ids)
                out.update({k: res[i] for k, i in local.items()})
        return out

    def train(self, rnd: int, clients: Sequence[int], downloads: Mapping[int, Download]
              ) -> dict[int, ClientUpdate | ClientFailure]:
        hook = self.client_hook  # fault injection names the run's (global) client ids

        def call(ex, local, ids):
            ex.client_hook = None if hook is None else (lambda i, r: hook(ids[i], r))
            return ex.train(rnd, list(local.values()), {i: downloads[k] for k, i in local.items()})

        return self._by_group(clients, call)

    def deliver(self, rnd: int, downloads: Mapping[int, Download]) -> dict[int, int]:
        return self._by_group(list(downloads), lambda ex, local, ids: ex.deliver(
            rnd, {i: downloads[k] for k, i in local.items()}))

    def merge_into_base(self, state: Mapping[str, torch.Tensor]) -> None:
        raise ConfigError("heterogeneous client models: no method that merges into a shared base runs here")

    def evaluate(self, rnd: int, clients: Sequence[int], downloads: Mapping[int, Download]
                 ) -> dict[int, dict[str, dict[str, float]]]:
        """Each client scored by its group on its own task, with what the server sent it."""
        return self._by_group(clients, lambda ex, local, ids: ex.evaluate(
            rnd, list(local.values()), {i: downloads[k] for k, i in local.items() if k in downloads}))

    def records(self) -> dict[int, dict[str, torch.Tensor]]:
        return {k: self.groups[g][1].store.get(i) for k, (g, i) in sorted(self.where.items())}

    def restore(self, records: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        for k, rec in records.items():
            g, i = self.where[k]
            self.groups[g][1].store.put(i, rec, copy=True)

    def client_adapter(self, client: int, download: Download) -> dict[str, torch.Tensor]:
        g, local = self.where[client]
        return self.groups[g][1].client_adapter(local, download)


class HeteroRun:
    """A run whose clients hold different base models (``federation.client_models``): each group's parts
    built as a homogeneous run's, one ``HeteroExecutor`` over them and one ``Server``; the round loop,
    records, checkpoints and resume are the driver's (``run``). See the module docstring."""

    groups_of_models = True

    def __init__(self, cfg: RunConfig, *, progress: bool = False, write: bool = True, overwrite: bool = False,
                 output: OutputDir | None = None, runtime: str = "embedded",
                 log: Callable[[str], None] | None = None, resume_from=None) -> None:
        if runtime not in RUNTIMES:
            raise ConfigError(f"--runtime: one of {', '.join(RUNTIMES)}, got {runtime!r}")
        if runtime != "embedded":
            from .runtime import HETERO_EMBEDDED_ONLY

            raise ConfigError(f"--runtime {runtime}: {HETERO_EMBEDDED_ONLY}")
        self.cfg, self.runtime = cfg, runtime
        self.progress, self.write, self.log, self.overwrite, self.output = progress, write, log, overwrite, output
        self.prepared = False
        self.privacy_plan = None  # fedlora.privacy.plan.PrivacyPlan once prepared, when privacy is on
        #: a verified checkpoint to continue from (``fedlora.llm.runs.resume``), or None
        self.resume_from = resume_from
        self.specs = group_configs(cfg)  # [(global ids, the group's RunConfig)]
        self.where = {k: (g, i) for g, (ids, _) in enumerate(self.specs) for i, k in enumerate(ids)}

    def check(self) -> dict[str, Any]:
        """A dry run's checks (``FederatedRun.check``), per group, then across groups as ``prepare`` does (the
        module types every group adapts, ``_align_layers``) where every group's model was checked:
        ``{"data": {"groups": [{clients, …}, …]}, "model": {"groups": [{clients, head, …}, …]}}``."""
        runs = [FederatedRun(c, write=False) for _, c in self.specs]
        checks = [(ids, run.check()) for (ids, _), run in zip(self.specs, runs)]
        if all(c["model"]["checked"] for _, c in checks):
            self.groups = runs
            self._align_layers()
        plan = dry_run_plan(self.cfg)  # the run's, over all clients (the groups' configs carry none)
        if self.cfg.privacy.level == "sample":  # every group's sizes and steps, in the run's client order
            got = [dry_run_sizes_and_steps(run, c["data"]) for run, (_, c) in zip(runs, checks)]
            plan = next((g for g in got if isinstance(g, dict)), None)
            if plan is None:
                sizes, steps = [0] * self.cfg.federation.clients, [0] * self.cfg.federation.clients
                for (ids, _), (n, t) in zip(self.specs, got):
                    for i, k in enumerate(ids):
                        sizes[k], steps[k] = n[i], t[i]
                plan = describe_plan(privacy_plan(self.cfg, len(sizes), sizes, steps))
        return {"data": {"groups": [{"clients": ids, **c["data"]} for ids, c in checks]},
                "model": {"groups": [{"clients": ids, "head": c["head"], **c["model"]} for ids, c in checks]},
                **({"privacy": plan} if plan is not None else {})}

    def prepare(self) -> "HeteroRun":
        cfg, fc = self.cfg, self.cfg.federation
        claim_run_folder(self)
        if cfg.train.threads is not None:
            torch.set_num_threads(cfg.train.threads)
        self.groups = [FederatedRun(c, write=False).prepare_model() for _, c in self.specs]
        self._align_layers()
        for run in self.groups:
            run.prepare_clients()
        self.method = self.groups[0].method  # the server's: H²Tune's aggregate and server_update are pure
        self.method_options = self.groups[0].method_options
        specs = [UploadSpec.of(run.method).tensors for run in self.groups]
        for g, s in enumerate(specs[1:], 1):
            if dict(s) != dict(specs[0]):
                raise ConfigError(f"federation.client_models: group {g}'s upload {_spec_text(s)} differs from "
                                  f"group 0's {_spec_text(specs[0])} (model.dtype must be the same in every group)")
        K = fc.clients
        self.K_train = K
        self.sizes = [self.groups[g].sizes[i] for g, i in (self.where[k] for k in range(K))]
        steps = [self.groups[g].steps[i] for g, i in (self.where[k] for k in range(K))]
        # one plan over all K clients, as a homogeneous run's (the groups' configs carry none: group_configs)
        self.privacy_plan = privacy_plan(cfg, K, self.sizes, steps)  # None: privacy off
        if self.privacy_plan is not None and self.privacy_plan.level == "sample":
            for (ids, _), run in zip(self.specs, self.groups):  # DP-SGD in each group's passes, the run's one plan
                run.slots.set_sample_dp(sample_dp_of(cfg, self.privacy_plan, ids))
        self.federation = Federation(n_groups=1, n_clients=K, client_weights=self.sizes,
                                     sample_fraction=fc.sample_fraction, sample_seed=cfg.seed)
        #: the executor in this process: one slot executor per group
        self.local = HeteroExecutor([(ids, run.slots) for (ids, _), run in zip(self.specs, self.groups)])
        first = self._first_target()
        # client-level DP: the first round's updates R_{k→g} − R_g⁰ are taken from the KL target every client holds
        private = self.privacy_plan is not None and self.privacy_plan.client is not None
        self.server = Server(self.method, self.federation, [self.method.initial_server_state(0)], cfg.train.rounds,
                             min_clients=fc.min_clients, spec=UploadSpec(specs[0]), privacy=self.privacy_plan,
                             dp_references=[first] if private else None)
        self.clients_without_test = sorted(self.specs[g][0][i] for g, run in enumerate(self.groups)
                                           for i in run.clients_without_test)
        self.tasks: dict[str, list[int]] = {}  # task name → its clients (global ids)
        for (ids, _), run in zip(self.specs, self.groups):
            self.tasks.setdefault(run.task.name, []).extend(ids)
        self.report = TasksReport(self)
        self.prepared = True
        self.driver = Driver.of(self, self.local)
        return self

    def run(self, executor: ClientExecutor | None = None) -> dict[str, Any]:
        """All rounds (``fedlora.llm.driver.Driver``) over ``executor`` or this run's ``HeteroExecutor``."""
        return run_to_end(self, executor)

    def _align_layers(self) -> None:
        """The module types every group adapts must agree (H²Tune shares R per type); L_g = the
        run's ``global_layers`` or the deepest group's layers per type, set on every group's method."""
        types = [module_types(run.targets) for run in self.groups]
        for g, t in enumerate(types[1:], 1):
            if set(t) != set(types[0]):
                raise ConfigError(f"federation.client_models: H²Tune shares R per module type, but group 0 adapts "
                                  f"{sorted(types[0])} and group {g} adapts {sorted(t)}; give model.target_modules "
                                  f"that every model has under the same name (LLaMA-type families: q_proj, v_proj)")
        depth = [max(t.values()) for t in types]
        given = self.groups[0].method.global_layers
        L_g = given if given is not None else max(depth)
        if L_g < max(depth):
            raise ConfigError(f"method.options.global_layers: must be ≥ the deepest group's {max(depth)} adapted "
                              f"layers per module type, got {L_g}")
        for run in self.groups:  # told to each group's method with its other runtime facts (prepare_clients)
            run.global_layers = L_g
        self.global_layers, self.depths = L_g, depth

    @torch.no_grad()
    def _first_target(self) -> dict[str, torch.Tensor]:
        """Every client's first KL target R_g⁰: the unweighted server mean (App. A) of ALL K clients' initial
        uploads R_init[:L_k] ×_layer Ω_k⁰ (eq. 4, what round −1 would send), each computed by its group's method
        from the seeds and options alone (``H2Tune.initial_uploads``: public, so client-level DP may take the
        first round's updates from it), delivered to each client's record (uncounted: set-up). Returns R_g⁰."""
        uploads: dict[int, Payload] = {}
        for (ids, _), run in zip(self.specs, self.groups):
            for local, up in enumerate(run.method.initial_uploads(0)):
                uploads[ids[local]] = Payload(up)
        K = self.K_train
        state = self.method.aggregate([uploads[k] for k in range(K)], torch.ones(K, dtype=torch.float64))
        self.local.deliver(-1, {k: Download(dict(state), counted=False) for k in range(K)})
        return state

    def describe(self) -> dict[str, Any]:
        """config.json's ``resolved``: the run-wide H²Tune set-up and every group's own (``FederatedRun.describe``)."""
        private = {"privacy": describe_plan(self.privacy_plan)} if self.privacy_plan is not None else {}
        return {"heterogeneous": True, "runtime": self.runtime, "method_options": self.method_options, **private,
                "step_sizes": self.method.step_sizes(), "global_layers": self.global_layers,
                "upload": {n: list(s) for n, (s, _) in self.server.spec.tensors.items()},
                "groups": [{"clients": ids, "client_layers": run.method.client_layers or [d] * len(ids),
                            **run.describe()}
                           for (ids, _), run, d in zip(self.specs, self.groups, self.depths)]}


class TasksReport:
    """What is recorded about a run of heterogeneous client models: per task the clients' means
    (``eval["tasks"]``: main metric, clients, test and validation summaries; H²Tune has no global model),
    the round line's and progress bar's figures per task, the summary, ``rounds.png`` and ``adapters/``."""

    def __init__(self, run: HeteroRun) -> None:
        self.run_ = run

    def evaluation(self, rnd: int, per_client: Mapping[int, Any]) -> dict[str, Any]:
        from .metrics import aggregate_client_metrics

        run = self.run_
        K = run.K_train
        out: dict[str, Any] = {"round": rnd + 1, "clients": {str(k): per_client[k] for k in range(K)}, "tasks": {}}
        for name, ks in run.tasks.items():
            runs = [run.groups[run.where[k][0]] for k in ks]
            local = [run.where[k][1] for k in ks]
            out["tasks"][name] = {
                "main_metric": runs[0].task.main_metric, "clients": list(ks),
                "test": aggregate_client_metrics([per_client[k]["test"] for k in ks],
                                                 [len(r.clients[i].test) for r, i in zip(runs, local)]),
                "val": aggregate_client_metrics([per_client[k]["val"] for k in ks],
                                                [len(r.clients[i].val) for r, i in zip(runs, local)])}
        return out

    def postfix(self, ev: Mapping[str, Any], rec: Mapping[str, Any]) -> dict[str, str]:
        post = {f"{name}:{t['main_metric']}": f"{t['test']['mean'][t['main_metric']]:.3f}"
                for name, t in ev["tasks"].items()}
        return {**post, "loss": f"{np.mean(list(rec['train_loss'].values())):.3f}"}

    def eval_text(self, ev: Mapping[str, Any]) -> str:
        """An evaluation in a round's line: each task's clients' mean test main metric."""
        return ", ".join(f"{name} test {t['main_metric']} {t['test']['mean'][t['main_metric']]:.4f}"
                         for name, t in ev["tasks"].items())

    def plot(self, history: list[dict[str, Any]], evals: list[dict[str, Any]], path: Path) -> None:
        from .plots import plot_tasks_run

        plot_tasks_run(history, evals, path, method=self.run_.method.name, clients=self.run_.K_train)

    def summary(self, evals: list[dict[str, Any]], history: list[dict[str, Any]], wall: float) -> dict[str, Any]:
        run = self.run_
        first, last = evals[0], evals[-1]
        tasks = {}
        for name, t in last["tasks"].items():
            main = t["main_metric"]
            best = max(evals[1:] or evals, key=lambda e: e["tasks"][name]["test"]["mean"].get(main, float("-inf")))
            tasks[name] = {"main_metric": main, "clients": t["clients"], "round0_test": first["tasks"][name]["test"],
                           "final_test": t["test"],
                           "best_round": {"round": best["round"], "test": best["tasks"][name]["test"],
                                          "selected_on": "test"}}
        records = run.local.records()
        s = {"method": run.method.name, "task": " + ".join(run.tasks), "tasks": tasks,
             "rounds": run.cfg.train.rounds, "clients": run.K_train,
             "groups": [{"clients": ids, "model": c.model.name, "task": g.task.name}
                        for (ids, c), g in zip(run.specs, run.groups)],
             "final_clients": last["clients"],
             "bytes_up_total": sum(sum(r["bytes_up"].values()) for r in history),
             "bytes_down_total": sum(sum(r["bytes_down"].values()) for r in history),
             "wall_s": wall, "record_bytes_per_client": {str(k): record_nbytes(records[k])
                                                         for k in range(run.K_train)},
             "n_clients_without_test": len(run.clients_without_test),
             "clients_without_test": list(run.clients_without_test)}
        private = privacy_summary(run.privacy_plan, history)
        if private is not None:
            s["privacy"] = private
        not_computed = {g.task.name: g.task.not_computed for g in run.groups if g.task.not_computed}
        if not_computed:
            s["metrics_not_computed"] = not_computed
        return s

    def save_adapters(self, folder: Path) -> list[Path]:
        """``client_<k>.safetensors`` per client (global id k), its group's model in the metadata (the
        tensors are that model's parameter names); each with what it lacks of the final state applied."""
        from safetensors.torch import save

        from .runfolder import config_digest

        run, paths = self.run_, []
        for k in range(run.K_train):
            g, _ = run.where[k]
            meta = {"method": run.method.name, "clients": str(run.K_train), "client": str(k), "group": str(g),
                    "model": run.specs[g][1].model.name, "config_sha256": config_digest(run.cfg.to_dict())}
            path = folder / f"client_{k}.safetensors"
            adapter = run.local.client_adapter(k, run.server.download_for(k, shared_base=True))
            write_bytes_atomic(path, save({n: v.contiguous() for n, v in adapter.items()}, metadata=meta))
            paths.append(path)
        return paths


def _spec_text(spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> str:
    return "{" + ", ".join(f"{n}: {tuple(s)} {str(d).replace('torch.', '')}" for n, (s, d) in spec.items()) + "}"
