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
3. A DeepSeek-style model at CPU size on two processes (PP=2 x VPP=2, MLA, routed and shared
   experts, an MoE MTP layer; `--deepseek run`, recorded in docs/measure_scale_deepseek_check.json):
   each rank's planned units, hooks' working sets, held layer inputs and host syncs (SNIP's and
   Megatron's token dispatcher's, counted by HostSyncs) against the model of that rank;
   `--deepseek recorded` (the default) compares the model with the record, `off` skips it.
4. The model's figures for the 1B, 7B and 70B recipes and DeepSeek-V3 at its published layout (61
   layers + an MTP layer, MLA, 256 routed experts top-8 + 1 shared; TP=2, PP=16 x VPP=2 with
   Megatron-Bridge's 32-chunk layout, EP=64): extra bytes per rank over a training step (and over a
   bare frozen pass), host syncs, and the compute in training-step equivalents at the assumed GPU's
   rates; for DeepSeek-V3 every pipeline rank's, the busiest in the RESULT line.

    python bench/measure_scale.py [--quick] [--deepseek run|recorded|off]
Prints `RESULT extra_gb_dsv3=<x> frozen_gb_dsv3=<x> syncs_dsv3=<x> dispatcher_syncs_dsv3=<x>
step_equiv_dsv3=<x> units_dsv3=<x> local_experts_dsv3=<x> expert_rows_dsv3=<x>
[ds_check_worst=<x> ds_check_mismatches=<n>]` (the MoE layout, the most of any rank; the check's
largest relative error of its memory figures and how many counts or unit sets differ), then last
RESULT extra_gb_70b=<x> syncs_70b=<x> step_equiv_70b=<x> model_error=<x>
(model_error: the largest relative error of the one-process validation's quantities.)
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
_HOOK_ROWS: dict = {}  # (hook, linear) -> the most rows (tokens; an expert's routed rows) a call saw


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
                g = [a for a in args if isinstance(a, torch.Tensor)][-1]  # G_Y or G_X: [..., features]
                _HOOK_ROWS[key] = max(_HOOK_ROWS.get(key, 0), g.numel() // g.shape[-1])

        return run

    collector._plain = tagging


class HostSyncs(TorchDispatchMode):
    """What would make the host wait for a GPU, counted on the CPU while on (a CPU stand-in, as
    tests/stats/test_syncs.py), by who asked: the first Python frame outside torch, this file and
    the CPU shim is SNIP's ("ours", in snip_megatron), Megatron's token dispatcher's ("dispatcher",
    moe/token_dispatcher.py and moe_utils.py) or another's ("other": Megatron's RNG tracker comparing
    CPU RNG states, its vocab-parallel cross entropy's boolean masks, the forward step's loss).

    - "read": a Tensor method that hands a value to Python or copies to the host (`item`,
      `float()`, `int()`, `bool()`, `__index__`, `tolist`, `cpu`) on a tensor that would be on the
      device: not on a host tensor (one made by `cpu()`, `torch.from_numpy` or `torch.tensor`
      without a device, or computed from host tensors only), and not inside `draw_seed` (its
      generator is a CPU one, tests/formats/test_sr_noise.py);
    - "sized": an ATen op on device tensors whose output size depends on their values (`nonzero`,
      `masked_select`, indexing or index_put with a boolean mask): a GPU computes the size and the
      host reads it;
    - "h2d": a blocking host-to-device copy: `torch.tensor(..., device=...)` naming a device (None
      on CPU, as measure.py's flags: the GPU run's), or `Tensor.to(<device>)` of a host tensor
      without `non_blocking`.
    """

    READS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist", "cpu")
    SIZED = ("nonzero", "masked_select")

    def __init__(self):
        super().__init__()
        self.counts: dict = {}
        self.sites: dict = {}  # (who, what, "file:function:line") -> count
        self.where = "?"
        self._host: dict = {}  # id -> weak reference of a host tensor
        self._saved: dict = {}

    def _tag(self, t, host: bool = True) -> None:
        if not isinstance(t, torch.Tensor):
            return
        if host:
            self._host[id(t)] = weakref.ref(t, lambda _, i=id(t): self._host.pop(i, None))
        else:
            self._host.pop(id(t), None)

    def is_host(self, t) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _who(self, redispatched: bool = True) -> "str | None":
        from snip_megatron.formats.sr_noise import draw_seed
        from snip_megatron.megatron import cpu_shim

        frame = sys._getframe(2)
        if frame.f_code is draw_seed.__code__ or (redispatched and frame.f_code.co_filename == cpu_shim.__file__):
            return None  # a host generator's draw; the shim re-dispatching a call counted already
        skip = (__file__, cpu_shim.__file__)
        while frame is not None and ("/torch/" in frame.f_code.co_filename.replace("\\", "/")
                                     or frame.f_code.co_filename in skip):
            frame = frame.f_back
        if frame is None:
            return "other"
        if frame.f_code is draw_seed.__code__:
            return None
        name = frame.f_code.co_filename.replace("\\", "/")
        self.where = f"{'/'.join(name.split('/')[-2:])}:{frame.f_code.co_name}:{frame.f_lineno}"
        if "/snip_megatron/" in name:
            return "ours"
        return "dispatcher" if name.endswith(("moe/token_dispatcher.py", "moe/moe_utils.py")) else "other"

    def _count(self, who, what) -> None:
        if who is not None:
            self.counts[(who, what)] = self.counts.get((who, what), 0) + 1
            self.sites[(who, what, self.where)] = self.sites.get((who, what, self.where), 0) + 1

    def __enter__(self):
        counter = self

        def read(name):
            original = getattr(torch.Tensor, name)

            def method(t, *args, **kwargs):
                if not counter.is_host(t):
                    counter._count(counter._who(), "read")
                out = original(t, *args, **kwargs)
                if name == "cpu":
                    counter._tag(out)
                return out
            return original, method

        def to(t, *args, **kwargs):
            device = kwargs.get("device", args[0] if args and isinstance(args[0], (torch.device, str)) else None)
            moved = device is not None and counter.is_host(t)
            if moved and not kwargs.get("non_blocking", False):
                counter._count(counter._who(), "h2d")
            out = counter._saved["to"](t, *args, **kwargs)
            if moved:
                counter._tag(out, host=False)  # a device tensor now (on a CPU run, maybe `t` itself)
            return out

        def tensor(*args, **kwargs):
            if "device" in kwargs:
                counter._count(counter._who(), "h2d")
            out = counter._saved["tensor"](*args, **kwargs)
            counter._tag(out, host="device" not in kwargs)
            return out

        def from_numpy(*args, **kwargs):
            out = counter._saved["from_numpy"](*args, **kwargs)
            counter._tag(out)
            return out

        for name in self.READS:
            self._saved[name], method = read(name)
            setattr(torch.Tensor, name, method)
        self._saved.update(to=torch.Tensor.to, tensor=torch.tensor, from_numpy=torch.from_numpy)
        torch.Tensor.to, torch.tensor, torch.from_numpy = to, tensor, from_numpy
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        for name in self.READS:
            setattr(torch.Tensor, name, self._saved[name])
        torch.Tensor.to, torch.tensor, torch.from_numpy = (self._saved["to"], self._saved["tensor"],
                                                           self._saved["from_numpy"])
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        host = bool(inputs) and all(self.is_host(a) for a in inputs)
        name = func.overloadpacket.__name__
        sized = name in self.SIZED
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            indices = args[1] if len(args) > 1 else (kwargs or {}).get("indices", ())
            sized = any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
        if sized and not host:
            self._count(self._who(redispatched=False), "sized")
        out = func(*args, **(kwargs or {}))
        if host:
            for t in tree_flatten(out)[0]:
                self._tag(t)
        return out


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
                  dtype=torch.float32, parallel: "dict | None" = None, build: "dict | None" = None) -> dict:
    """One measurement on this process's ranks of `parallel` (tp, pp, vpp; default one process) of
    a model of `shape` (`build`: build_model_chunks's config overrides, e.g. MLA, MoE, MTP): its
    hooks' working sets and rows, its peak and the bare passes' peak, the AdamW read, its host
    syncs (HostSyncs) and this rank's planned units."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from snip_megatron.megatron import runtime
    from snip_megatron.megatron.batch import make_forward_step, random_batch
    from snip_megatron.megatron.model import build_model_chunks
    from snip_megatron.megatron.smoke import wrap_ddp_and_optimizer
    from snip_megatron.stats.config import MeasureConfig
    from snip_megatron.stats.discover import planned_linears
    from snip_megatron.stats.microbatches import sample_microbatches

    meas = importlib.import_module("snip_megatron.stats.measure")
    runtime.initialize_model_parallel(**(parallel or dict(tp=1, pp=1)))
    overrides = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
        if recompute == "full" else {}
    chunks = build_model_chunks(shape, backend="emulated", params_dtype=dtype, **overrides, **(build or {}))
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
    _HOOK_ROWS.clear()
    with LiveBytes() as tr, HostSyncs() as syncs:
        _TRACKER[0] = tr
        try:
            meas.measure_chunks(model, make_forward_step(), data, config=config, optimizer=optimizer, **run)
        finally:
            _TRACKER[0] = None
    hooks, rows = dict(_HOOK_PEAKS), dict(_HOOK_ROWS)
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
    keys = sorted({(key.layer, key.name) for key, _ in planned_linears(chunks)})
    runtime.destroy()
    return {"peak": tr.peak, "bare": bare.peak, "hooks": hooks, "rows": rows, "adam": adam,
            "syncs": dict(syncs.counts), "sites": dict(syncs.sites), "keys": keys}


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


# -- 2b. a DeepSeek-style model on two processes ----------------------------------------------------
DS_SMALL = ModelShape(name="ds_small", num_layers=4, hidden_size=64, ffn_hidden_size=192, num_attention_heads=4,
                      num_query_groups=4, vocab_size=1024, seq_length=64)
"""DeepSeek-V3's structure at CPU size: MLA, layers 2-4 MoE (4 routed experts top-2 and a shared
expert), an MoE MTP layer; every width a multiple of the error function's 16-element blocks."""
DS_SMALL_RUN = dict(pp=2, vpp=2, micro_batch_size=4, microbatches=2)
"""PP=2 x VPP=2 (four chunks of one layer, the MTP layer on the last rank's last chunk, Megatron's
even split), 2 micro-batches of 4, every one measured, float32, no optimizer state."""
DS_CHECK_FILE = Path(__file__).resolve().parent.parent / "docs" / "measure_scale_deepseek_check.json"


