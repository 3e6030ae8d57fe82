"""Planted-anomaly scenarios: deterministic (from a seed) key / value / query streams for one layer
(B=1, H_kv=2, H_q=4, D=32) with a few planted token positions whose fate the runner tracks."""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Iterable

import numpy as np

D = 32
H_KV = 2
H_Q = 4
SCALE = D ** -0.5

# --------------------------------------------------------------------------------------------
# Scenario container and helpers
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Scenario:
    """One generated instance (one seed) of a scenario."""

    name: str
    family: str
    keys: np.ndarray  # (H_kv, T, D) float32
    values: np.ndarray  # (H_kv, T, D) float32
    queries: np.ndarray  # (H_q, T, D) float32
    prompt_len: int  # prefill covers [0, prompt_len); then T - prompt_len single-token steps
    chunk: int  # prefill chunk size
    planted: dict  # label -> sorted int array of planted positions
    target: str  # label whose retention is the headline number
    checkpoint_every: int = 0  # >0: record target retention every this many decode steps
    recall_query: bool = False  # report the final query's full-context attention mass kept
    info: dict = dataclasses.field(default_factory=dict)  # generator diagnostics (JSON-able)

    @property
    def total_len(self) -> int:
        return self.keys.shape[1]


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([int(seed), zlib.crc32(name.encode())])


def _basis(rng: np.random.Generator, n_special: int):
    """A random orthonormal basis of R^D: (special directions (n, D), complement (D-n, D))."""
    q, _ = np.linalg.qr(rng.standard_normal((D, D)))
    q = q.T  # rows orthonormal
    return q[:n_special], q[n_special:]


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _complement_noise(rng, comp: np.ndarray, shape: tuple, norm: float) -> np.ndarray:
    """Random vectors of the given norm inside span(comp)."""
    g = rng.standard_normal(shape + (comp.shape[0],))
    return norm * _unit(g) @ comp


def _values(rng, T: int) -> np.ndarray:
    return (0.5 * rng.standard_normal((H_KV, T, D))).astype(np.float32)


