"""A ``fedlora run`` folder: the names of its files, the digest that ties them to the run, and the one reader
of what a run wrote (docs/design.md §9, "a run folder").

``MERGED_UPDATE`` names FLoRA's merged update in ``adapters/``; ``config_digest`` is the SHA-256 of a run's config
that every adapter file and checkpoint carries, so that export and resume refuse files another run left behind.

``read_run_config`` reads ``config.json`` (the config as given and as resolved); ``read_run`` reads the
whole record — config.json, ``rounds.jsonl`` (line 0 the evaluation before training, then one record
per round), ``run.json`` (complete, running, interrupted, failed) and ``summary.json`` where the run
finished — into a ``RunFolder``. Both refuse, in one ``ConfigError`` line, a folder that is not a run:
no such folder, no config.json or rounds.jsonl, a file that is not the JSON a run writes. An incomplete
run is read as far as it got (``RunFolder.complete`` is False, ``incomplete_note`` says how far): a
last line of rounds.jsonl cut short by a kill is dropped (``dropped_partial_line``); a bad line
anywhere else is refused.

It imports no torch: ``fedlora export`` claims its ``--out`` (``claim_export_dir``, ``EXPORT_WRITES``, which
``fedlora.llm.export`` re-exports) and refuses a missing run folder from here, in one line, before it imports torch.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from fedlora.errors import ConfigError
from fedlora.io import claim_output_dir

from .config import RunConfig, group_configs
from .tasks import TASKS

#: every entry a run writes into its output folder: ``--overwrite`` clears a folder only when it holds
#: nothing else (``fedlora.io.claim_output_dir``). A new output file or folder must be added here.
RUN_WRITES = ("config.json", "run.json", "rounds.jsonl", "summary.json", "rounds.png", "adapters", "clients",
              "checkpoints")

__all__ = ["RunFolder", "read_run", "read_run_config", "config_digests", "read_status", "client_view", "EXPORT_WRITES", "claim_export_dir",
           "MERGED_UPDATE", "config_digest", "data_label"]

#: FLoRA: the update merged into the run's shared base (in ``adapters/``, one for all clients)
MERGED_UPDATE = "merged_update.safetensors"
GLOBAL_ADAPTER = "global.safetensors"  # adapters/global.safetensors: a SecAgg+ run's one adapter (the server's state)

#: every entry an export (PEFT or merged) may write into its ``--out``: ``--overwrite`` clears only these
#: (fnmatch patterns for sharded weights). The tokenizer's files are those HF tokenizers save.
EXPORT_WRITES = ("adapter_config.json", "adapter_model.safetensors", "fedlora_export.json",  # PEFT
                 "config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
                 "model.safetensors.index.json",                                               # merged
                 "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                 "chat_template.jinja", "chat_template.json", "vocab.txt", "vocab.json", "merges.txt",
                 "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")


def config_digest(config: Mapping[str, Any]) -> str:
    """SHA-256 of a run's config (``RunConfig.to_dict()``, config.json's "config"), as canonical JSON:
    the saved adapters carry it, so export knows they belong to the config.json beside them."""
    canon = json.dumps(json.loads(json.dumps(config)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def config_digests(saved: Mapping[str, Any], *, without_output_dir: bool = False) -> set[str]:
    """The digests that tie a file to config.json's config ``saved``: of it as written and as read today
    (``saved_config_today``: fields added since at their defaults) — a run resumed by a newer fedlora writes its
    later checkpoints and adapters with the config as it is today, the folder's config.json staying as written.
    ``without_output_dir``: of the config without ``output_dir`` (what checkpoints carry: a run folder may move)."""
    from .config import saved_config_today

    forms = [dict(saved)]
    try:
        forms.append(saved_config_today(saved))
    except ConfigError:  # no longer builds: only its own digest ties files to it
        pass
    if without_output_dir:
        forms = [{k: v for k, v in f.items() if k != "output_dir"} for f in forms]
    return {config_digest(f) for f in forms}


def _json_file(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{what}: cannot read {str(path)!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                          ) from None


def read_run_config(run_dir: str | Path, what: str = "RUN_DIR") -> dict[str, Any]:
    """``config.json`` of the run in ``run_dir``: ``{"config": the config as given, "resolved": what
    was built}``. ``ConfigError`` starting with ``what`` when the folder or file is missing or is not
    a run's config.json."""
    folder = Path(run_dir)
    if not folder.is_dir():
        why = "is a file, not a folder" if folder.exists() else "does not exist"
        raise ConfigError(f"{what}: {str(folder)!r} {why} (give the output folder of a `fedlora run`)")
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError(f"{what}: {str(folder)!r} is not a fedlora run folder (it has no config.json)")
    info = _json_file(path, what)
    if not (isinstance(info, dict) and isinstance(info.get("config"), dict) and isinstance(info.get("resolved"), dict)):
        raise ConfigError(f"{what}: {str(path)!r} is not a fedlora run's config.json (no 'config' and 'resolved' tables)")
    return info


