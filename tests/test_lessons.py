"""The lessons (lessons/NN_*.ipynb, and NNb_*.ipynb for a lesson added after NN) run top to bottom, and
their exercise checks reject wrong answers.

Each notebook runs in a fresh Jupyter kernel of this interpreter (ipykernel) with
TINYVIT_LESSON_SMALL=1 (every lesson shrinks its sizes) and MPLBACKEND=Agg, and any error fails the
test. The exercise scheme is described in lessons/README.md: an exercise cell (tag "exercise") holds a
working solution between two marker lines and a typical wrong answer in its metadata; the next cell
tagged "check" raises AssertionError on a wrong answer. At every exercise the wrong answer runs first
(its check must raise AssertionError), then the solution and the check run as written.
"""
import copy
import json
import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the lesson tests need the test extra: pip install -e '.[test]'")
nbclient = pytest.importorskip("nbclient", reason="the lesson tests need the test extra: pip install -e '.[test]'")
pytest.importorskip("ipykernel", reason="the lesson tests need the test extra: pip install -e '.[test]'")
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402  (comes with nbclient)
from jupyter_client.manager import KernelManager  # noqa: E402
from nbclient.exceptions import CellExecutionError  # noqa: E402

LESSONS = Path(__file__).resolve().parent.parent / "lessons"
NOTEBOOKS = sorted(LESSONS.glob("[0-9][0-9]*_*.ipynb"))   # 08_training, 08b_augmentation..., in reading order
BEGIN = "# --- your code here (a solution is filled in; replace it to try yourself) ---"
END = "# --- end of your code ---"
CELL_TIMEOUT = 300           # seconds per cell; a small-mode cell takes well under one
MAX_KB = 300                 # a committed notebook, figures included
MAX_SECONDS = 120            # a lesson's full run as committed, on a 2-core CPU (tools/run_lesson.py records it)
KERNEL = "tinyvit-lessons"
KERNEL_ENV = {"TINYVIT_LESSON_SMALL": "1", "MPLBACKEND": "Agg", "PYTHONHASHSEED": "0"}


# ----------------------------------------------------------------------------- helpers


def _tags(cell):
    return cell.get("metadata", {}).get("tags", [])


def _exercises(nb):
    """[(index of the exercise cell, index of its check cell)] in notebook order."""
    pairs = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and "exercise" in _tags(cell):
            j = next((j for j in range(i + 1, len(nb.cells)) if "check" in _tags(nb.cells[j])), None)
            pairs.append((i, j))
    return pairs


def _wrong_answer(cell):
    return cell.get("metadata", {}).get("lesson", {}).get("wrong_answer")


def _with_wrong_answer(cell):
    """A copy of the exercise cell with the lines between the markers replaced by its wrong answer
    (indented like the markers, so that an answer inside a class body stays there)."""
    lines = cell.source.splitlines()
    starts = [k for k, line in enumerate(lines) if line.strip() == BEGIN]
    ends = [k for k, line in enumerate(lines) if line.strip() == END]
    assert len(starts) == 1 and len(ends) == 1 and starts[0] < ends[0], "exercise cell without its two markers"
    indent = lines[starts[0]][: len(lines[starts[0]]) - len(lines[starts[0]].lstrip())]
    wrong = [indent + line if line.strip() else line for line in _wrong_answer(cell).splitlines()]
    new = copy.deepcopy(cell)
    new.source = "\n".join(lines[: starts[0] + 1] + wrong + lines[ends[0]:])
    new.outputs = []
    return new


@pytest.fixture
def client_for(tmp_path):
    """Make a NotebookClient whose kernel is this interpreter with the lesson environment."""
    kernels = tmp_path / "kernels"
    (kernels / KERNEL).mkdir(parents=True)
    (kernels / KERNEL / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "tinyvit lessons (small)", "language": "python", "env": KERNEL_ENV}))

    def make(nb):
        km = KernelManager(kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))
        return nbclient.NotebookClient(nb, km=km, timeout=CELL_TIMEOUT, startup_timeout=120,
                                       record_timing=False, resources={"metadata": {"path": str(LESSONS)}})
    return make


def _name(path):
    return path.name.split("_")[0]


# ----------------------------------------------------------------------------- tests


def test_lessons_are_found():
    assert NOTEBOOKS, f"no lessons/NN_*.ipynb under {LESSONS}"


def test_lessons_readme_links_every_lesson():
    """lessons/README.md's table links every notebook, and links no notebook that is not there."""
    readme = (LESSONS / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(([0-9][0-9][^)]*\.ipynb)\)", readme))
    present = {path.name for path in NOTEBOOKS}
    assert present <= linked, f"lessons/README.md does not link {sorted(present - linked)}"
    assert linked <= present, f"lessons/README.md links missing notebooks {sorted(linked - present)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_name)
