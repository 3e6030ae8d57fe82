"""KVzap's fit: closed-form ridge regression of log KVzip+ scores on hidden states, per layer, and the
fit's quality on held-out text. Host-side numpy (float64): this runs once, offline, never in a cache.

The target is ``log(max(s, floor))`` of the KVzip+ score s of every (token, KV head): the paper's
surrogate predicts log-space scores (arXiv 2601.07891, Sec. 3; its released scorers output log-space
scores). The attention sinks (the first ``n_sink`` positions) are left out: every method keeps them.
"""

from __future__ import annotations

import numpy as np

from ...config import budget_for

LOG_FLOOR = 1e-7  # scores below this (underflowed probabilities) are clipped before the log
ALPHAS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # ridge strengths tried, relative to the mean feature variance


def log_targets(scores: np.ndarray) -> np.ndarray:
    return np.log(np.maximum(scores.astype(np.float64), LOG_FLOOR))


class Ridge:
    """Closed-form ridge regression ``x W + b ~ y``: the centred Gram matrix is formed once, then solved for
    any strength. ``lam = alpha * mean diag`` of that matrix (scale-free); the bias is not penalized."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        x, y = x.astype(np.float64), y.astype(np.float64)
        self.mx, self.my = x.mean(axis=0), y.mean(axis=0)
        xc = x - self.mx
        self.gram, self.xty = xc.T @ xc, xc.T @ (y - self.my)
        self.scale = max(np.trace(self.gram) / self.gram.shape[0], 1e-12)

    def solve(self, alpha: float):
        w = np.linalg.solve(self.gram + alpha * self.scale * np.eye(self.gram.shape[0]), self.xty)
        return w, self.my - self.mx @ w


def ridge(x: np.ndarray, y: np.ndarray, alpha: float):
    """(W (d, H), b (H,)) of :class:`Ridge` at one strength."""
    return Ridge(x, y).solve(alpha)


def r2(pred: np.ndarray, y: np.ndarray) -> float:
    """Coefficient of determination pooled over tokens and heads (each head's own mean as baseline)."""
    sse = float(((pred - y) ** 2).sum())
    sst = float(((y - y.mean(axis=0)) ** 2).sum())
    return 1.0 - sse / sst if sst > 0 else float("nan")


def _ranks(a: np.ndarray) -> np.ndarray:
    r = np.empty_like(a, dtype=np.float64)
    r[np.argsort(a, kind="stable")] = np.arange(len(a))
    return r


def spearman(pred: np.ndarray, y: np.ndarray) -> float:
    """Rank correlation of one head's predicted and true scores over one text's tokens."""
    a, b = _ranks(pred), _ranks(y)
    a, b = a - a.mean(), b - b.mean()
    den = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / den) if den > 0 else float("nan")


def keep_overlap(pred: np.ndarray, y: np.ndarray, density: float) -> float:
    """Of the rows KVzip+ would keep at ``density`` (its top scores), the share the prediction keeps too."""
    k = budget_for(density, len(y))
    top_true = set(np.argsort(-y, kind="stable")[:k].tolist())
    top_pred = np.argsort(-pred, kind="stable")[:k]
    return sum(int(i) in top_true for i in top_pred) / k


def fit_layers(train: dict, val: dict, test: dict, density: float = 0.2):
    """Fit every layer. Each argument: {layer: [(x (n, d), y (n, H) log-targets), ... one per text]}.

    The ridge strength is chosen per layer on ``val`` (lowest squared error), the layer is refitted on
    train + val, and scored on ``test`` texts. Returns ({layer: (W, b)}, {layer: quality}, {layer: alpha})."""
    weights, quality, alphas = {}, {}, {}
    for layer in sorted(train):
        xt, yt = _stack(train[layer])
        xv, yv = _stack(val[layer])
        fit = Ridge(xt, yt)
        errs = [float(((xv @ w + b - yv) ** 2).mean()) for w, b in map(fit.solve, ALPHAS)]
        alpha = ALPHAS[int(np.argmin(errs))]
        w, b = ridge(np.concatenate([xt, xv]), np.concatenate([yt, yv]), alpha)
        weights[layer], alphas[layer] = (w.astype(np.float32), b.astype(np.float32)), alpha
        quality[layer] = held_out_quality(test[layer], lambda x, p=(w, b): predict(x, p), density)
    return weights, quality, alphas


def held_out_quality(texts: list, predict, density: float = 0.2) -> dict:
    """R^2 over the pooled held-out rows; mean per-(text, head) Spearman and top-``density`` overlap.
    ``predict``: (n, d) hidden states -> (n, H) predicted log-scores."""
    x, y = _stack(texts)
    rho, keep = [], []
    for xi, yi in texts:
        p = predict(xi)
        for h in range(yi.shape[1]):  # host-side report over a handful of heads, not a hot path
            rho.append(spearman(p[:, h], yi[:, h]))
            keep.append(keep_overlap(p[:, h], yi[:, h], density))
    return {"r2": round(r2(predict(x), y), 4), "spearman": round(float(np.nanmean(rho)), 4),
            f"keep_overlap_{density:g}": round(float(np.mean(keep)), 4), "rows": int(len(y))}


