"""The estimator's oracle: does the predicted cost rank layers like the harm quantizing them does?

Trains llama_tiny (6 layers, 24 planned linears; `--model` another compact-loop preset, e.g. the MoE
llama_tiny_moe8, whose RESULT adds the scores over its routed-expert units and over its attention
linears apart) on the default corpus in BF16, and at an early and
a later point measures, for every planned linear alone, by brute force:
  - one-step loss harm: held-out loss with only that layer quantized minus the BF16 loss, over
    `--val-batches` batches of each evaluation set (`--eval-sets`; two halves give the split-half
    ceiling), and its first-order part <G, dY> on the same batches (the rest is the second-order
    part, all a curvature estimate can see). Sets: "iid", sequences of the training distribution
    the run never reads (scored in RESULT), and "docs", Megatron's validation split of held-out
    documents, whose first-order part carries the train/validation shift of this corpus;
  - update deviation: ||AdamW update with only that layer's backward quantized - BF16 update||^2 /
    ||BF16 update||^2 on the measured batch, mean over `--rounding-seeds` (what WD predicts);
  - long-horizon harm (later point): `--long-steps` training steps with only that layer quantized
    (forward and backward), minus the BF16 continuation on the same data, final weights evaluated
    in BF16 on each evaluation set, for `--long-orders` data orders (the agreement of the two
    halves of them is the ceiling).
The prediction uses the controller's default measurement (one statistics step + two noise passes
on the step's micro-batches, `--num-mb` of `--mbs` sequences). Scores are Spearman over layers,
per precision, never pooled. Diagnostics: `--pred-batches N` repeats the measurement on N-1
further batches (the estimator's own batch noise, and what averaging would buy); `--probe` injects
each layer's actual quantization error alone on the measured batch (the exact loss change there,
and the curvature along the error itself); `--rescore FILE` recomputes every prediction from the
saved statistics with the current estimator; `--cache-dir DIR` keeps the trained model at each
point for later runs with the same training arguments (e.g. the other FP4 recipe). More data orders
for the long-horizon truth come from a second run: `--long-orders 8 --long-skip 2 --truths long`
draws the same first two orders (their BF16 continuations identify them) and runs orders 2-7;
`--rescore FIRST --long-from SECOND` joins them. `--sample-k 1,2,4,8` measures `--sample-repeats`
further steps of `--sample-mb` micro-batches with each K of MeasureConfig.micro_batches and all of
them, and scores each K against all and against the one-step truth (the noise micro-batch
sampling adds); with `--remeasure` it reuses a saved run's truths.

    python bench/estimator_fidelity.py --fp4-recipe nvfp4 --points later --num-mb 4 --long-num-mb 1 \
        --pred-batches 2 --long-precisions fp4 --cache-dir runs/cache --out runs/fidelity/nv5.json
    python bench/estimator_fidelity.py --fp4-recipe mxfp4 ... --out runs/fidelity/mx5.json

Last line: RESULT spearman_fp4=.. spearman_marginal=.. spearman_long=.. spearman_wd=..
spearman_proxy=.. ceiling_split=.. ceiling_long=..   (later point)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from snip_megatron.estimate import EstimateConfig, cost_table, proxy_table
from snip_megatron.formats.precision import Formats, Precision
from snip_megatron.plan import LayerKey

FP8, FP4, BF16 = Precision.FP8, Precision.FP4, Precision.BF16


def spearman(a, b) -> float:
    """Spearman rank correlation (average ranks for ties); NaN pairs dropped."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    if len(a) < 3:
        return math.nan

    def rank(x):
        order = np.argsort(x, kind="mergesort")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for v in np.unique(x):  # ties share their mean rank
            idx = x == v
            r[idx] = r[idx].mean()
        return r

    ra, rb = rank(a), rank(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = math.sqrt((ra ** 2).sum() * (rb ** 2).sum())
    return float((ra * rb).sum() / den) if den else math.nan


# -- the model under test ----------------------------------------------------------------------
class Harness:
    def __init__(self, args):
        from snip_megatron.stats.discover import planned_linears
        from snip_megatron.train.config import TrainConfig
        from snip_megatron.train.loop import Trainer

        self.args = args
        total = args.steps + 2 * args.long_steps + 8
        self.tr = Trainer(TrainConfig(model=args.model, steps=total, micro_batch_size=args.mbs,
                                      global_batch_size=args.mbs * args.num_mb, eval_interval=None,
                                      lr=args.lr, seed=args.seed, progress=False, precision="bf16"))
        # the LR schedule ends at the later point (as a finished run would); the long-horizon
        # continuations run on at min_lr, on data the run has not seen
        self.tr.scheduler.lr_decay_steps = args.steps
        self.linears = planned_linears(self.tr.modules)  # an MoE expert unit: each local expert's module
        self.keys = list(dict.fromkeys(k for k, _ in self.linears))
        self.groups = unit_groups(self.tr.inventory)
        self.evals = {name: self.eval_batches(name) for name in args.eval_sets}
        from snip_megatron.stats.quant_error import formats_error_fn

        self.err = formats_error_fn(Formats(fp4_recipe=args.fp4_recipe))  # E = Q(T) - T per precision and role

    def eval_batches(self, name: str) -> list:
        """`--val-batches` micro-batches of an evaluation set: "iid", sequences of the training
        split's shuffled epoch that the run never reads (its tail), i.e. held-out data from the
        training distribution; "docs", Megatron's validation split (held-out documents)."""
        from snip_megatron.data.gpt import BatchReader

        args, tr = self.args, self.tr
        n = args.val_batches * args.mbs
        if name == "docs":
            return BatchReader(tr.splits.valid, micro_batch_size=args.mbs).take(args.val_batches)
        if name != "iid":
            raise ValueError(f"unknown evaluation set {name!r}; valid: iid, docs")
        train = tr.splits.train
        start = len(train) - n
        if start < tr.config.steps * tr.config.global_batch_size:
            raise ValueError(f"the iid evaluation set ({n} sequences) would overlap the {tr.config.steps} "
                             f"steps the run may read of a {len(train)}-sequence training split")
        return BatchReader(train, micro_batch_size=args.mbs, consumed=start, wrap=False).take(args.val_batches)

    # precision of one layer; everything else BF16
    def set_only(self, key=None, precision=BF16, *, backward_only=False, sr_seed=0):
        for k, m in self.linears:
            p = precision if k == key else BF16
            m.set_precision(p, Formats(fp4_recipe=self.args.fp4_recipe))
            if k == key and backward_only:
                m.format_spec = dataclasses.replace(m.format_spec, fprop_input=None, fprop_weight=None)
            m.set_sr_seed(sr_seed * 1000 + 17)

    def train_steps(self, batches, per_step=None):
        tr = self.tr
        per_step = per_step or self.args.num_mb
        for i in range(0, len(batches), per_step):
            tr.current_batch = batches[i:i + per_step]
            tr.forward_backward()
            tr.optimizer.step()
            tr.scheduler.step(increment=1)
        tr.current_batch = None

    def val_halves(self, name: "str | None" = None) -> tuple[float, float]:
        """Loss on the two halves of an evaluation set (default: the first of --eval-sets)."""
        val = self.evals[name or self.args.eval_sets[0]]
        h = len(val) // 2
        return (self.tr.forward_backward(val[:h], forward_only=True),
                self.tr.forward_backward(val[h:], forward_only=True))

    def predict(self) -> tuple[dict, list]:
        """The prediction: the controller's default measurement on the next step's micro-batches
        (the measured step), then on `--pred-batches` - 1 further steps (the estimator's own batch
        noise), with the predictions from each. Returns the result fields and the measured step."""
        from snip_megatron.config import SnipConfig
        from snip_megatron.stats import measure_step

        args, tr = self.args, self.tr
        self.set_only()
        config = SnipConfig(fp4_recipe=args.fp4_recipe).measure_config()
        batches, tables, t0 = [], [], time.perf_counter()
        for i in range(max(args.pred_batches, 1)):
            tr.current_batch = tr.reader.take(args.num_mb)
            batches.append(tr.current_batch)
            tables.append(measure_step(tr, config))
            tr.current_batch = None
            if i == 0:
                measure_s = time.perf_counter() - t0
        if [str(k) for k in tables[0].keys] != [str(k) for k in self.keys]:  # every score pairs them by position
            raise RuntimeError(f"the statistics table's units {list(map(str, tables[0].keys))[:4]}... are not in "
                               f"the order of the planned linears {list(map(str, self.keys))[:4]}...")
        m_ew = self.momentum_dot_weight_error()
        out = {"measure_s": measure_s, "measure_config": repr(config),
               "stats": tables[0].to_array().tolist(), "stats_fields": list(tables[0].fields), "m_ew": m_ew,
               **predictions(tables[0], args.lambdas, m_ew),
               "extra_stats": [t.to_array().tolist() for t in tables[1:]],
               "extra_pred": [predictions(t, args.lambdas)["pred"] for t in tables[1:]]}
        return out, batches[0]

    def sampling_study(self) -> dict:
        """The estimator's noise from measuring K of a step's micro-batches (MeasureConfig.
        micro_batches): steps of `--sample-mb` micro-batches, each measured with every K of
        `--sample-k` (0: all of them), on `--sample-repeats` steps of fresh data."""
        from snip_megatron.config import SnipConfig
        from snip_megatron.stats import measure_step

        args, tr = self.args, self.tr
        self.set_only()
        base = SnipConfig(fp4_recipe=args.fp4_recipe).measure_config()
        runs = []
        for _ in range(args.sample_repeats):
            tr.current_batch = tr.reader.take(args.sample_mb)
            run = {}
            for k in args.sample_k:
                t0 = time.perf_counter()
                table = measure_step(tr, dataclasses.replace(base, micro_batches=k or None))
                run[str(k)] = {"seconds": time.perf_counter() - t0,
                               "pred": predictions(table, [EstimateConfig().lam])["pred"]}
            runs.append(run)
        tr.current_batch = None
        return {"k": list(args.sample_k), "num_mb": args.sample_mb, "runs": runs}

    def output_errors(self, x: torch.Tensor, w: torch.Tensor, p) -> torch.Tensor:
        """dY = Q(X) Q(W)^T - X W^T, the error of the layer's forward GEMM (fprop operands)."""
        err = self.err
        return (x + err(x, p, "fprop_input")) @ (w + err(w, p, "fprop_weight")).t() - x @ w.t()

    def frozen_routing_harm(self, name: str) -> list:
        """The one-step FP4 harm of each unit alone with routing frozen: every MoE router replays the
        top-k choices of the BF16 pass over the same batches (snip_megatron.stats.routing, as SNIP's
        noise passes do), so the harm leaves out what quantizing a unit does through changed routing.
        Per unit: (first half, second half) of the evaluation set."""
        from snip_megatron.stats import routing

        rows = []
        with routing.frozen_routing(self.tr.modules) as routes:
            self.set_only()
            routes.record()
            base = self.val_halves(name)
            for k in self.keys:
                self.set_only(k, FP4)
                routes.replay()
                a, b = self.val_halves(name)
                rows.append((a - base[0], b - base[1]))
        self.set_only()
        return rows

    def first_order_terms(self, name: str) -> dict:
        """The first-order part of the one-step harm on an evaluation set: per precision and layer,
        <G_Y, dY> summed over the set's tokens with G_Y the gradient of the mean loss, for each
        half. What is left of the harm (harm - this) is its second-order part, which is all an
        estimator of curvature can see; the first-order part follows the set's mean gradient."""
        val = self.evals[name]
        out = {p.value: {k: [0.0, 0.0] for k in self.keys} for p in (FP8, FP4)}
        state = {"half": 0, "scale": 1.0}

        def post(module, args, output, key):
            y = output[0] if isinstance(output, tuple) else output
            if args[0].numel() == 0 or not y.requires_grad:  # an MoE expert no token chose: nothing to add
                return
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            w = module.weight.detach().float()
            dys = {p: self.output_errors(x, w, p) for p in (FP8, FP4)}
            half, scale = state["half"], state["scale"]

            def hook(g):
                g2 = g.reshape(-1, g.shape[-1]).float()
                for p, dy in dys.items():
                    out[p.value][key][half] += scale * float((g2 * dy).sum())

            y.register_hook(hook)

        handles = [m.register_forward_hook(lambda mod, a, o, key=k: post(mod, a, o, key)) for k, m in self.linears]
        try:
            h, per = len(val) // 2, self.args.num_mb
            for half, part in enumerate((val[:h], val[h:])):
                state.update(half=half, scale=per / len(part))  # each call averages over `per` batches
                for i in range(0, len(part), per):
                    self.tr.forward_backward(part[i:i + per])
        finally:
            for hd in handles:
                hd.remove()
        return {p: [v[k] for k in self.keys] for p, v in out.items()}

    def snapshot(self):
        tr = self.tr
        params = [p.detach().clone() for c in tr.modules for p in c.parameters()]
        return params, copy.deepcopy(tr.optimizer.state_dict()), copy.deepcopy(tr.scheduler.state_dict())

    def restore(self, snap):
        params, opt, sched = snap
        tr = self.tr
        with torch.no_grad():
            for p, s in zip((p for c in tr.modules for p in c.parameters()), params):
                p.copy_(s)
        tr.optimizer.load_state_dict(copy.deepcopy(opt))
        tr.scheduler.load_state_dict(copy.deepcopy(sched))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"snap": self.snapshot(), "step": self.tr.step, "consumed": self.tr.reader.consumed}, path)

    def load(self, path: Path) -> None:
        saved = torch.load(path, weights_only=False)
        self.restore(saved["snap"])
        self.tr.step, self.tr.reader.consumed = saved["step"], saved["consumed"]

    def momentum_dot_weight_error(self) -> dict:
        """<m_hat, E_W> per precision and planned weight: the first-order loss change of quantizing
        the weight, with AdamW's bias-corrected first moment standing for the expected gradient
        (an average over ~1/(1-b1) recent batches instead of one). A diagnostic of the benchmark."""
        from snip_megatron.stats.adam import _group_of, _pairs
        err = self.err
        weights = {id(m.weight): k for k, m in self.linears}
        out = {p.value: {} for p in (FP8, FP4)}
        for model_param, main_param, inner in _pairs(self.tr.optimizer):
            k = weights.get(id(model_param))
            st = inner.state.get(main_param, {})
            if k is None or "exp_avg" not in st:
                continue
            b1, _ = _group_of(inner, main_param)["betas"]
            m_hat = st["exp_avg"].double() / (1 - b1 ** float(st.get("step", 1)))
            for p in (FP8, FP4):  # an MoE expert unit: its experts' terms add
                e = err(model_param.detach(), p, "fprop_weight").double()
                out[p.value][k] = out[p.value].get(k, 0.0) + float((m_hat.reshape(e.shape) * e).sum())
        return {p: [v.get(k, math.nan) for k in self.keys] for p, v in out.items()}

    def error_direction_probe(self, batch) -> dict:
        """Diagnostic: the layers' actual forward errors dY (fprop operands quantized, computed on
        the clean pass) injected into their outputs on the measurement batch. Per precision and
        layer: "batch", the exact loss change on that batch with that layer's dY alone; "secant",
        its part beyond first order, 1/2 <dY, G(Y+dY) - G(Y)> (the curvature along the error itself,
        at full size); "secant_sign", the same with a random sign per token (drops the cross-token
        terms); "joint_sign", every layer's signed dY at once in one pass (what one measurement
        pass could read; the other layers' terms are zero-mean noise)."""
        state: dict = {"mode": None, "p": None, "eps": {}}
        caps: dict = {}  # key -> one {"dy", "g"} per micro-batch of the step, in order

        def post(module, args, output, key):
            y = output[0] if isinstance(output, tuple) else output
            mine = caps.setdefault(key, [])
            mb = len(mine)
            mine.append({})
            if state["mode"] == "clean":
                x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
                w = module.weight.detach().float()
                mine[mb]["dy"] = self.output_errors(x, w, state["p"]).reshape(y.shape)
            elif key in state["eps"]:
                y = y + state["eps"][key][mb].to(y.dtype)
            y.register_hook(lambda g: mine[mb].__setitem__("g", g.detach().float()))
            return (y,) + tuple(output[1:]) if isinstance(output, tuple) else y

        def half_secant(eps, key, clean):  # 1/2 <eps, G(Y + eps) - G(Y)> over the step's micro-batches
            return 0.5 * sum(float((e * (c["g"] - c0["g"])).sum()) for e, c, c0 in zip(eps, caps[key], clean[key]))

        handles = [m.register_forward_hook(lambda mod, a, o, key=k: post(mod, a, o, key)) for k, m in self.linears]
        gen = torch.Generator().manual_seed(11)
        out = {}
        try:
            for p in (FP8, FP4):
                state.update(mode="clean", p=p, eps={})
                caps.clear()
                base = self.tr.forward_backward(batch)
                clean = {k: list(v) for k, v in caps.items()}
                dys = {k: [c["dy"] for c in clean[k]] for k in self.keys}
                signed = {k: [(torch.randint(0, 2, d.shape[:-1] + (1,), generator=gen) * 2 - 1).float() * d
                              for d in dys[k]] for k in self.keys}
                state["mode"] = "inject"
                rows = {"batch": [], "secant": [], "secant_sign": []}
                for k in self.keys:
                    for name, eps in (("secant", dys[k]), ("secant_sign", signed[k])):
                        state["eps"] = {k: eps}
                        caps.clear()
                        loss = self.tr.forward_backward(batch)
                        rows[name].append(half_secant(eps, k, clean))
                        if name == "secant":
                            rows["batch"].append(loss - base)
                state["eps"] = signed
                caps.clear()
                self.tr.forward_backward(batch)
                rows["joint_sign"] = [half_secant(signed[k], k, clean) for k in self.keys]
                out[p.value] = rows
        finally:
            for h in handles:
                h.remove()
        return out

    def adam_update(self) -> dict:
        """The AdamW update direction the next optimizer step would take for each planned weight
        (keyed by the weight: an MoE expert unit has several), from the gradient in main_grad (no step
        taken; lr, clipping and weight decay left out)."""
        from snip_megatron.stats.adam import _group_of, _pairs

        weights = {id(m.weight) for _, m in self.linears}
        out = {}
        for model_param, main_param, inner in _pairs(self.tr.optimizer):
            k = id(model_param)
            if k not in weights:
                continue
            st = inner.state.get(main_param, {})
            g = model_param.main_grad.double()
            b1, b2 = _group_of(inner, main_param)["betas"]
            eps = _group_of(inner, main_param)["eps"]
            t = float(st["step"]) + 1 if "step" in st else 1.0
            m = b1 * st["exp_avg"].double() + (1 - b1) * g if st else (1 - b1) * g
            v = b2 * st["exp_avg_sq"].double() + (1 - b2) * g * g if st else (1 - b2) * g * g
            out[k] = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
        return out


