"""What one measurement costs at scale: the model of stats/scale_model.py, validated on CPU models.

1. Calibration: the peak bytes of one quantization error E = Q(T) - T per input element, for each
   precision and role of the default formats (the only part of the memory model not read off the
   code), measured on a float32 tensor.
2. Validation on llama_tiny-sized models in one process (CPU, float32), for each case:
   - the largest working set of the statistics hooks (clean G_Y, clean G_X, backward-noise G_Y):
     measured as the peak of the bytes allocated inside the hooks and still alive, against the
     model's largest hook;
   - the layer inputs the hooks hold: the measurement's peak minus the peak of the same passes
     without hooks (the bare frozen passes), against the model's `held` (no recompute);
   - the AdamW read (a model with optimizer state), against `adam_bytes`.
   CPU torch has no allocator statistics; live bytes are counted by a TorchDispatchMode that sees
   every tensor an ATen op returns (forward and backward) and follows its storage until the last
   tensor on it is freed (weakref finalizers). Scratch inside a single kernel is not seen.
3. The model's figures for the 1B, 7B and 70B recipes and a DeepSeek-V3-sized MoE (61 layers, MLA,
   256 routed experts top-8 + 1 shared, EP=64: Megatron-Bridge's deepseek_v3_pretrain_config):
   extra bytes per rank over a training step (and over a bare frozen pass), host syncs, and the
   compute in training-step equivalents at the assumed GPU's rates.

    python bench/measure_scale.py [--quick]
Prints `RESULT extra_gb_dsv3=<x> syncs_dsv3=<x> dispatcher_syncs_dsv3=<x> step_equiv_dsv3=<x>
units_dsv3=<x> local_experts_dsv3=<x> expert_rows_dsv3=<x>` (the MoE layout), then last
RESULT extra_gb_70b=<x> syncs_70b=<x> step_equiv_70b=<x> model_error=<x>
(model_error: the largest relative error of the validated quantities.)
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from snip_megatron.formats.fused import reserve_cpu_scratch  # noqa: E402
from snip_megatron.shapes import ModelShape, get_shape  # noqa: E402
from snip_megatron.stats import scale_model as sm  # noqa: E402

MB = 1e6


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage allocated by ATen ops while the mode is on and still alive; `peak`;
    and the same for storages allocated while `tag` is set (`tagged`, `tagged_peak`).

    A storage is followed through the tensors that view it (weak references); it is freed when
    none is left, or when none still views it (Megatron swaps tensors' storage with `.data =`):
    a new storage at the same address then counts anew."""

    def __init__(self):
        super().__init__()
        self.views, self.size, self.tagged_keys = {}, {}, set()
        self.live = self.peak = self.tagged = self.tagged_peak = 0
        self.tag = False
        self.call, self.call_keys, self.call_live, self.call_peak = 0, set(), 0, 0

    def begin_call(self) -> None:
        """Count from here what is allocated until end_call (a hook's own working set)."""
        self.tag, self.call_keys, self.call_live, self.call_peak = True, set(), 0, 0

    def end_call(self) -> int:
        self.tag = False
        return self.call_peak

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output on an input's storage (a view, an in-place op) allocated nothing: an untracked
        # storage it views was there before the mode (e.g. the quantizer's kept CPU scratch).
        inputs = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
                  if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out

    def _viewing(self, key) -> list:
        alive = []
        for ref in self.views.get(key, ()):
            t = ref()
            if t is not None and t.untyped_storage().data_ptr() == key:
                alive.append(ref)
        return alive

    def _track(self, t: torch.Tensor, inputs=frozenset()) -> None:
        storage = t.untyped_storage()
        n, key = storage.nbytes(), storage.data_ptr()
        if n == 0:
            return
        if key in self.views and not self._viewing(key):
            self._free(key)  # a stale entry: its tensors moved to other storage
        if key not in self.views and key in inputs:
            return
        if key not in self.views:
            self.views[key], self.size[key] = [], n
            self.live += n
            self.peak = max(self.peak, self.live)
            if self.tag:
                self.tagged_keys.add(key)
                self.tagged += n
                self.tagged_peak = max(self.tagged_peak, self.tagged)
                self.call_keys.add(key)
                self.call_live += n
                self.call_peak = max(self.call_peak, self.call_live)
        self.views[key].append(weakref.ref(t, lambda _, key=key: self._release(key)))

    def _release(self, key) -> None:
        if key in self.views and not self._viewing(key):
            self._free(key)

    def _free(self, key) -> None:
        n = self.size.pop(key)
        del self.views[key]
        self.live -= n
        if key in self.tagged_keys:
            self.tagged_keys.discard(key)
            self.tagged -= n
        if key in self.call_keys:
            self.call_keys.discard(key)
            self.call_live -= n


