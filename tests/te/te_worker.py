"""Train a tiny Llama-like GPTModel built from Megatron's TE layer spec over the TE test double.

Needs `tests/te_double` on PYTHONPATH (tests/te/test_te_double.py sets it); the double's GPU is
its default, SM100 (TE_DOUBLE_COMPUTE_CAPABILITY), and the formats are what TE runs there with
this environment (`formats_on`: power-of-two blockwise scales unless
NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1):

    torchrun --nproc_per_node 2 tests/te/te_worker.py --tp 2 --variants megatron_init,plan,sp_pair --out DIR
    torchrun --nproc_per_node 2 tests/te/te_worker.py --pp 2 --variants name_init,plan --out DIR

The model is Megatron's own (`get_gpt_layer_with_transformer_engine_spec()`, RMSNorm, SwiGLU, RoPE,
GQA, untied embeddings); `snip_megatron.megatron.model.build_gpt_model` refuses backend 'te' without
a GPU, so it is built here. Training goes through Megatron's schedule, DDP and Adam with Megatron's
GPU default `gradient_accumulation_fusion=True` (TE's fuse_wgrad_accumulation into DDP's main_grad;
tests/apex_double stands in for apex's kernel under Megatron's own output layer). Variants:
  megatron_init  Megatron's CPU init (TP-invariant with use_cpu_initialization)
  name_init      every matrix re-drawn from its global name (pipeline stages draw differently)
  plan           megatron_init with PLAN as TransformerConfig.quant_recipe (TE backend, SM100), then
                 applied by SNIP's `apply_plan` as every loop does at its start
  sp_pair        no model: a TE LayerNormLinear -> Linear pair with sequence parallelism against
                 the same pair computed whole (Megatron's own output layer cannot run sequence
                 parallel on the CPU shim, see `sequence_parallel_pair`)
Every rank writes DIR/rank<R>.json: {variant: {"losses": [...] (last stage, else []),
"runs": {"<layer>.<linear>": {label: count}}, "classes": {...}, "steps": [{"unmoved": [...],
"zero_main_grad": [...], "stale": [...], "workspaces": {...}} per step]}}; sp_pair: {tensor: max rel. diff}.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from snip_megatron.shapes import ModelShape

SHAPE = ModelShape(name="te_tiny", num_layers=2, hidden_size=64, ffn_hidden_size=128,
                   num_attention_heads=4, num_query_groups=2, vocab_size=256, seq_length=32)
STEPS, MICRO_BATCH, NUM_MICRO, LR, SEED = 6, 2, 2, 3e-3, 1234
# Every linear kind meets every precision across the two layers.
PLAN_TABLE = {(1, "linear_qkv"): "fp8", (1, "linear_proj"): "fp4", (1, "linear_fc1"): "bf16",
              (1, "linear_fc2"): "fp8", (2, "linear_qkv"): "fp4", (2, "linear_proj"): "bf16",
              (2, "linear_fc1"): "fp8", (2, "linear_fc2"): "fp4"}
# What the double runs for each planned precision: our recipe name, or plain GEMMs.
EXPECTED_LABEL = {"fp8": "blockwise", "fp4": "nvfp4", "bf16": "high_precision"}
VARIANTS = ("megatron_init", "name_init", "plan", "sp_pair")


def require_double() -> None:
    """Fail loudly if `transformer_engine` is anything but this repository's test double; then give
    it SNIP's stochastic-rounding draws (snip_vs_double.share_snip_noise), so this process can
    compare its NVFP4 gradients with SNIP's emulation."""
    import transformer_engine

    here = os.path.dirname(os.path.abspath(transformer_engine.__file__))
    if os.path.join("tests", "te_double") not in here:
        raise RuntimeError(f"transformer_engine comes from {here}, not the test double")
    from tests.te.snip_vs_double import share_snip_noise

    share_snip_noise()


def plan():
    from snip_megatron.plan import LayerKey, Plan

    return Plan({LayerKey(layer, name): p for (layer, name), p in PLAN_TABLE.items()})


def formats_on(sm: int = 100):
    """The Formats TE runs on SM`sm` with this process's environment (what SNIP measures; no FP4
    before SM100)."""
    from snip_megatron.te import te_formats

    return te_formats(sm=sm, environ=os.environ, uses=("fp8", "fp4") if sm >= 100 else ("bf16", "fp8"))


def te_recipe_for(config, the_plan, *, sm: int = 100):
    """The plan as this chunk's quant_recipe for Megatron's TE linears (Blackwell dicts by default)."""
    from snip_megatron.megatron.quant_recipe import recipe_for_chunk

    return recipe_for_chunk(the_plan, config, backend="te", sm=sm, formats=formats_on(sm))


