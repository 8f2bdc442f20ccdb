"""Check SNIP's emulated linears on a GPU: build with a plan, train, re-plan at a step boundary, and
time what emulated FP8 and FP4 cost. This is where FP4 runs on Hopper (and any GPU): SNIP's TE
backend plans BF16/FP8 before SM100, and FP4 studies there run these linears
(`--transformer-impl local`), which compute NVFP4 and MXFP4 as SNIP measures them.

    python bench/gpu/emulation_cuda_check.py                 # CUDA + NCCL (one process per GPU)
    torchrun --nproc_per_node 2 bench/gpu/emulation_cuda_check.py --tp 2   # two GPUs or more
    python bench/gpu/emulation_cuda_check.py --device cpu    # the same logic on CPU (gloo)

What it checks, on a small Llama-like GPT (4 layers) built through Megatron-Core's local spec with
SNIP's emulated linears (the layers `--transformer-impl local` builds with SNIP on):
1. a plan given as `TransformerConfig.quant_recipe` (BF16, FP8 and FP4 linears) reaches every
   planned linear at build time;
2. for each FP4 recipe (`--fp4-recipes`, default nvfp4 and mxfp4), every planned linear on the
   device gives the output of its CPU twin (same weights, same input, same precision and formats)
   to `--tol` relative L2 error: the emulated FP8/FP4 quantizers and GEMMs agree across devices;
3. training runs with the FP4 layers of the plan: after the first step every planned linear's
   weight moved and its main_grad (Megatron DDP) is nonzero, per layer; on CUDA with apex's
   fused_weight_gradient_mlp_cuda, Megatron's default gradient_accumulation_fusion is on
   (`--fused-wgrad`); `apply_plan` at a step boundary switches exactly the re-planned linears
   (their outputs change, the others' do not), training continues and the loss falls;
4. the cost of emulation, so users know what an FP4 study costs: the training step of this model
   with BF16 parameters under uniform BF16, FP8, NVFP4 and MXFP4 plans (`--timing-steps`), and one
   emulated linear's forward + backward at a realistic shape (`--timing-shape tokens,in,out`,
   default a Llama-70B fc1 shard at TP=8 on 8192 tokens) on the device's default GEMM path (the
   tensor cores on CUDA) and on the FP32 path, against the same linear in BF16.
Last line: `RESULT device=<cuda|cpu> world=<n> linears=<n> replanned=<n> max_rel_err=<e>
step_ms=<t> loss_first=<l> loss_last=<l> fp4_recipes=<r,...> trained=<n>/<n> fused_wgrad=<0|1>
step_x=<p>:<x>,... linear_x=<p>:<x>,... linear_x_fp32=<p>:<x>,... ok=<0|1>` (step_x, linear_x
and linear_x_fp32: time relative to BF16; linear_x on the default GEMM path, linear_x_fp32 on the
FP32 one).

Needs torch and megatron-core (no Transformer Engine; apex only for --fused-wgrad on: fused
kernels are switched off otherwise). Not run on a GPU yet in this project (no GPU was lent when it
was written): only `--device cpu` is exercised, by tests/megatron/test_apply.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling linear_timing.py

from snip_megatron.emulation.gemm import gemm_path  # noqa: E402
from snip_megatron.formats.precision import FP4_RECIPES, Formats, Precision  # noqa: E402
from snip_megatron.models import gpt  # noqa: E402
from snip_megatron.plan import LayerKey, Plan  # noqa: E402
from snip_megatron.shapes import ModelShape  # noqa: E402
from linear_timing import sync, time_linear  # noqa: E402

# Dimensions are multiples of 128, so FP8 blockwise and NVFP4 blocks never straddle TP shards.
SHAPE = ModelShape(name="gpu_check", num_layers=4, hidden_size=256, ffn_hidden_size=512,
                   num_attention_heads=4, num_query_groups=2, vocab_size=512, seq_length=128)
# For the CPU test of this script's logic: the emulated FP4 path is slow on two CPU cores.
TINY = SHAPE.with_(name="gpu_check_tiny", hidden_size=128, ffn_hidden_size=256, vocab_size=256,
                   seq_length=32)
CYCLE = [Precision.BF16, Precision.FP8, Precision.FP4]
TIMING_SHAPE = (8192, 8192, 7168)
"""tokens, in, out of the timed linear: Llama-70B's linear_fc1 on one of 8 TP ranks (SwiGLU: 2 x
28672 / 8 outputs), 8192 tokens per micro-batch."""
TINY_TIMING_SHAPE = (128, 128, 256)


def plan_a(n: int) -> Plan:
    return Plan({k: CYCLE[(k.layer + gpt.LINEAR_NAMES.index(k.name)) % 3] for k in gpt.keys(n)})


def plan_b(n: int) -> Plan:
    a = plan_a(n)
    moves = [LayerKey(1, "linear_fc1"), LayerKey(1, "linear_qkv"), LayerKey(n, "linear_proj"),
             LayerKey(n, "linear_fc2")]
    return a.replace({k: CYCLE[(CYCLE.index(a[k]) + 1) % 3] for k in moves})


def timed_plans(fp4_recipes: list[str]) -> list[tuple[str, Precision, Formats]]:
    """(label, precision, formats) of the uniform plans the step timing runs: BF16, FP8 and FP4 in
    each recipe."""
    return [("bf16", Precision.BF16, Formats()), ("fp8", Precision.FP8, Formats())] + [
        (r, Precision.FP4, Formats(fp4_recipe=r)) for r in fp4_recipes]


def ratios(times: dict[str, float]) -> str:
    """{"bf16": t, "fp8": t, ...} -> "fp8:1.3,nvfp4:2.1" (each relative to BF16; "-" without BF16)."""
    base = times.get("bf16")
    if not base or len(times) < 2:
        return "-"
    return ",".join(f"{k}:{v / base:.2f}" for k, v in times.items() if k != "bf16")


def parse_fp4_recipes(text: str) -> list[str]:
    out = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in out if r not in FP4_RECIPES]
    if bad or not out:
        raise ValueError(f"--fp4-recipes {text!r}: choose from {', '.join(FP4_RECIPES)}")
    return list(dict.fromkeys(out))


def parse_timing_shape(text: str) -> tuple[int, int, int]:
    try:
        tokens, n_in, n_out = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--timing-shape {text!r} must read tokens,in,out (e.g. 8192,8192,7168)") from None
    if min(tokens, n_in, n_out) < 1:
        raise ValueError(f"--timing-shape {text!r}: every size must be positive")
    return tokens, n_in, n_out


def build(shape: ModelShape, config, plan: Plan, device: torch.device):
    from snip_megatron.megatron.model import build_gpt_model
    from snip_megatron.megatron.quant_recipe import recipe_for_chunk

    config.quant_recipe = recipe_for_chunk(plan, config)
    return build_gpt_model(shape, config=config, backend="emulated").to(device)


def linear_outputs(model, device: torch.device) -> dict:
    """Every planned linear on a fixed input (seeded by its key, the same on every rank)."""
    from snip_megatron.megatron.apply import list_planned_linears

    outs = {}
    with torch.no_grad():
        for pl in list_planned_linears(model):
            g = torch.Generator().manual_seed(1000 * pl.key.layer + gpt.LINEAR_NAMES.index(pl.key.name))
            x = torch.randn(16, 2, pl.module.weight.shape[1], generator=g)
            outs[pl.key] = pl.module(x.to(device))[0].float().cpu()
    return outs


def apply_with_formats(model, plan: Plan, formats: Formats) -> None:
    """`plan` in `formats` on every planned linear (apply_plan leaves a linear whose precision does
    not change in its formats, so everything goes through BF16 first)."""
    from snip_megatron.megatron.apply import apply_plan

    apply_plan(model, Plan.uniform(plan.num_layers, Precision.BF16))
    apply_plan(model, plan, formats=formats)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def fused_wgrad_available() -> "str | None":
    """Why Megatron's local linears cannot fuse their weight-gradient accumulation here, or None."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except Exception as e:
        return f"apex's fused_weight_gradient_mlp_cuda is missing ({type(e).__name__})"
    return None