def claim_export_dir(out: str | Path, overwrite: bool, run_dir: str | Path, flag: str = "--out"):
    """``out`` as the export's folder (``fedlora.io.claim_output_dir``, nothing cleared yet: the export clears
    it with ``OutputDir.clear`` once everything else is checked): new or empty, or with ``overwrite`` a folder
    that holds nothing but an earlier export's files (``EXPORT_WRITES``); never the run folder or one holding it."""
    o, r = Path(out).resolve(), Path(run_dir).resolve()
    if overwrite and (o == r or o in r.parents):
        raise ConfigError(f"{flag}: {str(out)!r} holds the run folder {str(run_dir)!r}: --overwrite would delete it")
    return claim_output_dir(out, flag, writes=EXPORT_WRITES, overwrite=overwrite, clear=False)


def client_view(info: Mapping[str, Any], client: int) -> dict[str, Any]:
    """config.json's content (``read_run_config``) as client ``client``'s model was built: the run's own —
    or, for a run with heterogeneous client models (``fedlora.llm.hetero``), its group's config (the group's
    model and data sections, ``fedlora.llm.config.group_configs``) and resolved build (layers, head, labels)."""
    res = info["resolved"]
    if not res.get("heterogeneous"):
        return dict(info)
    for g, grp in enumerate(res["groups"]):
        if client in grp["clients"]:
            return {"config": group_configs(RunConfig.from_dict(info["config"]))[g][1].to_dict(), "resolved": grp}
    raise ConfigError(f"client {client} is in none of the run's groups (federation.client_models)")


def data_label(task: str, kind: str, config_task: str | None, path: str | None) -> str:
    """The run's task as its summary line, summary.json and rounds.png name it: the task's name, or — where
    ``data.path`` replaced a registered task's own data (a bundled config run on the user's file) — the file's
    name with the task's kind and the task whose columns and metrics apply: ``reviews.csv (generation, columns
    of debian-describe)``. config.json keeps the task's name (``resolved.task``: export rebuilds it)."""
    if path is None or config_task is None:
        return task
    return f"{Path(path).name} ({kind}, columns of {task})"


