"""One run's driver (docs/design.md §9): the round loop over ``fedlora.server.Server.run_round``, the
evaluation schedule, the records (``rounds.jsonl``, ``run.json``, ``summary.json``, ``rounds.png``,
``adapters/``), checkpoints and resume, SIGINT/SIGTERM, the round lines and the progress bar.

The driver talks to its client executor only through ``fedlora.server.ClientExecutor`` (train,
deliver, evaluate with the downloads the server sends, records/restore); which executor it gets — the
slot executor of ``fedlora.llm.slots``, the heterogeneous one of ``fedlora.llm.hetero``, Flower's — is
the caller's choice (the command line). What is recorded about the run's content — the evaluation's
means, the global model's scores, the summary, the figure, the adapters — is the run's ``report``
(``Report`` for one base model; ``fedlora.llm.hetero.TasksReport`` for heterogeneous client models).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from fedlora.io import OutputDir, claim_output_dir, write_bytes_atomic, write_json_atomic
from fedlora.privacy.plan import BudgetExhausted
from fedlora.payload import Payload
from fedlora.server import ClientExecutor
from fedlora.signals import deferred_signals
from fedlora.state import record_nbytes

from .runfolder import GLOBAL_ADAPTER, MERGED_UPDATE, RUN_WRITES, config_digest, config_digests
from .slots import first_line

__all__ = ["Driver", "Report", "CHECKPOINTS", "abandon", "resume_point", "comparable", "config_differences"]

CHECKPOINTS = "checkpoints"  # output_dir/checkpoints/round_<r>/ (fedlora.checkpoint), the last two kept
#: a SecAgg+ simulation's nodes keep their clients' checkpoints under output_dir/checkpoints/nodes/ (a
#: deployment's keep none): ``fedlora.flower_client.node_checkpoints``
NODE_CHECKPOINTS = f"{CHECKPOINTS}/nodes"
#: a SecAgg+ run (privacy.secagg) whose nodes keep no checkpoint: why it cannot be resumed; what its adapters/ holds
SECAGG_NO_CHECKPOINT = ("this SecAgg+ run keeps no checkpoint and cannot be resumed: its clients' state never leaves "
                        "their nodes, which kept none (train.checkpoint_every 0, or a deployment)")
SECAGG_ADAPTERS = "global only (SecAgg+: each client's record stays on its node)"


class Driver:
    """The rounds of one built run (``fedlora.llm.runtime.FederatedRun`` or
    ``fedlora.llm.hetero.HeteroRun``: ``cfg``, ``method``, ``server``, ``K_train``, ``describe()``,
    ``report``, ``local`` — the executor in this process, which keeps the clients' records where the
    run's own adapters are saved from) over ``executor``. ``write``: the run folder ``output`` (claimed by
    the caller) is written; ``resume_from``: a verified checkpoint to continue from."""

    def __init__(self, run, executor: ClientExecutor, *, progress: bool = False, write: bool = True,
                 output: OutputDir | None = None, log: Callable[[str], None] | None = None,
                 resume_from=None) -> None:
        self.run_, self.executor = run, executor
        self.cfg, self.method, self.server, self.report = run.cfg, run.method, run.server, run.report
        self.progress, self.write, self.output, self.log = progress, write, output, log
        self._resume_from = resume_from
        self.history: list[dict[str, Any]] = []
        self._lines: list[str] = []  # rounds.jsonl as written
        self._done = 0  # the round records (round ≥ 1) in _lines: run.json's rounds_done
        #: wall seconds of the earlier parts of a resumed run (from the checkpoint; None: not recorded)
        self._wall_before: list[float | None] = []
        self._t0: float | None = None  # when this part's rounds started (time.perf_counter)
        self._stopped: dict[str, Any] | None = None  # why the rounds ended before train.rounds (privacy budget)

    @classmethod
    def of(cls, run, executor: ClientExecutor) -> "Driver":
        """The driver of a prepared run (``FederatedRun``, ``HeteroRun``) over ``executor``, with the run's progress,
        output folder, round log and checkpoint to continue from (``resume_from``)."""
        return cls(run, executor, progress=run.progress, write=run.write, output=run.output, log=run.log,
                   resume_from=run.resume_from)
        self._bar = None

    def run_round(self, rnd: int) -> dict[str, Any]:
        """Round ``rnd`` of the server's protocol (``fedlora.server.Server.run_round``) with the driver's
        executor; returns the round's record."""
        return self.server.run_round(self.executor, rnd)

    def evaluate(self, rnd: int) -> dict[str, Any]:
        """The evaluation after round ``rnd`` (−1: before training): every client scored by the executor
        (here, or on the clients' machines) on what the server sends it (``Server.evaluation_downloads``),
        then the report's means and the global model's scores (``Report.evaluation``)."""
        K = self.cfg.federation.clients
        downloads = self.server.evaluation_downloads(range(self.run_.K_train), self.executor)
        per_client = self.executor.evaluate(rnd, list(range(K)), downloads)
        return self.report.evaluation(rnd, per_client)

    # ------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """All rounds with evaluation; writes ``output_dir`` (see docs/reference/run-folder.md).
        ``run.json`` says whether the run is running, complete, interrupted or failed; a run that stops
        early (an error, SIGINT/SIGTERM) marks or removes it (``_abandon``)."""
        try:
            return self._run()
        except BaseException as e:
            if self.write:
                self._abandon(e)
            raise

    def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        out = Path(cfg.output_dir)
        if self._resume_from is not None:  # rounds.jsonl, the server, every client: as the checkpoint left them
            start, evals = self._restore(self._resume_from)
        else:
            start, self._lines = 0, []
            if self.write:
                write_json_atomic(out / "config.json", {"config": cfg.to_dict(), "resolved": self.run_.describe()})
                (out / "rounds.jsonl").write_text("")
            evals = [self.evaluate(-1)]
            self._append(out, {"round": 0, "eval": evals[0]})
        if self.write:
            self._write_status("running")
        bar = self._bar = _progress(cfg.train.rounds, self.progress, initial=start)  # a resumed run's bar: at start
        self._t0 = time.perf_counter()
        # SecAgg+ (fedlora.flower_secagg): the clients' records stay on their nodes — which keep their checkpoints
        # (when they can: keeps_checkpoints), and no final records
        private = self._records_on_nodes()
        checkpoints = not private or self.executor.keeps_checkpoints
        with deferred_signals(None if checkpoints else SECAGG_NO_CHECKPOINT) as pending:
            for rnd in range(start, cfg.train.rounds):
                try:
                    rec = self.run_round(rnd)  # after the last round: the final global state to every client (counted)
                except BudgetExhausted as e:  # privacy.max_epsilon: stop cleanly before the round, results kept
                    self._stopped = {"reason": "privacy budget", "why": str(e), "rounds_done": rnd}
                    if self.log is not None:
                        self.log(f"stopped: {e}")
                    if rnd > 0 and evals[-1].get("round") != rnd:  # the model the run ends with, scored
                        evals.append(self.evaluate(rnd - 1))
                    break
                last = rnd == cfg.train.rounds - 1
                if last or (rnd + 1) % cfg.eval.every == 0:
                    ev = self.evaluate(rnd)
                    rec["eval"] = ev
                    evals.append(ev)
                self.history.append(rec)
                self._append(out, rec)
                every = cfg.train.checkpoint_every
                if self.write and ((every and (rnd + 1) % every == 0) or (pending and not last and checkpoints)):
                    self.save_checkpoint(rnd + 1)
                bar.update(1)
                ev = rec.get("eval")
                if ev is not None and rec["train_loss"]:
                    bar.set_postfix(self.report.postfix(ev, rec))
                if self.log is not None:
                    self.log(self._round_line(rec, self._wall_total(self._wall_parts())))
                if pending and not last:  # SIGINT/SIGTERM during the round: it finished (and is checkpointed)
                    from fedlora.errors import Interrupted

                    raise Interrupted(pending[0])
        bar.close()
        local = self.run_.local
        if private:  # SecAgg+: adapters/ holds what the server has, the global adapter (Report.save_adapters)
            pass
        elif self.executor is not local:  # records kept elsewhere (Flower: on the clients' nodes): the adapters come from them
            local.restore(self.executor.records())
        parts = self._wall_parts()  # a resumed run: each part's rounds, the total in wall_s
        summary = self.report.summary(evals, self.history, self._wall_total(parts))
        summary["wall_s_parts"] = parts
        if self._stopped is not None:
            summary["stopped"] = self._stopped
        if private or _secagg(cfg):  # as Report.save_adapters, which writes the global adapter only
            summary["adapters"] = SECAGG_ADAPTERS
        if self.write:
            self.report.save_adapters(out / "adapters")
            write_json_atomic(out / "summary.json", summary, infinity=True)  # ε = ∞ when σ = 0, as in rounds.jsonl
            try:
                self.report.plot(self.history, evals, out / "rounds.png")
            except Exception as e:  # a figure must never lose a run's results
                summary["plot_error"] = str(e)
            self._write_status("complete", **({"stopped": self._stopped["reason"]} if self._stopped else {}))
        return summary

    # ------------------------------------------------------------------------------------------
    # checkpoints and resume (fedlora.checkpoint)
    def checkpoint_files(self) -> dict[str, bytes]:
        """Everything a resumed run needs that ``prepare`` does not rebuild: the server's
        ``state_dict`` (``server.safetensors``), every client's state record (``client_<k>.safetensors``),
        the method's runtime state and the torch RNG (``runtime.safetensors``) and the records so far
        (``rounds.jsonl``, exactly the lines written)."""
        from safetensors.torch import save

        from fedlora.state import record_to_bytes

        st = self.server.state_dict()
        files = {"server.safetensors": save({k: v.contiguous() for k, v in st["tensors"].items()},
                                            metadata={"server": json.dumps(st["meta"])})}
        if not self._records_on_nodes():  # (SecAgg+: each node has written its own, save_checkpoint)
            records = self.executor.records()  # (on Flower the records live on the clients' nodes: asked for)
            for k in range(self.run_.K_train):
                files[f"client_{k}.safetensors"] = record_to_bytes(records[k])
        runtime = {f"method:{n}": v.contiguous() for n, v in self.method.runtime_state().items()}
        runtime["rng:torch"] = torch.get_rng_state()
        files["runtime.safetensors"] = save(runtime)
        files["rounds.jsonl"] = "".join(line + "\n" for line in self._lines).encode()
        return files

    def _records_on_nodes(self) -> bool:
        """Whether the clients' records stay on their nodes (SecAgg+), each node checkpointing its own."""
        return bool(getattr(self.executor, "records_stay_on_clients", False))

    def save_checkpoint(self, rounds_done: int) -> Path:
        """``output_dir/checkpoints/round_<r>/`` (atomic, hashed, the last two kept). Under SecAgg+ every node
        first writes its client's record as its own checkpoint of the round (``SecAggExecutor.save_records``);
        the server's, written after, has none (``client_records: "nodes"`` in its meta)."""
        from fedlora.checkpoint import write_checkpoint

        meta = {"config_sha256": config_digest(comparable(self.cfg.to_dict())),
                "rounds": self.cfg.train.rounds, "method": self.method.name,
                # the rounds' wall time so far, per part (a resumed run adds one)
                "wall_s_parts": self._wall_parts()}
        if self._records_on_nodes():
            self.executor.save_records(rounds_done)
            meta["client_records"] = "nodes"
        return write_checkpoint(Path(self.cfg.output_dir) / CHECKPOINTS, rounds_done, self.checkpoint_files(),
                                meta=meta)

    def _restore(self, ckpt) -> tuple[int, list[dict[str, Any]]]:
        """Put the run in the state of ``ckpt`` (a verified ``fedlora.checkpoint.Checkpoint``): server,
        client records, method runtime state, torch RNG, the records (rounds.jsonl rewritten to the
        checkpoint's lines). Returns (the next round, the evaluations so far)."""
        from safetensors.torch import load

        from fedlora.state import record_from_bytes

        server = Payload.from_bytes(ckpt.files["server.safetensors"])
        self.server.load_state_dict({"tensors": dict(server.tensors), "meta": json.loads(server.meta["server"])})
        if ckpt.meta.get("client_records") == "nodes":  # SecAgg+: each node takes its record back from its own
            if not self._records_on_nodes():
                from fedlora.errors import ConfigError

                raise ConfigError(f"--resume: the clients' records of {str(ckpt.path)!r} are on their SecAgg+ nodes; "
                                  f"resume it on Flower with privacy.secagg.enabled")
            self.executor.load_records(ckpt.round)
        else:
            records = {k: record_from_bytes(ckpt.files[f"client_{k}.safetensors"]) for k in range(self.run_.K_train)}
            self.executor.restore(records)  # on Flower: every node takes its record back
        runtime = load(ckpt.files["runtime.safetensors"])
        self.method.load_runtime_state({n[len("method:"):]: v for n, v in runtime.items() if n.startswith("method:")})
        torch.set_rng_state(runtime["rng:torch"])
        self._lines = [ln for ln in ckpt.files["rounds.jsonl"].decode().splitlines() if ln]
        recs = [json.loads(ln) for ln in self._lines]
        self._done = sum(r.get("round", 0) >= 1 for r in recs)
        parts = ckpt.meta.get("wall_s_parts")  # a checkpoint of an older fedlora has none: that part is unknown
        self._wall_before = list(parts) if isinstance(parts, list) else [None]
        self.history = [r for r in recs if r.get("round", 0) >= 1]
        evals = [r["eval"] for r in recs if "eval" in r]
        if self.write:
            write_bytes_atomic(Path(self.cfg.output_dir) / "rounds.jsonl", ckpt.files["rounds.jsonl"])
        return self.server.round, evals

    def _write_status(self, status: str, done: int | None = None, **extra: Any) -> None:
        _write_status(Path(self.cfg.output_dir), self.cfg.train.rounds, status, done, **extra)

    def _abandon(self, e: BaseException) -> None:
        if self._bar is not None:
            self._bar.close()  # the progress bar's line ends before the command's last line
        abandon(e, self.cfg, self.output)

    def _append(self, out: Path, rec: Mapping[str, Any]) -> None:
        """One record to rounds.jsonl, then run.json (atomic) with ``rounds_done`` counting it: a reader —
        or a run killed with SIGKILL — finds run.json saying as many rounds as rounds.jsonl holds."""
        line = json.dumps(rec, allow_nan=True)
        self._lines.append(line)
        self._done += rec.get("round", 0) >= 1
        if self.write:
            with open(out / "rounds.jsonl", "a") as f:
                f.write(line + "\n")
            self._write_status("running", self._done)

    def _wall_parts(self) -> list[float | None]:
        """Wall seconds of the rounds, per part of the run: the parts before a resume (each up to the
        checkpoint the next part started from; None where an older checkpoint did not record it), then
        this part's so far — one part for a run that never stopped."""
        now = [] if self._t0 is None else [time.perf_counter() - self._t0]
        return [*self._wall_before, *now]

    @staticmethod
    def _wall_total(parts: Sequence[float | None]) -> float:
        return float(sum(p for p in parts if p is not None))

    def _round_line(self, rec: Mapping[str, Any], wall: float) -> str:
        """The line printed per round without a progress bar: mean training loss, the evaluation's
        figures where the round was evaluated (``_eval_text``), bytes up and down, failed clients, time."""
        losses = [v for v in rec["train_loss"].values() if math.isfinite(v)]
        parts = [f"training loss {np.mean(losses):.4f}" if losses else
                 "no client drawn (Poisson sampling under client-level DP)" if not rec["participants"] else
                 "no finite training loss"]
        if "privacy" in rec:
            parts.append(f"ε {rec['privacy']['epsilon']:.3g} (δ {rec['privacy']['delta']:.2g})")
        if "eval" in rec:
            parts.append(self.report.eval_text(rec["eval"]))
        parts.append(f"bytes up {sum(rec['bytes_up'].values()):,}, down {sum(rec['bytes_down'].values()):,}")
        failed = rec.get("failures") or {}
        if failed:
            which = ", ".join(f"{k} ({v['kind']})" for k, v in failed.items())
            parts.append(f"failed: client{'s' if len(failed) > 1 else ''} {which}")
        return f"round {rec['round']}/{self.cfg.train.rounds}: {', '.join(parts)} ({wall:.1f} s)"


