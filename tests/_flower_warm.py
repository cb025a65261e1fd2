"""What a warm SuperExec (fedlora.flower_warm) records of a deployment's messages, and the checks the deployment
tests make of it: every message ran in a child of its own, forked from the warm process, from an empty run
cache (what a message built died with its process), and was reaped."""
import json
from pathlib import Path


def ledger(path) -> dict[str, list[dict]]:
    """A ledger's lines by kind: ``launched`` (the parent's), ``tasks`` (each child's), ``reaped`` (the parent's)."""
    out = {"launched": [], "task": [], "reaped": []}
    for line in Path(path).read_text().splitlines():
        e = json.loads(line)
        out["launched" if "launched" in e else "task" if "task" in e else "reaped"].append(e)
    out["tasks"] = out.pop("task")
    return out


def assert_forked_per_message(work, nodes: int, messages: dict[int, int] | None = None) -> dict[int, dict]:
    """Each node's ``work/supernode<K>.tasks.jsonl``: one child per message (``messages[K]`` of them when
    given), each with its own pid, none the warm parent's or another node's, its parent the warm process;
    the parent never held a run, every child started with none (nothing of an earlier message survived) and
    some built one (the ClientApp's work ran in the child); every child exited 0 and was reaped."""
    seen, out = set(), {}
    for k in range(nodes):
        led = ledger(Path(work) / f"supernode{k}.tasks.jsonl")
        tasks, launched = led["tasks"], led["launched"]
        warm = {e["warm"] for e in launched}
        assert len(warm) == 1, (k, warm)
        warm = warm.pop()
        pids = [t["pid"] for t in tasks]
        assert len(set(pids)) == len(pids) and warm not in pids and not seen & ({warm} | set(pids)), (k, warm, pids)
        seen |= {warm} | set(pids)
        assert sorted(e["child"] for e in launched) == sorted(pids), (k, launched, pids)
        assert all(t["ppid"] == warm for t in tasks), (k, tasks)
        assert all(e["runs_in_parent"] == 0 for e in launched), (k, launched)
        # forked from a single-threaded point: no Python thread but the SuperNode's watcher (in waitpid)
        assert all(e["threads"] == ["MainThread", "supernode-watch"] for e in launched), (k, launched)
        assert all(t["runs_at_start"] == 0 for t in tasks), (k, tasks)
        assert any(t["runs_at_end"] == 1 for t in tasks), (k, tasks)
        assert all(t["exit"] == 0 for t in tasks), (k, tasks)
        assert sorted(e["reaped"] for e in led["reaped"]) == sorted(pids) and all(e["exit"] == 0 for e in led["reaped"]), (k, led["reaped"])
        if messages is not None:
            assert len(tasks) == messages[k], (k, len(tasks), messages)
        out[k] = led
    return out