def test_lesson_structure(path):
    """At least one exercise with a check after it, the markers, a recorded wrong answer; the
    notebook is committed with the outputs of a run and stays small."""
    nb = nbformat.read(path, as_version=4)
    pairs = _exercises(nb)
    assert pairs, f"{path.name}: no cell tagged 'exercise' (see lessons/README.md)"
    for i, j in pairs:
        assert j is not None, f"{path.name}: exercise cell {i} has no cell tagged 'check' after it"
        source = nb.cells[i].source
        assert BEGIN in source and END in source, f"{path.name}: exercise cell {i} lacks the marker lines"
        assert _wrong_answer(nb.cells[i]), f"{path.name}: exercise cell {i} records no wrong answer in its metadata"
    first_code = next(c for c in nb.cells if c.cell_type == "code")
    assert "TINYVIT_LESSON_SMALL" in first_code.source, f"{path.name}: the first code cell must read TINYVIT_LESSON_SMALL"
    unexecuted = [k for k, c in enumerate(nb.cells) if c.cell_type == "code" and c.execution_count is None]
    assert not unexecuted, f"{path.name}: code cells {unexecuted} have no outputs; commit the notebook executed"
    kb = path.stat().st_size / 1024
    assert kb < MAX_KB, f"{path.name} is {kb:.0f} KB; keep figures small (lower dpi or figsize)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_name)
def test_lesson_ran_in_under_two_minutes_as_committed(path):
    """tools/run_lesson.py records the full run's wall time in the notebook's metadata (a lesson's last
    cell may print it too: "lesson ran in X s"); a lesson that needs longer training loads stored
    results instead (lessons/README.md)."""
    nb = nbformat.read(path, as_version=4)
    record = dict(nb.metadata.get("tinyvit", {}))
    last_code = [cell for cell in nb.cells if cell.cell_type == "code"][-1:]
    printed = [re.search(r"lesson ran in ([0-9.]+) s", output.get("text", "")) for cell in last_code
               for output in cell.get("outputs", [])]
    if printed and printed[-1]:
        record.setdefault("ran_in_s", float(printed[-1].group(1)))
    assert "ran_in_s" in record, f"{path.name}: no recorded run time; execute it with tools/run_lesson.py"
    assert record["ran_in_s"] < MAX_SECONDS, (
        f"{path.name} ran in {record['ran_in_s']:.0f} s as committed ({record.get('machine', 'machine not recorded')}), "
        f"over {MAX_SECONDS} s; store the results of long runs (lessons/README.md)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_name)
def test_lesson_runs_and_checks_catch_wrong_answers(path, client_for):
    """Execute the lesson top to bottom in small mode; at each exercise, its recorded wrong answer
    must make the check raise AssertionError before the solution makes it pass."""
    nb = nbformat.read(path, as_version=4)
    checks = dict(_exercises(nb))
    client = client_for(nb)
    client.reset_execution_trackers()
    with client.setup_kernel(cleanup_kc=True):
        for index, cell in enumerate(nb.cells):
            j = checks.get(index)
            if j is not None and _wrong_answer(cell):
                try:
                    client.execute_cell(_with_wrong_answer(cell), index)    # the wrong answer itself runs
                except CellExecutionError as err:
                    pytest.fail(f"{path.name}: the wrong answer recorded in exercise cell {index} does not even "
                                f"run ({err.ename}: {err.evalue}); record one that the check must catch")
                raised = None
                try:
                    client.execute_cell(copy.deepcopy(nb.cells[j]), j)
                except CellExecutionError as failure:
                    raised = (failure.ename, failure.evalue)
                if raised is None:
                    pytest.fail(f"{path.name}: check cell {j} accepts the wrong answer recorded in exercise cell {index}")
                assert raised[0] == "AssertionError", (
                    f"{path.name}: with the wrong answer of exercise cell {index}, check cell {j} raised "
                    f"{raised[0]} ({raised[1]}), not AssertionError")
            client.execute_cell(cell, index)


def test_a_check_cell_fails_on_a_wrong_answer(client_for):
    """Independently of the interleaving above: run lesson 01 as a plain notebook up to its first
    check, with the first exercise's wrong answer in place, and see the execution fail."""
    path = NOTEBOOKS[0]
    nb = nbformat.read(path, as_version=4)
    i, j = _exercises(nb)[0]
    nb.cells[i] = _with_wrong_answer(nb.cells[i])
    nb.cells = nb.cells[: j + 1]
    with pytest.raises(CellExecutionError) as failure:
        client_for(nb).execute(cleanup_kc=True)
    assert failure.value.ename == "AssertionError"