def ds_small_dims():
    from snip_megatron.models.gpt import MLADims, MoEDims

    return (MLADims(q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=16, v_head_dim=16),
            MoEDims(num_experts=4, topk=2, ffn_hidden_size=64, shared_ffn_hidden_size=64, layer_freq=(0, 1, 1, 1)))


def ds_small_layout(quant: dict, stage: int) -> sm.MeasureLayout:
    """The cost model's layout of the small DeepSeek-style run's pipeline rank `stage`."""
    mla, moe = ds_small_dims()
    r = DS_SMALL_RUN
    return sm.MeasureLayout(shape=DS_SMALL, mla=mla, moe=moe, mtp_num_layers=1, pp=r["pp"], vpp=r["vpp"], stage=stage,
                            micro_batch_size=r["micro_batch_size"],
                            global_batch=r["micro_batch_size"] * r["microbatches"], micro_batches=None,
                            act_bytes=4, weight_bytes=4, quant_bytes=quant, distributed_optimizer=False,
                            has_optimizer=False, dispatcher="allgather")


def deepseek_worker(out: str) -> None:
    """One rank of the small DeepSeek-style run (under torchrun): its measurement as JSON."""
    import json

    import torch.distributed as dist

    from snip_megatron.megatron import runtime

    torch.set_num_threads(1)
    runtime.init_process_group()
    _install_hook_tagging()
    reserve_cpu_scratch()
    mla, moe = ds_small_dims()
    r = DS_SMALL_RUN
    build = dict(mla=mla, mtp_num_layers=1, **moe.config_fields())
    got = _measure_case(DS_SMALL, r["micro_batch_size"], r["microbatches"], "none", None, False, torch.float32,
                        parallel=dict(tp=1, pp=r["pp"], vpp=r["vpp"]), build=build)
    rank = dist.get_rank()
    record = {"rank": rank, "stage": rank, "peak": got["peak"], "bare": got["bare"], "keys": got["keys"],
              "hooks": [[h, n, v, got["rows"].get((h, n), 0)] for (h, n), v in sorted(got["hooks"].items())],
              "syncs": [[who, what, n] for (who, what), n in sorted(got["syncs"].items())],
              "sites": [[who, what, where, n] for (who, what, where), n in sorted(got["sites"].items())]}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    runtime.destroy(process_group=True)


