"""Training on a GPU without needless host work (issue 21, item 5), checked on the CuPy stand-in.

On a GPU every read of device data by the host (``.item()``, ``float(x)``, ``.get()``, ...) waits for
all the kernels queued before it, so a step that reads one number runs at the speed of its slowest
round trip. The stand-in counts those reads (cupy_standin.array.host_reads): a training step must
make none; the trainer reads its running sums once every ``CHECK_EVERY`` steps, and an evaluation
once at its end. The data lives on the device for the whole run, so a step gathers its batch there.
"""
import numpy as np
import pytest

import cupy_standin
from tinyvit import functional as F
from tinyvit import training as T
from tinyvit.data import Augment, DataLoader
from tinyvit.evaluation import evaluate

pytestmark = pytest.mark.skipif(not cupy_standin.available(), reason="the CuPy stand-in takes its names "
                                "from the cupy package, which is not installed (pip install 'tinyvit[cuda-compile]')")

MODEL = dict(dim=16, depth=1, num_heads=2, mlp_dim=32, image_size=8, patch_size=4, num_classes=4)


def _config(tmp_path, **overrides):
    return T.TrainConfig(dataset="synthetic", device="cuda", epochs=1, batch_size=4, out=str(tmp_path),
                         model="vit-ti/16", model_args=MODEL, eval_batch_size=16,
                         dataset_args=dict(num_classes=4, image_size=8, train_size=180, test_size=48),
                         **overrides)


@pytest.fixture
def standin(monkeypatch):
    return cupy_standin.install(monkeypatch)


def _reads_before_each_step(monkeypatch):
    """Patch the classification step to note the host-read count before each step."""
    from cupy_standin.array import host_reads
    seen, step = [], T.Classification.step

    def counting_step(self, model, x, y):
        seen.append(host_reads())
        return step(self, model, x, y)

    monkeypatch.setattr(T.Classification, "step", counting_step)
    return seen


@pytest.mark.parametrize("recipe", [
    dict(),                                                                      # plain labels
    dict(randaug="2,9", crop_padding=2, flip=True, erasing=0.5, label_smoothing=0.1, grad_clip=1.0,
         drop_path=0.1, ema=0.99),                                               # every per-step option
    dict(mixup=0.8, cutmix=1.0),                                                 # soft targets
])
def test_training_steps_read_nothing_back_but_the_periodic_check(standin, monkeypatch, tmp_path, recipe):
    seen = _reads_before_each_step(monkeypatch)
    T.train(_config(tmp_path, **recipe), progress=False, log=lambda *a: None)
    steps = 180 // 4
    assert len(seen) == steps
    reads_during_step = np.diff(seen)            # reads made by step i (and the loop after it), i = 1..44
    checks = [i - 1 for i in range(1, steps) if i % 20 == 0]        # after steps 20 and 40: the sums
    assert all(reads_during_step[i] == 0 for i in range(steps - 1) if i not in checks), reads_during_step
    assert all(reads_during_step[i] > 0 for i in checks), "the periodic check must read the sums"


def test_the_data_lives_on_the_device_for_the_whole_run(standin, monkeypatch, tmp_path):
    kinds = []

    class Recording(DataLoader):
        def __init__(self, images, labels, *args, **kwargs):
            kinds.append((type(images).__module__.split(".")[0], type(labels).__module__.split(".")[0]))
            super().__init__(images, labels, *args, **kwargs)

    monkeypatch.setattr(T.loop, "DataLoader", Recording)
    T.train(_config(tmp_path), progress=False, log=lambda *a: None)
    assert kinds == [("cupy_standin", "cupy_standin")] * 2          # train and test split, both on the device


def test_evaluation_reads_back_once(standin, tmp_path):
    from cupy_standin.array import host_reads
    ds = T.load_data("synthetic", None, dict(num_classes=4, image_size=8, train_size=8, test_size=64))
    model = T.Classification().build_model(_config(tmp_path).resolved(), ds).to(device="cuda")
    tf = Augment(ds.mean, ds.std)
    loader = DataLoader(*T.components.resident(ds.test_images, ds.test_labels, "cuda"), 8, device="cuda", transform=tf)
    before = host_reads()
    result = evaluate(model, loader)                                   # 8 batches
    assert host_reads() - before <= 4      # loss, correct, predictions, labels: not per batch
    assert result["preds"].shape == (64,) and isinstance(result["preds"], np.ndarray)


def test_cross_entropy_checks_labels_unless_told_they_are_checked(standin):
    from cupy_standin.array import host_reads
    logits = standin.asarray(np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 4\)"):
        F.cross_entropy(logits, standin.asarray(np.array([0, 4, 1])))
    good = standin.asarray(np.array([0, 3, 1]))
    before = host_reads()
    F.cross_entropy(logits, good)
    assert host_reads() == before + 1                                 # the range check: one read
    before = host_reads()
    loss = F.cross_entropy(logits, good, check_labels=False)
    assert host_reads() == before
    np.testing.assert_allclose(float(loss.data), np.log(4), rtol=1e-6)
