"""The table of task kinds: each ``Task`` implementation registers its kind (``fedlora.llm.tasks.register_kind``),
``fedlora.llm.task_kinds`` imports the implementations and builds tasks from the table — a new kind is its module
and one registration, and ``fedlora.llm.tasks`` imports none of them."""
import pytest

from fedlora.errors import ConfigError
from fedlora.llm import task_kinds, tasks
from fedlora.llm.classification import ClassificationTask
from fedlora.llm.generation import GenerationTask
from fedlora.llm.qa import QATask


@pytest.fixture
def table_kept():
    """The table of kinds as it was, after the test (in place: task_kinds reads the same dict)."""
    saved = dict(tasks.TASK_KINDS)
    yield
    tasks.TASK_KINDS.clear()
    tasks.TASK_KINDS.update(saved)


def test_every_kind_is_registered_by_its_own_module():
    assert tasks.TASK_KINDS == {"classification": ClassificationTask, "generation": GenerationTask, "qa": QATask}
    for name, spec in tasks.TASKS.items():  # every registered task builds its kind's implementation
        assert type(task_kinds.task_for(name)) is tasks.TASK_KINDS[spec.kind], name


def test_a_source_without_a_task_is_generation_with_a_target_column_else_classification():
    assert type(task_kinds.task_for(None, "summary")) is GenerationTask
    assert type(task_kinds.task_for(None)) is ClassificationTask
    done = task_kinds.task_from_resolved({"task": "squad", "task_kind": "qa", "metrics": ["exact", "f1"]})
    assert type(done) is QATask and done.name == "squad"


def test_a_new_kind_is_its_class_and_one_registration(table_kept):
    def nothing(self, *args, **kwargs):
        return None

    @tasks.register_kind("echo")
    class EchoTask(tasks.Task):
        load_data = build_model = encode = loss = outputs = predict = score = nothing

    spec = tasks.TaskSpec(name="echo/x", hf_path=None, hf_config=None, text_column="t", text_pair_column=None,
                          label_column=None, train_split="train", test_split="test", metrics=("bleu",),
                          main_metric="bleu", label_names=None, description="", kind="echo")
    task = task_kinds.build_task(spec)
    assert type(task) is EchoTask and task.kind == "echo" and task.spec is spec


def test_an_unknown_kind_is_one_line_naming_the_kinds():
    with pytest.raises(ConfigError) as e:
        task_kinds.task_from_resolved({"task": "glue/sst2", "task_kind": "ranking"})
    assert str(e.value) == "task kind 'ranking': one of ('classification', 'generation', 'qa')"


def test_a_kind_has_one_implementation(table_kept):
    tasks.register_kind("qa")(QATask)  # the same class again (a module reloaded): accepted
    with pytest.raises(ValueError, match="task kind 'qa' is fedlora.llm.qa.QATask's already"):
        tasks.register_kind("qa")(GenerationTask)
    assert tasks.TASK_KINDS["qa"] is QATask