# -- predictions from a statistics table -----------------------------------------------------------
# Loss terms built differently from the default, for comparison (EstimateConfig fields).
LOSS_VARIANTS = {
    "noise": dict(curvature="noise", output_error="model"),  # kappa times the random-error model
    "fisher": dict(curvature="fisher", output_error="model"),
    "mean": dict(curvature="mean", output_error="model"),  # the default before the measured dY
    "meas_noise": dict(curvature="noise", output_error="measured"),  # kappa times the measured ||dY||^2
    "meas_fisher": dict(curvature="fisher", output_error="measured"),
    "meas_mean": dict(curvature="mean", output_error="measured"),
    "ferr": dict(curvature="fisher_error"),  # the empirical Fisher along the measured dY
    "mix": dict(curvature="mean_error"),  # mean of meas_noise and ferr
    "fo": dict(curvature="mean", output_error="model", first_order=True),  # "mean" + signed first order
}


def predictions(stats, lambdas, m_ew=None) -> dict:
    """Everything the estimator predicts (default EstimateConfig, lambda varied) and the proxy."""
    costs = {lam: cost_table(stats, EstimateConfig(lam=lam)) for lam in lambdas}
    c0 = costs[lambdas[0]]
    cu = cost_table(stats, EstimateConfig(lam=0.0, adam_error_model="uniform"))
    pred = {p.value: {"dL": list(c0.column(p, "loss_div")), "WD": list(c0.column(p, "weight_div")),
                      "WD_uniform": list(cu.column(p, "weight_div")),
                      **{f"Q{lam}": list(costs[lam].column(p)) for lam in lambdas}}
            for p in (FP8, FP4)}
    for name, fields in LOSS_VARIANTS.items():
        cv = cost_table(stats, EstimateConfig(lam=0.0, **fields))
        for p in (FP8, FP4):
            pred[p.value][f"dL_{name}"] = list(cv.column(p, "loss_div"))
    for p in (FP8, FP4):
        if m_ew is not None:  # the first-order weight term from AdamW's first moment
            first = np.array(m_ew[p.value]) / stats.globals_["loss"]
            pred[p.value]["dL_mfo"] = list(np.array(pred[p.value]["dL"]) + first)
            if "dL_ferr" in pred[p.value]:
                pred[p.value]["dL_ferr_mfo"] = list(np.array(pred[p.value]["dL_ferr"]) + first)
                pred[p.value]["dL_mix_mfo"] = list(np.array(pred[p.value]["dL_mix"]) + first)
    proxy = proxy_table(stats)
    return {"pred": pred, "proxy": {p.value: [proxy[k][p] for k in stats.keys] for p in (FP8, FP4)},
            "kappa": [c0.kappa[k] for k in stats.keys]}