HOOKS = ("_on_gy_clean", "_on_gx_clean", "_on_gy_bwd_noise")
_TRACKER: list = [None]
_HOOK_PEAKS: dict = {}


def _install_hook_tagging() -> None:
    """Tag what the backward hooks allocate, and record each hook call's working set."""
    collector = importlib.import_module("snip_megatron.stats.collector")
    plain = collector._plain

    def tagging(fn, *args, **kwargs):  # _plain's own arguments (the error list, the layer) pass through
        inner = plain(fn, *args, **kwargs)
        name = getattr(getattr(fn, "func", fn), "__name__", "")
        if name not in HOOKS:
            return inner
        probe = getattr(getattr(fn, "func", fn), "__self__", None)

        @functools.wraps(inner)
        def run(*args, **kwargs):
            tr = _TRACKER[0]
            if tr is None:
                return inner(*args, **kwargs)
            tr.begin_call()
            try:
                return inner(*args, **kwargs)
            finally:
                key = (name, probe.key.name if probe is not None else "?")
                _HOOK_PEAKS[key] = max(_HOOK_PEAKS.get(key, 0), tr.end_call())

        return run

    collector._plain = tagging


# -- 1. calibration ------------------------------------------------------------------------------
def calibrate(rows: int = 1024, cols: int = 512) -> dict:
    from snip_megatron.formats.precision import Formats, Precision
    from snip_megatron.stats.quant_error import formats_error_fn

    err = formats_error_fn(Formats(fp4_recipe="nvfp4"))
    out = {}
    for p in (Precision.FP8, Precision.FP4):
        for role in ("fprop_input", "wgrad_input", "dgrad_grad_output", "wgrad_grad_output", "fprop_weight"):
            t = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
            with LiveBytes() as tr:
                e = err(t, p, role)
                del e
            out[(p.value, role)] = tr.peak / t.numel()
    return out