GPU_DEFAULTS = {"gradient_accumulation_fusion": True}
"""Megatron-LM's defaults on a GPU that CPU runs of the local spec turn off (TE fuses wgrad)."""


def build_te_gpt(shape: ModelShape = SHAPE, *, the_plan=None, quant_recipe=None,
                 **config_overrides):
    """This rank's GPTModel chunk with Megatron's TE layer spec (parallel state must be up), with
    Megatron-LM's GPU defaults unless overridden."""
    config_overrides = {**GPU_DEFAULTS, **config_overrides}
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from snip_megatron.megatron.model import make_transformer_config

    config = make_transformer_config(shape, tp=ps.get_tensor_model_parallel_world_size(),
                                     pp=ps.get_pipeline_model_parallel_world_size(),
                                     quant_recipe=quant_recipe, **config_overrides)
    if the_plan is not None:
        config.quant_recipe = te_recipe_for(config, the_plan)
    spec = get_gpt_layer_with_transformer_engine_spec(
        multi_latent_attention=bool(getattr(config, "multi_latent_attention", False)))
    return GPTModel(config=config, transformer_layer_spec=spec,
                    vocab_size=shape.vocab_size, max_sequence_length=shape.seq_length,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=False, position_embedding_type="rope")


def reinit_by_global_name(model) -> None:
    """Give every matrix values that depend only on its global name, as one process would draw."""
    named = [(n, p) for n, p in model.named_parameters() if ".layers." not in n]
    for layer in model.decoder.layers:
        named += [(f"{layer.layer_number}.{n}", p) for n, p in layer.named_parameters()]
    for name, p in named:
        if p.dim() == 2:
            g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + p.numel())
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def planned_linears(model):
    """{"<global layer>.<linear>": module} of this chunk's planned TE linears."""
    from snip_megatron.megatron.quant_recipe import key_for_path, layer_offset

    offset = layer_offset(model.config)
    found = {}
    for name, module in model.named_modules():
        key = key_for_path(name, offset)
        if key is not None:
            found[f"{key.layer}.{key.name}"] = module
    return found


def module_classes(model) -> dict[str, str]:
    """Class name of every module below the first transformer layer, and of the final norm."""
    layer = model.decoder.layers[0]
    names = {f"layers.0.{n}": type(m).__name__ for n, m in layer.named_modules() if n}
    final = getattr(model.decoder, "final_layernorm", None)
    if final is not None:
        names["final_layernorm"] = type(final).__name__
    return names


def fixed_batches(shape: ModelShape = SHAPE, num: int = NUM_MICRO, mbs: int = MICRO_BATCH,
                  seed: int = SEED) -> list:
    from snip_megatron.megatron.batch import random_batch

    generator = torch.Generator().manual_seed(seed)  # the same data on every rank
    return [random_batch(mbs, shape.seq_length, shape.vocab_size, generator) for _ in range(num)]


def step_record(linears: dict, before: dict) -> dict:
    """After a step's forward and backward (before the optimizer step): the planned linears whose
    main_grad stayed zero, whose quantized forward read a cached weight other than this step's
    (`before`: their weights at the step's start), and how each used TE's weight cache."""
    zero, stale, workspaces = [], [], {}
    for key, module in linears.items():
        grad = getattr(module.weight, "main_grad", None)
        if grad is None or not bool(grad.abs().sum() > 0):
            zero.append(key)
        run = module.last_run
        workspaces[key] = run.weight_workspace
        cached = getattr(module, "_fp8_workspaces", {}).get("weight")
        if run.quantized and run.weight_workspace != "none" and not torch.equal(cached.values, before[key]):
            stale.append(key)
    return {"zero_main_grad": zero, "stale": stale, "workspaces": workspaces}