def run_deepseek_check(quant: dict, timeout: float = 5400) -> dict:
    """Run the small DeepSeek-style measurement on two processes (torchrun, gloo); the record
    written to DS_CHECK_FILE (the ranks' measurements and the calibration they are compared with)."""
    import json
    import os
    import socket
    import subprocess
    import tempfile
    import time

    root = Path(__file__).resolve().parent.parent
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
               "--master_addr=127.0.0.1", f"--master_port={port}", str(Path(__file__).resolve()),
               "--deepseek-worker", out]
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise SystemExit(f"the DeepSeek-style run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-6000:]}")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    record = {"case": {"shape": vars(DS_SMALL), **DS_SMALL_RUN, "mtp_num_layers": 1,
                       "mla": vars(ds_small_dims()[0]), "moe": {k: v for k, v in vars(ds_small_dims()[1]).items()}},
              "quant_bytes": [[p, role, v] for (p, role), v in quant.items()],
              "seconds": round(time.perf_counter() - start, 1), "ranks": ranks}
    DS_CHECK_FILE.write_text(json.dumps(record, indent=1) + "\n")
    return record


def compare_deepseek(record: dict) -> tuple[list, float, int]:
    """The cost model against the small DeepSeek-style run's record, per pipeline rank: the units it
    holds, every hook's working set (the worst linear and the largest, each hook; an expert unit's
    at the most routed rows it saw), the layer inputs held (its peak above the bare passes'), and
    the host syncs (SNIP's, exactly; Megatron's dispatcher's, exactly). Returns (rows, the largest
    relative error of the memory figures, the number of counts that differ)."""
    quant = {(p, role): v for p, role, v in record["quant_bytes"]}
    rows, worst, mismatches = [], 0.0, 0
    for rec in record["ranks"]:
        lay = ds_small_layout(quant, rec["stage"])
        label = f"rank {rec['rank']} (chunks: " + " | ".join(
            ", ".join(f"{'MTP' if k == 'mtp' else 'L'}{n}" for k, n in c) for c in lay.stage_chunks()) + ")"
        keys = sorted((k.layer, k.name) for k in lay.stage_keys())
        same = keys == sorted(tuple(k) for k in rec["keys"])
        mismatches += not same
        rows.append((label, f"planned units held (model {len(keys)})", len(rec["keys"]), len(keys), None if same else 1.0))
        checks = []
        hooks = {(h, n): (v, r) for h, n, v, r in rec["hooks"]}
        for hook, fn in (("_on_gy_clean", sm.clean_hook_bytes), ("_on_gx_clean", sm.gx_hook_bytes),
                         ("_on_gy_bwd_noise", sm.bwd_noise_hook_bytes)):
            per = {}
            for (h, n), (v, r) in hooks.items():
                if h == hook:
                    view = lay.view(n)
                    per[n] = (v, fn(view, n, r if lay.is_expert(n) else view.tokens))
            name, (measured, predicted) = max(per.items(), key=lambda kv: abs(kv[1][1] - kv[1][0]) / kv[1][0])
            checks.append((f"{hook}, worst linear ({name})", measured, predicted))
            checks.append((f"{hook}, largest", max(v for v, _ in per.values()), max(p for _, p in per.values())))
        held, pending = sm.held_peak(lay)
        checks.append((f"held layer inputs (peak - bare; {pending} chunk-forwards)", rec["peak"] - rec["bare"], held))
        for what, measured, predicted in checks:
            rel = abs(predicted - measured) / max(measured, 1)
            worst = max(worst, rel)
            rows.append((label, what, measured, predicted, rel))
        counts = {(who, what): n for who, what, n in rec["syncs"]}
        model = sm.host_syncs(lay)
        for what, measured, predicted in (
                ("SNIP's device-to-host syncs", counts.get(("ours", "read"), 0) + counts.get(("ours", "sized"), 0),
                 model["device_to_host"]),
                ("SNIP's host-to-device copies", counts.get(("ours", "h2d"), 0), model["host_to_device"]),
                ("Megatron's dispatcher syncs", counts.get(("dispatcher", "read"), 0) + counts.get(("dispatcher", "sized"), 0),
                 sm.dispatcher_syncs(lay))):
            mismatches += measured != predicted
            rows.append((label, what + " (count)", measured, predicted, None if measured == predicted else 1.0))
    return rows, worst, mismatches


