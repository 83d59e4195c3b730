"""Profile files: measured micro-batch times, the per-strategy fit, and calibration.

Why it exists: the analytic cost model is a guess about the machine; a profile is what
the machine actually did. `dcp-profile` (the torch harness, dcp_ext/cli/profile.py)
times real forward+backward steps over a grid of document lengths and layouts, then calls
`fit_profile(records)` and `Profile.save(path)`. Planners given the file
(`make_planner(..., profile=path)`) price micro-batches with the fitted numbers instead
of the analytic ones. Pure: json + numpy.

File format (JSON, schema "dcp-profile/v1"):
    { "schema": "dcp-profile/v1",
      "model": {"name": ..., ...}, "cluster": {"name": ..., ...},
      "records": [ {"tp": 1, "cp": 1, "pp": 1, "recompute_layers": 0,
                    "lengths": [512, 300],        # documents packed in the micro-batch
                    "seconds": 0.123,             # forward+backward of that micro-batch,
                                                  # alone, on the whole replica (all stages)
                    "num_layers": 4 },            # layers of the profiled model (optional)
                   ... ],
      "sync": [ {"tp": 1, "cp": 1, "pp": 1, "seconds": 0.01} ],   # optional pull+push
      "fits": [ {"tp", "cp", "pp", "recompute_layers", "num_layers",
                 "a", "b", "c", "c0", "n", "rms_rel_err"} ] }      # written by fit_profile

Fit per strategy (tp, cp, pp, recompute_layers), on the replica time of one micro-batch:
    seconds = c0 + a * sum(s_i^2) + b * sum(s_i) + c * n_docs
non-negative least squares weighted by 1/seconds (relative error). The cost model works
per pipeline stage, so the fit is divided by pp when used. If the profiled model had
fewer layers than the planned one (DCP-style: profile a few layers, extrapolate), every
coefficient is scaled by num_layers_planned / num_layers_profiled; with records at two
or more layer counts for a strategy, per-layer and fixed parts are fitted separately.
Strategies without a fit use the analytic coefficients times the median ratio
(fitted / analytic) over the fitted strategies.
"""
from __future__ import annotations

import itertools
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

SCHEMA = "dcp-profile/v1"


@dataclass
class ProfileRecord:
    """One measurement: a micro-batch of `lengths` under (tp, cp, pp, recompute_layers)."""

    tp: int
    cp: int
    pp: int
    recompute_layers: int
    lengths: list[int]
    seconds: float  # forward + backward of this micro-batch alone, whole replica
    num_layers: int | None = None  # layers of the profiled model

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.tp, self.cp, self.pp, self.recompute_layers)

    def features(self) -> np.ndarray:
        s = np.asarray(self.lengths, dtype=float)
        return np.array([1.0, float(s @ s), float(s.sum()), float(len(s))])


@dataclass
class StrategyFit:
    tp: int
    cp: int
    pp: int
    recompute_layers: int
    a: float
    b: float
    c: float
    c0: float
    num_layers: int | None = None  # layers of the profiled model the fit is for
    n: int = 0
    rms_rel_err: float = 0.0
    # per-layer parts when records at several layer counts allowed separating them
    a_layer: float | None = None
    b_layer: float | None = None
    c_layer: float | None = None
    c0_layer: float | None = None

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.tp, self.cp, self.pp, self.recompute_layers)

    def coeffs_for(self, num_layers: int | None) -> tuple[float, float, float, float]:
        """(a, b, c, c0) of the whole replica for a model of `num_layers` layers."""
        if num_layers is None or self.num_layers is None or num_layers == self.num_layers:
            return self.a, self.b, self.c, self.c0
        if self.a_layer is not None:
            # fixed part + per-layer part
            d = num_layers - self.num_layers
            return (self.a + d * self.a_layer, self.b + d * self.b_layer, self.c + d * (self.c_layer or 0.0),
                    self.c0 + d * (self.c0_layer or 0.0))
        k = num_layers / self.num_layers
        return self.a * k, self.b * k, self.c * k, self.c0 * k

    def predict(self, lengths: Sequence[int], num_layers: int | None = None) -> float:
        a, b, c, c0 = self.coeffs_for(num_layers)
        s = np.asarray(lengths, dtype=float)
        return c0 + a * float(s @ s) + b * float(s.sum()) + c * len(s)