def train(model, *, steps: int = STEPS, lr: float = LR, records: "list | None" = None,
          before_step=None) -> list[float]:
    """Megatron's schedule, DDP and Adam on fixed micro-batches; the per-step mean loss on the last
    pipeline stage (an empty list elsewhere). `records` gets one `step_record` per step, plus the
    planned linears whose weight the step left unchanged; `before_step(i)` runs before step i."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from snip_megatron.megatron.batch import make_forward_step
    from snip_megatron.megatron.smoke import wrap_ddp_and_optimizer

    ddp_chunks, optimizer = wrap_ddp_and_optimizer([model], model.config, lr=lr, clip_grad=1.0,
                                                   distributed_optimizer=False)
    batches = fixed_batches()
    forward_backward, forward_step = get_forward_backward_func(), make_forward_step()
    linears = planned_linears(model)
    losses = []
    for i in range(steps):
        if before_step is not None:
            before_step(i)
        ddp_chunks[0].zero_grad_buffer()
        optimizer.zero_grad()
        before = {key: m.weight.detach().clone() for key, m in linears.items()}
        reduced = forward_backward(forward_step_func=forward_step, data_iterator=iter(batches),
                                   model=ddp_chunks, num_microbatches=len(batches),
                                   seq_length=SHAPE.seq_length, micro_batch_size=MICRO_BATCH,
                                   forward_only=False)
        record = step_record(linears, before) if records is not None else None
        optimizer.step()
        if record is not None:
            record["unmoved"] = [k for k, m in linears.items() if torch.equal(m.weight.detach(), before[k])]
            records.append(record)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            losses.append(sum(float(r["lm loss"]) for r in reduced) / len(reduced))
    return losses


def run_variant(variant: str) -> dict:
    """Build (seeded afresh), train and describe one variant on this rank."""
    from snip_megatron.megatron import runtime

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")
    if variant == "sp_pair":
        return sequence_parallel_pair()
    runtime.seed_all(SEED)
    model = build_te_gpt(the_plan=plan() if variant == "plan" else None)
    if variant == "name_init":
        reinit_by_global_name(model)
    if variant == "plan":  # what every SNIP loop does at its start (keep_te_weights_fresh included)
        from snip_megatron.megatron.apply import apply_plan

        apply_plan(model, plan(), sm=100, formats=formats_on(100))
    records: list = []
    losses = train(model, records=records)
    runs = {key: dict(m.run_counts) for key, m in planned_linears(model).items()}
    return {"losses": losses, "runs": runs, "classes": module_classes(model), "steps": records}


def sequence_parallel_pair(k: int = 64, m: int = 128, s: int = 32, b: int = 2) -> dict:
    """The double's TP collectives with sequence parallelism, checked without Megatron's model.

    (A TE-spec GPTModel with sequence_parallel=True fails on CPU in Megatron's own output layer:
    its backward allocates on `torch.cuda.current_device()` inside `torch.autograd.backward`, where
    snip_megatron's CPU shim mode is not active.) Returns {tensor: max |sharded - whole| / max
    |whole|} for the output, dX, the norm output (gathered), dW of both layers and dgamma.
    """
    import torch.distributed as dist
    import transformer_engine.pytorch as te
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(11)
    x, gy = torch.randn(s, b, k, generator=g), torch.randn(s, b, k, generator=g)
    w1, w2 = torch.randn(m, k, generator=g) * 0.1, torch.randn(k, m, generator=g) * 0.1
    gamma = 1.0 + 0.1 * torch.randn(k, generator=g)

    def pair(tp_group, size):
        col = te.LayerNormLinear(k, m, bias=False, normalization="RMSNorm", tp_group=tp_group,
                                 tp_size=size, sequence_parallel=True, parallel_mode="column",
                                 return_layernorm_output=True,
                                 return_layernorm_output_gathered=True)
        row = te.Linear(m, k, bias=False, tp_group=tp_group, tp_size=size,
                        sequence_parallel=True, parallel_mode="row")
        r = rank if size > 1 else 0
        with torch.no_grad():
            col.layer_norm_weight.copy_(gamma)
            col.weight.copy_(w1.chunk(size, 0)[r])
            row.weight.copy_(w2.chunk(size, 1)[r])
        xs = x.chunk(size, 0)[r].clone().requires_grad_()
        h, ln_out = col(xs)
        y = row(h)
        y.backward(gy.chunk(size, 0)[r])
        dgamma = col.layer_norm_weight.grad.clone()
        if size > 1:  # Megatron all-reduces grads of params flagged sequence_parallel
            assert col.layer_norm_weight.sequence_parallel
            dist.all_reduce(dgamma, group=tp_group)
        return {"y": y.detach(), "dx": xs.grad, "ln_out": ln_out.detach(),
                "dw_col": col.weight.grad, "dw_row": row.weight.grad, "dgamma": dgamma}

    sharded, whole = pair(group, tp), pair(None, 1)
    expected = {"y": whole["y"].chunk(tp, 0)[rank], "dx": whole["dx"].chunk(tp, 0)[rank],
                "ln_out": whole["ln_out"], "dw_col": whole["dw_col"].chunk(tp, 0)[rank],
                "dw_row": whole["dw_row"].chunk(tp, 1)[rank], "dgamma": whole["dgamma"]}
    return {name: float((sharded[name] - want).abs().max() / want.abs().max())
            for name, want in expected.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--variants", default="megatron_init", help=f"comma-separated, of {VARIANTS}")
    parser.add_argument("--out", required=True, help="folder for rank<R>.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    require_double()

    from snip_megatron.megatron import runtime

    rank, _ = runtime.init_process_group()
    runtime.initialize_model_parallel(tp=args.tp, pp=args.pp, seed=SEED)
    results = {variant: run_variant(variant) for variant in args.variants.split(",")}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    runtime.destroy(process_group=True)


if __name__ == "__main__":
    main()