# -- 3. the recipes ------------------------------------------------------------------------------
DSV3_LAYOUT = ((("embedding", "decoder"),) + (("decoder", "decoder"),) * 30 + (("mtp", "loss"),))
"""Megatron-Bridge's DeepSeek-V3 pipeline layout over 32 chunks, "Et|(tt|)*30mL" (0.6's
perf_recipes/deepseek/h100/deepseek_v3.py): the embedding with layer 1, thirty chunks of two
layers, the MTP layer with the loss. At PP=16 x VPP=2, rank r runs chunks r and r + 16."""
DSV3 = "DeepSeek-V3 (TP2 PP16 VPP2 EP64, DP32, SP, mbs 1, seq 4096, batch 4096, MTP 1)"


def deepseek_v3(quant: dict) -> sm.MeasureLayout:
    """DeepSeek-V3 as Megatron-Bridge 0.6's `deepseek_v3_pretrain_1024gpu_h100_bf16_config`
    (recipes/deepseek/h100/deepseek_v3.py: 1024 H100s, TP=2, PP=16, EP=64, ETP=1, SP, no recompute,
    micro-batch 1, global batch 4096, distributed optimizer with BF16 moments, one MTP layer) builds
    it from the Hugging Face config through its DeepSeek-V3 bridge: 61 layers (the first 3 dense),
    hidden 7168, FFN 18432, 128 heads, MLA (q_lora 1536, kv_lora 512, head dims 128 + 64 rope, v 128),
    256 routed experts of FFN 2048 top-8 and one shared expert (FFN 2048), vocab 129280; its MTP layer
    an MoE layer as the last decoder layer is. With the interleaved schedule: VPP=2 and Bridge's
    32-chunk layout (DSV3_LAYOUT; the recipe itself runs PP=16 without VPP, its perf recipe this
    layout at PP=8 x VPP=4). Its dispatcher: alltoall (the recipe asks for the flex dispatcher with
    HybridEP where the GPU has it, whose syncs are not modelled)."""
    from snip_megatron.models.gpt import MLADims, MoEDims

    shape = ModelShape(name="deepseek_v3", num_layers=61, hidden_size=7168, ffn_hidden_size=18432,
                       num_attention_heads=128, num_query_groups=128, vocab_size=129280, seq_length=4096,
                       kv_channels=128)
    return sm.MeasureLayout(
        shape=shape, mla=MLADims(q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
                                 v_head_dim=128),
        moe=MoEDims(num_experts=256, topk=8, ffn_hidden_size=2048, shared_ffn_hidden_size=2048,
                    layer_freq=(0,) * 3 + (1,) * 58),
        mtp_num_layers=1, tp=2, pp=16, vpp=2, pipeline_layout=DSV3_LAYOUT, dp=32, ep=64, etp=1,
        sequence_parallel=True, micro_batch_size=1, global_batch=4096, moment_bytes=2, quant_bytes=quant)


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


