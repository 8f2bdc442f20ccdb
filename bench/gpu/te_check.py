"""SNIP's Transformer Engine path on a real GPU with the real Transformer Engine: the checks that
tests/te and tests/pretrain/test_te_runs.py make on CPU over the TE test double.

    python bench/gpu/te_check.py                   # checks 1-4 on this GPU (one process)
    python bench/gpu/te_check.py --skip-pretrain   # checks 1-3

Refuses to start without a CUDA GPU and Transformer Engine (the real one: not tests/te_double).
1. TE's environment switches: TE's recipe classes read NVTE_FP8_BLOCK_SCALING_FP32_SCALES and the
   NVTE_NVFP4_DISABLE_* switches as snip_megatron.te.environment does.
2. Per GPU facts and recipe flags: for every FP8 and FP4 recipe, TE raises on this GPU exactly
   where snip_megatron.te.gpu says it cannot run; for every recipe flag of the CPU check
   (RECIPE_FLAGS), SnipConfig resolved for this GPU either refuses it or, for FP8 and FP4, a
   te.Linear inside the per-module autocast Megatron opens from SNIP's TE dict gives the forward
   output of our emulation of the measured formats on the same inputs: its relative error to the
   emulation must be below `--max-ratio` times its error to the unquantized GEMM (GEMM
   accumulation, TE's Hadamard signs and its scale arithmetic may differ; the quantization error
   must be ours). Backward gradients are reported (stochastic rounding and TE's Hadamard signs
   make them differ), and must be finite.
3. Megatron's TE layer spec: a mixed plan through quant_recipe reaches every TE linear's
   te_quant_params; training runs; apply_plan re-plans at a step boundary (the switched linears'
   te_quant_params follow), training goes on and the loss falls.
4. `snip-pretrain-gpt --transformer-impl transformer_engine --snip` on mock data (a subprocess):
   the start-up line of this GPU, a measurement and a re-plan, exit status 0.
Last line: `RESULT sm=<sm> flags=<n> refused=<n> fwd_ratio_max=<x> replanned=<n> loss_first=<l>
loss_last=<l> pretrain=<0|1|skipped> ok=<0|1>`.

Never run: no machine with both a GPU and Transformer Engine was available (bench/gpu/README.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)

from snip_megatron.formats.precision import Precision  # noqa: E402
from snip_megatron.plan import LINEAR_NAMES, LayerKey, Plan, all_keys  # noqa: E402
from snip_megatron.shapes import ModelShape  # noqa: E402

# Multiples of 128: no FP8 / NVFP4 block straddles a tensor edge.
SHAPE = ModelShape(name="te_check", num_layers=4, hidden_size=256, ffn_hidden_size=512,
                   num_attention_heads=4, num_query_groups=2, vocab_size=512, seq_length=128)
RECIPE_FLAGS = [{}, {"fp8_format": "hybrid"}, {"fp8_recipe": "tensorwise"},
                {"fp8_recipe": "tensorwise", "fp8_format": "e4m3"}, {"fp8_recipe": "mxfp8"},
                {"fp8_block_scales": "pow2"}, {"fp8_block_scales": "fp32"},
                {"fp4_gradient_rounding": "nearest"}, {"fp4_gradient_rounding": "stochastic"},
                {"fp4_recipe": "mxfp4"}]
"""The same flags as tests/te/megatron_checks.py (kept equal by tests/bench/test_te_check.py)."""
CYCLE = [Precision.BF16, Precision.FP8, Precision.FP4]
PRETRAIN_MODEL = ["--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "512",
                  "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
                  "--seq-length", "128", "--max-position-embeddings", "128", "--position-embedding-type", "rope",
                  "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
                  "--untie-embeddings-and-output-weights", "--micro-batch-size", "2", "--global-batch-size", "4",
                  "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--bf16",
                  "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--mock-data",
                  "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "100"]


def require_gpu_and_te() -> None:
    """SystemExit unless a CUDA GPU and the real Transformer Engine are here."""
    if not torch.cuda.is_available():
        raise SystemExit("te_check.py needs a CUDA GPU and Transformer Engine; this machine has no GPU "
                         "(tests/te runs the same checks on CPU over the TE test double)")
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # absent, or a broken install
        raise SystemExit(f"te_check.py needs Transformer Engine (import failed: {type(e).__name__}: {e}); "
                         "use the NGC PyTorch image (docker/)") from None
    if os.path.join("tests", "te_double") in os.path.abspath(transformer_engine.__file__):
        raise SystemExit("te_check.py found the TE test double (tests/te_double), not Transformer Engine; "
                         "take tests/te_double off PYTHONPATH")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def check_switches(log) -> bool:
    from transformer_engine.common.recipe import Float8BlockScaling, NVFP4BlockScaling

    from snip_megatron.te.environment import TESwitches

    ours = TESwitches.read()
    block, nv = Float8BlockScaling(), NVFP4BlockScaling()
    same = (block.fp8_quant_fwd_inp.power_2_scale == (ours.fp8_block_scales == "pow2")
            and nv.disable_stochastic_rounding == ours.nvfp4_disable_stochastic_rounding
            and nv.disable_rht == ours.nvfp4_disable_rht
            and nv.disable_2d_quantization == ours.nvfp4_disable_2d)
    log(f"1. TE's switches as SNIP reads them: {ours} -> {'agree' if same else 'DISAGREE'} with TE's recipes")
    return same


def _autocast_for(config: dict):
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


def check_flags(sm: int, max_ratio: float, log) -> tuple[bool, int, int, float]:
    from snip_megatron.config import SnipConfig
    from snip_megatron.formats.precision import Formats
    from snip_megatron.megatron.quant_recipe import config_dict_for
    from snip_megatron.te import te_params, te_unavailable

    ok, refused, worst = True, 0, 0.0
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
        log(f"2. FP8 {fp8} on SM{sm}: SNIP says {'runs' if predicted else 'cannot run'}, TE "
            f"{'ran it' if ran else 'raised ' + why.splitlines()[0]}")
        ok &= ran == predicted
    for flags in RECIPE_FLAGS:
        name = ",".join(f"{k}={v}" for k, v in flags.items()) or "defaults"
        snip = SnipConfig(enabled=True, precisions="bf16,fp8,fp4", **flags)
        try:
            run = snip.resolved("te", sm=sm)
        except ValueError as e:
            refused += 1
            log(f"2. {name}: refused at start-up ({str(e).splitlines()[-1].strip()})")
            continue
        formats = run.measure_config().formats
        configs = config_dict_for("te", sm=sm, formats=formats)
        for p in ("fp8", "fp4"):
            te_y, te_dx, te_dw = _te_linear_run(configs[p], x, w, gy)
            emu_y, emu_dx, emu_dw = _emulated_run(formats.spec(p), x, w, gy)
            ratio = rel(te_y, emu_y) / max(rel(te_y, plain), 1e-30)
            finite = all(bool(torch.isfinite(t).all()) for t in (te_y, te_dx, te_dw))
            worst = max(worst, ratio)
            good = ratio < max_ratio and finite
            ok &= good
            log(f"2. {name} {p} ({formats.describe(p)}): forward |TE-ours|/|TE-unquantized| = {ratio:.3f}, "
                f"dX {rel(te_dx, emu_dx):.3f}, dW {rel(te_dw, emu_dw):.3f} relative to ours"
                f"{'' if good else '  <-- FAILED'}")
    return ok, len(RECIPE_FLAGS), refused, worst


def plan_a(n: int) -> Plan:
    return Plan({k: CYCLE[(k.layer + LINEAR_NAMES.index(k.name)) % 3] for k in all_keys(n)})


def check_te_spec_gpt(sm: int, steps: int, log) -> tuple[bool, int, list]:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from snip_megatron.config import SnipConfig
    from snip_megatron.megatron.apply import apply_plan, current_plan
    from snip_megatron.megatron.batch import make_forward_step, random_batch
    from snip_megatron.megatron.model import make_transformer_config
    from snip_megatron.megatron.quant_recipe import recipe_for_chunk
    from snip_megatron.megatron.smoke import wrap_ddp_and_optimizer

    formats = SnipConfig(enabled=True).resolved("te", sm=sm).formats
    n = SHAPE.num_layers
    a = plan_a(n)
    config = make_transformer_config(SHAPE, params_dtype=torch.bfloat16)
    config.quant_recipe = recipe_for_chunk(a, config, backend="te", sm=sm, formats=formats)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
                     vocab_size=SHAPE.vocab_size, max_sequence_length=SHAPE.seq_length,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope").cuda()
    built = current_plan(model) == a
    log(f"3. TE-spec GPT built with the plan: {'delivered' if built else 'NOT delivered'} to "
        f"{len(current_plan(model))} TE linears")
    chunks, optimizer = wrap_ddp_and_optimizer([model], config, lr=3e-3, clip_grad=1.0, distributed_optimizer=False)
    g = torch.Generator().manual_seed(7)
    batches = [{k: v.cuda() for k, v in random_batch(4, SHAPE.seq_length, SHAPE.vocab_size, g).items()}
               for _ in range(2)]
    forward_backward, forward_step, losses = get_forward_backward_func(), make_forward_step(), []

    def train(k: int) -> None:
        for _ in range(k):
            chunks[0].zero_grad_buffer()
            optimizer.zero_grad()
            reduced = forward_backward(forward_step_func=forward_step, data_iterator=iter(batches), model=chunks,
                                       num_microbatches=len(batches), seq_length=SHAPE.seq_length,
                                       micro_batch_size=4, forward_only=False)
            optimizer.step()
            losses.append(sum(float(r["lm loss"]) for r in reduced) / len(reduced))

    train(steps)
    b = a.replace({LayerKey(1, "linear_fc1"): "fp4", LayerKey(n, "linear_proj"): "bf16",
                   LayerKey(2, "linear_qkv"): "fp8"})
    changes = apply_plan(chunks, b, sm=sm, formats=formats)
    followed = current_plan(model) == b and {c.key for c in changes} == {c.key for c in a.diff(b)}
    log(f"3. re-plan: {len(changes)} TE linears switched, te_quant_params {'follow' if followed else 'do NOT follow'}")
    train(steps)
    falls = all(loss == loss for loss in losses) and losses[-1] < losses[0]
    log(f"3. losses: {' '.join(f'{loss:.4f}' for loss in losses)}")
    return built and followed and falls, len(changes), losses


def check_pretrain(log) -> bool:
    cmd = [sys.executable, "-m", "snip_megatron.pretrain", *PRETRAIN_MODEL, "--transformer-impl",
           "transformer_engine", "--train-iters", "5", "--snip", "--snip-warmup", "2", "--snip-interval", "10",
           "--snip-lag", "1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[snip]")]
    generation = any(line.startswith("[snip] SM") for line in lines)
    replanned = any(line.startswith("[snip] step 3: plan") for line in lines)
    for line in lines:
        log(f"4. {line}")
    if proc.returncode != 0:
        log(f"4. snip-pretrain-gpt failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.returncode == 0 and generation and replanned


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="training steps before and after the re-plan")
    ap.add_argument("--max-ratio", type=float, default=0.25,
                    help="largest |TE - ours| / |TE - unquantized| of a forward output")
    ap.add_argument("--skip-pretrain", action="store_true", help="skip check 4 (the entry point)")
    args = ap.parse_args(argv)
    require_gpu_and_te()

    from snip_megatron.megatron import runtime
    from snip_megatron.te import gpu

    runtime.init_process_group(backend="nccl")
    runtime.initialize_model_parallel(tp=1, seed=1234)
    sm = gpu.current_sm()

    def log(msg: str) -> None:
        print(msg, flush=True)

    log(f"GPU {torch.cuda.get_device_name()} = SM{sm}")
    ok = check_switches(log)
    flags_ok, flags, refused, worst = check_flags(sm, args.max_ratio, log)
    gpt_ok, replanned, losses = check_te_spec_gpt(sm, args.steps, log)
    runtime.destroy(process_group=True)
    pretrain = "skipped" if args.skip_pretrain else str(int(check_pretrain(log)))
    ok = ok and flags_ok and gpt_ok and pretrain != "0"
    log(f"RESULT sm={sm} flags={flags} refused={refused} fwd_ratio_max={worst:.3f} replanned={replanned} "
        f"loss_first={losses[0]:.4f} loss_last={losses[-1]:.4f} pretrain={pretrain} ok={int(ok)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
