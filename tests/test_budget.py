"""A run's length (tinyvit/budget.py): --time-budget, the warmup of short runs, and the curves.

The time budget is planned from a timed trial; the tests replace the trial's measurement with fixed
times (tinyvit.training.loop._time_run), so what they check is the arithmetic and the run that follows it,
never the speed of the machine.
"""
import json
import math

import numpy as np
import pytest

import tinyvit.training.recipes
import tinyvit.data
import tinyvit.training.components
import tinyvit.training.loop
from tinyvit.training import budget
from tinyvit.cli import main
from tinyvit.evaluation.plots import training_curves
from tinyvit.training import TrainConfig, train

MODEL = dict(dim=16, depth=1, num_heads=2, mlp_dim=32)
DATA = dict(train_size=256, test_size=64, image_size=16, channels=3, num_classes=4)   # 8 steps of 32


def _config(tmp_path, **overrides):
    return TrainConfig.from_dict({"dataset": "synthetic", "model": "vit-cifar/4", "model_args": MODEL,
                                  "dataset_args": DATA, "batch_size": 32, "out": str(tmp_path / "run"),
                                  **overrides})


def _quiet(*args, **kwargs):
    pass


# ---------------------------------------------------------------- durations


@pytest.mark.parametrize("text, minutes", [("30m", 30), ("2h", 120), ("1h30m", 90), ("90s", 1.5), ("45", 45),
                                           ("0.5", 0.5), ("1.5h", 90), (" 10M ", 10)])
def test_durations_read_as_minutes(text, minutes):
    assert budget.parse_duration(text) == pytest.approx(minutes)


@pytest.mark.parametrize("text", ["3x", "", "m", "h30", "nan", "inf", "0", "-5", "0m", "1d"])
def test_bad_durations_are_refused(text):
    with pytest.raises(ValueError, match="--time-budget"):
        budget.parse_duration(text)


def test_durations_are_printed_in_words():
    assert [budget.format_duration(m) for m in (0.5, 30, 90, 120)] == ["30 s", "30 min", "1 h 30 min", "2 h"]


