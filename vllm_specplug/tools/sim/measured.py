"""Forward-pass prices from a measured table (``data/h200-2026-12-04.jsonl``).

The table (provenance in ``data/README.md``) times one forward pass per
shape on one NVIDIA H200: ``B`` requests of ``q`` query tokens each over
``L`` tokens of cached context, for the models the GPU setups run
(``llama-3.1-8b``, ``llama-3-70b-tp2``: one rank of TP=2, ``llama-3.2-1b-tp2``,
``eagle3-8b``: one EAGLE-3 layer).  It is the GPU's side of a pass only: no
vLLM kernels, no all-reduce between ranks, no host time (``cost.py`` adds
those as named assumptions).

A pass of the engine is priced from it as

    t = dec(B, q, L) + W(pad(T)) - W(B * q) + sum over prefill chunks of a(c) * L_c

- ``dec(B, q, L)``: the decode-shaped part, ``B`` decoding requests with
  ``q`` = their mean query tokens (1 + drafts verified), clamped to the
  measured 1..9, and ``L`` their mean context.  At L = 1024 (the full grid:
  20 batch sizes 1..512 x q = 1, 2, 3, 4, 5, 7, 9) bilinear in (log B, log q);
  past B = 512 linear in B from the last two batch sizes (attention's KV
  reads grow with B).  Other contexts add ``D(B, q) * (L - 1024) / (Lm - 1024)``
  with ``D`` the measured difference t(B, q, Lm) - t(B, q, 1024), Lm = 256
  for L < 1024 and 4096 for L > 1024: linear in L (and so extrapolated below
  256 and above 4096), ``D`` bilinear in (log B, log q) over that sparser grid
  (B = 1, 8, 32, 128, 512 at 256; 1, 8, 32, 64, 128 at 4096; q = 1, 3, 5, 9),
  q held at its edges, and past the largest measured B proportional to B
  (the context's KV reads).  (Interpolating the difference, not a
  per-request slope: the B = 1 rows carry +-1 ms of noise on the 70B rank,
  which a slope multiplied by B would spread over the neighbouring batches.)
- ``W(T)``: the token-proportional part (the weight GEMMs, the LM head), the
  B = 1 prefill passes at L = 0 (T = 16, 64, 256, 1024, 2048), linear in
  log T between them, flat below 16 (a pass that small reads its weights
  and nothing else), linear in T past 2048 at the slope of 1024..2048.  Every
  token the decode-shaped part does not cover (prefill chunks, padding to a
  CUDA-graph capture size, drafts past q = 9) is priced at W's margin.  A pass
  with no decoding request is ``W(pad(T))`` plus its chunks' attention.
- ``a(c)``: a prefill chunk of ``c`` tokens after ``L_c`` cached ones adds
  ``a(c) * L_c``, ``a`` = (t(1, c, 1024) - t(1, c, 0)) / 1024 from the
  table, linear in log c between the measured chunk sizes, proportional to c
  outside them, and never negative.

Every measured decode shape and prefill chunk is reproduced exactly (tested),
and between two measured points along B or q the price is monotone whenever
the two points are (linear interpolation).  The table's own noise stays: a
few neighbouring points are not monotone (the 70B rank at B = 1 is 24.3 ms,
at B = 2 22.7 ms).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent / "data"
BASE_L = 1024.0


def _interp_cols(x: np.ndarray, xs: np.ndarray, ys: np.ndarray, extrapolate: str) -> np.ndarray:
    """Each column of ``ys`` (rows at ``xs``, ascending) at ``x``: linear in
    log x inside; below ``xs[0]`` held; above ``xs[-1]`` ``"linear"`` (in x,
    from the last two rows) or ``"hold"``.  Returns shape (len(x), ncols)."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    lx, lxs = np.log(np.maximum(x, xs[0])), np.log(xs)
    i = np.clip(np.searchsorted(lxs, lx, side="right") - 1, 0, len(xs) - 2)
    w = np.clip((lx - lxs[i]) / (lxs[i + 1] - lxs[i]), 0.0, 1.0)[:, None]
    out = ys[i] * (1.0 - w) + ys[i + 1] * w
    if extrapolate == "linear":
        over = x > xs[-1]
        if over.any():
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            out[over] = ys[-1] + (x[over] - xs[-1])[:, None] * slope
    return out


