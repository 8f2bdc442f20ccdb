"""Check SNIP's emulated linears on a GPU: build with a plan, train, re-plan at a step boundary.

    python bench/gpu/emulation_cuda_check.py                 # CUDA + NCCL (one process per GPU)
    torchrun --nproc_per_node 2 bench/gpu/emulation_cuda_check.py --tp 2   # two GPUs or more
    python bench/gpu/emulation_cuda_check.py --device cpu    # the same logic on CPU (gloo)

What it checks, on a small Llama-like GPT (4 layers) built through Megatron-Core's local spec:
1. a plan given as `TransformerConfig.quant_recipe` reaches every planned linear at build time;
2. every planned linear on the device gives the output of its CPU twin (same weights, same input,
   same precision) to `--tol` relative L2 error: the emulated FP8/FP4 quantizers and GEMMs agree
   across devices;
3. training runs; `apply_plan` at a step boundary switches exactly the re-planned linears (their
   outputs change, the others' do not), training continues and the loss falls.
Last line: `RESULT device=<cuda|cpu> world=<n> linears=<n> replanned=<n> max_rel_err=<e>
step_ms=<t> loss_first=<l> loss_last=<l> ok=<0|1>`.

Needs torch and megatron-core (no Transformer Engine, no apex: fused kernels are switched off).
Not run on a GPU yet in this project (no GPU was lent when it was written): only `--device cpu`
is exercised, by tests/megatron/test_apply.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from snip_megatron.formats.precision import Precision  # noqa: E402
from snip_megatron.plan import LINEAR_NAMES, LayerKey, Plan, all_keys  # noqa: E402
from snip_megatron.shapes import ModelShape  # noqa: E402

# Dimensions are multiples of 128, so FP8 blockwise and NVFP4 blocks never straddle TP shards.
SHAPE = ModelShape(name="gpu_check", num_layers=4, hidden_size=256, ffn_hidden_size=512,
                   num_attention_heads=4, num_query_groups=2, vocab_size=512, seq_length=128)
# For the CPU test of this script's logic: the emulated FP4 path is slow on two CPU cores.
TINY = SHAPE.with_(name="gpu_check_tiny", hidden_size=128, ffn_hidden_size=256, vocab_size=256,
                   seq_length=32)
CYCLE = [Precision.BF16, Precision.FP8, Precision.FP4]


def plan_a(n: int) -> Plan:
    return Plan({k: CYCLE[(k.layer + LINEAR_NAMES.index(k.name)) % 3] for k in all_keys(n)})


def plan_b(n: int) -> Plan:
    a = plan_a(n)
    moves = [LayerKey(1, "linear_fc1"), LayerKey(1, "linear_qkv"), LayerKey(n, "linear_proj"),
             LayerKey(n, "linear_fc2")]
    return a.replace({k: CYCLE[(CYCLE.index(a[k]) + 1) % 3] for k in moves})


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
            g = torch.Generator().manual_seed(1000 * pl.key.layer + LINEAR_NAMES.index(pl.key.name))
            x = torch.randn(16, 2, pl.module.weight.shape[1], generator=g)
            outs[pl.key] = pl.module(x.to(device))[0].float().cpu()
    return outs


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps-before", type=int, default=3)
    ap.add_argument("--steps-after", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a smaller model (for the CPU test)")
    ap.add_argument("--tol", type=float, default=1e-3, help="max relative L2 error device vs CPU")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu")

    import torch.distributed as dist

    from snip_megatron.megatron import runtime

    owns_group = not dist.is_initialized()  # a caller's process group is left up
    rank, world = runtime.init_process_group(backend="nccl" if args.device == "cuda" else "gloo")
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if args.device == "cuda" else "cpu")
    runtime.initialize_model_parallel(tp=args.tp, seed=1234)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from snip_megatron.megatron.apply import apply_plan, current_plan
    from snip_megatron.megatron.batch import make_forward_step, random_batch
    from snip_megatron.megatron.model import CPU_SAFE_FLAGS, make_transformer_config
    from snip_megatron.megatron.smoke import wrap_ddp_and_optimizer

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    shape = TINY if args.tiny else SHAPE
    n = shape.num_layers
    # CPU initialisation on both devices: the device model and its CPU twin get the same weights.
    # The fusion flags are off because there is no TE/apex here.
    config = make_transformer_config(shape, tp=args.tp, **CPU_SAFE_FLAGS)
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
    log(f"build: {len(local)} planned linears, plan {'delivered' if built_ok else 'NOT delivered'}")
    ok &= built_ok

    # 2. device vs CPU twin, per linear, under both plans
    max_err = float("nan")
    if twin is None:
        log("device-vs-CPU check skipped: TP>1 on NCCL (run it with --tp 1)")
    else:
        max_err = 0.0
        for label, plan in (("plan A", plan_a(n)), ("plan B", plan_b(n))):
            apply_plan(model, plan)
            apply_plan(twin, plan)
            dev, cpu = linear_outputs(model, device), linear_outputs(twin, torch.device("cpu"))
            errs = {k: rel_err(dev[k], cpu[k]) for k in dev}
            worst = max(errs, key=errs.get)
            by_p = {p.value: max((e for k, e in errs.items() if plan[k] is p), default=0.0)
                    for p in Precision}
            log(f"{label}: {args.device} vs CPU max rel err by precision {by_p} (worst {worst})")
            max_err = max(max_err, errs[worst])
        ok &= max_err <= args.tol
        apply_plan(model, plan_a(n))
        del twin

    # 3. train, re-plan at a step boundary, train on
    chunks, optimizer = wrap_ddp_and_optimizer([model], config, lr=3e-3, clip_grad=1.0,
                                               distributed_optimizer=False)
    gen = torch.Generator().manual_seed(7)
    batches = [{k: v.to(device) for k, v in random_batch(4, shape.seq_length, shape.vocab_size, gen).items()}
               for _ in range(2)]
    forward_backward, forward_step, losses, times = get_forward_backward_func(), make_forward_step(), [], []

    def train(steps: int) -> None:
        for _ in range(steps):
            start = time.perf_counter()
            chunks[0].zero_grad_buffer()
            optimizer.zero_grad()
            reduced = forward_backward(forward_step_func=forward_step, data_iterator=iter(batches),
                                       model=chunks, num_microbatches=len(batches),
                                       seq_length=shape.seq_length, micro_batch_size=4,
                                       forward_only=False)
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            losses.append(sum(float(r["lm loss"]) for r in reduced) / len(reduced))

    train(args.steps_before)
    before = linear_outputs(model, device)
    changes = apply_plan(chunks, plan_b(n))
    after = linear_outputs(model, device)
    expected = {c.key for c in plan_a(n).diff(plan_b(n)) if c.key in before}
    switched_ok = ({c.key for c in changes} == expected
                   and all((not torch.equal(before[k], after[k])) == (k in expected) for k in before))
    log(f"re-plan: {len(changes)} linears switched "
        f"({', '.join(f'{c.key} {c.old}->{c.new}' for c in changes)}); "
        f"{'only they' if switched_ok else 'NOT only they'} changed output")
    ok &= switched_ok
    train(args.steps_after)
    falls = losses[-1] < losses[0] and all(x == x for x in losses)
    log(f"losses: {' '.join(f'{x:.4f}' for x in losses)}")
    ok &= falls
    step_ms = 1e3 * sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else float("nan")
    ok_all = torch.tensor([int(ok)], device=device)
    torch.distributed.all_reduce(ok_all, op=torch.distributed.ReduceOp.MIN)
    log(f"RESULT device={args.device} world={world} linears={len(local)} replanned={len(changes)} "
        f"max_rel_err={max_err:.2e} step_ms={step_ms:.1f} loss_first={losses[0]:.4f} "
        f"loss_last={losses[-1]:.4f} ok={int(ok_all.item())}")
    runtime.destroy(process_group=owns_group)
    return 0 if ok_all.item() else 1


if __name__ == "__main__":
    sys.exit(main())
