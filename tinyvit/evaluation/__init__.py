"""Using and looking into trained models: the tools after training.

    inference.py   load a checkpoint for inference, evaluate it on a test split (accuracy, confusion
                   matrix), predict the classes of image files
    fewshot.py     the paper's few-shot linear evaluation (section 4.1): features, least squares
    analysis.py    section 4.5's inspection: attention rollout, attention distance, position-embedding
                   similarity, the embedding filters' principal components
    plots.py       pictures of those, and the training curves

    from tinyvit.evaluation import load_for_inference, evaluate
"""
from .analysis import (attention_distance, attention_rollout, collect_attentions, embedding_filters,
                       inspect_checkpoint, position_embedding_similarity)
from .fewshot import extract_features, fewshot_evaluate, fewshot_linear, fewshot_subsets, fit_least_squares
from .inference import (check_fits, confusion_matrix, evaluate, format_report, load_for_inference, predict_files,
                        read_image)

__all__ = ["load_for_inference", "evaluate", "check_fits", "confusion_matrix", "format_report", "predict_files",
           "read_image", "extract_features", "fewshot_evaluate", "fewshot_linear", "fewshot_subsets",
           "fit_least_squares", "attention_distance", "attention_rollout", "collect_attentions", "embedding_filters",
           "inspect_checkpoint", "position_embedding_similarity"]