def _gqa(x_kv: np.ndarray) -> np.ndarray:
    """Map per-KV-head arrays (H_kv, ...) onto query heads (H_q, ...) (GQA grouping)."""
    return np.repeat(x_kv, H_Q // H_KV, axis=0)


def attention_probs(keys: np.ndarray, queries: np.ndarray, q_pos: Iterable[int]) -> np.ndarray:
    """Exact causal softmax attention over the full context (no eviction), float64.

    keys (H_kv, T, D), queries (H_q, T, D); returns (H_q, len(q_pos), T), zero above the diagonal.
    """
    q_pos = np.asarray(list(q_pos))
    kq = _gqa(keys).astype(np.float64)
    q = queries[:, q_pos].astype(np.float64)
    logits = np.einsum("hqd,htd->hqt", q, kq) * SCALE
    T = keys.shape[1]
    logits = np.where(np.arange(T)[None, None, :] <= q_pos[None, :, None], logits, -np.inf)
    logits -= logits.max(-1, keepdims=True)
    p = np.exp(logits)
    return p / p.sum(-1, keepdims=True)


def block_distribution(probs: np.ndarray, block: int = 32) -> np.ndarray:
    """Row-normalised block sums (Nexus Eq. 1) of (..., T) attention rows over absolute-position blocks."""
    T = probs.shape[-1]
    nb = -(-T // block)
    pad = nb * block - T
    p = np.pad(probs, [(0, 0)] * (probs.ndim - 1) + [(0, pad)])
    s = p.reshape(p.shape[:-1] + (nb, block)).sum(-1)
    return s / s.sum(-1, keepdims=True)


# --------------------------------------------------------------------------------------------
# 1. NestedKV geometries
# --------------------------------------------------------------------------------------------

NESTED_KINDS = ("global", "episodic", "recency")


def episodic_block(n: int) -> int:
    """NestedKV's episodic block length clip(floor(N/32), 128, 256)."""
    return int(min(max(n // 32, 128), 256))


def make_nested(kind: str, n: int, seed: int, n_decode: int = 4, chunk: int | None = None) -> Scenario:
    """One of the three NestedKV geometries with a single planted token in a prompt of n tokens.

    Background keys (per KV head, independent noise) are unit vectors around a local base
    direction, scaled so logits are O(2). Queries are drawn around the same local base direction as
    the keys at their position (they follow the local context and never point at the anomaly).

    * global: base = mu everywhere; the planted key is orthogonal to mu (anomalous against the
      global mean; there is no local structure).
    * episodic: consecutive episodic blocks (length clip(N/32,128,256)) alternate
      base = mu + v / mu - v, so the global mean is ~mu (an odd trailing block, if any, is mu);
      the planted key is mu itself inside a +-v block centred in 20-70% of the prompt: zero global
      anomaly, anomalous against its block (and its in-block trailing window).
    * recency: base = mu, except the 64 tokens before the planted token and everything after it
      (rest of the prompt and decode) are mu + v; the planted key is mu: near-zero global anomaly,
      anomalous against its trailing window. It sits 4-7 tokens before the end of the prompt.
    """
    if kind not in NESTED_KINDS:
        raise ValueError(f"kind must be one of {NESTED_KINDS}")
    name = f"nested_{kind}_N{n}"
    rng = _rng(seed, name)
    T = n + n_decode
    mu, v, u = _basis(rng, 3)[0]
    r = math.sqrt(2 * math.sqrt(D))  # |q| = |k| = r  ->  logit = 2 cos(q, k)
    base = np.tile(mu, (T, 1))
    if kind == "global":
        p = int(rng.integers(n // 4, 3 * n // 4))
        planted_dir = u
    elif kind == "episodic":
        be = episodic_block(n)
        nfull = n // be
        npair = nfull // 2
        for b in range(2 * npair):
            base[b * be:(b + 1) * be] = _unit(mu + (v if b % 2 == 0 else -v))
        # a +-v block whose centre lies in the middle of the prompt (never in a recent window)
        mid = [b for b in range(2 * npair) if 0.2 * n <= (b + 0.5) * be <= 0.7 * n] or list(range(2 * npair))
        blk = int(rng.choice(mid))
        p = blk * be + int(rng.integers(be // 4, 3 * be // 4))
        planted_dir = mu
    else:
        p = n - 4 - int(rng.integers(0, 4))
        base[p - 64:] = _unit(mu + v)
        planted_dir = mu
    sigma_k, sigma_q = 0.3, 0.5
    keys = np.empty((H_KV, T, D), np.float32)
    for h in range(H_KV):
        g = rng.standard_normal((T, D)) / math.sqrt(D)
        k = _unit(base + sigma_k * g)
        k[p] = _unit(planted_dir + sigma_k * g[p])
        keys[h] = r * k
    queries = np.empty((H_Q, T, D), np.float32)
    for h in range(H_Q):
        g = rng.standard_normal((T, D)) / math.sqrt(D)
        queries[h] = r * _unit(base + sigma_q * g)
    return Scenario(
        name=name, family=f"nested_{'small' if n <= 1024 else 'paper'}", keys=keys, values=_values(rng, T),
        queries=queries, prompt_len=n, chunk=chunk or (64 if n <= 1024 else 512),
        planted={"planted": np.array([p])}, target="planted",
        info={"geometry": kind, "N": n, "planted_pos": p, "episodic_block": episodic_block(n),
              "anomaly": _nested_anomalies(keys[:, :n], p, n)})


def _nested_anomalies(keys: np.ndarray, p: int, n: int, window: int = 64) -> dict:
    """Cosine anomaly (1 - cos) of the planted key vs the global / episodic / trailing-window means,
    and its rank (1 = most anomalous) among all prompt tokens, head 0."""
    k = _unit(keys[0].astype(np.float64))
    be = episodic_block(n)
    g = k.mean(0)
    blk = np.stack([k[(i // be) * be:(i // be + 1) * be].mean(0) for i in range(n)])
    cs = np.cumsum(np.vstack([np.zeros(D), k]), 0)
    win = np.stack([(cs[i + 1] - cs[max(i + 1 - window, 0)]) / (i + 1 - max(i + 1 - window, 0))
                    for i in range(n)])
    out = {}
    for label, anchor in (("global", np.broadcast_to(g, k.shape)), ("episodic", blk), ("current", win)):
        a = 1 - np.sum(k * _unit(anchor), -1)
        out[label] = {"value": float(a[p]), "rank": int((a > a[p]).sum() + 1)}
    return out


# --------------------------------------------------------------------------------------------
# 2. Bridge tokens (Nexus Thm 4.2)
# --------------------------------------------------------------------------------------------

BRIDGE_WINDOW = 16


def make_bridge(seed: int, n: int = 1024, n_distractors: int = 16, peak: float = 0.6, hub: float = 0.04,
                hub_jitter: float = 0.25) -> Scenario:
    """A hub block that every window query gives moderate mass, none a peak, among peaked distractors.

    n tokens (n/32 blocks of 32, block-aligned) in ONE prefill chunk (as mlx-lm would prefill a
    1K prompt) plus one decode token. Special directions e_hub, e_d1..e_dM are orthonormal;
    background keys/queries live in the orthogonal complement (logit noise ~0.15). Hub and
    distractor blocks (32 tokens each, random block slots) have keys 3*e + small noise. The first
    n - 16 queries are background (uninformative). Window query w (the last 16 prompt tokens)
    points at distractor d(w) = w mod M and at the hub, with logits solved so that (against the
    full context) its block mass is ~``peak`` on d(w) and ~hub*(1 + jitter*U[-1,1]) on the hub.
    With M = 16 distractors each is peaked by one window query: its direct score ~peak/M exceeds
    the hub's ~hub, but the hub is in every row (the walk's overlap term).
    """
    name = f"bridge_N{n}"
    rng = _rng(seed, name)
    nb = n // 32
    T = n + 1
    special, comp = _basis(rng, 1 + n_distractors)
    e_hub, e_d = special[0], special[1:]
    # block slots: avoid the sink block, the window block and the block before it
    slots = rng.permutation(np.arange(1, nb - 2))[: 1 + n_distractors]
    hub_blk, d_blks = int(slots[0]), [int(s) for s in slots[1:]]
    kb = qb = 2.0
    beta = 3.0
    keys = np.empty((H_KV, T, D), np.float32)
    for h in range(H_KV):
        k = _complement_noise(rng, comp, (T,), kb)
        k[hub_blk * 32:(hub_blk + 1) * 32] = beta * e_hub + _complement_noise(rng, comp, (32,), 0.3)
        for j, b in enumerate(d_blks):
            k[b * 32:(b + 1) * 32] = beta * e_d[j] + _complement_noise(rng, comp, (32,), 0.3)
        keys[h] = k
    m_w = hub * (1 + hub_jitter * rng.uniform(-1, 1, BRIDGE_WINDOW))
    queries = np.empty((H_Q, T, D), np.float32)
    w0 = n - BRIDGE_WINDOW
    for h in range(H_Q):
        q = _complement_noise(rng, comp, (T,), qb)
        for w in range(BRIDGE_WINDOW):
            t = w0 + w
            n_other = t + 1 - 64  # visible tokens outside the hub and the peaked block
            rest = 1 - peak - m_w[w]
            lp = math.log(peak * n_other / (32 * rest))
            lh = math.log(m_w[w] * n_other / (32 * rest))
            q[t] = q[t] + (lp * math.sqrt(D) / beta) * e_d[w % n_distractors] + (lh * math.sqrt(D) / beta) * e_hub
        queries[h] = q
    hub_pos = np.arange(hub_blk * 32, hub_blk * 32 + 32)
    dis_pos = np.concatenate([np.arange(b * 32, b * 32 + 32) for b in sorted(d_blks)])
    sc = Scenario(name=name, family="bridge", keys=keys, values=_values(rng, T), queries=queries,
                  prompt_len=n, chunk=n, planted={"hub": hub_pos, "distractors": dis_pos}, target="hub")
    sc.info = {"hub_block": hub_blk, "distractor_blocks": sorted(d_blks), **bridge_stats(sc)}
    return sc


def bridge_stats(sc: Scenario) -> dict:
    """Window block distributions (per query head, exact, full context) and the hub diagnostics:
    per-query hub mass vs that query's peak block mass, direct score a_j, mean pairwise
    co-attention mean_{q != q'} a_j^(q) a_j^(q') (the block's share of the walk's overlap term
    <a^(q), C>), and Thm 4.2's hub score h_j = Sigma_j^T a_* (window rows of all query heads pooled)."""
    n = sc.prompt_len
    w_pos = range(n - BRIDGE_WINDOW, n)
    rows = block_distribution(attention_probs(sc.keys, sc.queries, w_pos)).mean(0)  # head-averaged (W, Nk)
    hub_blk = int(sc.planted["hub"][0]) // 32
    nk = rows.shape[1]
    cand = np.ones(nk, bool)
    cand[0] = cand[nk - 1] = False  # sink block and window block are forced by every method
    a = rows.mean(0)
    R = rows.shape[0]
    co = (rows.sum(0) ** 2 - (rows ** 2).sum(0)) / (R * (R - 1))
    cov = np.cov(rows, rowvar=False, bias=True)
    hscore = cov @ a
    peak_block = rows.argmax(1)
    return {
        "hub_never_peak": bool((peak_block != hub_blk).all()),
        "hub_mass_over_row_peak_max": float((rows[:, hub_blk] / rows.max(1)).max()),
        "hub_direct_rank": int((a[cand] > a[hub_blk]).sum() + 1),
        "hub_coattention_rank": int((co[cand] > co[hub_blk]).sum() + 1),
        "hub_h_score_rank": int((hscore[cand] > hscore[hub_blk]).sum() + 1),
        "hub_direct_score": float(a[hub_blk]),
        "distractor_direct_score_mean": float(a[[b for b in range(nk) if
                                                 b * 32 in set(sc.planted["distractors"].tolist())]].mean()),
    }


# --------------------------------------------------------------------------------------------
# 3. Marginal erosion (Nexus Lemma 4.1)
# --------------------------------------------------------------------------------------------


def make_erosion(seed: int, n_decode: int = 6400, prompt: int = 512, n_subtle: int = 3, rho: float = 0.9,
                 mean_logit: float = 0.35, sd_logit: float = 0.45, final_logit: float = 2.5,
                 checkpoint_every: int = 64) -> Scenario:
    """Three subtle blocks whose attention fluctuates around the cutoff over a long decode stream.

    Prompt of ``prompt`` tokens (chunks of 256) then ``n_decode`` single-token decode steps.
    Directions e_hh, e_s1..e_s3 orthonormal; background keys/queries in the complement (logit
    noise ~0.15). Four heavy-hitter tokens (positions 40-43, logit +3 for every query) occupy a
    block every method should keep. Three subtle spans of 32 tokens sit in random block-aligned
    slots of the prompt with keys 2*e_si. Query t gets component x_i(t) on e_si so that the subtle
    tokens' logit is L_i(t) = mean_logit + sd_logit * z_i(t), z_i an AR(1) process (rho=0.9,
    unit variance), independent per span: on average above a background block, regularly below.
    The last decode query needs them: logit ``final_logit`` on every subtle token.
    """
    name = f"erosion_T{n_decode}"
    rng = _rng(seed, name)
    T = prompt + n_decode
    special, comp = _basis(rng, 1 + n_subtle)
    e_hh, e_s = special[0], special[1:]
    nb = prompt // 32
    slots = sorted(int(s) for s in rng.permutation(np.arange(3, nb - 1))[:n_subtle])
    kb = qb = 2.0
    beta = 2.0
    hh_pos = np.arange(40, 44)
    keys = np.empty((H_KV, T, D), np.float32)
    for h in range(H_KV):
        k = _complement_noise(rng, comp, (T,), kb)
        k[hh_pos] = beta * e_hh + _complement_noise(rng, comp, (len(hh_pos),), 0.3)
        for i, b in enumerate(slots):
            k[b * 32:(b + 1) * 32] = beta * e_s[i] + _complement_noise(rng, comp, (32,), 0.3)
        keys[h] = k
    z = np.empty((n_subtle, T))
    z[:, 0] = rng.standard_normal(n_subtle)
    eps = rng.standard_normal((n_subtle, T))
    for t in range(1, T):
        z[:, t] = rho * z[:, t - 1] + math.sqrt(1 - rho ** 2) * eps[:, t]
    L = mean_logit + sd_logit * z  # (n_subtle, T)
    L[:, -1] = final_logit
    coef = math.sqrt(D) / beta
    queries = np.empty((H_Q, T, D), np.float32)
    for h in range(H_Q):
        q = _complement_noise(rng, comp, (T,), qb)
        q += (3.0 * coef) * e_hh[None, :]
        q += (L.T * coef) @ e_s
        queries[h] = q
    sub_pos = np.concatenate([np.arange(b * 32, b * 32 + 32) for b in slots])
    return Scenario(
        name=name, family="erosion", keys=keys, values=_values(rng, T), queries=queries, prompt_len=prompt,
        chunk=256, planted={"subtle": sub_pos, "heavy": hh_pos}, target="subtle",
        checkpoint_every=checkpoint_every, recall_query=True,
        info={"subtle_blocks": slots, "frac_steps_below_background": float((L[:, prompt:-1] < 0).mean())})


# --------------------------------------------------------------------------------------------
# 4. Heavy hitters (sanity floor)
# --------------------------------------------------------------------------------------------


def make_heavy(seed: int, n: int = 2048, n_hh: int = 8, n_decode: int = 64, hh_logit: float = 3.0) -> Scenario:
    """Eight tokens every query attends to strongly (logit +3 vs ~0 for the background).

    Prompt of n tokens (chunks of 512) plus ``n_decode`` decode steps; heavy-hitter positions are
    random in [64, n/2); keys 2*e_hh + noise, every query has the e_hh component giving logit 3.
    """
    name = f"heavy_N{n}"
    rng = _rng(seed, name)
    T = n + n_decode
    special, comp = _basis(rng, 1)
    e_hh = special[0]
    pos = np.sort(rng.choice(np.arange(64, n // 2), n_hh, replace=False))
    beta = 2.0
    keys = np.empty((H_KV, T, D), np.float32)
    for h in range(H_KV):
        k = _complement_noise(rng, comp, (T,), 2.0)
        k[pos] = beta * e_hh + _complement_noise(rng, comp, (n_hh,), 0.3)
        keys[h] = k
    queries = np.empty((H_Q, T, D), np.float32)
    for h in range(H_Q):
        queries[h] = _complement_noise(rng, comp, (T,), 2.0) + (hh_logit * math.sqrt(D) / beta) * e_hh
    return Scenario(name=name, family="heavy_hitters", keys=keys, values=_values(rng, T), queries=queries,
                    prompt_len=n, chunk=512, planted={"heavy": pos}, target="heavy")


def cumulative_attention(sc: Scenario, stride: int = 1) -> np.ndarray:
    """Causal cumulative attention each key position receives from all queries (head-summed)."""
    q_pos = range(0, sc.total_len, stride)
    total = np.zeros(sc.total_len)
    for start in range(0, len(q_pos), 256):
        sub = list(q_pos)[start:start + 256]
        total += attention_probs(sc.keys, sc.queries, sub).sum((0, 1))
    return total