# The MLP surrogate (paper Sec. 3: a 2-layer MLP beside the linear one). Training defaults as the
# authors' released training script: hidden width 512, 15 epochs, Adam at 5e-3, batches of 512 rows.
MLP_DEFAULTS = {"hidden": 512, "epochs": 15, "lr": 5e-3, "batch": 512}


def mlp_predict(x: np.ndarray, w1, b1, w, b) -> np.ndarray:
    """Host-side MLP prediction ``gelu(x W1 + b1) W + b`` (the same function the cache compiles)."""
    import mlx.core as mx
    import mlx.nn as nn

    h = nn.gelu(mx.array(x, dtype=mx.float32) @ mx.array(w1) + mx.array(b1))
    return np.array(h @ mx.array(w) + mx.array(b)).astype(np.float64)


def predict(x: np.ndarray, params) -> np.ndarray:
    """Host-side prediction of one layer's scorer, (W, b) linear or (W1, b1, W, b) MLP."""
    params = [np.asarray(a) for a in params]
    return mlp_predict(x, *params) if len(params) == 4 else x @ params[0] + params[1]


def fit_mlp_layers(train: dict, val: dict, test: dict, density: float = 0.2, hidden: int = 512,
                   epochs: int = 15, lr: float = 5e-3, batch: int = 512, seed: int = 0):
    """Fit a 2-layer MLP per layer (MLX, Adam, mean squared error on log-targets). Inputs and targets are
    standardized on the training rows for the optimizer and the scaling is folded back into the weights;
    the epoch with the lowest validation error is kept. Returns ({layer: (W1, b1, W, b)}, {layer:
    quality}, {layer: best epoch})."""
    weights, quality, best_epochs = {}, {}, {}
    for layer in sorted(train):
        xt, yt = _stack(train[layer])
        xv, yv = _stack(val[layer])
        params, epoch = _train_mlp(xt, yt, xv, yv, hidden, epochs, lr, batch, seed + layer)
        weights[layer], best_epochs[layer] = params, epoch
        quality[layer] = held_out_quality(test[layer], lambda x, p=params: predict(x, p), density)
    return weights, quality, best_epochs


def _train_mlp(xt, yt, xv, yv, hidden, epochs, lr, batch, seed):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    mu, sd = xt.mean(axis=0), xt.std(axis=0) + 1e-6
    ym, ys = yt.mean(axis=0), yt.std(axis=0) + 1e-6
    X, Y = mx.array(((xt - mu) / sd).astype(np.float32)), mx.array(((yt - ym) / ys).astype(np.float32))
    Xv, Yv = mx.array(((xv - mu) / sd).astype(np.float32)), mx.array(((yv - ym) / ys).astype(np.float32))
    mx.random.seed(seed)
    net = nn.Sequential(nn.Linear(X.shape[1], hidden), nn.GELU(), nn.Linear(hidden, Y.shape[1]))
    opt = optim.Adam(learning_rate=lr)

    def loss(model, x, y):
        return nn.losses.mse_loss(model(x), y)

    step_grad = nn.value_and_grad(net, loss)

    rng = np.random.default_rng(seed)
    best, best_epoch, best_params = np.inf, 0, None
    for epoch in range(1, epochs + 1):
        order = mx.array(rng.permutation(X.shape[0]))
        for s in range(0, X.shape[0], batch):  # minibatches of an offline fit, not a cache's hot path
            idx = order[s:s + batch]
            _, grads = step_grad(net, X[idx], Y[idx])
            opt.update(net, grads)
            mx.eval(net.parameters(), opt.state)
        v = float(loss(net, Xv, Yv).item())
        if v < best:
            best, best_epoch = v, epoch
            best_params = [np.array(a) for a in (net.layers[0].weight, net.layers[0].bias,
                                                 net.layers[2].weight, net.layers[2].bias)]
    w1, b1, w2, b2 = best_params  # mlx Linear weights are (out, in): transpose to x @ W
    w1 = w1.T / sd[:, None]  # ((x - mu) / sd) W1n = x w1 - mu w1
    b1 = (b1 - mu @ w1).astype(np.float32)
    w1 = w1.astype(np.float32)
    w = (w2.T * ys[None, :]).astype(np.float32)
    b = (b2 * ys + ym).astype(np.float32)
    return (w1, b1, w, b), best_epoch


def _stack(texts: list):
    return (np.concatenate([x for x, _ in texts]).astype(np.float64),
            np.concatenate([y for _, y in texts]).astype(np.float64))


def summarize(quality: dict) -> dict:
    """Mean of each quality number over layers."""
    keys = [k for k in next(iter(quality.values())) if k != "rows"]
    return {k: round(float(np.mean([q[k] for q in quality.values()])), 4) for k in keys}