def load_stats(keys, array, fields=None):
    """A StatsTable from a saved array; files from before a field was added get zeros for it."""
    from snip_megatron.stats.table import StatsTable, field_names

    array = np.asarray(array, float)
    new = field_names()
    if fields is None and array.shape[1] != len(new):
        fields = [f for f in new if f not in ("adam_dv_sq", "adam_v_sum")]  # the first layout
    if fields is not None and list(fields) != list(new):
        out = np.zeros((array.shape[0], len(new)))
        for j, f in enumerate(fields):
            out[:, new.index(f)] = array[:, j]
        out[-1, :] = 0.0
        out[-1, :3] = array[-1, :3]
        array = out
    return StatsTable.from_array(keys, array)


# -- one evaluation point ------------------------------------------------------------------------
def measure_point(h: Harness, long_horizon: bool, log) -> dict:
    args, tr = h.args, h.tr
    out, batch = h.predict()
    snap = h.snapshot()

    out["probe"] = h.error_direction_probe(batch) if args.probe else {}
    log("  error-direction probe done")

    # truth 1: one-step loss harm on each evaluation set, each layer alone, and its first-order part
    t0 = time.perf_counter()
    sets = {}
    for name in args.eval_sets:
        base = h.val_halves(name)
        harm = {}
        for p in ((FP8, FP4) if "harm" in args.truths else ()):
            rows = []
            for k in h.keys:
                h.set_only(k, p)
                a, b = h.val_halves(name)
                rows.append((a - base[0], b - base[1]))
            harm[p.value] = rows
        h.set_only()
        sets[name] = {"harm": harm, "base_val": base,
                      "first_order": h.first_order_terms(name) if "harm" in args.truths else {}}
    primary = args.eval_sets[0]
    out.update(eval_set=primary, harm=sets[primary]["harm"], base_val=sets[primary]["base_val"],
               first_order=sets[primary]["first_order"])
    out["other_sets"] = {n: v for n, v in sets.items() if n != primary}
    log(f"  one-step harm ({', '.join(args.eval_sets)}): {time.perf_counter() - t0:.0f}s")
    if "frozen" in args.truths:  # an MoE model: the FP4 harm without the routing changes it causes
        t0 = time.perf_counter()
        out["harm_frozen"] = h.frozen_routing_harm(primary)
        log(f"  one-step FP4 harm, routing frozen ({primary}): {time.perf_counter() - t0:.0f}s")

    # truth 2: one-step update deviation, only that layer's backward quantized
    t0 = time.perf_counter()
    tr.forward_backward(batch)
    u0 = h.adam_update()
    norm0 = sum(float((u ** 2).sum()) for u in u0.values())
    dev, dev_seeds = {}, {}
    for p in ((FP8, FP4) if "dev" in args.truths else ()):
        rows = []
        for k in h.keys:
            vals = []
            for seed in range(args.rounding_seeds):
                h.set_only(k, p, backward_only=True, sr_seed=seed)
                tr.forward_backward(batch)
                u = h.adam_update()
                vals.append(sum(float(((u[j] - u0[j]) ** 2).sum()) for j in u0) / norm0)
            rows.append(vals)
        dev[p.value] = [float(np.mean(v)) for v in rows]
        dev_seeds[p.value] = rows
    h.set_only()
    out["dev"] = dev
    out["dev_seeds"] = dev_seeds
    log(f"  update deviation: {time.perf_counter() - t0:.0f}s")

    # truth 3: long-horizon harm, each layer alone, 2 data orders
    if long_horizon and args.long_precisions and "long" in args.truths:
        t0 = time.perf_counter()
        long_mb = args.long_num_mb or args.num_mb
        orders = [tr.reader.take(args.long_steps * long_mb) for _ in range(args.long_orders)]
        own = range(args.long_skip, args.long_orders)  # the orders whose quantized runs this run does

        def evaluate():  # final weights in BF16 on every evaluation set
            return {name: float(np.mean(h.val_halves(name))) for name in args.eval_sets}

        long = {name: {} for name in args.eval_sets}
        bases = []
        for o, data in enumerate(orders):
            h.restore(snap)
            h.set_only(sr_seed=o)
            h.train_steps(data, long_mb)
            bases.append(evaluate())
            if o not in own:  # a skipped order's base only identifies its data (see merge_long)
                continue
            h.restore(snap)  # determinism check: the BF16 continuation repeats exactly
            h.train_steps(data, long_mb)
            again = evaluate()
            if again != bases[-1]:
                log(f"  WARNING: BF16 continuation not deterministic ({again} vs {bases[-1]})")
        for p in args.long_precisions:
            rows = []
            for k in h.keys:
                vals = []
                for o in own:
                    data = orders[o]
                    h.restore(snap)
                    h.set_only(k, p, sr_seed=o)
                    h.train_steps(data, long_mb)
                    h.set_only()
                    vals.append(evaluate())
                rows.append(vals)
            for name in args.eval_sets:
                long[name][p.value] = [[v[name] - bases[o][name] for o, v in zip(own, r)] for r in rows]
            log(f"  long-horizon {p.value}: {time.perf_counter() - t0:.0f}s")
        out["long"] = long[primary]
        out["long_base"] = [b[primary] for b in bases]
        out["long_orders"] = list(own)
        for name, v in out["other_sets"].items():
            v["long"] = long[name]
    h.restore(snap)
    h.set_only()
    if args.sample_k:  # last: it reads fresh data, which must not shift the truths' data
        out["sampling"] = h.sampling_study()
        log("  micro-batch sampling study done")
    return out


def sampling_scores(r: dict) -> dict:
    """Per K: Spearman of the K-micro-batch prediction (dL FP4, WD FP4) against the all-micro-batch
    one of the same step, and of dL FP4 against the one-step truth; mean and spread over steps."""
    study = r.get("sampling")
    if not study:
        return {}
    harm = np.array(r["harm"]["fp4"]).mean(1) if r.get("harm") else None
    out = {}
    for k in study["k"]:
        rows = {"vs_all": [], "wd_vs_all": [], "vs_truth": [], "seconds": []}
        for run in study["runs"]:
            pk, pall = run[str(k)]["pred"]["fp4"], run["0"]["pred"]["fp4"]
            rows["vs_all"].append(spearman(pk["dL"], pall["dL"]))
            rows["wd_vs_all"].append(spearman(pk["WD"], pall["WD"]))
            if harm is not None:
                rows["vs_truth"].append(spearman(pk["dL"], harm))
            rows["seconds"].append(run[str(k)]["seconds"])
        out[k] = {name: (float(np.mean(v)), float(np.std(v))) for name, v in rows.items() if v}
    return out


# -- scores ----------------------------------------------------------------------------------------
def unit_groups(inventory) -> dict:
    """Each planned unit's kind, from the model's inventory: "attention" (the self-attention linears),
    "experts" (an MoE layer's routed experts, one unit per linear and layer), "shared_experts", "mlp"."""
    def kind(e):
        if e.experts:
            return "experts"
        if e.suffix.startswith("self_attention."):
            return "attention"
        return "shared_experts" if ".shared_experts." in e.suffix else "mlp"

    return {str(e.key): kind(e) for e in inventory}


def group_scores(keys, r: dict, groups: dict) -> dict:
    """Per kind of unit (unit_groups) with at least 3 units: Spearman of the predicted FP4 dL against
    the one-step FP4 harm over that kind's units alone, the split-half ceiling of the harm over them,
    and the same against the harm's second-order part (when the first-order terms were measured);
    with `--pred-batches` > 1 also the prediction averaged over the measured batches (fp4_avg_*: the
    estimator's batch noise averaged out, as the controller's cost EMA does across measurements)."""
    out = {}
    harm = np.array(r["harm"]["fp4"]) if r.get("harm") else None
    frozen = np.array(r["harm_frozen"]) if r.get("harm_frozen") else None
    if (harm is None and frozen is None) or not groups:
        return out
    dl = np.array(r["pred"]["fp4"]["dL"])
    extra = [np.array(p["fp4"]["dL"]) for p in r.get("extra_pred") or []]
    dl_avg = np.mean([dl, *extra], axis=0) if extra else None
    fo = (r.get("first_order") or {}).get("fp4")
    for g in dict.fromkeys(groups[k] for k in keys):
        idx = [i for i, k in enumerate(keys) if groups[k] == g]
        if len(idx) < 3:
            continue
        if harm is not None:
            h = harm[idx]
            out[f"fp4_{g}"] = spearman(dl[idx], h.mean(1))
            out[f"ceiling_split_{g}"] = spearman(h[:, 0], h[:, 1])
            if fo is not None:
                out[f"fp4_second_order_{g}"] = spearman(dl[idx], (h - np.array(fo)[idx]).mean(1))
            if dl_avg is not None:
                out[f"fp4_avg_{g}"] = spearman(dl_avg[idx], h.mean(1))
                if fo is not None:
                    out[f"fp4_avg_second_order_{g}"] = spearman(dl_avg[idx], (h - np.array(fo)[idx]).mean(1))
        if frozen is not None:  # the truth with routing frozen (Harness.frozen_routing_harm)
            out[f"fp4_frozen_routing_{g}"] = spearman(dl[idx], frozen[idx].mean(1))
            out[f"ceiling_split_frozen_routing_{g}"] = spearman(frozen[idx][:, 0], frozen[idx][:, 1])
            if harm is not None:
                out[f"frozen_vs_free_{g}"] = spearman(frozen[idx].mean(1), harm[idx].mean(1))
        out[f"units_{g}"] = len(idx)
    return out


def scores(r: dict, lambdas, default_lam) -> dict:
    s = {}
    if not r["harm"]:
        r = dict(r, harm={p: [[math.nan, math.nan]] * len(r["kappa"]) for p in ("fp8", "fp4")})
    if not r["dev"]:
        r = dict(r, dev={p: [math.nan] * len(r["kappa"]) for p in ("fp8", "fp4")})
    harm = {p: np.array(r["harm"][p]).mean(1) for p in ("fp8", "fp4")}
    halves = {p: np.array(r["harm"][p]) for p in ("fp8", "fp4")}
    dL = {p: np.array(r["pred"][p]["dL"]) for p in ("fp8", "fp4")}
    prox = {p: np.array(r["proxy"][p]) for p in ("fp8", "fp4")}
    s["fp4"] = spearman(dL["fp4"], harm["fp4"])
    for name in r["pred"]["fp4"]:
        kind = name[3:]
        if name.startswith("dL_") and name in r["pred"]["fp8"]:
            d4, d8 = np.array(r["pred"]["fp4"][name]), np.array(r["pred"]["fp8"][name])
            s[f"fp4_{kind}"] = spearman(d4, harm["fp4"])
            s[f"marginal_{kind}"] = spearman(d4 - d8, harm["fp4"] - harm["fp8"])
    # the estimator's own batch noise: agreement of measurements on different batches, and the
    # score of their mean (what measuring on more batches would buy)
    extra = r.get("extra_pred") or []
    if extra:
        for name in r["pred"]["fp4"]:
            if not name.startswith("dL") or any(name not in e["fp4"] for e in extra):
                continue
            runs = [np.array(r["pred"]["fp4"][name])] + [np.array(e["fp4"][name]) for e in extra]
            runs8 = [np.array(r["pred"]["fp8"][name])] + [np.array(e["fp8"][name]) for e in extra]
            s[f"batch_split_{name}"] = spearman(runs[0], runs[1])
            s[f"fp4_avg_{name}"] = spearman(np.mean(runs, 0), harm["fp4"])
            s[f"marginal_avg_{name}"] = spearman(np.mean(runs, 0) - np.mean(runs8, 0), harm["fp4"] - harm["fp8"])
    for name in ("batch", "secant", "secant_sign", "joint_sign"):  # the error-direction probe
        if name in r.get("probe", {}).get("fp4", {}):
            a4, a8 = np.array(r["probe"]["fp4"][name]), np.array(r["probe"]["fp8"][name])
            s[f"probe_fp4_{name}"] = spearman(a4, harm["fp4"])
            s[f"probe_marginal_{name}"] = spearman(a4 - a8, harm["fp4"] - harm["fp8"])
    fo = r.get("first_order") or {}
    if "fp4" in fo and "fp8" in fo:  # the truth without its first-order part (see first_order_terms)
        so = {p: halves[p] - np.array(fo[p]) for p in ("fp8", "fp4")}
        so_mean = {p: so[p].mean(1) for p in so}
        s["fp4_second_order"] = spearman(dL["fp4"], so_mean["fp4"])
        s["marginal_second_order"] = spearman(dL["fp4"] - dL["fp8"], so_mean["fp4"] - so_mean["fp8"])
        s["ceiling_second_order"] = spearman(so_mean["fp4"], harm["fp4"])  # a perfect curvature estimate
        s["ceiling_second_order_marginal"] = spearman(so_mean["fp4"] - so_mean["fp8"], harm["fp4"] - harm["fp8"])
        s["split_first_order"] = spearman(np.array(fo["fp4"])[:, 0], np.array(fo["fp4"])[:, 1])
        s["split_second_order"] = spearman(so["fp4"][:, 0], so["fp4"][:, 1])
        s["first_order_share"] = float(np.abs(np.array(fo["fp4"]).mean(1)).sum() / np.abs(harm["fp4"]).sum())
    s["fp8"] = spearman(dL["fp8"], harm["fp8"])
    s["marginal"] = spearman(dL["fp4"] - dL["fp8"], harm["fp4"] - harm["fp8"])
    s["proxy_fp4"] = spearman(prox["fp4"], harm["fp4"])
    s["proxy_marginal"] = spearman(prox["fp4"] - prox["fp8"], harm["fp4"] - harm["fp8"])
    s["ceiling_split"] = spearman(halves["fp4"][:, 0], halves["fp4"][:, 1])
    s["ceiling_split_marginal"] = spearman(halves["fp4"][:, 0] - halves["fp8"][:, 0],
                                           halves["fp4"][:, 1] - halves["fp8"][:, 1])
    for p in ("fp8", "fp4"):
        dev = np.array(r["dev"][p])
        s[f"wd_{p}"] = spearman(r["pred"][p]["WD"], dev)
        if "WD_uniform" in r["pred"][p]:
            s[f"wd_uniform_{p}"] = spearman(r["pred"][p]["WD_uniform"], dev)
        s[f"proxy_wd_{p}"] = spearman(prox[p], dev)
    s["wd"] = s["wd_fp4"]
    seeds = np.array(r.get("dev_seeds", {}).get("fp4", []))
    if seeds.ndim == 2 and seeds.shape[1] >= 2:  # agreement of two rounding seeds: the WD ceiling
        s["ceiling_wd"] = spearman(seeds[:, 0], seeds[:, 1])
    if "long" in r:
        for p, rows in r["long"].items():
            rows = np.array(rows)
            truth = rows.mean(1)
            for lam in lambdas:
                s[f"long_{p}_Q{lam}"] = spearman(r["pred"][p][f"Q{lam}"], truth)
            for name in r["pred"][p]:
                if name.startswith("dL_"):
                    s[f"long_{p}_{name}"] = spearman(r["pred"][p][name], truth)
            s[f"long_{p}_proxy"] = spearman(prox[p], truth)
            # agreement of the two halves of the data orders (seed vs seed with 2 orders)
            half = rows.shape[1] // 2
            s[f"ceiling_long_{p}"] = spearman(rows[:, :half].mean(1), rows[:, half:2 * half].mean(1))
        s["long"] = s.get(f"long_fp4_Q{default_lam}", math.nan)
        s["ceiling_long"] = s.get("ceiling_long_fp4", math.nan)
    return s


def print_table(keys, r: dict, name: str) -> None:
    print(f"\n== {name}: per layer (harm = validation loss increase; dev = relative update deviation)")
    print(f"{'layer':<16}{'kappa':>9}{'dL.fp8':>10}{'harm.fp8':>10}{'dL.fp4':>10}{'harm.fp4':>10}"
          f"{'proxy4':>9}{'WD.fp4':>10}{'dev.fp4':>10}" + (f"{'long.fp4':>10}{'long.fp8':>10}" if "long" in r else ""))
    for i, k in enumerate(keys):
        line = (f"{str(k):<16}{r['kappa'][i]:>9.3g}{r['pred']['fp8']['dL'][i]:>10.3g}"
                f"{np.mean(r['harm']['fp8'][i]):>10.3g}{r['pred']['fp4']['dL'][i]:>10.3g}"
                f"{np.mean(r['harm']['fp4'][i]):>10.3g}{r['proxy']['fp4'][i]:>9.3g}"
                f"{r['pred']['fp4']['WD'][i]:>10.3g}{r['dev']['fp4'][i]:>10.3g}")
        if "long" in r:
            for p in ("fp4", "fp8"):
                line += f"{np.mean(r['long'][p][i]):>10.3g}" if p in r["long"] else f"{'-':>10}"
        print(line)


# arguments that change the trained model or the data position at a point (not what is measured there)
TRAINING_ARGS = ("steps", "early", "mbs", "num_mb", "lr", "seed", "long_steps", "pred_batches", "points")


def cache_path(args, point: str) -> "Path | None":
    if not args.cache_dir:
        return None
    import hashlib

    settings = {a: getattr(args, a) for a in TRAINING_ARGS}
    if getattr(args, "model", "llama_tiny") != "llama_tiny":  # llama_tiny's caches keep their names
        settings["model"] = args.model
    key = json.dumps(settings, sort_keys=True)
    return Path(args.cache_dir) / f"{point}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.pt"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fp4-recipe", default="nvfp4", choices=["nvfp4", "mxfp4"])
    ap.add_argument("--model", default="llama_tiny", help="compact-loop preset (snip_megatron.shapes.PRESETS); "
                    "an MoE one (llama_tiny_moe8) adds the scores over its routed experts and its attention "
                    "linears apart to RESULT")
    ap.add_argument("--steps", type=int, default=1000, help="BF16 training steps to the later point")
    ap.add_argument("--early", type=int, default=300, help="step of the early point")
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--num-mb", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--long-num-mb", type=int, default=None,
                    help="micro-batches per step of the long-horizon continuations (default --num-mb)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--val-batches", type=int, default=128, help="micro-batches of each evaluation set")
    ap.add_argument("--eval-sets", default="iid,docs", help="evaluation sets of the truths, the first is "
                    "scored in RESULT: iid (held-out sequences of the training distribution), docs "
                    "(Megatron's validation split: held-out documents)")
    ap.add_argument("--cache-dir", default=None, help="keep the trained model at each point here and "
                    "reuse it in later runs with the same training arguments")
    ap.add_argument("--probe", action="store_true", help="diagnostic: inject each layer's actual "
                    "quantization error alone on the measurement batch (exact batch harm, curvature along the error)")
    ap.add_argument("--pred-batches", type=int, default=1, help="measurements on this many batches at a "
                    "point; the first is the prediction, the others show the estimator's batch noise "
                    "(with --remeasure: more than the saved run's, if given)")
    ap.add_argument("--rounding-seeds", type=int, default=2)
    ap.add_argument("--long-steps", type=int, default=60)
    ap.add_argument("--long-orders", type=int, default=2, help="data orders of the long-horizon truth "
                    "(its ceiling: the agreement of the mean over each half of them)")
    ap.add_argument("--long-skip", type=int, default=0, help="run the quantized continuations of the "
                    "data orders from this one on (the earlier orders' data is still drawn, and their BF16 "
                    "continuations identify it); join the runs with --rescore FILE --long-from FILE2")
    ap.add_argument("--long-from", default="", help="with --rescore: comma-separated runs of the same model "
                    "whose long-horizon orders are appended to FILE's (checked to be different orders of "
                    "the same data stream)")
    ap.add_argument("--long-precisions", default="fp4,fp8")
    ap.add_argument("--lambdas", default="0,0.3,1,3")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--truths", default="harm,dev,long", help="which truths to measure (and \"frozen\": "
                    "the one-step FP4 harm with MoE routing frozen at the BF16 pass's choices)")
    ap.add_argument("--points", default="early,later", help="which points to measure")
    ap.add_argument("--rescore", default=None, help="recompute predictions and scores from a saved "
                    "--out JSON with the current estimator (the measurement and truths are reused)")
    ap.add_argument("--remeasure", default=None, help="redo the measurement (the prediction) of a saved "
                    "--out JSON with the current default on the model kept in --cache-dir, keep its truths, "
                    "and score it (a change to the measurement without recomputing the truths)")
    ap.add_argument("--sample-k", default="", help="micro-batch sampling study: comma-separated K of "
                    "MeasureConfig.micro_batches (0 = all; it is added), each measured on the same steps")
    ap.add_argument("--sample-mb", type=int, default=16, help="micro-batches per step of the sampling study")
    ap.add_argument("--sample-repeats", type=int, default=3, help="steps of the sampling study")
    ap.add_argument("--out", default=None, help="write all raw numbers as JSON")
    args = ap.parse_args(argv)
    args.lambdas = [float(x) for x in args.lambdas.split(",")]
    args.long_precisions = [Precision.parse(p) for p in args.long_precisions.split(",") if p]
    args.eval_sets = [n for n in args.eval_sets.split(",") if n]
    args.sample_k = sorted({int(k) for k in args.sample_k.split(",") if k} | {0}, key=lambda k: k or 1 << 30) \
        if args.sample_k else []
    if args.long_from and not args.rescore:
        ap.error("--long-from joins long-horizon orders into a saved run: it needs --rescore FILE")
    if not 0 <= args.long_skip < args.long_orders:
        ap.error(f"--long-skip {args.long_skip} must leave at least one of the {args.long_orders} orders")
    from snip_megatron.models.gpt import PRESET_MOE

    if args.probe and args.model in PRESET_MOE:
        ap.error(f"--probe with the MoE --model {args.model}: the probe injects one tensor per linear and "
                 "micro-batch, and an expert unit has one per expert; run it on a dense model")
    if args.rescore:
        return rescore(args)
    if args.remeasure:
        return remeasure(args)
    start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - start:7.0f}s] {msg}", flush=True)

    h = Harness(args)
    log(f"{args.model}, {len(h.keys)} planned units, fp4 recipe {args.fp4_recipe}")
    results = {}
    for name, step, long_horizon in (("early", args.early, False), ("later", args.steps, True)):
        if name not in args.points:
            continue
        cached = cache_path(args, name)
        if cached is not None and cached.exists():
            h.load(cached)
            log(f"loaded the step-{step} model from {cached}; measuring '{name}'")
        else:
            data = h.tr.reader.take((step - h.tr.step) * args.num_mb)
            h.train_steps(data)
            h.tr.step = step
            if cached is not None:
                h.save(cached)
            log(f"trained to step {step}; measuring '{name}'")
        results[name] = measure_point(h, long_horizon, log)
        if args.out:  # keep what is done if a later phase is interrupted
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out + ".partial").write_text(json.dumps({"keys": [str(k) for k in h.keys],
                                                               "groups": h.groups, "results": results}))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": {k: (v if not isinstance(v, list) else [str(x) for x in v])
                                                        for k, v in vars(args).items()},
                                              "keys": [str(k) for k in h.keys], "groups": h.groups,
                                              "results": results}))
    log("done")
    report([str(k) for k in h.keys], results, args, h.groups)


def remeasure(args) -> None:
    saved = json.loads(Path(args.remeasure).read_text())
    pred_batches = args.pred_batches
    for a in TRAINING_ARGS + ("fp4_recipe",):
        setattr(args, a, saved["args"][a])
    args.model = saved["args"].get("model", "llama_tiny")  # runs from before --model: llama_tiny
    cached = cache_path(args, "later")
    if cached is None or not cached.exists():
        raise SystemExit(f"--remeasure needs the run's model in --cache-dir (no {cached}); "
                         f"rerun the benchmark with --cache-dir")
    if pred_batches > 1:  # more measured batches than the run had (its cache is keyed by its own)
        args.pred_batches = saved["args"]["pred_batches"] = pred_batches
    args.eval_sets = []
    h = Harness(args)
    h.load(cached)
    r = saved["results"]["later"]
    r.update(h.predict()[0])
    if args.sample_k:
        r["sampling"] = h.sampling_study()
    if args.out:
        Path(args.out).write_text(json.dumps(saved))
    print(f"remeasured {args.remeasure} with {r['measure_config']}")
    report(saved["keys"], saved["results"], args, saved.get("groups"))


def rescore(args) -> None:
    from snip_megatron.plan import parse_key

    saved = json.loads(Path(args.rescore).read_text())
    keys = [parse_key(k) for k in saved["keys"]]
    args.fp4_recipe = saved.get("args", {}).get("fp4_recipe", args.fp4_recipe)
    results = saved["results"]
    for extra in filter(None, args.long_from.split(",")):
        merge_long(results["later"], json.loads(Path(extra).read_text())["results"]["later"], extra)
    for r in results.values():
        r.update(predictions(load_stats(keys, r["stats"], r.get("stats_fields")), args.lambdas, r.get("m_ew")))
        r["extra_pred"] = [predictions(load_stats(keys, a, r.get("stats_fields")), args.lambdas)["pred"]
                           for a in r.get("extra_stats", [])]
    if args.out:  # e.g. the run with the long-horizon orders of --long-from joined in
        Path(args.out).write_text(json.dumps(saved))
    print(f"rescored {args.rescore} with the current estimator ({EstimateConfig()})")
    report([str(k) for k in keys], results, args, saved.get("groups"))


def merge_long(r: dict, extra: dict, name: str) -> None:
    """Append the long-horizon orders of `extra` (a --long-skip run of the same model) to those of
    `r`. The two runs drew their orders from the same data stream: each order both ran must have
    the same BF16 continuation loss, bit for bit, and no order may be counted twice."""
    have = r.get("long_orders", list(range(len(r["long_base"]))))
    new = extra["long_orders"]
    if set(have) & set(new):
        raise SystemExit(f"--long-from {name}: orders {sorted(set(have) & set(new))} are in both runs")
    for o in have:
        if o >= len(extra["long_base"]) or extra["long_base"][o] != r["long_base"][o]:
            raise SystemExit(f"--long-from {name}: order {o}'s BF16 continuation differs from the "
                             f"first run's, so its data orders are not the same stream")
    pairs = [(r, extra)] + [(v, extra["other_sets"][n]) for n, v in (r.get("other_sets") or {}).items()]
    for into, add in pairs:  # the primary evaluation set, then every other one
        if set(into["long"]) != set(add["long"]) or any(
                len(into["long"][p]) != len(add["long"][p]) for p in into["long"]):
            raise SystemExit(f"--long-from {name}: other precisions or layers than the first run's")
        for p, rows in add["long"].items():
            into["long"][p] = [a + b for a, b in zip(into["long"][p], rows)]
    r["long_orders"] = have + new
    r["long_base"] = extra["long_base"]


def report(keys, results: dict, args, groups: "dict | None" = None) -> None:
    """Print the tables and scores; `groups` (unit_groups) adds the scores over each kind of unit
    (an MoE model: the routed experts and the attention linears apart) to RESULT."""
    default_lam = EstimateConfig().lam
    all_scores = {n: scores(r, args.lambdas, default_lam) for n, r in results.items()}
    other = {}  # the same predictions scored against the other evaluation sets' truths
    for n, r in results.items():
        for name, v in (r.get("other_sets") or {}).items():
            swapped = dict(r, harm=v["harm"], first_order=v.get("first_order"), base_val=v["base_val"])
            if "long" in v:
                swapped["long"] = v["long"]
            else:
                swapped.pop("long", None)
            other[f"{n}/{name}"] = scores(swapped, args.lambdas, default_lam)
    for n, r in results.items():
        if r["harm"] and r["dev"]:
            print_table(keys, r, f"{n} point ({args.fp4_recipe})")
    print(f"\n== Spearman over {len(keys)} layers ({args.fp4_recipe}); predicted dL vs one-step harm, "
          f"WD vs update deviation, Q(lambda) vs long-horizon harm")
    for n, s in all_scores.items():
        print(f"{n} ({results[n].get('eval_set', 'docs')}): " + " ".join(f"{k}={v:.3f}" for k, v in s.items()))
    for n, s in other.items():
        print(f"{n}: " + " ".join(f"{k}={v:.3f}" for k, v in s.items()))
    later = all_scores.get("later", next(iter(all_scores.values())))
    best = max(args.lambdas, key=lambda lam: later.get(f"long_fp4_Q{lam}", -1))
    print(f"lambda by long-horizon FP4 score: " + " ".join(
        f"{lam}:{later.get(f'long_fp4_Q{lam}', math.nan):.3f}" for lam in args.lambdas)
          + f"  -> best {best} (EstimateConfig default {default_lam})")
    for n, s in other.items():
        if n.startswith("later/"):
            print(f"against the {n[6:]} truth: spearman_fp4={s['fp4']:.3f} spearman_marginal={s['marginal']:.3f} "
                  f"spearman_long={s.get('long', math.nan):.3f} spearman_proxy={s['proxy_fp4']:.3f} "
                  f"ceiling_split={s['ceiling_split']:.3f} ceiling_second_order={s.get('ceiling_second_order', math.nan):.3f} "
                  f"fp4_second_order={s.get('fp4_second_order', math.nan):.3f}")
    for n, r in results.items():
        for k, sc in sampling_scores(r).items():
            truth = sc.get("vs_truth")
            print(f"sampling {n}: K={k or 'all'} of {r['sampling']['num_mb']} micro-batches "
                  f"({sc['seconds'][0]:.1f}s): dL FP4 vs all {sc['vs_all'][0]:.3f} +- {sc['vs_all'][1]:.3f}, "
                  f"WD FP4 vs all {sc['wd_vs_all'][0]:.3f} +- {sc['wd_vs_all'][1]:.3f}"
                  + (f", dL FP4 vs one-step truth {truth[0]:.3f} +- {truth[1]:.3f}" if truth else ""))
    by_kind = {}
    for n, r in results.items():
        gs = group_scores(keys, r, groups or {})
        if gs:
            print(f"{n} by kind of unit: " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                                     for k, v in gs.items()))
        if n == "later" or not by_kind:
            by_kind = gs
    kinds = "".join(f" spearman_{g}={v:.3f} ceiling_split_{g[4:]}={by_kind[f'ceiling_split_{g[4:]}']:.3f}"
                    for g, v in by_kind.items() if g.startswith("fp4_") and not g.startswith(("fp4_second_order_", "fp4_avg_")))
    print(f"RESULT spearman_fp4={later['fp4']:.3f} spearman_marginal={later['marginal']:.3f} "
          f"spearman_long={later.get('long', math.nan):.3f} spearman_wd={later['wd']:.3f} "
          f"spearman_proxy={later['proxy_fp4']:.3f} ceiling_split={later['ceiling_split']:.3f} "
          f"ceiling_long={later.get('ceiling_long', math.nan):.3f}" + (kinds if groups and any(
              v == "experts" for v in groups.values()) else ""))


if __name__ == "__main__":
    main()