class Report:
    """What is recorded about a run over one base model: the evaluation's clients' means (unweighted
    and test-size-weighted; clients without test rows left out) and the global model's scores where
    the method has one — the server side's own evaluation, by the run's ``local`` slot executor on the
    server's state —, the round line's and progress bar's figures, the summary, ``rounds.png`` and
    ``adapters/`` (``SlotExecutor.save_adapters``, what each client lacks of the final state applied)."""

    def __init__(self, run) -> None:
        self.run_ = run
        self.cfg, self.method, self.task, self.server = run.cfg, run.method, run.task, run.server

    def evaluation(self, rnd: int, per_client: Mapping[int, Any]) -> dict[str, Any]:
        from .metrics import aggregate_client_metrics

        K, m, run = self.cfg.federation.clients, self.method, self.run_
        out: dict[str, Any] = {"round": rnd + 1, "clients": {str(k): per_client[k] for k in range(K)}}
        sizes = [len(run.clients[k].test) for k in range(K)]
        out["test"] = aggregate_client_metrics([per_client[k]["test"] for k in range(K)], sizes)  # size 0: skipped
        if self.cfg.eval.global_model and m.has_global_model:
            out["global"] = run.local.evaluate_global(self.server.states[0])
        return out

    def eval_text(self, ev: Mapping[str, Any]) -> str:
        """An evaluation in a round's line: the clients' mean test main metric."""
        main = self.task.main_metric
        return f"test {main} {ev['test']['mean'][main]:.4f} (clients' mean)"

    def postfix(self, ev: Mapping[str, Any], rec: Mapping[str, Any]) -> dict[str, str]:
        """The progress bar's figures after an evaluated round: the clients' mean test main metric, the loss."""
        main = self.task.main_metric
        return {f"test_{main}": f"{ev['test']['mean'][main]:.3f}",
                "loss": f"{np.mean(list(rec['train_loss'].values())):.3f}"}

    def plot(self, history: list[dict[str, Any]], evals: list[dict[str, Any]], path: Path) -> None:
        """``rounds.png`` (``fedlora.llm.plots.plot_run``)."""
        from .plots import plot_run

        plot_run(history, evals, self.task.main_metric, path, method=self.method.name, task=self.run_.task_label,
                 clients=self.cfg.federation.clients)

    def summary(self, evals: list[dict[str, Any]], history: list[dict[str, Any]], wall: float) -> dict[str, Any]:
        main = self.task.main_metric
        first, last = evals[0], evals[-1]
        up = sum(sum(r["bytes_up"].values()) for r in history)
        down = sum(sum(r["bytes_down"].values()) for r in history)
        s = {"method": self.method.name, "task": self.run_.task_label, "task_kind": self.task.kind, "main_metric": main,
             "rounds": self.cfg.train.rounds, "clients": self.cfg.federation.clients,
             "round0_test": first["test"], "final_test": last["test"],
             "final_clients": last["clients"], "bytes_up_total": up, "bytes_down_total": down,
             "wall_s": wall, "record_bytes_per_client": record_nbytes(self.run_.store.get(0)),
             "n_clients_without_test": len(self.run_.clients_without_test),  # left out of every clients' mean
             "clients_without_test": list(self.run_.clients_without_test)}
        from .privacy import privacy_summary

        private = privacy_summary(getattr(self.run_, "privacy_plan", None), history)  # the plan, ε of the rounds run
        if private is not None:
            s["privacy"] = private
        if "global" in last:
            s["round0_global"], s["final_global"] = first.get("global"), last["global"]
        if self.task.not_computed:  # e.g. METEOR without WordNet: named, with the reason, never silently absent
            s["metrics_not_computed"] = self.task.not_computed
        # The round with the best clients' mean of the main metric — chosen ON THE TEST SPLIT, as
        # RoLoRA's tables report it: for comparison with papers only, never a model selection.
        best = max(evals[1:] or evals, key=lambda e: e["test"]["mean"].get(main, float("-inf")))
        s["best_round"] = {"round": best["round"], "test": best["test"], "selected_on": "test",
                           "note": "best clients' mean over the evaluated rounds, selected on the test split: "
                                   "for comparison with papers that report it, not a model selection"}
        if "global" in best:
            s["best_round"]["global"] = best["global"]
        return s

    def save_adapters(self, folder: Path) -> list[Path]:
        """Every client's final model (``SlotExecutor.client_adapter``: its record with what it lacks of the
        final state applied; Centralized's one model for each) as ``client_<k>.safetensors``, and FLoRA's
        merged update (``SlotExecutor.merged_update``) once as ``merged_update.safetensors``; each file's
        metadata names the method, the client, the number of clients and the SHA-256 of the run's config
        (``fedlora.llm.export.config_digest``), so export refuses files another run left in the folder. A SecAgg+
        run (``privacy.secagg``) writes only what its server holds: the global adapter, ``global.safetensors``
        (``SlotExecutor.global_adapter``: the server's state in a fresh replica, the model ``evaluate_global`` scores)."""
        from safetensors.torch import save

        local, cfg = self.run_.local, self.cfg
        meta = {"method": self.method.name, "clients": str(cfg.federation.clients),
                "config_sha256": config_digest(cfg.to_dict())}
        if _secagg(cfg):  # the server holds the global state only (SECAGG_ADAPTERS)
            path = folder / GLOBAL_ADAPTER
            adapter = local.global_adapter(self.server.states[0])
            write_bytes_atomic(path, save({n: v.contiguous() for n, v in adapter.items()},
                                          metadata={**meta, "client": "global"}))
            return [path]
        merged = local.merged_update()
        if merged is not None:
            tensors, form = merged
            write_bytes_atomic(folder / MERGED_UPDATE, save(tensors, metadata={
                **meta, "form": form, "merges": str(len(self.server.increments[0]))}))
            meta["merged_update"] = MERGED_UPDATE
        paths = []
        for k in range(cfg.federation.clients):
            owner = 0 if local.centralized else k
            adapter = local.client_adapter(k, self.server.download_for(owner, shared_base=True))
            path = folder / f"client_{k}.safetensors"
            write_bytes_atomic(path, save({n: v.contiguous() for n, v in adapter.items()},
                                          metadata={**meta, "client": str(k)}))
            paths.append(path)
        return paths