def time_steps(shape: ModelShape, tp: int, fused: bool, fp4_recipes: list[str], device: torch.device,
               steps: int, batches: list) -> dict[str, float]:
    """Median seconds of a training step of a BF16 model (BF16 parameters and GEMMs, Megatron's
    mixed-precision Adam) under uniform BF16, FP8 and each FP4 recipe's plan."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from snip_megatron.megatron.batch import make_forward_step
    from snip_megatron.megatron.model import CPU_SAFE_FLAGS, make_transformer_config
    from snip_megatron.megatron.smoke import wrap_ddp_and_optimizer

    config = make_transformer_config(shape, tp=tp, params_dtype=torch.bfloat16,
                                     **{**CPU_SAFE_FLAGS, "gradient_accumulation_fusion": fused})
    model = build(shape, config, Plan.uniform(shape.num_layers, Precision.BF16), device)
    chunks, optimizer = wrap_ddp_and_optimizer([model], config, lr=1e-4, clip_grad=1.0, distributed_optimizer=False)
    forward_backward, forward_step, times = get_forward_backward_func(), make_forward_step(), {}
    for label, precision, formats in timed_plans(fp4_recipes):
        apply_with_formats(chunks, Plan.uniform(shape.num_layers, precision), formats)
        took = []
        for _ in range(steps + 1):  # the first step warms up
            start = time.perf_counter()
            chunks[0].zero_grad_buffer()
            optimizer.zero_grad()
            forward_backward(forward_step_func=forward_step, data_iterator=iter(batches), model=chunks,
                             num_microbatches=len(batches), seq_length=shape.seq_length, micro_batch_size=4,
                             forward_only=False)
            optimizer.step()
            sync(device)
            took.append(time.perf_counter() - start)
        times[label] = statistics.median(took[1:])
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps-before", type=int, default=3)
    ap.add_argument("--steps-after", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a smaller model and timed linear (for the CPU test)")
    ap.add_argument("--tol", type=float, default=1e-3, help="max relative L2 error device vs CPU")
    ap.add_argument("--fp4-recipes", default=",".join(FP4_RECIPES),
                    help="FP4 recipes to check against the CPU twin and to time (default: all)")
    ap.add_argument("--fused-wgrad", choices=("auto", "on", "off"), default="auto",
                    help="Megatron's gradient_accumulation_fusion (its GPU default): auto = on where apex's "
                         "fused_weight_gradient_mlp_cuda is importable on CUDA")
    ap.add_argument("--timing-steps", type=int, default=None,
                    help="timed training steps per uniform plan (0: no timing; default 5, --tiny 1)")
    ap.add_argument("--timing-shape", default=None,
                    help="tokens,in,out of the timed linear (default 8192,8192,7168; --tiny 128,128,256)")
    ap.add_argument("--timing-iters", type=int, default=None, help="timed linear runs (default 5, --tiny 1)")
    args = ap.parse_args(argv)
    try:
        fp4_recipes = parse_fp4_recipes(args.fp4_recipes)
        timing_shape = parse_timing_shape(args.timing_shape or ",".join(
            map(str, TINY_TIMING_SHAPE if args.tiny else TIMING_SHAPE)))
    except ValueError as e:
        ap.error(str(e))
    timing_steps = args.timing_steps if args.timing_steps is not None else (1 if args.tiny else 5)
    timing_iters = args.timing_iters if args.timing_iters is not None else (1 if args.tiny else 5)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu")
    why_not_fused = fused_wgrad_available() if args.device == "cuda" else "not on CPU"
    if args.fused_wgrad == "on" and why_not_fused:
        raise SystemExit(f"--fused-wgrad on: {why_not_fused}")
    fused = args.fused_wgrad == "on" or (args.fused_wgrad == "auto" and why_not_fused is None)

    import torch.distributed as dist

    from snip_megatron.megatron import runtime

    owns_group = not dist.is_initialized()  # a caller's process group is left up
    rank, world = runtime.init_process_group(backend="nccl" if args.device == "cuda" else "gloo")
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if args.device == "cuda" else "cpu")
    runtime.initialize_model_parallel(tp=args.tp, seed=1234)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from snip_megatron.megatron.apply import apply_plan, current_plan, list_planned_linears, precision_of
    from snip_megatron.megatron.batch import make_forward_step, random_batch
    from snip_megatron.megatron.model import CPU_SAFE_FLAGS, make_transformer_config
    from snip_megatron.megatron.smoke import wrap_ddp_and_optimizer

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability()
        log(f"GPU {torch.cuda.get_device_name()} = SM{major}{minor}: FP8 and FP4 ({', '.join(fp4_recipes)}) in "
            "SNIP's emulation (tensor-core GEMMs on exact BF16 operands, FP32 scales after), the FP4 "
            "study path on any GPU")
    log(f"gradient_accumulation_fusion {'on' if fused else 'off (' + str(why_not_fused) + ')'}")

    shape = TINY if args.tiny else SHAPE
    n = shape.num_layers
    # CPU initialisation on both devices: the device model and its CPU twin get the same weights.
    # Fused kernels are off (no TE/apex needed), but weight-gradient accumulation fusion where asked.
    config = make_transformer_config(shape, tp=args.tp, **{**CPU_SAFE_FLAGS, "gradient_accumulation_fusion": fused})
    runtime.seed_all(1234)
    model = build(shape, config, plan_a(n), device)
    # A CPU twin under TP>1 would need CPU collectives; NCCL has none, so it is compared at TP=1.
    twin = None
    if args.tp == 1 or device.type == "cpu":
        runtime.seed_all(1234)
        twin = build(shape, make_transformer_config(shape, tp=args.tp, **CPU_SAFE_FLAGS), plan_a(n),
                     torch.device("cpu"))
    ok = True

    # 1. build-time plan reaches every local linear
    local = current_plan(model)
    built_ok = all(plan_a(n)[k] is p for k, p in local.items()) and len(local) == 4 * n
    log(f"build: {len(local)} planned linears, plan {local.counts()} {'delivered' if built_ok else 'NOT delivered'}")
    ok &= built_ok

    # 2. device vs CPU twin, per linear, under both plans and each FP4 recipe
    max_err = float("nan")
    if twin is None:
        log("device-vs-CPU check skipped: TP>1 on NCCL (run it with --tp 1)")
    else:
        max_err = 0.0
        for recipe in fp4_recipes:
            formats = Formats(fp4_recipe=recipe)
            for label, plan in (("plan A", plan_a(n)), ("plan B", plan_b(n))):
                apply_with_formats(model, plan, formats)
                apply_with_formats(twin, plan, formats)
                dev, cpu = linear_outputs(model, device), linear_outputs(twin, torch.device("cpu"))
                errs = {k: rel_err(dev[k], cpu[k]) for k in dev}
                worst = max(errs, key=errs.get)
                by_p = {p.value: max((e for k, e in errs.items() if plan[k] is p), default=0.0)
                        for p in Precision}
                log(f"{label}, fp4 {recipe}: {args.device} vs CPU max rel err by precision {by_p} (worst {worst})")
                max_err = max(max_err, errs[worst])
        ok &= max_err <= args.tol
        apply_with_formats(model, plan_a(n), Formats(fp4_recipe=fp4_recipes[0]))
        del twin

    # 3. train (every planned weight moves, per layer), re-plan at a step boundary, train on
    chunks, optimizer = wrap_ddp_and_optimizer([model], config, lr=3e-3, clip_grad=1.0,
                                               distributed_optimizer=False)
    gen = torch.Generator().manual_seed(7)
    batches = [{k: v.to(device) for k, v in random_batch(4, shape.seq_length, shape.vocab_size, gen).items()}
               for _ in range(2)]
    forward_backward, forward_step, losses, times = get_forward_backward_func(), make_forward_step(), [], []

    def train(steps: int, record=True) -> list[float]:
        took = []
        for _ in range(steps):
            start = time.perf_counter()
            chunks[0].zero_grad_buffer()
            optimizer.zero_grad()
            reduced = forward_backward(forward_step_func=forward_step, data_iterator=iter(batches),
                                       model=chunks, num_microbatches=len(batches),
                                       seq_length=shape.seq_length, micro_batch_size=4,
                                       forward_only=False)
            optimizer.step()
            sync(device)
            took.append(time.perf_counter() - start)
            if record:
                losses.append(sum(float(r["lm loss"]) for r in reduced) / len(reduced))
        return took

    linears = list_planned_linears(model)
    before = {pl.key: pl.module.weight.detach().clone() for pl in linears}
    times += train(1)
    trained = {}
    for pl in linears:
        main_grad = getattr(pl.module.weight, "main_grad", None)
        trained[pl.key] = (not torch.equal(pl.module.weight.detach(), before[pl.key]),
                           main_grad is not None and bool(main_grad.abs().sum() > 0))
    moved = [k for k, (m, g) in trained.items() if m and g]
    for pl in linears:
        if pl.key not in moved:
            log(f"step 1: {pl.key} ({precision_of(pl.module)}) moved={trained[pl.key][0]} "
                f"main_grad={trained[pl.key][1]}  <-- FAILED")
    by_p = {p.value: sum(1 for pl in linears if pl.key in moved and precision_of(pl.module) is p) for p in Precision}
    log(f"step 1: {len(moved)}/{len(linears)} planned linears moved with a nonzero main_grad {by_p}")
    ok &= len(moved) == len(linears)
    del before
    times += train(max(args.steps_before - 1, 0))
    before_out = linear_outputs(model, device)
    changes = apply_plan(chunks, plan_b(n), formats=Formats(fp4_recipe=fp4_recipes[0]))
    after = linear_outputs(model, device)
    expected = {c.key for c in plan_a(n).diff(plan_b(n)) if c.key in before_out}
    switched_ok = ({c.key for c in changes} == expected
                   and all((not torch.equal(before_out[k], after[k])) == (k in expected) for k in before_out))
    log(f"re-plan: {len(changes)} linears switched "
        f"({', '.join(f'{c.key} {c.old}->{c.new}' for c in changes)}); "
        f"{'only they' if switched_ok else 'NOT only they'} changed output")
    ok &= switched_ok
    times += train(args.steps_after)
    falls = losses[-1] < losses[0] and all(x == x for x in losses)
    log(f"losses: {' '.join(f'{x:.4f}' for x in losses)}")
    ok &= falls
    step_ms = 1e3 * sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else float("nan")

    # 4. what emulation costs: a step of a BF16 model under uniform plans, and one linear at a
    # realistic shape on each GEMM path
    step_times, linear_times, fp32_times = {}, {}, {}
    if timing_steps > 0:
        step_times = time_steps(shape, args.tp, fused, fp4_recipes, device, timing_steps, batches)
        log("step time of the BF16 model by uniform plan: "
            + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in step_times.items())
            + f" (relative to BF16: {ratios(step_times)})")
        for label, precision, formats in timed_plans(fp4_recipes):
            spec = formats.spec(precision)
            linear_times[label] = time_linear(spec, timing_shape, device, timing_iters)
            if precision is not Precision.BF16:
                fp32_times[label] = time_linear(spec, timing_shape, device, timing_iters, "fp32")
        fp32_times["bf16"] = linear_times["bf16"]
        tokens, n_in, n_out = timing_shape
        log(f"one linear {n_out}x{n_in} on {tokens} tokens, forward + backward, default GEMM path "
            f"({gemm_path(device)}): " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in linear_times.items())
            + f" (relative to BF16: {ratios(linear_times)}); FP32 path: "
            + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in fp32_times.items() if k != "bf16")
            + f" (relative to BF16: {ratios(fp32_times)})")

    ok_all = torch.tensor([int(ok)], device=device)
    torch.distributed.all_reduce(ok_all, op=torch.distributed.ReduceOp.MIN)
    log(f"RESULT device={args.device} world={world} linears={len(local)} replanned={len(changes)} "
        f"max_rel_err={max_err:.2e} step_ms={step_ms:.1f} loss_first={losses[0]:.4f} "
        f"loss_last={losses[-1]:.4f} fp4_recipes={','.join(fp4_recipes)} trained={len(moved)}/{len(linears)} "
        f"fused_wgrad={int(fused)} step_x={ratios(step_times)} linear_x={ratios(linear_times)} "
        f"linear_x_fp32={ratios(fp32_times)} ok={int(ok_all.item())}")
    runtime.destroy(process_group=owns_group)
    return 0 if ok_all.item() else 1


if __name__ == "__main__":
    sys.exit(main())
