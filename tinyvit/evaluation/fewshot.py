"""Few-shot linear evaluation of a frozen representation (section 4.1, "Metrics").

    "Few-shot accuracies are obtained by solving a regularized least-squares regression problem
     that maps the (frozen) representation of a subset of training images to {-1, 1}^K target
     vectors. This formulation allows us to recover the exact solution in closed form."

With features X (n, d) of the n = K * shots training images and targets T (n, K), T[i, k] = +1 if
image i is of class k else -1, ridge regression with an unregularised bias b:

    mu = mean of the rows of X,  t = mean of the rows of T,  Xc = X - mu,  Tc = T - t
    W = argmin ||Xc W - Tc||^2 + l2 ||W||^2 = (Xc^T Xc + l2 I)^{-1} Xc^T Tc       (primal, d x d)
                                            = Xc^T (Xc Xc^T + l2 I)^{-1} Tc       (dual, n x n)
    predict argmax_k ((x - mu) W + t)_k

Choices: the bias is handled by centring (exactly unregularised, no constant feature whose scale
would matter); features are standardised to unit variance per dimension with the training subset's
statistics (``standardize=True``), so one l2 suits any model; the symmetric positive-definite
system is solved (np.linalg.solve, never an explicit inverse) in float64, in whichever form is
smaller: the dual when n < d, as in the few-shot regime. Each accuracy is averaged over several
random subsets (seeds) of ``shots`` images per class, reported as mean and spread.
"""
from __future__ import annotations

import numpy as np

from .. import backend
from ..autograd import Tensor, no_grad


def _as_float64(x) -> np.ndarray:
    x = x.data if isinstance(x, Tensor) else x          # (a CuPy array's .data is its memory pointer)
    return np.asarray(backend.to_numpy(x), dtype=np.float64)


def fit_least_squares(features, labels, num_classes: int, l2: float = 1.0, standardize: bool = True):
    """Fit the regularised least-squares classifier of section 4.1.

    features: (n, d)   labels: (n,) int in [0, K)  ->  a function mapping (m, d) features to (m, K)
    scores (argmax = predicted class). See the module docstring for the formula."""
    x, y = _as_float64(features), np.asarray(backend.to_numpy(labels)).astype(np.int64)
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise ValueError(f"features must be (n, d) and labels (n,), got {x.shape} and {y.shape}")
    if not np.isfinite(l2) or l2 < 0 or (l2 == 0 and x.shape[0] <= x.shape[1]):    # NaN fails no comparison
        raise ValueError(f"l2 must be a finite number > 0 (or >= 0 with more examples than dimensions), got {l2}")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes})")
    mu = x.mean(axis=0)
    scale = x.std(axis=0) + 1e-6 if standardize else np.ones(x.shape[1])
    xc = (x - mu) / scale                                                  # (n, d), centred
    t = 2.0 * np.eye(num_classes)[y] - 1.0                                 # (n, K) in {-1, 1}
    t_mean = t.mean(axis=0)
    tc = t - t_mean
    n, d = xc.shape
    if n < d:                                                              # dual: an n x n system
        w = xc.T @ np.linalg.solve(xc @ xc.T + l2 * np.eye(n), tc)
    else:                                                                  # primal: a d x d system
        w = np.linalg.solve(xc.T @ xc + l2 * np.eye(d), xc.T @ tc)

    def scores(test_features):
        return ((_as_float64(test_features) - mu) / scale) @ w + t_mean
    return scores


def fewshot_linear(train_features, train_labels, test_features, test_labels, l2: float = 1.0,
                   num_classes: int | None = None, standardize: bool = True) -> float:
    """Accuracy in [0, 1] on the test set of the closed-form least-squares classifier fitted to
    (train_features (n, d), train_labels (n,)); test_features (m, d), test_labels (m,).
    num_classes: K (default: 1 + the largest label seen)."""
    test_labels = np.asarray(backend.to_numpy(test_labels)).astype(np.int64)
    if num_classes is None:
        num_classes = int(max(np.max(backend.to_numpy(train_labels)), test_labels.max())) + 1
    scores = fit_least_squares(train_features, train_labels, num_classes, l2, standardize)
    return float((scores(test_features).argmax(axis=1) == test_labels).mean())