def chunk_label(lay: sm.MeasureLayout) -> str:
    """A rank's chunks, e.g. "L1 | L32, L33" or "L31 | MTP1" (empty chunks: "-")."""
    return " | ".join(", ".join(f"{'MTP' if k == 'mtp' else 'L'}{n}" for k, n in c) or "-" for c in lay.stage_chunks())


def stage_figures(lay: sm.MeasureLayout, rates: sm.GPURates) -> list:
    """(stage layout, memory, flops, dispatcher syncs) of every pipeline rank of a layout with a
    pipeline_layout; else the layout's own (its busiest stage's bound) alone."""
    ranks = lay.stages() if lay.pipeline_layout is not None else [lay]
    return [(r, sm.memory(r), sm.flops(r, rates), sm.dispatcher_syncs(r)) for r in ranks]


def print_deepseek_check(record: dict) -> tuple[float, int]:
    rows, worst, mismatches = compare_deepseek(record)
    case = record["case"]
    print(f"\nDeepSeek-style check ({case['shape']['num_layers']} layers + {case['mtp_num_layers']} MTP, MLA, "
          f"{case['moe']['num_experts']} experts top-{case['moe']['topk']} + shared, PP={case['pp']} x "
          f"VPP={case['vpp']}, 2 processes, float32; {record['seconds']} s), measured vs model (MB, counts):")
    for label, what, measured, predicted, rel in rows:
        if what.endswith("(count)") or what.startswith("planned units"):
            fig = f"{measured:8d} {predicted:8d}"
        else:
            fig = f"{measured / MB:8.3f} {predicted / MB:8.3f}"
        tail = "" if rel is None else f"{rel * 100:5.1f}%"
        if rel is not None and (what.endswith("(count)") or what.startswith("planned units")):
            tail = "DIFFERS"
        print(f"  {label:<34} {what:<58} {fig} {tail}")
    print(f"  memory figures within {worst * 100:.1f}%; {mismatches} counts or unit sets differ")
    return worst, mismatches