def comparable(config: Mapping[str, Any]) -> dict[str, Any]:
    """A run's config without ``output_dir`` (a run folder may move; the run stays the same)."""
    return {k: v for k, v in json.loads(json.dumps(config)).items() if k != "output_dir"}


def config_differences(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the fields where two configs (``RunConfig.to_dict()``) differ."""
    out = []
    for k in sorted(set(a) | set(b)):
        name = f"{prefix}{k}"
        va, vb = a.get(k), b.get(k)
        if isinstance(va, Mapping) and isinstance(vb, Mapping) and prefix.count(".") < 1:
            out += config_differences(va, vb, name + ".")
        elif va != vb:
            out.append(f"{name} ({json.dumps(va)} → {json.dumps(vb)})")
    return out


def _rounds_done(path: Path) -> int:
    """Rounds finished: the round records (round ≥ 1) in ``rounds.jsonl`` (line 0 is the evaluation before training)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    done = 0
    for line in lines:
        try:
            done += int(json.loads(line).get("round", 0) >= 1)
        except (ValueError, AttributeError):  # a line cut short by the interruption
            pass
    return done


def _add_note(e: BaseException, note: str) -> None:
    """``e.add_note(note)`` (Python ≥ 3.11 shows it under the traceback; the command line prints it)."""
    if hasattr(e, "add_note"):
        e.add_note(note)
    else:
        e.__notes__ = [*getattr(e, "__notes__", []), note]


def _progress(total: int, enabled: bool, initial: int = 0):
    """The rounds' progress bar (stderr); ``initial``: the rounds already done (a resumed run)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="rounds", unit="round", disable=not enabled)


def abandon(e: BaseException, cfg, output: OutputDir) -> None:
    """The run stopped early with ``e``. With a finished round in rounds.jsonl the folder stays,
    marked incomplete: run.json says ``interrupted`` (SIGINT/SIGTERM, ``signal``) or ``failed``
    (``error``) and how many rounds finished (no adapters or summary are written). With none,
    nothing of value was written: what the run wrote is removed, and the folder too if the run
    created it. Adds a note saying which to ``e`` (the command line prints it)."""
    out = Path(cfg.output_dir)
    try:
        done = _rounds_done(out / "rounds.jsonl")
        if done == 0:
            output.discard()
            note = f"{'removed' if not out.exists() else 'emptied'} {out} (no round had finished)"
        else:
            stopped = isinstance(e, KeyboardInterrupt)
            status = "interrupted" if stopped else "failed"
            _write_status(out, cfg.train.rounds, status,
                          **({"signal": getattr(e, "signal_name", "SIGINT")} if stopped
                             else {"error": first_line(e)}))
            note = f"{out} is incomplete: run.json says {status} after round {done} of {cfg.train.rounds}"
            from fedlora.checkpoint import list_checkpoints

            ckpts = list_checkpoints(out / CHECKPOINTS)
            if ckpts:
                note += f"; `fedlora run --resume {out}` continues from its checkpoint ({ckpts[0].name})"
            elif _secagg(cfg):
                note += f"; {SECAGG_NO_CHECKPOINT}"
    except Exception as err:  # never hide why the run stopped
        note = f"could not mark {out} incomplete: {first_line(err)}"
    _add_note(e, note)


def _secagg(cfg) -> bool:
    """Whether the run's config switches SecAgg+ on (``privacy.secagg.enabled``)."""
    privacy = getattr(cfg, "privacy", None)
    return bool(getattr(getattr(privacy, "secagg", None), "enabled", False))


def _write_status(out: Path, rounds: int, status: str, done: int | None = None, **extra: Any) -> None:
    """``run.json`` (atomic): ``status`` — running, complete, interrupted or failed — the rounds
    planned and the rounds finished (``done``, else counted in rounds.jsonl), and what stopped it
    (``signal`` or ``error``)."""
    done = _rounds_done(out / "rounds.jsonl") if done is None else done
    write_json_atomic(out / "run.json", {"status": status, "rounds": rounds, "rounds_done": done, **extra})


def resume_point(run_dir, config=None, overrides: Sequence[str] = ()):
    """What continues the interrupted run in ``run_dir`` (``fedlora run --resume RUN_DIR``): its config
    (``output_dir`` the folder), its newest intact checkpoint and the runtime it ran on (config.json's
    ``resolved.runtime``). ``config`` / ``overrides``: optional, and must then equal the run's own config
    (every field but ``output_dir``): a one-line ``ConfigError`` names the fields that differ. Also
    refused in one line: a folder that is not a run, a complete run, a run without an intact checkpoint."""
    from fedlora.checkpoint import list_checkpoints, load_checkpoint
    from fedlora.errors import ConfigError

    from .config import RunConfig, apply_overrides, load_config, saved_config_today
    from .runfolder import read_run_config, read_status

    folder = Path(run_dir)
    info = read_run_config(folder, "--resume")  # the one reader of run folders (docs/design.md §9)
    saved = info["config"]
    if read_status(folder) == "complete":
        raise ConfigError(f"--resume: the run in {str(folder)!r} is complete (run.json); nothing to resume")
    if ((saved.get("privacy") or {}).get("secagg") or {}).get("enabled") and not list_checkpoints(folder / CHECKPOINTS):
        raise ConfigError(f"--resume: the run in {str(folder)!r} ran with SecAgg+ (privacy.secagg.enabled): "
                          f"{SECAGG_NO_CHECKPOINT}; start it again")
    if config is None:
        given = RunConfig.from_dict(apply_overrides(saved, overrides))
    elif isinstance(config, RunConfig):
        given = config
    else:
        given = load_config(config, overrides)
    try:  # a field added since the run was written reads as its default, which the run ran with
        today = saved_config_today(saved)
    except ConfigError as e:
        raise ConfigError(f"--resume: the config in {str(folder / 'config.json')!r} no longer builds ({e}); "
                          f"start the run again") from None
    diff = config_differences(comparable(today), comparable(given.to_dict()))
    if diff:
        raise ConfigError(f"--resume: the config differs from the run's in {', '.join(diff[:8])}"
                          f"{' …' if len(diff) > 8 else ''}; a resumed run continues the same run — start a "
                          f"new one (another --out) to change them")
    ckpt = load_checkpoint(folder / CHECKPOINTS)
    if ckpt.meta.get("config_sha256") not in config_digests(saved, without_output_dir=True):
        raise ConfigError(f"--resume: the checkpoint {str(ckpt.path)!r} belongs to another config than "
                          f"{str(folder / 'config.json')!r}")
    cfg = RunConfig.from_dict({**given.to_dict(), "output_dir": str(folder)})
    return cfg, ckpt, info["resolved"].get("runtime", "embedded")


def claim_run_folder(run) -> None:
    """Claim ``run``'s output folder (``cfg.output_dir``) once, before any work — unless it writes nothing or its
    caller claimed one already (``run.output``, the command line): a folder that is not empty is refused unless
    ``run.overwrite`` (``fedlora.io.claim_output_dir``). For the one-base run and the heterogeneous one alike."""
    if run.write and run.output is None:
        run.output = claim_output_dir(run.cfg.output_dir, "output_dir", writes=RUN_WRITES,
                                      overwrite=run.overwrite, overwrite_flag="overwrite=True")


def run_to_end(run, executor: ClientExecutor | None = None) -> dict[str, Any]:
    """``run.run()`` of a built run (``FederatedRun``, ``HeteroRun``): its folder claimed before any work, its
    parts prepared (a failure there marks or removes the folder: ``abandon``), then all rounds with evaluation by
    its driver over ``executor`` — the caller's choice (the command line: Flower's) — or the run's own."""
    claim_run_folder(run)
    try:
        if not run.prepared:
            run.prepare()
    except BaseException as e:
        if run.write:
            abandon(e, run.cfg, run.output)
        raise
    if executor is not None:
        run.driver.executor = executor
    return run.driver.run()