def nnls_small(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns: the best unconstrained fit
    over every support whose solution is non-negative (exact for few columns)."""
    k = X.shape[1]
    best, best_err = np.zeros(k), float(np.sum(y * y))
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            sub = X[:, cols]
            sol, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(sol < 0):
                continue
            err = float(np.sum((sub @ sol - y) ** 2))
            if err < best_err - 1e-18:
                full = np.zeros(k)
                full[list(cols)] = sol
                best, best_err = full, err
    return best


def _fit_group(records: Sequence[ProfileRecord]) -> tuple[np.ndarray, float]:
    X = np.array([r.features() for r in records])
    y = np.array([r.seconds for r in records], dtype=float)
    w = 1.0 / np.maximum(y, 1e-12)
    # columns scaled to unit size so the solver is well conditioned
    scale = np.maximum(np.abs(X).max(axis=0), 1e-30)
    coef = nnls_small(X / scale * w[:, None], y * w) / scale
    pred = X @ coef
    rms = float(np.sqrt(np.mean(((pred - y) / np.maximum(y, 1e-12)) ** 2))) if len(y) else 0.0
    return coef, rms


@dataclass
class Profile:
    model: dict[str, Any] = field(default_factory=dict)
    cluster: dict[str, Any] = field(default_factory=dict)
    records: list[ProfileRecord] = field(default_factory=list)
    fits: dict[tuple[int, int, int, int], StrategyFit] = field(default_factory=dict)
    sync: dict[tuple[int, int, int], float] = field(default_factory=dict)

    # ------------------------------------------------------------------ io
    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "model": self.model,
            "cluster": self.cluster,
            "records": [asdict(r) for r in self.records],
            "sync": [{"tp": k[0], "cp": k[1], "pp": k[2], "seconds": v} for k, v in self.sync.items()],
            "fits": [asdict(f) for f in self.fits.values()],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Profile":
        if d.get("schema") != SCHEMA:
            raise ValueError(f"profile schema is {d.get('schema')!r}, expected {SCHEMA!r}")
        recs = [ProfileRecord(**r) for r in d.get("records", [])]
        fits = {}
        for f in d.get("fits", []):
            sf = StrategyFit(**f)
            fits[sf.key] = sf
        prof = cls(d.get("model", {}), d.get("cluster", {}), recs, fits,
                   {(s["tp"], s["cp"], s["pp"]): float(s["seconds"]) for s in d.get("sync", [])})
        if not prof.fits and prof.records:
            prof.fits = fit_profile(prof.records).fits
        return prof

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "Profile":
        with open(path) as f:
            return cls.from_json(json.load(f))

    # ------------------------------------------------------------------ use
    def fit_for(self, tp: int, cp: int, pp: int, recompute_layers: int) -> StrategyFit | None:
        return self.fits.get((tp, cp, pp, recompute_layers))

    def predict(self, record: ProfileRecord, cost_model=None) -> float:
        """Predicted replica seconds of a record's micro-batch: the strategy's own fit, else
        the calibrated cost model (needs `cost_model`)."""
        f = self.fit_for(*record.key)
        if f is not None:
            return f.predict(record.lengths, record.num_layers)
        if cost_model is None:
            raise KeyError(f"no fit for strategy {record.key} and no cost model to fall back on")
        from dcp_ext.planning.layout import Layout

        lay = Layout(record.tp, record.cp, record.pp)
        rs = cost_model.stage_recompute(lay, record.recompute_layers)
        return cost_model.mb_replica_time(record.lengths, lay, rs)

    def _ratios(self, cm) -> tuple[float, float, float]:
        """Median fitted/analytic ratios for (attention, per token, constant)."""
        cache = getattr(self, "_ratio_cache", None)
        if cache is not None and cache[0] is cm:
            return cache[1]
        from dcp_ext.planning.layout import Layout

        ra, rb, rc = [], [], []
        for f in self.fits.values():
            lay = Layout(f.tp, f.cp, f.pp)
            if not cm.layout_valid(lay):
                continue
            an = cm.analytic_coeffs(lay, cm.stage_recompute(lay, f.recompute_layers))
            a, b, c, c0 = f.coeffs_for(cm.model.num_layers)
            if an.a > 0 and a > 0:
                ra.append(a / f.pp / an.a)
            if an.b > 0 and b > 0:
                rb.append(b / f.pp / an.b)
            if an.c0 > 0 and (c0 + c) > 0:
                rc.append((c0 + c) / f.pp / an.c0)
        med = lambda v: float(np.median(v)) if v else 1.0  # noqa: E731
        out = (med(ra), med(rb), med(rc))
        self._ratio_cache = (cm, out)
        return out

    def calibrate(self, cm, layout, rs: int, analytic):
        """Stage coefficients for (layout, rs): from the strategy's fit when there is one,
        else the analytic ones scaled by the median fitted/analytic ratios."""
        from dcp_ext.planning.cost_model import StageCoeffs

        r = cm.recompute_layers(layout, rs)
        f = self.fit_for(layout.tp, layout.cp, layout.pp, r)
        if f is None:
            # nearest recompute level of the same layout, scaled by the analytic change
            same = [g for g in self.fits.values() if (g.tp, g.cp, g.pp) == tuple(layout)]
            if same:
                g = min(same, key=lambda g: abs(g.recompute_layers - r))
                base = cm.analytic_coeffs(layout, cm.stage_recompute(layout, g.recompute_layers))
                a, b, c, c0 = g.coeffs_for(cm.model.num_layers)
                k = lambda new, old: new / old if old > 0 else 1.0  # noqa: E731
                a *= k(analytic.a, base.a)
                b *= k(analytic.b, base.b)
                c0 *= k(analytic.c0, base.c0)
                return _split(a / layout.pp, b / layout.pp, c / layout.pp, c0 / layout.pp, analytic)
            ka, kb, kc = self._ratios(cm)
            return StageCoeffs(
                a_f=analytic.a_f * ka, b_f=analytic.b_f * kb, c_f=analytic.c_f, c0_f=analytic.c0_f * kc,
                a_b=analytic.a_b * ka, b_b=analytic.b_b * kb, c_b=analytic.c_b, c0_b=analytic.c0_b * kc,
                cp_att=analytic.cp_att * ka, cp_comm=analytic.cp_comm * kb,
                cp_layers=analytic.cp_layers, cp_recompute=analytic.cp_recompute,
            )
        a, b, c, c0 = f.coeffs_for(cm.model.num_layers)
        return _split(a / layout.pp, b / layout.pp, c / layout.pp, c0 / layout.pp, analytic)

    def calibrate_sync(self, cm, layout, analytic_seconds: float) -> float:
        got = self.sync.get((layout.tp, layout.cp, layout.pp))
        return analytic_seconds if got is None else got


def _split(a: float, b: float, c: float, c0: float, analytic):
    """Fitted stage totals split forward/backward in the analytic proportions; the fit
    already contains any unhidden CP exchange, so no excess term is added."""
    from dcp_ext.planning.cost_model import StageCoeffs

    def part(tot_f, tot_b, value):
        tot = tot_f + tot_b
        fr = tot_f / tot if tot > 0 else 1.0 / 3.0
        return value * fr, value * (1 - fr)

    af, ab = part(analytic.a_f, analytic.a_b, a)
    bf, bb = part(analytic.b_f, analytic.b_b, b)
    cf, cb = part(1.0, 2.0, c)
    c0f, c0b = part(analytic.c0_f, analytic.c0_b, c0)
    return StageCoeffs(a_f=af, b_f=bf, c_f=cf, c0_f=c0f, a_b=ab, b_b=bb, c_b=cb, c0_b=c0b)


def fit_profile(records: Iterable[ProfileRecord | dict], model: dict | None = None, cluster: dict | None = None,
                sync: dict | None = None) -> Profile:
    """Fit every strategy in `records` (ProfileRecord or dicts with its fields).

    For the harness: collect records, then `fit_profile(records, model=spec.to_json(),
    cluster=cluster.to_json()).save(path)`. Strategies with fewer records than
    coefficients still get a fit (the NNLS keeps the supported columns)."""
    recs = [r if isinstance(r, ProfileRecord) else ProfileRecord(**r) for r in records]
    groups: dict[tuple[int, int, int, int], list[ProfileRecord]] = {}
    for r in recs:
        if r.seconds <= 0 or not r.lengths:
            raise ValueError(f"profile record with no time or no documents: {r}")
        groups.setdefault(r.key, []).append(r)
    fits = {}
    for key, rs in groups.items():
        layers = sorted({r.num_layers for r in rs if r.num_layers is not None})
        if len(layers) >= 2:
            # seconds = fixed(c0, a, b, c) + L * per_layer(c0, a, b, c)
            X = np.array([np.concatenate([r.features(), (r.num_layers - layers[0]) * r.features()]) for r in rs])
            y = np.array([r.seconds for r in rs])
            w = 1.0 / y
            scale = np.maximum(np.abs(X).max(axis=0), 1e-30)
            coef = nnls_small_greedy(X / scale * w[:, None], y * w) / scale
            pred = X @ coef
            rms = float(np.sqrt(np.mean(((pred - y) / y) ** 2)))
            fits[key] = StrategyFit(*key, a=coef[1], b=coef[2], c=coef[3], c0=coef[0], num_layers=layers[0], n=len(rs),
                                    rms_rel_err=rms, a_layer=coef[5], b_layer=coef[6], c_layer=coef[7], c0_layer=coef[4])
        else:
            coef, rms = _fit_group(rs)
            fits[key] = StrategyFit(*key, a=coef[1], b=coef[2], c=coef[3], c0=coef[0],
                                    num_layers=layers[0] if layers else None, n=len(rs), rms_rel_err=rms)
    return Profile(model or {}, cluster or {}, recs, fits, dict(sync or {}))


def nnls_small_greedy(X: np.ndarray, y: np.ndarray, iters: int = 500) -> np.ndarray:
    """Projected-gradient NNLS for more columns than `nnls_small` enumerates comfortably."""
    if X.shape[1] <= 8 and X.shape[0] >= 1:
        return nnls_small(X, y)
    x = np.maximum(np.linalg.lstsq(X, y, rcond=None)[0], 0)
    L = np.linalg.norm(X, 2) ** 2 or 1.0
    for _ in range(iters):
        x = np.maximum(x - (X.T @ (X @ x - y)) / L, 0)
    return x


def evaluate_profile(profile: Profile, held_out: Iterable[ProfileRecord | dict], cost_model=None) -> float:
    """Mean absolute percentage error of `profile` on records it was not fitted on."""
    errs = []
    for r in held_out:
        r = r if isinstance(r, ProfileRecord) else ProfileRecord(**r)
        p = profile.predict(r, cost_model)
        errs.append(abs(p - r.seconds) / r.seconds)
    if not errs:
        raise ValueError("no held-out records")
    return 100.0 * float(np.mean(errs))


def split_holdout(records: Sequence[ProfileRecord], every: int = 4) -> tuple[list[ProfileRecord], list[ProfileRecord]]:
    """Hold out, per strategy, the records whose total length is every `every`-th distinct
    value (lengths not used for fitting); the rest are for fitting."""
    fit, held = [], []
    groups: dict[tuple, list[ProfileRecord]] = {}
    for r in records:
        groups.setdefault(r.key, []).append(r)
    for rs in groups.values():
        totals = sorted({sum(r.lengths) for r in rs})
        out = set(totals[1::every]) if len(totals) > 2 else set()
        for r in rs:
            (held if sum(r.lengths) in out else fit).append(r)
    return fit, held


def profile_grid(cost_model, max_len: int, layouts=None, recompute=("none", "full"), points: int = 8,
                 docs_per_pack=(1, 2, 4), min_len: int = 32) -> list[dict]:
    """What dcp-profile should time: for each layout (default: every valid layout of the
    cost model's cluster) and recompute setting, packs of 1, 2 and 4 equal documents
    whose total spans `min_len`..`max_len` geometrically. Returns dicts with tp, cp, pp,
    recompute_layers and lengths, ready to become ProfileRecords once timed. Distinct
    totals per strategy let `split_holdout` keep lengths out of the fit."""
    from dcp_ext.planning.layout import Layout

    lays = [Layout(*l) for l in layouts] if layouts is not None else cost_model.all_layouts()
    totals = sorted({int(round(x)) for x in np.geomspace(min_len, max_len, points)})
    out = []
    for lay in lays:
        L = cost_model.model.num_layers
        for rc in recompute:
            r = 0 if rc == "none" else L
            for total in totals:
                for k in docs_per_pack:
                    if total // k < 1:
                        continue
                    lens = [total // k] * k
                    # documents are padded to a multiple of 2*cp by the runtime
                    if min(lens) < 2 * lay.cp:
                        continue
                    out.append({"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "recompute_layers": r, "lengths": lens})
    return out


def load_profile(path_or_profile) -> Profile | None:
    if path_or_profile is None or isinstance(path_or_profile, Profile):
        return path_or_profile
    return Profile.load(path_or_profile)


def profile_problem(path: str) -> str | None:
    """Why a dcp-profile file cannot be used (None if it can): missing, unreadable, not JSON, wrong schema."""
    if os.path.isdir(path):
        return "is a directory, not a profile file"
    if not os.path.isfile(path):
        return "no such file (write one with dcp-profile --out FILE)"
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        return f"cannot read it ({getattr(e, 'strerror', None) or e})"
    except ValueError as e:
        return f"not valid JSON ({e}); rewrite it with dcp-profile --out FILE"
    if not isinstance(data, dict):
        return "expected a JSON object written by dcp-profile"
    try:
        Profile.from_json(data)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"not a dcp-profile file ({first[:200]}); rewrite it with dcp-profile --out FILE"
    return None