def _pick(rows: np.ndarray, q: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Row-wise linear-in-log-q interpolation between the columns ``qs``
    (q clamped to [qs[0], qs[-1]])."""
    lq, lqs = np.log(np.clip(q, qs[0], qs[-1])), np.log(qs)
    j = np.clip(np.searchsorted(lqs, lq, side="right") - 1, 0, len(qs) - 2)
    w = np.clip((lq - lqs[j]) / (lqs[j + 1] - lqs[j]), 0.0, 1.0)
    r = np.arange(rows.shape[0])
    return rows[r, j] * (1.0 - w) + rows[r, j + 1] * w


class PassTable:
    """One model's measured passes (seconds)."""

    def __init__(self, model: str, records: list[dict]) -> None:
        self.model = model
        t = {(int(r["B"]), int(r["q"]), int(r["L"])): r["ms_full_est"] * 1e-3 for r in records}
        self.points = t
        dec = {(b, q): v for (b, q, L), v in t.items() if L == BASE_L and not (b == 1 and q > 9)}
        self.B = np.array(sorted({b for b, _ in dec}), dtype=np.float64)
        self.q = np.array(sorted({q for _, q in dec}), dtype=np.float64)
        self.grid = np.array([[dec[(int(b), int(q))] for q in self.q] for b in self.B])
        self.q_max = float(self.q[-1])
        # differences to L = 256 and L = 4096 at the measured (B, q)
        self.diffs = {}
        for L in (256, 4096):
            pts = {(b, q): v for (b, q, LL), v in t.items() if LL == L}
            bs = np.array(sorted({b for b, _ in pts}), dtype=np.float64)
            qs = np.array(sorted({q for _, q in pts}), dtype=np.float64)
            d = np.array([[pts[(int(b), int(q))] - t[(int(b), int(q), int(BASE_L))]
                           for q in qs] for b in bs])
            self.diffs[L] = (bs, qs, d)
        # prefill chunks at B = 1: W(T) from L = 0, a(c) from L = 1024 - L = 0
        chunk = sorted(q for (b, q, L) in t if b == 1 and L == 0)
        self.chunk = np.array(chunk, dtype=np.float64)
        self.w = np.array([t[(1, c, 0)] for c in chunk])
        self.a = np.maximum(np.array([(t[(1, c, int(BASE_L))] - t[(1, c, 0)]) / BASE_L
                                      for c in chunk]), 0.0)
        self._log_chunk = np.log(self.chunk)
        self._w_slope = (self.w[-1] - self.w[-2]) / (self.chunk[-1] - self.chunk[-2])
        self._rows: dict[tuple[float, int], tuple[np.ndarray, np.ndarray]] = {}

    # -- the parts --------------------------------------------------------------
    def W(self, tokens) -> np.ndarray:
        """Token-proportional part of a pass over ``tokens`` (see module doc)."""
        x = np.asarray(tokens, dtype=np.float64)
        lc = self._log_chunk
        out = np.interp(np.log(np.maximum(x, self.chunk[0])), lc, self.w)
        return np.where(x > self.chunk[-1], self.w[-1] + (x - self.chunk[-1]) * self._w_slope,
                        out)

    def chunk_attention(self, chunks, ctx) -> float:
        """Extra seconds of prefill chunks ``chunks`` after ``ctx`` cached tokens each."""
        c = np.asarray(chunks, dtype=np.float64).reshape(-1)
        if c.size == 0:
            return 0.0
        lo, hi = self.chunk[0], self.chunk[-1]
        a = _interp_cols(np.clip(c, lo, hi), self.chunk, self.a[:, None], "hold")[:, 0]
        a = a * np.where(c < lo, c / lo, np.where(c > hi, c / hi, 1.0))
        return float((a * np.asarray(ctx, dtype=np.float64).reshape(-1)).sum())

    def _row(self, B: float, Lm: int) -> tuple[np.ndarray, np.ndarray]:
        """(log q nodes, values over q) at one batch size: the L = 1024 grid
        (``Lm`` 1024) or the difference to ``Lm`` (already scaled past the
        largest measured B).  Cached: the oracle prices many plans a step at
        one batch size."""
        key = (B, Lm)
        hit = self._rows.get(key)
        if hit is None:
            if Lm == BASE_L:
                hit = (np.log(self.q), _interp_cols(np.array([B]), self.B, self.grid, "linear")[0])
            else:
                bs, qs, d = self.diffs[Lm]
                row = _interp_cols(np.array([B]), bs, d, "hold")[0] * max(B / bs[-1], 1.0)
                hit = (np.log(qs), row)
            self._rows[key] = hit
        return hit

    def decode(self, B, q, L) -> np.ndarray:
        """``B`` requests of ``q`` query tokens (clamped to 1..9) over ``L`` cached tokens."""
        if np.ndim(B) == 0 and np.ndim(L) == 0:  # one batch size, one context: by rows
            B, L = float(B), float(L)
            q = np.asarray(q, dtype=np.float64)
            lq, row = self._row(B, int(BASE_L))
            lqv = np.log(np.clip(q, self.q[0], self.q[-1]))
            out = np.interp(lqv, lq, row)
            if L != BASE_L:
                Lm = 256 if L < BASE_L else 4096
                lqs, drow = self._row(B, Lm)
                out = out + np.interp(lqv, lqs, drow) * (L - BASE_L) / (Lm - BASE_L)
            return out
        B, q, L = (np.asarray(v, dtype=np.float64) for v in np.broadcast_arrays(B, q, L))
        shape = B.shape
        B, q, L = B.reshape(-1), q.reshape(-1), L.reshape(-1)
        base = _pick(_interp_cols(B, self.B, self.grid, "linear"), q, self.q)
        for Lm, sel in ((256, L < BASE_L), (4096, L > BASE_L)):
            if sel.any():
                bs, qs, d = self.diffs[Lm]
                b = B[sel]
                diff = _pick(_interp_cols(b, bs, d, "hold"), q[sel], qs)
                diff = diff * np.maximum(b / bs[-1], 1.0)
                base[sel] += diff * (L[sel] - BASE_L) / (Lm - BASE_L)
        return base.reshape(shape)

    # -- a pass -----------------------------------------------------------------
    def pass_seconds(self, tokens, padded, n_dec: float, dec_ctx: float,
                     chunks=None, chunk_ctx=None) -> np.ndarray:
        """A pass over ``tokens`` (array ok) computing ``padded`` of them:
        ``n_dec`` decoding requests with ``dec_ctx`` cached tokens in all,
        the rest prefill chunks ``chunks`` after ``chunk_ctx`` cached tokens."""
        tokens = np.asarray(tokens, dtype=np.float64)
        extra = self.chunk_attention(chunks, chunk_ctx) if chunks is not None else 0.0
        if n_dec <= 0:
            return self.W(padded) + extra
        chunk_tok = float(np.sum(chunks)) if chunks is not None else 0.0
        q = np.maximum((tokens - chunk_tok) / n_dec, 1.0)
        qc = np.minimum(q, self.q_max)
        dec = self.decode(n_dec, qc, dec_ctx / n_dec)
        return dec + self.W(padded) - self.W(n_dec * qc) + extra


@cache
def load(name: str) -> tuple[dict, dict[str, PassTable]]:
    """(meta lines, model -> PassTable) of ``data/<name>``."""
    meta, by_model = {}, {}
    with open(DATA / name, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            if "model" in r and "ms_full_est" in r:
                by_model.setdefault(r["model"], []).append(r)
            elif "calib" in r:
                meta[r["calib"]] = r
            elif "device" in r:
                meta["env"] = r
    return meta, {m: PassTable(m, rs) for m, rs in by_model.items()}