@pytest.mark.parametrize("argv, message", [
    (["--time-budget", "3x"], "cannot read '3x' as a duration"),
    (["--time-budget=-1m"], "cannot read '-1m'"),
    (["--time-budget", "0"], "must be a positive duration"),
    (["--time-budget", "10m", "--epochs", "3"], "pass --epochs or --time-budget, not both"),
])
def test_bad_budgets_are_one_line_through_the_cli(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--dataset", "synthetic", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and message in err[-1] and "Traceback" not in "\n".join(err)


# ---------------------------------------------------------------- the arithmetic


def _cost(steps, step_s, epoch_s, per_epoch):
    return steps * step_s + math.ceil(steps / per_epoch) * epoch_s


@pytest.mark.parametrize("seed", range(20))
def test_steps_within_is_the_most_that_fits(seed):
    rng = np.random.default_rng(seed)
    budget_s, elapsed = float(rng.uniform(30, 5000)), float(rng.uniform(0, 20))
    step_s, epoch_s, per_epoch = float(rng.uniform(0.01, 2)), float(rng.uniform(0, 30)), int(rng.integers(1, 500))
    steps = budget.steps_within(budget_s, elapsed, step_s, epoch_s, per_epoch)
    room = budget_s - elapsed - budget.SAFETY_SECONDS
    assert steps == 0 or _cost(steps, step_s, epoch_s, per_epoch) <= room + 1e-9
    assert _cost(steps + 1, step_s, epoch_s, per_epoch) > room - 1e-9


def test_a_recipes_long_warmup_is_shortened_an_asked_one_is_not():
    steps, note = budget.warmup_steps_for(10, 39, 39, from_recipe=True)     # CIFAR's 10 epochs, 1-epoch run
    assert steps == 3 and "shortened to 3 steps" in note and "--warmup-epochs" in note
    assert budget.warmup_steps_for(10, 390, 78000, from_recipe=True) == (3900, None)   # 5% of 200 epochs: kept
    steps, note = budget.warmup_steps_for(10, 39, 39, from_recipe=False)
    assert steps == 390 and "never reaches --lr" in note                   # asked for: kept, and said
    assert budget.warmup_steps_for(0.5, 100, 1000, from_recipe=False) == (50, None)


def test_no_step_fits_is_a_clear_error():
    with pytest.raises(ValueError, match="leaves no time to train"):
        budget.plan_for_budget(0.1, 3.0, 1.0, 1.0, 10, 1, True)


# ---------------------------------------------------------------- runs


@pytest.fixture
def timed(monkeypatch):
    """The trial's measurement replaced by 1 s per step and 0.5 s per evaluation, and the plan never
    refitted to the real (much faster) pace; counts the trial's calls."""
    calls = []

    def fixed(*args, **kwargs):
        calls.append(1)
        return 1.0, 0.5
    monkeypatch.setattr(tinyvit.training.loop, "_time_run", fixed)
    monkeypatch.setattr(budget, "keep_to_budget", lambda plan, *args: (plan, None))
    return calls


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_budget_run_trains_exactly_the_planned_steps(tmp_path, timed):
    messages = []
    result = train(_config(tmp_path, time_budget=0.5), progress=False, log=messages.append)
    plan = next(m for m in messages if m.startswith("time budget 30 s"))
    total = int(plan.split(" steps (")[0].rsplit(" ", 1)[1])
    assert _cost(total, 1.0, 0.5, 8) <= 30 - budget.SAFETY_SECONDS                 # it fits the budget
    assert _cost(total + 1, 1.0, 0.5, 8) > 30 - budget.SAFETY_SECONDS - 1           # and fills it
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == math.ceil(total / 8) and timed == [1]
    assert rows[-1]["epochs_trained"] == pytest.approx(total / 8, abs=1e-4)         # the last epoch cut short
    assert rows[-1]["lr"] == pytest.approx(1e-6)                                    # decayed to min_lr at its end
    steps = _rows(tmp_path / "run" / "steps.jsonl")
    assert steps[-1]["step"] == total and result["epoch"] == len(rows)


def test_a_budget_run_stopped_and_resumed_keeps_its_plan(tmp_path, timed):
    straight = train(_config(tmp_path, time_budget=0.5, out=str(tmp_path / "straight")), progress=False, log=_quiet)
    cfg = _config(tmp_path, time_budget=0.5, out=str(tmp_path / "stopped"))
    train(cfg, stop_after_epoch=1, progress=False, log=_quiet)
    resumed = train(TrainConfig.from_dict({**cfg.__dict__, "resume": True}), progress=False, log=_quiet)
    assert timed == [1, 1]                                   # the resumed run reused the stopped run's plan
    assert resumed["epoch"] == straight["epoch"]
    a = tinyvit.load(tmp_path / "straight" / "latest.safetensors").state_dict()
    b = tinyvit.load(tmp_path / "stopped" / "latest.safetensors").state_dict()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_the_plan_is_refitted_to_the_pace():
    plan = budget.Plan(1000, 100, 10)
    same, note = budget.keep_to_budget(plan, 3, 85, 0.1, 1.0, 200, 100)      # 810 more fit: not 5% more
    assert same is plan and note is None
    jitter, note = budget.keep_to_budget(plan, 3, 87.5, 0.1, 1.0, 200, 100)   # 6 steps short: 0.6 s, absorbed
    assert jitter is plan and note is None
    shorter, note = budget.keep_to_budget(plan, 10, 400, 0.5, 1.0, 200, 100)  # 195 s left at 0.5 s a step
    assert shorter.total_steps < 1000 and shorter.warmup_steps == 100 and "behind the time budget" in note
    room = 600 - 400 - budget.SAFETY_SECONDS
    assert _cost(shorter.total_steps - 200, 0.5, 1.0, 100) <= room
    assert shorter.epochs == math.ceil(shorter.total_steps / 100)
    longer, note = budget.keep_to_budget(plan, 30, 60, 0.1, 1.0, 200, 100)   # early, and far more fits
    assert longer.total_steps > 1050 and "ahead of the time budget" in note
    late, note = budget.keep_to_budget(plan, 30, 60, 0.1, 1.0, 600, 100)     # past half the plan: kept
    assert late is plan and note is None


def test_a_run_slower_than_its_trial_is_shortened_to_end_in_time(tmp_path, monkeypatch):
    """The trial claims 1 ms a step: the first epoch shows the real pace, and the plan shrinks."""
    monkeypatch.setattr(tinyvit.training.loop, "_time_run", lambda *args, **kwargs: (0.001, 0.0))
    monkeypatch.setattr(budget, "SAFETY_SECONDS", 0.0)
    monkeypatch.setattr(budget, "EPOCH_OVERHEAD_SECONDS", 0.05)
    messages = []
    train(_config(tmp_path, time_budget=0.05), progress=False, log=messages.append)   # 3 s
    planned = int(next(m for m in messages if m.startswith("time budget")).split(" steps (")[0].rsplit(" ", 1)[1])
    assert any(m.startswith("behind the time budget") for m in messages), messages
    # the last refit decides (at this tiny scale a later epoch may run fast enough to lengthen it again)
    refits = [m for m in messages if m.startswith(("behind the time budget", "ahead of the time budget"))]
    total = int(refits[-1].split("ends after ")[1].split(" steps")[0])
    assert total < planned
    rows, steps = _rows(tmp_path / "run" / "metrics.jsonl"), _rows(tmp_path / "run" / "steps.jsonl")
    assert steps[-1]["step"] == total and rows[-1]["epochs_trained"] == pytest.approx(total / 8, abs=1e-4)


def test_the_timing_trial_leaves_the_run_untouched(tmp_path):
    cfg = _config(tmp_path).resolved()
    ds = tinyvit.training.load_data("synthetic", None, DATA)
    model = tinyvit.training.Classification().build_model(cfg, ds)
    train_tf, eval_tf = tinyvit.training.components.make_transforms(cfg, ds)
    loader = tinyvit.data.DataLoader(ds.train_images, ds.train_labels, 32, shuffle=True, transform=train_tf)
    test_loader = tinyvit.data.DataLoader(ds.test_images, ds.test_labels, 32, transform=eval_tf)
    before = ({k: v.copy() for k, v in model.state_dict().items()}, train_tf.state_dict(), loader.state_dict(),
              tinyvit.backend.rng().bit_generator.state)
    step_s, epoch_s = tinyvit.training.loop._time_run(cfg, model, tinyvit.training.Classification(0.0), loader, test_loader,
                                              steps=2, warmup=1)
    assert step_s > 0 and epoch_s >= budget.EPOCH_OVERHEAD_SECONDS
    after = (model.state_dict(), train_tf.state_dict(), loader.state_dict(), tinyvit.backend.rng().bit_generator.state)
    for name in before[0]:
        np.testing.assert_array_equal(before[0][name], after[0][name])
    assert before[1:] == after[1:]


def test_a_short_run_with_the_recipes_warmup_says_it_shortened_it(tmp_path):
    messages = []
    train(_config(tmp_path, epochs=1), progress=False, log=messages.append)   # synthetic recipe: 1 warmup epoch
    assert any("shortened to 0 steps" in m for m in messages)


# ---------------------------------------------------------------- curves


def _steps(epochs, per_epoch=60):
    rows = []
    for step in range(20, epochs * per_epoch + 1, 20):
        rows.append({"step": step, "epoch": step / per_epoch, "train_loss": 2.0 / (1 + step / 100),
                     "train_acc": 1 - 1 / (1 + step / 100), "lr": 1e-3})
    return rows


def _epochs(epochs):
    return [{"epoch": e, "epochs_trained": e, "test_loss": 1.0 / e, "test_acc": 1 - 0.5 / e} for e in range(1, epochs + 1)]


@pytest.mark.parametrize("epochs", [1, 200])
def test_curves_are_readable_after_one_epoch_and_after_many(tmp_path, epochs):
    fig = training_curves(_epochs(epochs), _steps(epochs), tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    loss, acc, lr = fig.axes
    for ax in (loss, acc):
        train_line, test_line = ax.lines
        assert len(train_line.get_xdata()) == len(_steps(epochs)) >= 3          # a curve, not one point
        assert test_line.get_marker() == "o" and len(test_line.get_xdata()) == epochs
    assert lr.get_title() == "learning rate" and len(lr.lines) == 1


# ---------------------------------------------------------------- a short run's augmentation


def test_a_short_run_leaves_out_the_recipes_augmentation_and_says_so():
    notes = []
    cfg = TrainConfig(dataset="cifar10", epochs=1).resolved(notes)
    assert (cfg.crop_padding, cfg.flip, cfg.randaug, cfg.mixup, cfg.cutmix, cfg.erasing) == (0, False, "", 0, 0, 0)
    assert cfg.label_smoothing == 0.1 and cfg.drop_path == 0.1            # regularisers other than augmentation stay
    assert len(notes) == 1 and "1-epoch run is short" in notes[0] and "--crop-padding" in notes[0]


def test_a_flag_keeps_its_augmentation_in_a_short_run_and_long_runs_keep_the_recipe():
    cfg = TrainConfig(dataset="fashion-mnist", epochs=2, crop_padding=2).resolved()
    assert cfg.crop_padding == 2 and cfg.flip is False                     # asked for: kept; the recipe's flip: off
    recipe = tinyvit.training.recipes.RECIPES["fashion-mnist"]
    long = TrainConfig(dataset="fashion-mnist", epochs=tinyvit.training.recipes.SHORT_RUN_EPOCHS).resolved()
    assert (long.crop_padding, long.flip) == (recipe["crop_padding"], recipe["flip"])
    notes = []
    budgeted = TrainConfig(dataset="fashion-mnist", time_budget=5).resolved(notes)
    assert (budgeted.crop_padding, budgeted.flip) == (recipe["crop_padding"], recipe["flip"]) and notes == []



def test_the_refit_pace_ignores_one_slow_epoch_but_follows_a_lasting_slowdown():
    rows = lambda seconds: [{"seconds": s, "epochs_trained": i + 1} for i, s in enumerate(seconds)]  # noqa: E731
    assert budget.recent_pace(rows([10.0]), 100) == pytest.approx(0.1)
    assert budget.recent_pace(rows([10.0, 10.0, 20.0]), 100) == pytest.approx(0.1)        # one slow epoch
    assert budget.recent_pace(rows([10.0, 20.0, 20.0]), 100) == pytest.approx(0.2)        # two: a slowdown
    assert budget.recent_pace(rows([30.0, 10.0, 12.0, 11.0]), 100) == pytest.approx(0.11)  # the last 3 only
    assert budget.recent_pace(rows([10.0, 14.0]), 100) == pytest.approx(0.12)              # two: their mean
    partial = [{"seconds": 10.0, "epochs_trained": 1}, {"seconds": 2.0, "epochs_trained": 1.1}]
    assert budget.recent_pace(partial, 100) == pytest.approx(0.15)                         # 2 s for 10 steps
    with pytest.raises(ValueError, match="no epoch"):
        budget.recent_pace([], 100)