def main(argv=None) -> None:
    import json

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="skip the larger validation model")
    ap.add_argument("--deepseek", choices=("run", "recorded", "off"), default="recorded",
                    help="the small DeepSeek-style check: run it on two processes (and record it in "
                         f"{DS_CHECK_FILE.relative_to(DS_CHECK_FILE.parents[1])}), compare the model with that "
                         "record (the default), or skip it")
    ap.add_argument("--deepseek-worker", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.deepseek_worker:
        deepseek_worker(args.deepseek_worker)
        return
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
    print("\nvalidation (CPU, float32, one process), measured vs model, MB:")
    for label, what, measured, predicted, rel in rows:
        tail = f"{rel * 100:5.1f}%" if rel is not None else ""
        print(f"  {label:<54} {what:<48} {measured / MB:8.3f} {predicted / MB:8.3f} {tail}")
    ds_check = None
    if args.deepseek != "off":
        record = run_deepseek_check(quant) if args.deepseek == "run" else json.loads(DS_CHECK_FILE.read_text())
        ds_check = print_deepseek_check(record)
    rates = sm.GPURates()
    print(f"\nrecipes ({rates.name}: BF16 {rates.bf16:.0f}, FP8 {rates.fp8:.0f} TFLOP/s dense, "
          f"HBM {rates.hbm_tb_s} TB/s; the training step's linears at the FP8 rate, the initial plan):")
    result = {}
    for name, lay in recipes(quant).items():
        stages = stage_figures(lay, rates)
        top, mem, fl, _ = max(stages, key=lambda s: s[1]["extra_over_training"])
        syncs = sm.host_syncs(lay)
        biggest = max(mem["hooks"], key=mem["hooks"].get)
        where = f" (the busiest rank, {top.stage}: {chunk_label(top)})" if len(stages) > 1 else ""
        print(f"  {name}\n    measures {fl['measured_microbatches']} of {fl['microbatches']} micro-batches "
              f"per replica; extra memory over a training step {mem['extra_over_training'] / 1e9:.3f} GB{where} "
              f"(largest hook {biggest} {mem['hooks'][biggest] / 1e9:.3f} GB, AdamW read {mem['adam'] / 1e9:.3f} GB, "
              f"tables {mem['persistent'] / 1e6:.2f} MB); over a bare frozen pass "
              f"{mem['extra_over_frozen_pass'] / 1e9:.3f} GB ({mem['in_flight']} in flight, "
              f"{mem['held'] / 1e9:.3f} GB of held layer inputs)\n"
              f"    host syncs {syncs['device_to_host']} device-to-host + {syncs['host_to_device']} small "
              f"host-to-device copies; compute {fl['step_equiv']:.4f} training steps "
              f"({fl['measure_s']:.2f} s at peak rates against a {fl['step_s']:.1f} s step; "
              f"elementwise {fl['elementwise_s']:.2f} s)")
        if lay.moe is not None:
            moe_layers = max(r.moe_layers() if r.pipeline_layout is not None else r.stage_layers()["moe"]
                             for r, *_ in stages)
            print(f"    MoE: {len(lay.inventory)} planned units, {lay.local_experts} local experts per MoE layer "
                  f"(an expert unit's hooks run one expert at a time), {lay.expert_tokens} routed rows per "
                  f"expert per micro-batch (balanced); {sm.measurement_passes(lay)} passes x "
                  f"{fl['measured_microbatches']} micro-batches x {moe_layers} MoE layers on the busiest rank: "
                  f"{max(d for *_, d in stages)} syncs of Megatron's {lay.dispatcher} dispatcher (its own, one per "
                  f"MoE layer forward, as in each training micro-batch)")
        if len(stages) > 1:
            print("    per pipeline rank: chunks; extra over a training step, held layer inputs (chunk-forwards "
                  "in flight), GB; dispatcher syncs; compute, training steps")
            for r, m, f, d in stages:
                print(f"      {r.stage:2d} {chunk_label(r):<22} {m['extra_over_training'] / 1e9:6.3f} "
                      f"{m['held'] / 1e9:7.3f} ({m['in_flight']:2d}) {d:4d} {f['step_equiv']:.4f}")
        result[name] = (stages, syncs)
    stages, syncs = result[DSV3]
    lay = recipes(quant)[DSV3]
    extra = max(m["extra_over_training"] for _, m, _, _ in stages)
    check = f" ds_check_worst={ds_check[0]:.3f} ds_check_mismatches={ds_check[1]}" if ds_check else ""
    print(f"RESULT extra_gb_dsv3={extra / 1e9:.3f} "
          f"frozen_gb_dsv3={max(m['extra_over_frozen_pass'] for _, m, _, _ in stages) / 1e9:.3f} "
          f"syncs_dsv3={syncs['device_to_host'] + syncs['host_to_device']} "
          f"dispatcher_syncs_dsv3={max(d for *_, d in stages)} "
          f"step_equiv_dsv3={max(f['step_equiv'] for _, _, f, _ in stages):.4f} "
          f"units_dsv3={len(lay.inventory)} local_experts_dsv3={lay.local_experts} "
          f"expert_rows_dsv3={lay.expert_tokens}{check}")
    [(_, mem, fl, _)], syncs = result[next(n for n in result if n.startswith("70B (TP8"))]
    print(f"RESULT extra_gb_70b={mem['extra_over_training'] / 1e9:.3f} "
          f"syncs_70b={syncs['device_to_host'] + syncs['host_to_device']} step_equiv_70b={fl['step_equiv']:.4f} "
          f"model_error={worst:.3f}")


if __name__ == "__main__":
    main()
