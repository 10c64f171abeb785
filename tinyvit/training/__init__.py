"""Training: the loop and everything a run is made of.

    recipes.py     what a run is: TrainConfig and the recipes (per dataset, fine-tuning, pre-training)
    objectives.py  what a run minimises: Classification, MaskedPrediction (section 4.6)
    components.py  the model, data, optimizer and augmentation a run is built from
    loop.py        train(): data -> augment -> model -> loss -> backward -> clip -> optimizer -> schedule
    budget.py      --time-budget: the number of steps that fit, measured
    run_folder.py  the run folder: checkpoints, logs, the lock, resuming
    signals.py     Ctrl-C, SIGTERM and SIGHUP without losing work
    finetune.py    a trained model made ready for a new task (section 3.2)

    from tinyvit.training import TrainConfig, train
    train(TrainConfig(dataset="fashion-mnist", epochs=2))
"""
from .components import load_data
from .finetune import prepare_finetune
from .loop import TrainingDiverged, train
from .objectives import Classification, MaskedPrediction
from .recipes import FINETUNE_RECIPE, PRETRAIN_RECIPE, RECIPES, TrainConfig
from .run_folder import RunFolderInUse
from .signals import Stopped

__all__ = ["train", "TrainConfig", "RECIPES", "FINETUNE_RECIPE", "PRETRAIN_RECIPE", "Classification",
           "MaskedPrediction", "prepare_finetune", "load_data", "TrainingDiverged", "RunFolderInUse", "Stopped"]