def sample_per_class(labels, shots: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of ``shots`` random examples of every class present in ``labels`` (n,), without
    replacement, grouped by class: (K * shots,). Raises if a class has fewer than ``shots``."""
    labels = np.asarray(labels)
    classes, counts = np.unique(labels, return_counts=True)
    if shots < 1 or counts.min() < shots:
        raise ValueError(f"{shots}-shot needs {shots} examples of every class; the smallest class has {counts.min()}")
    order = np.lexsort((rng.random(len(labels)), labels))                 # by class, shuffled within
    sorted_labels = labels[order]
    first = np.searchsorted(sorted_labels, sorted_labels)                  # where each class starts
    keep = (np.arange(len(labels)) - first) < shots                        # the first `shots` of each
    return order[keep]


def extract_features(model, images, mean=None, std=None, batch_size: int = 256, device: str = "cpu",
                     pool: str | None = None) -> np.ndarray:
    """The frozen representation of every image, in batches, under no_grad: (n, d) float32 on the host.

    model: a ViT (or anything with ``to_vit()``, such as a pre-trained MaskedPatchViT, whose encoder is
    used). images: (n, C, H, W) uint8 (or float in [0, 1]); mean, std: the normalisation the model was
    trained with (default: none). pool: None -> the model's own representation, the input of its
    classification head (pre-logits(y) of Eq. 4); "token" -> the class token's output (Eq. 4);
    "gap" -> the mean of the patch tokens' outputs (after the final LayerNorm)."""
    from ..data import normalize, to_float
    if pool not in (None, "token", "gap"):
        raise ValueError(f"pool must be None, 'token' or 'gap', got {pool!r}")
    vit = model.to_vit() if hasattr(model, "to_vit") else model
    prefix = vit.config.num_prefix_tokens
    if pool == "token" and not prefix:
        raise ValueError("pool='token': this model has no class token (it was built with pool='gap')")
    was_training = vit.training
    vit.eval()
    out = []
    try:
        with no_grad():
            for start in range(0, len(images), batch_size):
                x = to_float(backend.to_device(images[start:start + batch_size], device))
                if mean is not None:
                    x = normalize(x, mean, std)
                tokens = vit.encode(vit.add_position(vit.embed_patches(x)))      # (b, prefix + N, D)
                if pool is None:
                    y = vit.pre_logits(vit.pool(tokens))
                elif pool == "token":
                    y = tokens[:, 0]
                else:
                    y = tokens[:, prefix:].mean(axis=1)
                out.append(backend.to_numpy(y.data))
    finally:
        vit.train(was_training)
    return np.concatenate(out) if out else np.zeros((0, vit.config.dim), np.float32)


def fewshot_subsets(labels, shots=(1, 5, 10, 25), seeds: int = 5, seed: int = 0) -> dict:
    """{(shots, s): indices (K * shots,)} of the training subset of every shot count and repetition
    s < seeds, subset s drawn with np.random.default_rng([seed, s, shots]) (reproducible)."""
    labels = np.asarray(backend.to_numpy(labels))
    return {(n, s): sample_per_class(labels, n, np.random.default_rng([seed, s, n]))
            for n in shots for s in range(seeds)}


def fewshot_evaluate(train_features, train_labels, test_features, test_labels, shots=(1, 5, 10, 25),
                     seeds: int = 5, l2s=(1.0,), num_classes: int | None = None, standardize: bool = True,
                     seed: int = 0) -> dict:
    """Few-shot accuracy for each shot count and l2, over ``seeds`` random training subsets.

    train_features (n, d) / train_labels (n,): the pool the subsets are drawn from (only the rows
    that ``fewshot_subsets`` picks are read, so the others may be left unfilled).
    Returns {(shots, l2): {"accs": [accuracy per subset], "mean": ..., "std": ...}}."""
    train_labels = np.asarray(backend.to_numpy(train_labels))
    k = num_classes or int(max(train_labels.max(), np.max(backend.to_numpy(test_labels)))) + 1
    subsets = fewshot_subsets(train_labels, shots, seeds, seed)
    results = {}
    for n_shots in shots:
        for l2 in l2s:
            accs = [fewshot_linear(train_features[idx], train_labels[idx], test_features, test_labels,
                                   l2=l2, num_classes=k, standardize=standardize)
                    for (n, _), idx in subsets.items() if n == n_shots]
            results[(n_shots, l2)] = {"accs": accs, "mean": float(np.mean(accs)), "std": float(np.std(accs))}
    return results