def read_status(run_dir: str | Path) -> str:
    """run.json's status (complete, running, interrupted, failed), or ``unknown`` without a readable one."""
    try:
        state = json.loads((Path(run_dir) / "run.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return "unknown"
    return str(state.get("status", "unknown")) if isinstance(state, dict) else "unknown"


@dataclass(frozen=True)
class RunFolder:
    """What one run wrote. ``records``: rounds.jsonl's lines in order (``records[0]`` is round 0, the
    evaluation before training); ``status``: run.json's (``complete``, ``running``, ``interrupted``,
    ``failed``; ``unknown`` without run.json: then complete iff summary.json exists);
    ``rounds_planned``: train.rounds; ``summary``: summary.json, None until the run completed."""

    path: Path
    config: Mapping[str, Any]
    resolved: Mapping[str, Any]
    records: tuple[Mapping[str, Any], ...]
    status: str
    rounds_planned: int
    summary: Mapping[str, Any] | None
    dropped_partial_line: bool = False

    # ---- what the run was
    @property
    def method(self) -> str:
        return str(self.config["method"]["name"])

    @property
    def task(self) -> str:
        return str(self.resolved.get("task") or self.config.get("data", {}).get("task") or "?")

    @property
    def data_name(self) -> str:
        """The run's data as its summary line and rounds.png name it (``data_label``): the task's name, or
        the user's file where ``data.path`` replaced a registered task's data. ``task`` stays the registered
        name (what export rebuilds, what decides whether runs are comparable)."""
        if self.summary and "task" in self.summary:
            return str(self.summary["task"])
        data = self.config.get("data", {})
        kind = self.resolved.get("task_kind")
        if kind is None:
            return self.task
        return data_label(self.task, str(kind), data.get("task"), data.get("path"))

    @property
    def clients(self) -> int:
        return int(self.config["federation"]["clients"])

    @property
    def metrics(self) -> tuple[str, ...]:
        """The metrics every evaluation of the run reports (the keys of the clients' test mean: the
        task's metrics and ``loss``), in the order of the first evaluation."""
        evals = [r["eval"] for r in self.records if "eval" in r]
        if not evals:
            return tuple(self.resolved.get("metrics", ()))
        keys = list(evals[0]["test"]["mean"])
        return tuple(k for k in keys if all(k in e["test"]["mean"] for e in evals))

    @property
    def main_metric(self) -> str:
        """The task's main metric: summary.json's; for a run without one, the registered task's, else
        the first of the run's metrics (config.json's ``resolved.metrics``, main first for every task)."""
        if self.summary and "main_metric" in self.summary:
            return str(self.summary["main_metric"])
        spec = TASKS.get(self.task)
        if spec is not None:
            return spec.main_metric
        listed = list(self.resolved.get("metrics") or self.metrics)
        if not listed:
            raise ConfigError(f"RUN_DIR: {str(self.path)!r}: config.json names no metrics")
        return str(listed[0])

    @property
    def split(self) -> Mapping[str, Any] | None:
        """config.json's ``resolved.split``: per-client sizes and label histograms (``describe_split``)."""
        return self.resolved.get("split")

    # ---- how far it got
    @property
    def complete(self) -> bool:
        return self.status == "complete" or (self.status == "unknown" and self.summary is not None)

    @property
    def rounds_done(self) -> int:
        """Round records (round ≥ 1) read from rounds.jsonl."""
        return sum(1 for r in self.records if r.get("round", 0) >= 1)

    @property
    def incomplete_note(self) -> str | None:
        """None for a complete run, else one clause saying how far it got, e.g. ``run.json says interrupted
        after round 3 of 10``."""
        if self.complete:
            return None
        said = f"run.json says {self.status}" if self.status != "unknown" else "no run.json and no summary.json"
        note = f"{said} after round {self.rounds_done} of {self.rounds_planned}"
        return note + ("; the last line of rounds.jsonl was cut short and is left out" if self.dropped_partial_line else "")

    # ---- the records
    def evaluations(self) -> list[tuple[int, Mapping[str, Any]]]:
        """(round, eval) of every evaluated round, round 0 first."""
        return [(int(r["round"]), r["eval"]) for r in self.records if "eval" in r]

    def trained_rounds(self) -> list[Mapping[str, Any]]:
        """The round records of training rounds (round ≥ 1), in order."""
        return [r for r in self.records if r.get("round", 0) >= 1]


def read_run(run_dir: str | Path, what: str = "RUN_DIR") -> RunFolder:
    """The run in ``run_dir`` as a ``RunFolder`` (see the module's docstring for what is refused)."""
    folder = Path(run_dir)
    info = read_run_config(folder, what)
    path = folder / "rounds.jsonl"
    if not path.is_file():
        raise ConfigError(f"{what}: {str(folder)!r} is not a fedlora run folder (it has no rounds.jsonl)")
    status_path = folder / "run.json"
    state = _json_file(status_path, what) if status_path.is_file() else {}
    status = read_status(folder)
    summary_path = folder / "summary.json"
    summary = _json_file(summary_path, what) if summary_path.is_file() else None
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what}: cannot read {str(path)!r}: {e}") from None
    records, dropped = [], False
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("round"), int):
                raise ValueError("not a round record")
        except ValueError as e:
            last = all(not ln.strip() for ln in lines[i + 1:])
            if last and status != "complete":  # the line a killed run was writing
                dropped = True
                break
            raise ConfigError(f"{what}: {str(path)!r} line {i + 1} is not a round record ({e})") from None
        records.append(rec)
    if not records:
        raise ConfigError(f"{what}: the run in {str(folder)!r} has no records yet (rounds.jsonl is empty)")
    rounds = [r["round"] for r in records]
    if rounds != list(range(rounds[0], rounds[0] + len(rounds))) or rounds[0] != 0:
        raise ConfigError(f"{what}: {str(path)!r} does not hold rounds 0, 1, 2, … in order (it holds {rounds[:6]}…)")
    planned = info["config"].get("train", {}).get("rounds")
    planned = int(planned) if isinstance(planned, int) and not isinstance(planned, bool) else (
        int(state["rounds"]) if isinstance(state, dict) and isinstance(state.get("rounds"), int) else len(records) - 1)
    return RunFolder(folder, info["config"], info["resolved"], tuple(records), status, planned, summary, dropped)

