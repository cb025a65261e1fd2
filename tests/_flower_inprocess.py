"""A Flower deployment in one process, for tests: ``OneProcessGrid`` is a Flower ``Grid`` that hands each
message at once to ``fedlora.flower.client_app`` as a deployment's SuperNode does — every message as if
in a fresh ``flwr-clientapp`` process: this process's run cache (``fedlora.flower._RUNS``) emptied first,
the message and the node's ``Context`` rebuilt from the bytes of Flower's own protobuf serialisation, the
node's state kept only as those bytes between messages (a ClientApp that raises leaves it as it was, and its
reply is the error a deployment's ``flwr-clientapp`` sends).

What a method keeps anywhere but ``context.state`` — in the cached run, its model, its method object, a
module — passes Ray's simulation (its actors persist) but fails here, as it fails a real deployment; the
processes, TLS, authentication and the command line of a deployment are tested by a few real ones
(tests/test_flower_deploy.py, tests/test_flower_synthetic.py)."""
from __future__ import annotations

import json
import uuid
from pathlib import Path

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.common.serde import context_from_proto, context_to_proto, message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Context as ProtoContext
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.supercore.task_identity import TaskIdentity

from fedlora import flower

#: Flower's error code for an exception a ClientApp raised (flwr.common.constant.ErrorCode)
CLIENT_APP_RAISED_EXCEPTION = 0


def _through_wire(msg: Message) -> Message:
    return message_from_proto(ProtoMessage.FromString(message_to_proto(msg).SerializeToString()))


class OneProcessGrid:
    """``n`` SuperNodes; node ids are not partition ids (node ``NODE0 + k`` holds partition ``n - 1 - k``), so a
    message sent to the wrong node is noticed. ``messages``: how many each partition answered."""

    NODE0 = 1001

    def __init__(self, n: int, run_id: int = 7, *, fresh: bool = True) -> None:
        """``fresh=False``: the run cache kept between messages, as a Ray actor keeps it (for the test that
        shows what this grid catches and the simulation does not)."""
        self.n, self.run_id, self.fresh = n, run_id, fresh
        self.partition = {self.NODE0 + k: n - 1 - k for k in range(n)}
        self.state = {node: context_to_proto(Context(run_id=run_id, node_id=node,
                                                     node_config={"partition-id": p, "num-partitions": n},
                                                     state=RecordDict(), run_config={})).SerializeToString()
                      for node, p in self.partition.items()}
        self.replies: dict[str, Message] = {}
        self.messages = {p: 0 for p in range(n)}

    def get_node_ids(self):
        return list(self.partition)

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            ids.append(msg.metadata.message_id)
            self.replies[msg.metadata.message_id] = self._deliver(_through_wire(msg))
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]

    def _deliver(self, msg: Message) -> Message:
        node = msg.metadata.dst_node_id
        if self.fresh:
            flower._RUNS.clear()  # a new process: nothing of an earlier message's run
        context = context_from_proto(ProtoContext.FromString(self.state[node]))
        self.messages[self.partition[node]] += 1
        try:
            reply = flower.client_app(message=msg, context=context)
        except Exception as ex:  # as flwr-clientapp: the node's state unchanged, an error reply
            return _through_wire(Message(Error(code=CLIENT_APP_RAISED_EXCEPTION,
                                               reason=f"{type(ex)}:<'{ex}'>"), reply_to=msg))
        self.state[node] = context_to_proto(context).SerializeToString()
        return _through_wire(reply)


def expected_messages(run_dir, clients: int = 3) -> dict[int, int]:
    """The messages each client's node answers in a `fedlora run` on Flower that wrote ``run_dir``: ``hello``,
    every evaluation but the last, a ``train`` per round it was drawn for (rounds.jsonl), a ``get-record`` per
    checkpoint before the last round (``train.checkpoint_every``), the final ``deliver`` — which is also the
    last evaluation and brings the final records (the adapters, a last checkpoint) back: no message of their own."""
    rounds = [json.loads(line) for line in (Path(run_dir) / "rounds.jsonl").read_text().splitlines()]
    every = json.loads((Path(run_dir) / "config.json").read_text())["config"]["train"]["checkpoint_every"]
    evals = sum("eval" in r for r in rounds)
    checkpoints = sum(1 for r in range(1, len(rounds) - 1) if every and r % every == 0)
    return {k: 1 + evals + checkpoints + sum(k in r["participants"] for r in rounds[1:]) for k in range(clients)}


def simulate_in_one_process(main, n_clients: int):
    """``fedlora.flower.simulate``'s signature: ``main(grid)`` over a ``OneProcessGrid`` of ``n_clients``."""
    return run_as_serverapp(main, OneProcessGrid(n_clients))


def run_as_serverapp(main, grid: OneProcessGrid):
    """``main(grid)``, this process being the ServerApp's (Flower's ``TaskIdentity``, as flwr-serverapp sets it)."""
    saved = TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, grid.run_id, SUPERLINK_NODE_ID
    try:
        return main(grid)
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved
