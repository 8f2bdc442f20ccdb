"""SNIP's Transformer Engine path on a real GPU with the real Transformer Engine: what tests/te and
tests/pretrain/test_te_runs.py check on CPU over the TE test double, plus what only TE's run-time
state and kernels can show (issue 31).

    python bench/gpu/te_check.py                          # every part (GPU + TE + megatron-core)
    python bench/gpu/te_check.py --skip-pretrain          # all but the snip-pretrain-gpt runs
    python bench/gpu/te_check.py --only availability,timing   # the parts that run without TE

Sized for about five minutes on one H200 (the parts print their seconds). Parts (`--only`):
availability  TE's version and its own answers, `is_fp8_available`, `is_fp8_block_scaling_available`,
              `is_mxfp8_available`, `is_nvfp4_available` (each with its reason), against SNIP's GPU
              table and SNIP's start-up decision for this GPU. Before SM100: SNIP refuses FP4 with
              TE (an FP4 plan, `precisions` with fp4, an FP4 budget), naming the fix (SNIP's
              emulated linears, `--transformer-impl local`), and `--snip` alone plans BF16/FP8.
              Without TE: SNIP's side only.
timing        BF16 against FP8 time of the three GEMMs (fprop, dgrad, wgrad) of each planned
              linear of a Llama-70B layer at TP=8 (local shapes, `--tokens` per micro-batch):
              through TE's linears (GEMM + TE's casts; `delay_wgrad_compute` splits dgrad from
              wgrad) with SNIP's FP8 recipe and, from SM100, NVFP4; and through torch._scaled_mm
              (FP8 GEMM alone, per-tensor scales), which needs no TE. Prints the cost model it
              implies as `--snip-gemm-cost bf16=1,fp8=<ratio>,fp4=<ratio>` (fp4 measured only where
              TE runs NVFP4, SM100+).
flags         TE's environment switches as SNIP reads them; which FP8 recipes TE runs on this GPU
              against snip_megatron.te; for every recipe flag of the CPU check (RECIPE_FLAGS),
              SNIP's start-up on this GPU either refuses it or a te.Linear inside the autocast
              Megatron opens from SNIP's TE dict gives our emulation's forward output (relative
              error to the emulation below `--max-ratio` times its error to the unquantized GEMM).
warmup        Two forwards before a backward (a pipeline's warm-up) on every recipe TE runs on this
              GPU: te.Linear and te.LayerNormLinear with fuse_wgrad_accumulation, forward with
              is_first_microbatch True then False, then both backwards: no error, the cached
              weight's output equals a fresh forward, weight.main_grad filled.
gpt           A TE-spec GPTModel with a mixed plan this GPU runs, Megatron-LM's default
              gradient_accumulation_fusion=True (TE's fuse_wgrad_accumulation), Megatron DDP
              (main_grad buffers): after each of the first two steps every planned linear's weight
              moved and its main_grad is nonzero (per layer); step 2's quantized forwards (through
              Megatron's schedule, which re-arms is_first_microbatch itself only on
              megatron-core >= 0.19 with a quant_recipe) equal a fresh forward on step 2's weights,
              not step 1's; then a re-plan with apply_plan and more training (the loss falls).
pretrain      `snip-pretrain-gpt --transformer-impl transformer_engine --snip` on mock data with
              Megatron-LM's default flags (gradient-accumulation fusion on), in a subprocess with a
              probe on SNIP's controller: the start-up line, a measurement and a re-plan, every
              planned TE linear built with fuse_wgrad_accumulation, each one's weight moved and
              main_grad nonzero after every step, no FP4 in any plan before SM100. Before SM100
              also `--snip --snip-precisions fp8,fp4` must be refused at start-up with the fix.

Refuses to start without a CUDA GPU; the parts flags, warmup, gpt and pretrain refuse without
Transformer Engine (the real one, not tests/te_double) and name the parts that run without it.
Last line: `RESULT <key>=<value> ...` with RESULT_KEYS (a part not run reads `skipped`).

Never run: no machine with both a GPU and Transformer Engine was available (bench/gpu/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling single_gpu.py, when loaded by path

from snip_megatron.formats.precision import Precision  # noqa: E402
from snip_megatron.models import gpt  # noqa: E402
from snip_megatron.models.inventory import ParallelKind  # noqa: E402
from snip_megatron.plan import LayerKey, Plan  # noqa: E402
from snip_megatron.shapes import PRESETS, ModelShape  # noqa: E402
from single_gpu import single_process_env  # noqa: E402

# Multiples of 128: no FP8 / NVFP4 block straddles a tensor edge.
SHAPE = ModelShape(name="te_check", num_layers=4, hidden_size=256, ffn_hidden_size=512,
                   num_attention_heads=4, num_query_groups=2, vocab_size=512, seq_length=128)
RECIPE_FLAGS = [{}, {"fp8_format": "hybrid"}, {"fp8_recipe": "tensorwise"},
                {"fp8_recipe": "tensorwise", "fp8_format": "e4m3"}, {"fp8_recipe": "mxfp8"},
                {"fp8_block_scales": "pow2"}, {"fp8_block_scales": "fp32"},
                {"fp4_gradient_rounding": "nearest"}, {"fp4_gradient_rounding": "stochastic"},
                {"fp4_recipe": "mxfp4"}]
"""The same flags as tests/te/megatron_checks.py (kept equal by tests/bench/test_te_check.py)."""
PRETRAIN_MODEL = ["--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "512",
                  "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
                  "--seq-length", "128", "--max-position-embeddings", "128", "--position-embedding-type", "rope",
                  "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
                  "--untie-embeddings-and-output-weights", "--micro-batch-size", "2", "--global-batch-size", "4",
                  "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--bf16",
                  "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--mock-data",
                  "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "100"]
"""A 2-layer model with Megatron-LM's defaults otherwise: no --no-gradient-accumulation-fusion."""
PRETRAIN_SNIP = ["--transformer-impl", "transformer_engine", "--train-iters", "5", "--snip",
                 "--snip-warmup", "2", "--snip-interval", "10", "--snip-lag", "1"]

PARTS = ("availability", "timing", "flags", "warmup", "gpt", "pretrain")
"""In the order they run."""
TE_PARTS = ("flags", "warmup", "gpt", "pretrain")
"""The parts that need Transformer Engine (availability and timing run without it)."""
RESULT_KEYS = ("sm", "te", "mcore", "parts", "avail_agree", "snip_default", "fp4_refused", "fp8_cost",
               "fp4_cost", "gemm_cost", "switches", "flags", "refused", "fwd_ratio_max", "warmup",
               "fused_wgrad", "stale", "stale_rel", "replanned", "loss_first", "loss_last", "pretrain",
               "seconds", "ok")
"""The keys of the RESULT line, in order."""

TE_AVAILABILITY = (("fp8", "is_fp8_available", "tensorwise"),
                   ("fp8_block_scaling", "is_fp8_block_scaling_available", "blockwise"),
                   ("mxfp8", "is_mxfp8_available", "mxfp8"),
                   ("nvfp4", "is_nvfp4_available", "nvfp4"))
"""(TESupport name, TE's function in transformer_engine.pytorch, SNIP's recipe name)."""
FP4_FIXES = ("--transformer-impl local", "emulated linears")
"""What SNIP's FP4 refusal before SM100 must name (one of them): where FP4 runs on Hopper."""
GEMMS = ("fprop", "dgrad", "wgrad")
COLUMN_PARALLEL = tuple(s.name for s in gpt.LINEARS if s.kind is ParallelKind.COLUMN)
"""Linears whose output features TP splits (the others split their input features): the GPT adapter's."""


# -- pure helpers (tested on CPU) ------------------------------------------------------------------
@dataclass(frozen=True)
class Gemm:
    """One GEMM of a linear layer: out[m, n] = a[m, k] @ b[k, n]."""

    linear: str
    gemm: str
    """fprop (Y = X W^T), dgrad (dX = dY W) or wgrad (dW = dY^T X)."""
    m: int
    n: int
    k: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


def tp_linear_shapes(shape: ModelShape, tp: int) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each planned linear on one of `tp` tensor-parallel ranks:
    linear_qkv and linear_fc1 split their outputs, linear_proj and linear_fc2 their inputs."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if shape.num_query_groups % tp:
        raise ValueError(f"num_query_groups={shape.num_query_groups} is not divisible by tp={tp}")
    out = {}
    for name, (n_out, n_in) in gpt.linear_shapes(shape).items():
        split = n_out if name in COLUMN_PARALLEL else n_in
        if split % tp:
            raise ValueError(f"{name}: {split} features are not divisible by tp={tp}")
        out[name] = (n_out // tp, n_in) if name in COLUMN_PARALLEL else (n_out, n_in // tp)
    return out


def gemm_problems(shape: ModelShape, tp: int, tokens: int) -> list[Gemm]:
    """The three GEMMs of each planned linear of one layer on one TP rank, `tokens` rows of X."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"tokens must be a positive integer, got {tokens!r}")
    out = []
    for name, (n_out, n_in) in tp_linear_shapes(shape, tp).items():
        out += [Gemm(name, "fprop", tokens, n_out, n_in), Gemm(name, "dgrad", tokens, n_in, n_out),
                Gemm(name, "wgrad", n_out, n_in, tokens)]
    return out


def cost_model(times: dict) -> dict[str, "float | None"]:
    """{(linear, gemm, precision): seconds} -> {precision: summed time / summed BF16 time} over the
    GEMMs measured in both (the layer's GEMM time in that precision relative to BF16, so each
    GEMM counts by its time); None where a precision has no GEMM measured."""
    bf16 = {(lin, g): t for (lin, g, p), t in times.items() if p == "bf16"}
    costs: dict[str, "float | None"] = {"bf16": 1.0}
    for p in ("fp8", "fp4"):
        pairs = [(t, bf16[(lin, g)]) for (lin, g, q), t in times.items() if q == p and (lin, g) in bf16]
        costs[p] = sum(t for t, _ in pairs) / sum(b for _, b in pairs) if pairs else None
    return costs


def gemm_cost_flag(costs: dict, fallback: dict) -> str:
    """`--snip-gemm-cost` syntax ("bf16=1,fp8=0.55,fp4=0.3"): the measured costs, and `fallback`'s
    value for a precision not measured (the flag needs all three)."""
    parts = []
    for p in ("bf16", "fp8", "fp4"):
        value = costs.get(p)
        if value is None:
            value = fallback[p]
        if not value > 0:
            raise ValueError(f"{p} costs {value!r}; every GEMM cost must be > 0")
        parts.append(f"{p}={value:.3g}")
    return ",".join(parts)


def select_parts(only: "str | None", skip_pretrain: bool = False) -> list[str]:
    """The parts to run, in PARTS order: `only` (comma-separated) or all; ValueError naming an
    unknown part."""
    wanted = list(PARTS) if only is None else [p.strip() for p in only.split(",") if p.strip()]
    unknown = [p for p in wanted if p not in PARTS]
    if unknown or not wanted:
        raise ValueError(f"--only {only!r}: unknown part(s) {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(PARTS)}")
    return [p for p in PARTS if p in wanted and not (skip_pretrain and p == "pretrain")]


def refusal(parts: list[str], cuda: bool, te_error: "str | None") -> "str | None":
    """Why this machine cannot run `parts` (None when it can)."""
    needs_te = [p for p in parts if p in TE_PARTS]
    if not cuda:
        what = "a CUDA GPU and Transformer Engine" if needs_te else "a CUDA GPU"
        return (f"te_check.py needs {what}; this machine has no GPU (tests/te runs the TE checks on CPU "
                "over the TE test double)")
    if needs_te and te_error is not None:
        runnable = [p for p in parts if p not in TE_PARTS]
        return (f"te_check.py parts {', '.join(needs_te)} need Transformer Engine ({te_error}); use the NGC "
                f"PyTorch image (docker/), or run the parts that do not need it: --only "
                f"{','.join(runnable) or 'availability,timing'}")
    return None


def result_line(fields: dict) -> str:
    """`RESULT k=v ...` over RESULT_KEYS; a key not in `fields` reads `skipped`. ValueError for a
    field that is not a RESULT key (a typo would vanish from the line)."""
    unknown = sorted(set(fields) - set(RESULT_KEYS))
    if unknown:
        raise ValueError(f"not RESULT keys: {', '.join(unknown)}")
    out = []
    for key in RESULT_KEYS:
        value = fields.get(key, "skipped")
        if isinstance(value, bool):
            value = int(value)
        elif isinstance(value, float):
            value = f"{value:.4g}"
        value = str(value).replace(" ", "")
        out.append(f"{key}={value or '-'}")
    return "RESULT " + " ".join(out)


def plan_cycle(fp4_runs: bool) -> list[Precision]:
    """The precisions of the mixed plans: BF16, FP8 and, where TE runs NVFP4, FP4."""
    return [Precision.BF16, Precision.FP8] + ([Precision.FP4] if fp4_runs else [])


def plan_a(n: int, cycle: list[Precision]) -> Plan:
    return Plan({k: cycle[(k.layer + gpt.LINEAR_NAMES.index(k.name)) % len(cycle)] for k in gpt.keys(n)})


def plan_b(n: int, cycle: list[Precision]) -> Plan:
    """plan_a with three linears moved to the next precision of the cycle."""
    a = plan_a(n, cycle)
    moves = [LayerKey(1, "linear_fc1"), LayerKey(n, "linear_proj"), LayerKey(2, "linear_qkv")]
    return a.replace({k: cycle[(cycle.index(a[k]) + 1) % len(cycle)] for k in moves})


def evaluate_probe(records: list[dict], *, fp4_runs: bool) -> tuple[bool, list[str]]:
    """Judge what the pretrain probe wrote after each step ({"step", "fusion", "precisions",
    "linears": {key: {"precision", "moved", "main_grad", "fused"}}}): gradient-accumulation fusion
    on, every planned linear fused, moved and with a nonzero main_grad after every step, and no FP4
    where TE runs none. Returns (ok, one line per problem or a summary)."""
    if not records:
        return False, ["the probe recorded no step"]
    problems = []
    for r in records:
        step, linears = r["step"], r["linears"]
        if not linears:
            problems.append(f"step {step}: no planned linears found")
        if r.get("fusion") is not True:
            problems.append(f"step {step}: gradient_accumulation_fusion is {r.get('fusion')!r}, not Megatron-LM's "
                            "default True")
        if not fp4_runs and "fp4" in (r.get("precisions") or []):
            problems.append(f"step {step}: the run's precisions {r.get('precisions')} include fp4 before SM100")
        for key, v in linears.items():
            what = [w for w, bad in (("not fused (fuse_wgrad_accumulation off)", v.get("fused") is not True),
                                     ("weight did not move", not v.get("moved")),
                                     ("main_grad is zero or missing", not v.get("main_grad")),
                                     ("FP4 before SM100", not fp4_runs and v.get("precision") == "fp4"))
                    if bad]
            if what:
                problems.append(f"step {step}: {key} ({v.get('precision')}): {', '.join(what)}")
    if problems:
        return False, problems
    n = len(records[-1]["linears"])
    return True, [f"{len(records)} steps: all {n} planned linears fused, moved and with a nonzero main_grad "
                  f"after every step (precisions {records[-1].get('precisions')})"]


# -- this machine ----------------------------------------------------------------------------------
def te_import_error() -> "str | None":
    """Why the real Transformer Engine cannot be used here, or None."""
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # absent, or a broken install
        return f"import failed: {type(e).__name__}: {e}"
    if os.path.join("tests", "te_double") in os.path.abspath(transformer_engine.__file__):
        return "found the TE test double (tests/te_double), not Transformer Engine; take it off PYTHONPATH"
    return None


def te_version() -> str:
    """Installed TE's version (TE's __version__ reads its distribution's metadata)."""
    import transformer_engine

    return str(getattr(transformer_engine, "__version__", "unknown"))


def mcore_version() -> str:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:
        try:
            import megatron.core

            return str(megatron.core.__version__)
        except Exception:
            return "absent"


def snip_api(module: str, name: str):
    """snip_megatron's `module.name`, or RuntimeError saying this checkout predates it."""
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"{module}.{name} is missing ({type(e).__name__}: {e}): this checkout predates "
                           "issue 31's API that te_check.py is written against") from None


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def te_recipe(name: str):
    """TE's recipe object for SNIP's recipe name (TE's defaults otherwise, as SNIP's TE dicts ask)."""
    from transformer_engine.common import recipe

    return {"tensorwise": recipe.Float8CurrentScaling, "blockwise": recipe.Float8BlockScaling,
            "mxfp8": recipe.MXFP8BlockScaling, "nvfp4": recipe.NVFP4BlockScaling}[name]()


def te_autocast(recipe):
    """TE's autocast with `recipe` (te.autocast from TE 2.9; fp8_autocast before)."""
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def te_answers() -> dict[str, tuple[bool, str]]:
    """TE's own availability answers {TESupport name: (ok, reason)} on this GPU."""
    import transformer_engine.pytorch as te

    out = {}
    for name, fn, _ in TE_AVAILABILITY:
        answer = getattr(te, fn)(return_reason=True)
        ok, reason = answer if isinstance(answer, tuple) else (bool(answer), "")
        out[name] = (bool(ok), str(reason or ""))
    return out


def te_support():
    """snip_megatron.te.installed's reading of the installed TE (what SNIP's start-up asks TE)."""
    return snip_api("snip_megatron.te.installed", "read_te_support")()


# -- availability ----------------------------------------------------------------------------------
def snip_starts(sm: int, support=None, **flags) -> "tuple[object | None, str]":
    """(SnipConfig(enabled=True, **flags) resolved for TE on SM`sm` with the installed TE's answers
    `support` (None: the GPU table alone), as SNIP's start-up resolves it, "") or (None, the refusal).
    Before SM90 the FP8 recipe defaults to tensorwise here (SNIP's default, blockwise, needs SM90)."""
    from snip_megatron.config import SnipConfig

    if sm < 90:
        flags.setdefault("fp8_recipe", "tensorwise")
    try:
        return SnipConfig(enabled=True, **flags).resolved("te", sm=sm, support=support), ""
    except ValueError as e:
        return None, " ".join(str(e).split())


def check_fp4_refused(sm: int, log, support=None) -> tuple[bool, str]:
    """The start-up on SM`sm` (with the installed TE's answers `support`, if any): `--snip` alone
    plans what runs (BF16/FP8 under an FP8 budget before SM100, FP4 from SM100); before SM100
    every way of asking FP4 with TE is refused, naming the fix, and so is a plan with FP4 linears.
    Pure Python where `support` is None (the SM is a parameter). Returns (ok, the precisions
    `--snip` alone plans)."""
    from snip_megatron.megatron.quant_recipe import check_runnable, config_dict_for

    run, why = snip_starts(sm, support)
    if run is None:
        log(f"A. --snip alone on SM{sm}: REFUSED ({why})  <-- FAILED")
        return False, "refused"
    default = ",".join(run.precisions or [])
    hopper = sm < 100
    if hopper:
        ok = run.precisions == ["bf16", "fp8"] and run.budget == "fp8_fraction"
    else:
        ok = "fp4" in (run.precisions or [])
    log(f"A. --snip alone on SM{sm} plans {default} under budget {run.budget}"
        f"{'' if ok else '  <-- FAILED (want bf16,fp8 / fp8_fraction before SM100, fp4 from SM100)'}")
    if not hopper:
        return ok, default
    asks = {"precisions bf16,fp8,fp4": dict(precisions="bf16,fp8,fp4"),
            "precisions fp8,fp4": dict(precisions="fp8,fp4"), "fp4_budget 0.5": dict(fp4_budget=0.5),
            "fp4_recipe mxfp4": dict(fp4_recipe="mxfp4")}
    for label, flags in asks.items():
        started, why = snip_starts(sm, support, **flags)
        named = any(fix in why for fix in FP4_FIXES)
        good = started is None and named
        ok &= good
        log(f"A. {label} on SM{sm}: {'refused' if started is None else 'STARTED'}"
            f"{' naming the fix' if named else ' without naming the fix'}{'' if good else '  <-- FAILED'}")
    # A plan with FP4 linears (a saved or resumed one) is refused by the start-up's plan check.
    plan = plan_a(SHAPE.num_layers, plan_cycle(True))
    try:
        check_runnable(plan, config_dict_for("te", sm=sm, formats=run.formats), backend="te", sm=sm,
                       formats=run.formats)
        log(f"A. a plan with FP4 linears on SM{sm}: ACCEPTED  <-- FAILED")
        ok = False
    except ValueError as e:
        log(f"A. a plan with FP4 linears on SM{sm}: refused ({' '.join(str(e).split())[:200]})")
    return ok, default


def check_availability(sm: int, te_error: "str | None", log) -> dict:
    """TE's version and availability answers against SNIP's GPU table and SNIP's start-up (which
    asks TE too, through snip_megatron.te.installed)."""
    fields: dict = {}
    fp4_unavailable = snip_api("snip_megatron.te.gpu", "fp4_unavailable")
    fp8_unavailable = snip_api("snip_megatron.te.gpu", "fp8_unavailable")
    table = {name: (fp4_unavailable(recipe, sm) if recipe == "nvfp4" else fp8_unavailable(recipe, sm))
             for name, _, recipe in TE_AVAILABILITY}
    support, agree = None, True
    if te_error is not None:
        fields["te"] = "absent"
        log(f"A. Transformer Engine: absent ({te_error}); SNIP's side only (its GPU table)")
    else:
        fields["te"] = te_version()
        log(f"A. Transformer Engine {fields['te']} (megatron-core {mcore_version()}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda})")
        try:
            support = te_support()
            log(f"A. SNIP reads TE {support.version}: "
                + ", ".join(f"{name} {getattr(support, name).ok}" for name, _, _ in TE_AVAILABILITY))
            agree &= str(support.version) == fields["te"]
        except (RuntimeError, ValueError) as e:  # missing API, or a TE SNIP refuses (too old)
            log(f"A. snip_megatron.te.installed.read_te_support(): {e}  <-- FAILED")
            agree = False
    answers = te_answers() if te_error is None else {}
    for name, fn, recipe in TE_AVAILABILITY:
        flags = (dict(precisions="bf16,fp8,fp4") if recipe == "nvfp4"
                 else dict(precisions="bf16,fp8", fp8_recipe=recipe))
        run, why = snip_starts(sm, support, **flags)
        said = f"SNIP's table: {'runs' if table[name] is None else table[name]}; SNIP's start-up " + (
            f"runs {recipe}" if run is not None else f"refuses {recipe} ({why[:160]})")
        if name not in answers:
            log(f"A. {recipe}: {said}")
            continue
        ok, reason = answers[name]
        mine = getattr(support, name).ok if support is not None else ok
        same = ok == (run is not None) and mine == ok
        agree &= same
        log(f"A. {fn}() = {ok}{' (' + reason + ')' if reason else ''}; {said}"
            f"{'' if same else '  <-- DISAGREES with TE'}")
    if answers:
        fields["avail_agree"] = agree
    fp4_ok, default = check_fp4_refused(sm, log, support)
    fields["snip_default"] = default
    fields["fp4_refused"] = fp4_ok if sm < 100 else "n/a"
    fields["_ok"] = agree and fp4_ok
    return fields


# -- timing ----------------------------------------------------------------------------------------
def _elapsed(fn, iters: int, warmup: int) -> float:
    """Mean seconds of fn() on the current CUDA stream."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def time_torch_gemms(g: Gemm, iters: int, warmup: int) -> dict[str, float]:
    """{"bf16": s, "fp8": s} of one GEMM: torch.matmul in BF16 and torch._scaled_mm in FP8 E4M3
    with per-tensor scales (operands laid out as _scaled_mm wants them, made outside the timing as
    TE keeps its transposed copies)."""
    dev = "cuda"
    a = torch.randn(g.m, g.k, device=dev, dtype=torch.bfloat16)
    b_t = torch.randn(g.n, g.k, device=dev, dtype=torch.bfloat16)  # b = b_t.t(): column-major [k, n]
    out = {"bf16": _elapsed(lambda: torch.matmul(a, b_t.t()), iters, warmup)}
    if hasattr(torch, "_scaled_mm") and hasattr(torch, "float8_e4m3fn"):
        a8, b8_t = a.to(torch.float8_e4m3fn), b_t.to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev, dtype=torch.float32)
        out["fp8"] = _elapsed(lambda: torch._scaled_mm(a8, b8_t.t(), scale_a=one, scale_b=one,
                                                       out_dtype=torch.bfloat16), iters, warmup)
    return out


def time_te_linear(n_out: int, n_in: int, tokens: int, recipe, iters: int, warmup: int) -> dict[str, float]:
    """{"fprop", "dgrad", "wgrad": mean seconds} of a te.Linear (BF16 weights, no bias) under
    `recipe` (None: BF16), each GEMM with TE's casts around it; delay_wgrad_compute splits the
    backward into dgrad (backward()) and wgrad (backward_dw()). The weight is quantized once
    (is_first_microbatch True, then False), as in a step of several micro-batches."""
    import transformer_engine.pytorch as te

    layer = te.Linear(n_in, n_out, bias=False, params_dtype=torch.bfloat16, device="cuda",
                      delay_wgrad_compute=True)
    x = torch.randn(tokens, n_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(tokens, n_out, device="cuda", dtype=torch.bfloat16)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    sums = dict.fromkeys(GEMMS, 0.0)
    for i in range(warmup + iters):
        events[0].record()
        if recipe is None:
            y = layer(x, is_first_microbatch=i == 0)
        else:
            with te_autocast(recipe):
                y = layer(x, is_first_microbatch=i == 0)
        events[1].record()
        y.backward(gy)
        events[2].record()
        layer.backward_dw()
        events[3].record()
        torch.cuda.synchronize()
        if i >= warmup:
            for j, name in enumerate(GEMMS):
                sums[name] += events[j].elapsed_time(events[j + 1]) / 1e3
        x.grad = None
    return {name: s / iters for name, s in sums.items()}


def check_timing(sm: int, te_error: "str | None", tokens: int, iters: int, warmup: int, log) -> dict:
    """BF16 vs FP8 (and NVFP4 from SM100, through TE) GEMM time of a Llama-70B layer at TP=8."""
    from snip_megatron.formats.precision import Formats

    shape = PRESETS["llama_70b"]
    problems = gemm_problems(shape, 8, tokens)
    log(f"T. {shape.name} at TP=8, {tokens} tokens per micro-batch: "
        + ", ".join(f"{n} {o}x{i}" for n, (o, i) in tp_linear_shapes(shape, 8).items()))
    torch_times, te_times = {}, {}
    if sm < 89:
        log(f"T. SM{sm} has no FP8 tensor cores: BF16 only")
    for g in problems:
        t = time_torch_gemms(g, iters, warmup) if sm >= 89 else {}
        for p, s in t.items():
            torch_times[(g.linear, g.gemm, p)] = s
    te_recipes = {}
    if te_error is None:
        answers = te_answers()
        fp8_recipe = Formats().fp8_recipe  # SNIP's default FP8 recipe (blockwise)
        name = dict((r, n) for n, _, r in TE_AVAILABILITY)[fp8_recipe]
        if answers[name][0]:
            te_recipes["fp8"] = fp8_recipe
        elif answers["fp8"][0]:
            te_recipes["fp8"] = "tensorwise"
            log(f"T. TE cannot run {fp8_recipe} here ({answers[name][1]}); FP8 timed with tensorwise")
        if answers["nvfp4"][0]:
            te_recipes["fp4"] = "nvfp4"
        for n_lin, (n_out, n_in) in tp_linear_shapes(shape, 8).items():
            for p, r in [("bf16", None), *te_recipes.items()]:
                for gemm, s in time_te_linear(n_out, n_in, tokens, None if r is None else te_recipe(r),
                                              iters, warmup).items():
                    te_times[(n_lin, gemm, p)] = s
    for g in problems:
        row = []
        for label, times in (("TE", te_times), ("torch", torch_times)):
            bf = times.get((g.linear, g.gemm, "bf16"))
            if bf is None:
                continue
            row.append(f"{label} bf16 {bf * 1e3:.3f} ms ({g.flops / bf / 1e12:.0f} TFLOP/s)")
            for p in ("fp8", "fp4"):
                t = times.get((g.linear, g.gemm, p))
                if t is not None:
                    row.append(f"{label} {p} {t * 1e3:.3f} ms ({t / bf:.2f}x)")
        log(f"T. {g.linear} {g.gemm} (m={g.m} n={g.n} k={g.k}): " + "; ".join(row))
    model = snip_api("snip_megatron.te.gpu", "gemm_cost")(sm)
    fallback = {p.value: float(c) for p, c in model.items()}
    fields = {}
    for label, times, what in (("torch", torch_times, "FP8 GEMM alone, per-tensor scales (torch._scaled_mm)"),
                               ("TE", te_times, f"TE's linears with their casts ({te_recipes or 'BF16 only'})")):
        if not times:
            continue
        costs = cost_model(times)
        flag = gemm_cost_flag(costs, fallback)
        fields.update(fp8_cost=costs["fp8"] if costs["fp8"] is not None else "n/a",
                      fp4_cost=costs["fp4"] if costs["fp4"] is not None else "n/a", gemm_cost=flag)
        log(f"T. cost model from {what}: --snip-gemm-cost {flag}"
            f"{'' if costs['fp4'] is not None else '  (fp4 not measured: no NVFP4 on this GPU/TE; SNIP model value)'}")
    log(f"T. SNIP's model for SM{sm} (snip_megatron.te.gpu.gemm_cost): "
        + ",".join(f"{p}={c:g}" for p, c in fallback.items()))
    fields["_ok"] = bool(torch_times or te_times)
    return fields


# -- flags -----------------------------------------------------------------------------------------
def check_switches(log) -> bool:
    from transformer_engine.common.recipe import Float8BlockScaling, NVFP4BlockScaling

    from snip_megatron.te.environment import TESwitches

    ours = TESwitches.read()
    block, nv = Float8BlockScaling(), NVFP4BlockScaling()
    same = (block.fp8_quant_fwd_inp.power_2_scale == (ours.fp8_block_scales == "pow2")
            and nv.disable_stochastic_rounding == ours.nvfp4_disable_stochastic_rounding
            and nv.disable_rht == ours.nvfp4_disable_rht
            and nv.disable_2d_quantization == ours.nvfp4_disable_2d)
    log(f"F. TE's switches as SNIP reads them: {ours} -> {'agree' if same else 'DISAGREE'} with TE's recipes")
    return same


def _autocast_for(config: dict):
    """The autocast Megatron's TE linear opens from a TEQuantizationParams dict."""
    from megatron.core.extensions.transformer_engine import (TEQuantizationParams,
                                                             _get_fp8_autocast_for_quant_params)
    from megatron.core.quantization.quant_config import MatchContext, QuantizationConfig

    params = TEQuantizationParams.parse_from_config(
        QuantizationConfig(config, MatchContext("decoder.layers.0.mlp.linear_fc1", 0), "check"))
    return _get_fp8_autocast_for_quant_params(params, True)


def _te_linear_run(config: dict, x, w, gy):
    import transformer_engine.pytorch as te

    layer = te.Linear(w.shape[1], w.shape[0], bias=False, params_dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        layer.weight.copy_(w)
    xg = x.clone().requires_grad_()
    with _autocast_for(config):
        y = layer(xg)
    y.backward(gy)
    return y.detach(), xg.grad, layer.weight.grad


def _emulated_run(spec, x, w, gy):
    from snip_megatron.emulation.quantized_linear import QuantRuntime, quantized_linear

    xg, wg = x.float().clone().requires_grad_(), w.float().clone().requires_grad_()
    generator = torch.Generator(device=x.device).manual_seed(0)
    y = quantized_linear(xg, wg, None, spec, QuantRuntime(generator=generator))
    y.backward(gy.float())
    return y.detach(), xg.grad, wg.grad


def check_flags(sm: int, max_ratio: float, log) -> dict:
    from snip_megatron.formats.precision import Formats
    from snip_megatron.megatron.quant_recipe import config_dict_for
    from snip_megatron.te import te_params, te_unavailable

    switches = check_switches(log)
    support = te_support()
    ok, refused, worst = switches, 0, 0.0
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(256, 256, generator=g, device="cuda").bfloat16()
    w = (0.05 * torch.randn(512, 256, generator=g, device="cuda")).bfloat16()
    gy = torch.randn(256, 512, generator=g, device="cuda").bfloat16()
    plain = torch.nn.functional.linear(x.float(), w.float())
    # GPU facts: TE runs an FP8 recipe exactly where SNIP says it can (TE's check_recipe_support
    # raises in Python; NVFP4 kernels on an older GPU would fail inside CUDA, so they are not tried).
    for fp8 in ("blockwise", "tensorwise", "mxfp8"):
        formats = Formats(fp8_recipe=fp8, fp8_block_scales="pow2" if fp8 == "blockwise" else "fp32")
        predicted = "fp8" not in te_unavailable(formats=formats, sm=sm)
        config = {"transformer_engine_config_type": "TEQuantizationParams",
                  "training_recipe": {"fp8_quantization_recipe": fp8, "override_quantized_autocast": True,
                                      "override_nonquantized_autocast": True}}
        if predicted:
            config = te_params("fp8", formats=formats, sm=sm)
        try:
            _te_linear_run(config, x, w, gy)
            ran, why = True, ""
        except Exception as e:  # noqa: BLE001 - TE's own refusal
            ran, why = False, f"{type(e).__name__}: {e}"
        log(f"F. FP8 {fp8} on SM{sm}: SNIP says {'runs' if predicted else 'cannot run'}, TE "
            f"{'ran it' if ran else 'raised ' + why.splitlines()[0]}{'' if ran == predicted else '  <-- FAILED'}")
        ok &= ran == predicted
    # Every recipe flag as the start-up on this GPU takes it: the precisions this GPU plans (fp8 and
    # fp4 from SM100, bf16 and fp8 before), the flags that ask FP4 refused before SM100.
    for flags in RECIPE_FLAGS:
        name = ",".join(f"{k}={v}" for k, v in flags.items()) or "defaults"
        run, why = snip_starts(sm, support, **flags)
        if run is None:
            refused += 1
            log(f"F. {name}: refused at start-up ({why[-200:]})")
            continue
        formats = run.measure_config().formats
        configs = config_dict_for("te", sm=sm, formats=formats)
        quantized = [p for p in (run.precisions or ()) if p != "bf16"]
        if not quantized:
            ok = False
            log(f"F. {name}: the start-up plans no quantized precision ({run.precisions})  <-- FAILED")
        for p in quantized:
            te_y, te_dx, te_dw = _te_linear_run(configs[p], x, w, gy)
            emu_y, emu_dx, emu_dw = _emulated_run(formats.spec(p), x, w, gy)
            ratio = rel(te_y, emu_y) / max(rel(te_y, plain), 1e-30)
            finite = all(bool(torch.isfinite(t).all()) for t in (te_y, te_dx, te_dw))
            worst = max(worst, ratio)
            good = ratio < max_ratio and finite
            ok &= good
            log(f"F. {name} {p} ({formats.describe(p)}): forward |TE-ours|/|TE-unquantized| = {ratio:.3f}, "
                f"dX {rel(te_dx, emu_dx):.3f}, dW {rel(te_dw, emu_dw):.3f} relative to ours"
                f"{'' if good else '  <-- FAILED'}")
    return {"switches": switches, "flags": len(RECIPE_FLAGS), "refused": refused, "fwd_ratio_max": worst,
            "_ok": ok}


# -- warmup ----------------------------------------------------------------------------------------
def check_warmup(log, device: str = "cuda") -> dict:
    """Two forwards before a backward on every recipe TE runs here (1F1B / VPP warm-up). `device`
    cpu: the same logic over the TE test double (tests/bench/test_te_check.py)."""
    import transformer_engine.pytorch as te

    answers = te_answers()
    recipes = [recipe for name, _, recipe in TE_AVAILABILITY if answers[name][0]]
    passed, runs = 0, 0
    for recipe in recipes:
        for kind in ("Linear", "LayerNormLinear"):
            runs += 1
            label = f"W. {kind} {recipe}"
            try:
                torch.manual_seed(11)
                kwargs = dict(bias=False, params_dtype=torch.bfloat16, device=device, fuse_wgrad_accumulation=True)
                if kind == "LayerNormLinear":
                    kwargs["normalization"] = "RMSNorm"
                layer = getattr(te, kind)(256, 512, **kwargs)
                weight = layer.weight
                weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device=device)
                weight.grad_added_to_main_grad = False
                x1, x2 = (torch.randn(256, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
                          for _ in range(2))
                with te_autocast(te_recipe(recipe)):
                    y1 = layer(x1, is_first_microbatch=True)
                with te_autocast(te_recipe(recipe)):
                    y2 = layer(x2, is_first_microbatch=False)  # the cached weight
                y1.backward(torch.randn_like(y1))
                y2.backward(torch.randn_like(y2))
                with torch.no_grad(), te_autocast(te_recipe(recipe)):
                    fresh = layer(x2.detach(), is_first_microbatch=None)  # quantizes the weight anew
                same = rel(y2.detach(), fresh)
                filled = bool(weight.main_grad.abs().sum() > 0) and bool(torch.isfinite(weight.main_grad).all())
                finite = all(bool(torch.isfinite(t).all()) for t in (x1.grad, x2.grad))
                good = same <= 1e-3 and filled and finite and weight.grad_added_to_main_grad is True
                passed += good
                log(f"{label}: forward(True), forward(False), backward, backward: ran; cached vs fresh output "
                    f"{same:.2e}; main_grad {'filled' if filled else 'EMPTY'}; grad_added_to_main_grad "
                    f"{weight.grad_added_to_main_grad}; dX {'finite' if finite else 'NOT finite'}"
                    f"{'' if good else '  <-- FAILED'}")
            except Exception as e:  # noqa: BLE001 - the failure this part looks for
                log(f"{label}: RAISED {type(e).__name__}: {' '.join(str(e).split())[:300]}  <-- FAILED")
    if not recipes:
        log("W. TE runs no FP8/FP4 recipe on this GPU")
    return {"warmup": f"{passed}/{runs}", "_ok": passed == runs}


# -- gpt -------------------------------------------------------------------------------------------
def apex_wgrad_error() -> "str | None":
    """Why Megatron's local output layer cannot fuse its weight-gradient accumulation here."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except Exception as e:
        return f"apex's fused_weight_gradient_mlp_cuda is missing ({type(e).__name__}: {e})"
    return None


def _snapshot(linears) -> dict:
    return {pl.key: pl.module.weight.detach().clone() for pl in linears}


def _moved_and_filled(linears, before: dict) -> dict:
    """{key: (weight moved since `before`, main_grad nonzero)}."""
    out = {}
    for pl in linears:
        w = pl.module.weight
        main_grad = getattr(w, "main_grad", None)
        filled = main_grad is not None and bool(main_grad.abs().sum() > 0)
        out[pl.key] = (not torch.equal(w.detach(), before[pl.key]), filled)
    return out


def check_te_spec_gpt(sm: int, fp4_runs: bool, steps: int, stale_tol: float, log, device: str = "cuda") -> dict:
    """Fused wgrad moves every planned weight; no stale quantized weight across steps; a re-plan.
    `device` cpu: the same logic over the TE test double on gloo (tests/bench/test_te_check.py)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from snip_megatron.config import SnipConfig
    from snip_megatron.megatron import runtime
    from snip_megatron.megatron.apply import apply_plan, current_plan, list_planned_linears, precision_of
    from snip_megatron.megatron.batch import make_forward_step, random_batch
    from snip_megatron.megatron.model import make_transformer_config
    from snip_megatron.megatron.quant_recipe import recipe_for_chunk
    from snip_megatron.megatron.smoke import wrap_ddp_and_optimizer

    runtime.init_process_group(backend="nccl" if device == "cuda" else "gloo")
    runtime.initialize_model_parallel(tp=1, seed=1234)
    try:
        apex = apex_wgrad_error()
        fusion = apex is None
        if apex:
            log(f"G. {apex}: Megatron-LM's default --gradient-accumulation-fusion cannot run on this image "
                "(its local output layer needs it); the GPT runs with fusion off and the fused-wgrad check FAILS")
        formats = SnipConfig(enabled=True).resolved("te", sm=sm, support=te_support()).formats
        n, cycle = SHAPE.num_layers, plan_cycle(fp4_runs)
        a = plan_a(n, cycle)
        config = make_transformer_config(SHAPE, params_dtype=torch.bfloat16, gradient_accumulation_fusion=fusion)
        config.quant_recipe = recipe_for_chunk(a, config, backend="te", sm=sm, formats=formats)
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
                         vocab_size=SHAPE.vocab_size, max_sequence_length=SHAPE.seq_length,
                         share_embeddings_and_output_weights=False, position_embedding_type="rope").to(device)
        built = current_plan(model) == a
        linears = list_planned_linears(model)
        chunks, optimizer = wrap_ddp_and_optimizer([model], config, lr=3e-3, clip_grad=1.0,
                                                   distributed_optimizer=False)
        # As SNIP's controller does before the first step: apply the plan (on a megatron-core that
        # does not re-arm TE's weight cache for a quant_recipe, this turns the cache off per module).
        apply_plan(chunks, a, sm=sm, formats=formats)
        fused = [pl.key for pl in linears if getattr(pl.module, "fuse_wgrad_accumulation", None) is True]
        cache_off = [pl.key for pl in linears if getattr(pl.module, "disable_parameter_transpose_cache", False)]
        log(f"G. megatron-core {mcore_version()}: TE-spec GPT built with plan {a.counts()}: "
            f"{'delivered' if built else 'NOT delivered'} to {len(linears)} TE linears; "
            f"{len(fused)} with fuse_wgrad_accumulation; {len(cache_off)} with the weight cache turned off by SNIP")
        g = torch.Generator().manual_seed(7)
        batches = [{k: v.to(device) for k, v in random_batch(4, SHAPE.seq_length, SHAPE.vocab_size, g).items()}
                   for _ in range(2)]
        forward_backward, forward_step, losses = get_forward_backward_func(), make_forward_step(), []

        def train(k: int) -> None:
            for _ in range(k):
                chunks[0].zero_grad_buffer()
                optimizer.zero_grad()
                reduced = forward_backward(forward_step_func=forward_step, data_iterator=iter(batches),
                                           model=chunks, num_microbatches=len(batches),
                                           seq_length=SHAPE.seq_length, micro_batch_size=4, forward_only=False)
                optimizer.step()
                losses.append(sum(float(r["lm loss"]) for r in reduced) / len(reduced))

        # Steps 1 and 2: every planned weight moves and gets a main_grad; step 2's forwards are
        # recorded (input, output, the weight they ran with) on every quantized linear.
        step1_weights = _snapshot(linears)
        train(1)
        moved = _moved_and_filled(linears, step1_weights)
        step2_weights = _snapshot(linears)
        # Everything step 2's forward reads (a LayerNormLinear's norm weight too).
        step2_params = {pl.key: {name: p.detach().clone() for name, p in pl.module.named_parameters()}
                        for pl in linears}
        quantized = [pl for pl in linears if precision_of(pl.module) is not Precision.BF16]
        seen: dict = {pl.key: [] for pl in quantized}

        def recorder(key):
            def hook(module, args, output):
                out = output[0] if isinstance(output, tuple) else output
                seen[key].append((args[0].detach().clone(), out.detach().clone()))
            return hook

        handles = [pl.module.register_forward_hook(recorder(pl.key)) for pl in quantized]
        train(1)
        for h in handles:
            h.remove()
        moved2 = _moved_and_filled(linears, step2_weights)
        good = [k for k in moved if all(moved[k]) and all(moved2[k])]
        for pl in linears:
            (m1, f1), (m2, f2) = moved[pl.key], moved2[pl.key]
            if not (m1 and f1 and m2 and f2):
                log(f"G. {pl.key} ({precision_of(pl.module)}): step 1 moved={m1} main_grad={f1}, step 2 moved={m2} "
                    f"main_grad={f2}  <-- FAILED")
        fused_ok = fusion and len(good) == len(linears) and len(fused) == len(linears)
        log(f"G. fused wgrad: {len(good)}/{len(linears)} planned linears moved with a nonzero main_grad after "
            f"steps 1 and 2{'' if fused_ok else '  <-- FAILED'}")

        # Step 2's forwards against fresh forwards (is_first_microbatch=True re-quantizes) on the
        # parameters of step 2, and on those with step 1's weight: equal to the first, not the second.
        same_max, stale_min, stale_ok = 0.0, float("inf"), bool(quantized)
        with torch.no_grad():
            for pl in quantized:
                params = dict(pl.module.named_parameters())
                now = {name: p.detach().clone() for name, p in params.items()}
                fresh = {}
                for label, weight in (("step 2", step2_weights), ("step 1", step1_weights)):
                    for name, p in params.items():
                        p.copy_(step2_params[pl.key][name])
                    pl.module.weight.copy_(weight[pl.key])
                    fresh[label] = []
                    for x, _ in seen[pl.key]:
                        pl.module.is_first_microbatch = True
                        out = pl.module(x)
                        fresh[label].append((out[0] if isinstance(out, tuple) else out).detach())
                for name, p in params.items():
                    p.copy_(now[name])
                pl.module.is_first_microbatch = True  # the next step's forward quantizes these weights
                same = max(rel(y, f) for (_, y), f in zip(seen[pl.key], fresh["step 2"]))
                stale = min(rel(y, f) for (_, y), f in zip(seen[pl.key], fresh["step 1"]))
                good_one = same <= stale_tol and stale > 10 * max(same, 1e-6)
                same_max, stale_min = max(same_max, same), min(stale_min, stale)
                stale_ok &= good_one and len(seen[pl.key]) == len(batches)
                log(f"G. {pl.key} ({precision_of(pl.module)}): step 2's {len(seen[pl.key])} forwards vs step 2's "
                    f"weights {same:.2e}, vs step 1's {stale:.2e}{'' if good_one else '  <-- STALE or FAILED'}")
        log(f"G. no stale weight: {'yes' if stale_ok else 'NO'} on megatron-core {mcore_version()} (largest "
            f"difference to step 2's weights {same_max:.2e}, smallest to step 1's {stale_min:.2e})")

        train(max(steps - 2, 0))
        b = plan_b(n, cycle)
        changes = apply_plan(chunks, b, sm=sm, formats=formats)
        followed = current_plan(model) == b and {c.key for c in changes} == {c.key for c in a.diff(b)}
        log(f"G. re-plan: {len(changes)} TE linears switched, te_quant_params "
            f"{'follow' if followed else 'do NOT follow'}")
        train(steps)
        falls = all(loss == loss for loss in losses) and losses[-1] < losses[0]
        log(f"G. losses: {' '.join(f'{loss:.4f}' for loss in losses)}{'' if falls else '  <-- does NOT fall'}")
        return {"fused_wgrad": f"{len(good)}/{len(linears)}" + ("" if fusion else "(fusion-off)"),
                "stale": int(not stale_ok), "stale_rel": same_max, "replanned": len(changes),
                "loss_first": losses[0], "loss_last": losses[-1],
                "_ok": built and fused_ok and stale_ok and followed and falls}
    finally:
        runtime.destroy(process_group=True)


# -- pretrain --------------------------------------------------------------------------------------
def pretrain_worker(argv: list[str]) -> int:
    """`te_check.py --pretrain-worker OUT -- <snip-pretrain-gpt arguments>`: snip-pretrain-gpt with
    a probe on SNIP's controller that writes OUT/probe.jsonl (one line per step: per planned
    linear, its precision, whether its weight moved in the step and its main_grad is nonzero, and
    whether TE fuses its weight-gradient accumulation)."""
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    args = argv[2:] if len(argv) > 1 and argv[1] == "--" else argv[1:]
    from snip_megatron.pretrain import setup

    make = setup.make_controller

    def probed(*a, **k):
        controller = make(*a, **k)
        on_step_start, on_step_end = controller.on_step_start, controller.on_step_end
        before: dict = {}

        def step_start(ctx, step):
            on_step_start(ctx, step)  # a plan applied here trains this step
            from snip_megatron.megatron.apply import list_planned_linears

            before.clear()
            before.update(_snapshot(list_planned_linears(ctx.chunks)))

        def step_end(ctx, step, metrics=None):
            on_step_end(ctx, step, metrics)
            import torch.distributed as dist

            from snip_megatron.megatron.apply import list_planned_linears, precision_of

            linears = list_planned_linears(ctx.chunks)
            state = _moved_and_filled(linears, before)
            chunk_config = getattr(ctx.chunks[0], "config", None)
            record = {"step": step, "precisions": list(getattr(controller.config, "precisions", None) or []),
                      "fusion": getattr(chunk_config, "gradient_accumulation_fusion", None), "linears": {}}
            for pl in linears:
                record["linears"][str(pl.key)] = {
                    "precision": str(precision_of(pl.module)), "numel": pl.module.weight.numel(),
                    "moved": state[pl.key][0],
                    "main_grad": state[pl.key][1], "fused": getattr(pl.module, "fuse_wgrad_accumulation", None),
                    "cache_disabled": getattr(pl.module, "disable_parameter_transpose_cache", None)}
            if not dist.is_initialized() or dist.get_rank() == 0:
                with (out / "probe.jsonl").open("a") as f:
                    f.write(json.dumps(record) + "\n")

        controller.on_step_start, controller.on_step_end = step_start, step_end
        return controller

    setup.make_controller = probed
    from snip_megatron.errors import run_cli
    from snip_megatron.pretrain.entry import main as pretrain_main

    return run_cli("snip-pretrain-gpt", pretrain_main, args)


def _pretrain(args: list[str], out: "Path | None" = None, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.abspath(__file__), "--pretrain-worker", str(out), "--", *args] if out else \
        [sys.executable, "-m", "snip_megatron.pretrain", *args]
    # one rank without a launcher: Megatron-LM's process group reads MASTER_ADDR/PORT (single_gpu.py)
    return subprocess.run(cmd, cwd=ROOT, env=single_process_env(), capture_output=True, text=True, timeout=timeout)


def check_pretrain_refuses_fp4(sm: int, log) -> bool:
    """Before SM100, `snip-pretrain-gpt --transformer-impl transformer_engine --snip
    --snip-precisions fp8,fp4` exits 2 at start-up, naming the fix."""
    proc = _pretrain([*PRETRAIN_MODEL, *PRETRAIN_SNIP, "--snip-precisions", "fp8,fp4"], timeout=300)
    named = any(fix in proc.stderr for fix in FP4_FIXES)
    good = proc.returncode == 2 and named
    log(f"P. --snip --snip-precisions fp8,fp4 on SM{sm}: exit {proc.returncode}, "
        f"{'names the fix' if named else 'does NOT name the fix'}: {proc.stderr.strip()[-400:]}"
        f"{'' if good else '  <-- FAILED'}")
    return good


def check_pretrain(sm: int, fp4_runs: bool, log) -> dict:
    ok = check_pretrain_refuses_fp4(sm, log) if sm < 100 else True
    with tempfile.TemporaryDirectory(prefix="te_check_pretrain_") as tmp:
        proc = _pretrain([*PRETRAIN_MODEL, *PRETRAIN_SNIP], out=Path(tmp))
        probe = Path(tmp) / "probe.jsonl"
        records = [json.loads(line) for line in probe.read_text().splitlines()] if probe.exists() else []
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[snip]")]
    for line in lines:
        log(f"P. {line}")
    generation = any(line.startswith("[snip] SM") for line in lines)
    replanned = any(line.startswith("[snip] step 3: plan") for line in lines)
    if proc.returncode != 0:
        log(f"P. snip-pretrain-gpt failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    moved_ok, report = evaluate_probe(records, fp4_runs=fp4_runs)
    for line in report[:20]:
        log(f"P. probe: {line}")
    log(f"P. start-up line {'printed' if generation else 'MISSING'}; re-plan at step 3 "
        f"{'done' if replanned else 'MISSING'}; per-layer movement {'ok' if moved_ok else 'FAILED'}")
    ok = ok and proc.returncode == 0 and generation and replanned and moved_ok
    return {"pretrain": ok, "_ok": ok}


# -- main ------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--pretrain-worker"]:
        return pretrain_worker(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help=f"comma-separated parts to run: {', '.join(PARTS)} (default: all)")
    ap.add_argument("--skip-pretrain", action="store_true", help="skip the pretrain part (the subprocess runs)")
    ap.add_argument("--steps", type=int, default=4, help="gpt: training steps before and after the re-plan (>= 2)")
    ap.add_argument("--max-ratio", type=float, default=0.25,
                    help="flags: largest |TE - ours| / |TE - unquantized| of a forward output")
    ap.add_argument("--stale-tol", type=float, default=1e-3,
                    help="gpt: largest relative difference of step 2's forward to a fresh one on step 2's weights")
    ap.add_argument("--tokens", type=int, default=8192, help="timing: tokens per micro-batch (rows of X)")
    ap.add_argument("--iters", type=int, default=20, help="timing: timed iterations per GEMM")
    ap.add_argument("--warmup-iters", type=int, default=5, help="timing: untimed iterations first")
    args = ap.parse_args(argv)
    try:
        parts = select_parts(args.only, args.skip_pretrain)
    except ValueError as e:
        ap.error(str(e))
    if args.steps < 2:
        ap.error("--steps must be at least 2 (steps 1 and 2 are checked)")
    cuda = torch.cuda.is_available()
    te_error = te_import_error() if cuda else None
    why = refusal(parts, cuda, te_error)
    if why:
        raise SystemExit(why)

    from snip_megatron.te import gpu

    sm = gpu.current_sm()
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(msg, flush=True)

    fields: dict = {"sm": sm, "te": "absent" if te_error else te_version(), "mcore": mcore_version(),
                    "parts": ",".join(parts)}
    log(f"GPU {torch.cuda.get_device_name()} = SM{sm}; Transformer Engine {fields['te']}; "
        f"megatron-core {fields['mcore']}; parts {', '.join(parts)}")
    fp4_runs = te_error is None and te_answers()["nvfp4"][0]
    ok = True
    for part in parts:
        began = time.perf_counter()
        try:
            got = {"availability": lambda: check_availability(sm, te_error, log),
                   "timing": lambda: check_timing(sm, te_error, args.tokens, args.iters, args.warmup_iters, log),
                   "flags": lambda: check_flags(sm, args.max_ratio, log),
                   "warmup": lambda: check_warmup(log),
                   "gpt": lambda: check_te_spec_gpt(sm, fp4_runs, args.steps, args.stale_tol, log),
                   "pretrain": lambda: check_pretrain(sm, fp4_runs, log)}[part]()
        except Exception as e:  # noqa: BLE001 - one part's crash is its failure; the others still run
            import traceback

            log(f"{part}: CRASHED {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
            got = {"_ok": False}
        part_ok = got.pop("_ok")
        ok &= bool(part_ok)
        fields.update(got)
        log(f"{part}: {'ok' if part_ok else 'FAILED'} in {time.perf_counter() - began:.0f} s")
    fields["seconds"] = round(time.perf_counter() - start)
    fields["ok"] = ok
    log(result_line(fields))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