# -- 2. validation -------------------------------------------------------------------------------
def _measure_case(shape: ModelShape, mbs: int, num_mb: int, recompute: str, k, with_optimizer: bool,
                  dtype=torch.float32) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from snip_megatron.megatron import runtime
    from snip_megatron.megatron.batch import make_forward_step, random_batch
    from snip_megatron.megatron.model import build_model_chunks
    from snip_megatron.megatron.smoke import wrap_ddp_and_optimizer
    from snip_megatron.stats.config import MeasureConfig
    from snip_megatron.stats.discover import planned_linears
    from snip_megatron.stats.microbatches import sample_microbatches

    meas = importlib.import_module("snip_megatron.stats.measure")
    runtime.initialize_model_parallel(tp=1, pp=1)
    overrides = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
        if recompute == "full" else {}
    chunks = build_model_chunks(shape, backend="emulated", params_dtype=dtype, **overrides)
    model, optimizer = chunks, None
    g = torch.Generator().manual_seed(0)
    data = [random_batch(mbs, shape.seq_length, shape.vocab_size, g) for _ in range(num_mb)]
    run = dict(seq_length=shape.seq_length, micro_batch_size=mbs)
    if with_optimizer:
        model, optimizer = wrap_ddp_and_optimizer(chunks, chunks[0].config, lr=1e-3, clip_grad=0.0,
                                                  distributed_optimizer=False)
        get_forward_backward_func()(forward_step_func=make_forward_step(), data_iterator=iter(data), model=model,
                                    num_microbatches=num_mb, forward_only=False, **run)
        optimizer.step()
    config = MeasureConfig(micro_batches=k)
    meas.measure_chunks(model, make_forward_step(), data, config=config, optimizer=optimizer, **run)  # warm-up
    _HOOK_PEAKS.clear()
    with LiveBytes() as tr:
        _TRACKER[0] = tr
        try:
            meas.measure_chunks(model, make_forward_step(), data, config=config, optimizer=optimizer, **run)
        finally:
            _TRACKER[0] = None
    hooks = dict(_HOOK_PEAKS)
    # the same passes without hooks: the bare frozen passes on the same sampled micro-batches
    picked, _ = sample_microbatches(num_mb, 0, 1, k)
    measured = [data[i] for i in picked]
    noise = measured if len(measured) > 1 else meas._halves(measured, mbs) or measured
    with LiveBytes() as bare:
        with meas.measurement_mode(chunks, planned_linears(chunks), chunks[0].config):
            meas._run_pass(chunks, make_forward_step(), measured, **run)
            meas._run_pass(chunks, make_forward_step(), noise, seq_length=shape.seq_length,
                           micro_batch_size=mbs if noise is measured else mbs // 2)
    adam = 0
    if optimizer is not None:
        from snip_megatron.stats import adam as adam_mod

        weights = {key: m.weight for key, m in planned_linears(chunks)}
        with LiveBytes() as tr_adam:
            adam_mod.adam_statistics(optimizer, weights, add=lambda *a: None)
        adam = tr_adam.peak
    runtime.destroy()
    return {"peak": tr.peak, "bare": bare.peak, "hooks": hooks, "adam": adam}


def validate(quant: dict, quick: bool) -> tuple[list, float]:
    from snip_megatron.stats import weights

    tiny = get_shape("llama_tiny")
    wide = tiny.with_(name="wide", num_layers=2, hidden_size=256, ffn_hidden_size=1024, seq_length=256)
    # label, shape, micro-batch size, micro-batches, recompute, K, optimizer, dtype, weight block elements
    cases = [("llama_tiny, 1 micro-batch of 8", tiny, 8, 1, "none", None, True, torch.float32, None),
             ("llama_tiny, 4 of 4 micro-batches", tiny, 8, 4, "none", None, False, torch.float32, None),
             ("llama_tiny, 2 of 4, full recompute", tiny, 8, 4, "full", 2, False, torch.float32, None),
             ("llama_tiny BF16, 1 of 2, weights in blocks of 128 rows", tiny, 8, 2, "none", 1, False,
              torch.bfloat16, 1 << 14)]
    if not quick:
        cases.append(("2 layers, hidden 256, FFN 1024, seq 256, BF16, 2 of 2 of 4", wide, 4, 2, "none", None, True,
                      torch.bfloat16, None))
    rows, worst = [], 0.0
    saved_block = weights.MAX_BLOCK_ELEMS
    for label, shape, mbs, num_mb, recompute, k, opt, dtype, block in cases:
        weights.MAX_BLOCK_ELEMS = block or saved_block
        try:
            got = _measure_case(shape, mbs, num_mb, recompute, k, opt, dtype)
        finally:
            weights.MAX_BLOCK_ELEMS = saved_block
        nbytes = 2 if dtype == torch.bfloat16 else 4
        lay = sm.MeasureLayout(shape=shape, micro_batch_size=mbs, global_batch=mbs * num_mb, micro_batches=k,
                               recompute=recompute, act_bytes=nbytes, weight_bytes=nbytes, quant_bytes=quant,
                               distributed_optimizer=False, weight_block_elems=block or sm.WEIGHT_BLOCK_ELEMS)
        model = sm.memory(lay)
        checks = []
        noise_tokens = lay.tokens // 2 if lay.measured == 1 else lay.tokens  # a lone micro-batch's halves
        for hook, fn, tokens in (("_on_gy_clean", sm.clean_hook_bytes, lay.tokens),
                                 ("_on_gx_clean", sm.gx_hook_bytes, lay.tokens),
                                 ("_on_gy_bwd_noise", sm.bwd_noise_hook_bytes, noise_tokens)):
            per = {n: (v, fn(lay, n, tokens)) for (h, n), v in got["hooks"].items() if h == hook}
            name, (measured, predicted) = max(per.items(), key=lambda kv: abs(kv[1][1] - kv[1][0]) / kv[1][0])
            checks.append((f"{hook}, worst linear ({name})", measured, predicted))
            measured, predicted = max(v for v, _ in per.values()), max(p for _, p in per.values())
            checks.append((f"{hook}, largest", measured, predicted))
        if recompute == "none":
            checks.append(("held layer inputs (peak - bare passes)", got["peak"] - got["bare"], model["held"]))
        if opt:
            checks.append(("AdamW read", got["adam"], model["adam"]))
        for what, measured, predicted in checks:
            rel = abs(predicted - measured) / max(measured, 1)
            worst = max(worst, rel)
            rows.append((label, what, measured, predicted, rel))
        rows.append((label, "measurement's peak above its start; bare passes'", got["peak"], got["bare"], None))
    return rows, worst


# -- 3. the recipes ------------------------------------------------------------------------------
DSV3 = "DeepSeek-V3 (TP2 PP16 EP64, DP32, SP, mbs 1, seq 4096, batch 4096)"


def deepseek_v3(quant: dict) -> sm.MeasureLayout:
    """DeepSeek-V3 as Megatron-Bridge 0.6's `deepseek_v3_pretrain_config` (recipes/deepseek/h100/
    deepseek_v3.py: 1024 H100s, TP=2, PP=16, EP=64, ETP=1, SP, no recompute, micro-batch 1, global
    batch 4096, distributed optimizer with BF16 moments) builds it from the Hugging Face config through
    its DeepSeek-V3 bridge: 61 layers (the first 3 dense), hidden 7168, FFN 18432, 128 heads, MLA
    (q_lora 1536, kv_lora 512, head dims 128 + 64 rope, v 128), 256 routed experts of FFN 2048 top-8
    and one shared expert (FFN 2048), vocab 129280. Without its MTP layer (SNIP refuses MTP with
    experts today)."""
    from snip_megatron.models.gpt import MLADims, MoEDims

    shape = ModelShape(name="deepseek_v3", num_layers=61, hidden_size=7168, ffn_hidden_size=18432,
                       num_attention_heads=128, num_query_groups=128, vocab_size=129280, seq_length=4096,
                       kv_channels=128)
    return sm.MeasureLayout(
        shape=shape, mla=MLADims(q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
                                 v_head_dim=128),
        moe=MoEDims(num_experts=256, topk=8, ffn_hidden_size=2048, shared_ffn_hidden_size=2048,
                    layer_freq=(0,) * 3 + (1,) * 58),
        tp=2, pp=16, dp=32, ep=64, etp=1, sequence_parallel=True, micro_batch_size=1, global_batch=4096,
        moment_bytes=2, quant_bytes=quant)


def recipes(quant: dict) -> dict:
    return {
        "1B (TP1, DP8, mbs 4, seq 2048, batch 512)": sm.MeasureLayout(
            shape=get_shape("llama_1b"), dp=8, micro_batch_size=4, global_batch=512, quant_bytes=quant),
        "7B (TP4 PP2, DP4, SP, mbs 1, seq 2048, batch 1024)": sm.MeasureLayout(
            shape=get_shape("llama_7b"), tp=4, pp=2, dp=4, sequence_parallel=True, micro_batch_size=1,
            global_batch=1024, recompute="selective", quant_bytes=quant),
        "70B (TP8 PP8, DP1, SP, full recompute, mbs 1, seq 4096, batch 1024)": sm.MeasureLayout(
            shape=get_shape("llama_70b"), tp=8, pp=8, dp=1, sequence_parallel=True, recompute="full",
            micro_batch_size=1, global_batch=1024, quant_bytes=quant),
        "70B, precision-aware optimizer (FP8 moments), DP16": sm.MeasureLayout(
            shape=get_shape("llama_70b"), tp=8, pp=8, dp=16, sequence_parallel=True, recompute="full",
            micro_batch_size=1, global_batch=1024, moment_bytes=1, quant_bytes=quant),
        "70B, every micro-batch measured (micro_batches=None)": sm.MeasureLayout(
            shape=get_shape("llama_70b"), tp=8, pp=8, dp=1, sequence_parallel=True, recompute="full",
            micro_batch_size=1, global_batch=1024, micro_batches=None, quant_bytes=quant),
        DSV3: deepseek_v3(quant),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="skip the larger validation model")
    args = ap.parse_args(argv)
    from snip_megatron.megatron import runtime

    runtime.init_process_group()
    _install_hook_tagging()
    # The fused quantizer keeps per-thread scratch on CPU (a GPU allocates it per call, inside
    # the quantization peak that calibrate() measures); allocated here, before any counting.
    reserve_cpu_scratch()
    quant = calibrate()
    print("quantization error E = Q(T) - T, peak bytes per float32 input element:")
    print("  " + ", ".join(f"{p}/{r} {v:.1f}" for (p, r), v in quant.items()))
    rows, worst = validate(quant, args.quick)
    print(f"\nvalidation (CPU, float32, one process), measured vs model, MB:")
    for label, what, measured, predicted, rel in rows:
        tail = f"{rel * 100:5.1f}%" if rel is not None else ""
        print(f"  {label:<54} {what:<48} {measured / MB:8.3f} {predicted / MB:8.3f} {tail}")
    rates = sm.GPURates()
    print(f"\nrecipes ({rates.name}: BF16 {rates.bf16:.0f}, FP8 {rates.fp8:.0f} TFLOP/s dense, "
          f"HBM {rates.hbm_tb_s} TB/s; the training step's linears at the FP8 rate, the initial plan):")
    result = {}
    for name, lay in recipes(quant).items():
        mem, fl, syncs = sm.memory(lay), sm.flops(lay, rates), sm.host_syncs(lay)
        biggest = max(mem["hooks"], key=mem["hooks"].get)
        print(f"  {name}\n    measures {fl['measured_microbatches']} of {fl['microbatches']} micro-batches "
              f"per replica; extra memory over a training step {mem['extra_over_training'] / 1e9:.3f} GB "
              f"(largest hook {biggest} {mem['hooks'][biggest] / 1e9:.3f} GB, AdamW read {mem['adam'] / 1e9:.3f} GB, "
              f"tables {mem['persistent'] / 1e6:.2f} MB); over a bare frozen pass "
              f"{mem['extra_over_frozen_pass'] / 1e9:.3f} GB ({mem['in_flight']} in flight x "
              f"{mem['held_per_microbatch'] / 1e9:.3f} GB of held layer inputs)\n"
              f"    host syncs {syncs['device_to_host']} device-to-host + {syncs['host_to_device']} small "
              f"host-to-device copies; compute {fl['step_equiv']:.4f} training steps "
              f"({fl['measure_s']:.2f} s at peak rates against a {fl['step_s']:.1f} s step; "
              f"elementwise {fl['elementwise_s']:.2f} s)")
        if lay.moe is not None:
            print(f"    MoE: {len(lay.inventory)} planned units, {lay.local_experts} local experts per MoE layer "
                  f"(an expert unit's hooks run one expert at a time), {lay.expert_tokens} routed rows per "
                  f"expert per micro-batch (balanced); {sm.measurement_passes(lay)} passes x "
                  f"{lay.stage_layers()['moe']} MoE layers on the busiest stage: "
                  f"{sm.dispatcher_syncs(lay)} syncs of Megatron's alltoall dispatcher (its own, one per MoE "
                  f"layer forward, as in each training micro-batch)")
        result[name] = (mem, fl, syncs)
    mem, fl, syncs = result[DSV3]
    lay = recipes(quant)[DSV3]
    print(f"RESULT extra_gb_dsv3={mem['extra_over_training'] / 1e9:.3f} "
          f"syncs_dsv3={syncs['device_to_host'] + syncs['host_to_device']} "
          f"dispatcher_syncs_dsv3={sm.dispatcher_syncs(lay)} step_equiv_dsv3={fl['step_equiv']:.4f} "
          f"units_dsv3={len(lay.inventory)} local_experts_dsv3={lay.local_experts} "
          f"expert_rows_dsv3={lay.expert_tokens}")
    mem, fl, syncs = result[next(n for n in result if n.startswith("70B (TP8"))]
    print(f"RESULT extra_gb_70b={mem['extra_over_training'] / 1e9:.3f} "
          f"syncs_70b={syncs['device_to_host'] + syncs['host_to_device']} step_equiv_70b={fl['step_equiv']:.4f} "
          f"model_error={worst:.3f}")


if __name__ == "__main__":
    main()
