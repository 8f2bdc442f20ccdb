"""Hooks on the planned linears that collect the statistics of one pass.

A pass is the forward and backward of every micro-batch of the measured step, in one of four
modes:
  clean      norms of X, W, Y, G_Y, G_X, G_W, quantization errors per precision and role, the
             first-order inner products, the output error dY of the quantized forward GEMM and its
             per-token projection on G_Y, and <z, G_Y> for the curvature (on the micro-batches
             that will get forward noise);
  fwd_noise  s_l * z_l added to every layer output at once; <z, G~_Y>;
  bwd_noise  t_l * eta_l added to every layer's input gradient at once, with a zero loss
             gradient, so every G_Y is exactly the propagated noise; ||G_Y^T X||^2 and ||eta||^2;
  noise      both noise passes in one: fwd_noise on even micro-batches, bwd_noise on odd ones
             (micro-batches are independent, so one pass does the work of two on half the data).
Parameters never get gradients here: measure.py freezes them and makes layer inputs leaves.
"""

from __future__ import annotations

import functools

import torch

from snip_megatron.formats.precision import Precision
from snip_megatron.plan import LayerKey
from snip_megatron.stats import noise
from snip_megatron.stats.quant_error import ErrorFn
from snip_megatron.stats.reduce import COLUMN_PARALLEL
from snip_megatron.stats.table import StatsTable, precision_field

MODES = ("clean", "fwd_noise", "bwd_noise", "noise")


TOKEN_CHUNK = 16  # error subsampling keeps whole chunks of consecutive tokens, so NVFP4 blocks and
# its 16-point Hadamard along tokens see their real neighbours; small chunks spread the sample over
# all sequence positions (a position-clustered sample is biased: early positions differ)


def _token_subsample(t2: torch.Tensor, stride: int) -> tuple[torch.Tensor, float]:
    """Every stride-th chunk of TOKEN_CHUNK rows, and the factor that scales its sums back up."""
    n = t2.shape[0]
    if stride == 1 or n < stride * TOKEN_CHUNK:
        return t2, 1.0
    keep = torch.arange(n, device=t2.device)
    keep = keep[(keep // TOKEN_CHUNK) % stride == 0]
    return t2.index_select(0, keep), n / keep.numel()


def _plain(fn):
    """Run a hook without the CPU shim's TorchFunctionMode (megatron/cpu_shim.py): the statistics
    create no CUDA tensors, and the mode's per-op Python dispatch is a large part of their cost."""
    from snip_megatron.megatron import cpu_shim

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with cpu_shim.suspended():
            return fn(*args, **kwargs)

    return run


def _sq(t: torch.Tensor) -> float:
    return float(t.float().pow(2).sum())


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() * b.float()).sum())


class LinearProbe:
    """The hooks of one planned linear (a Megatron Column/RowParallelLinear or subclass)."""

    def __init__(self, key: LayerKey, module, collector: "Collector"):
        self.key, self.module, self.c = key, module, collector
        self.column = key.name in COLUMN_PARALLEL
        w = module.weight
        tp = collector.tp_size
        self.stride = int(getattr(w, "partition_stride", 1) or 1)
        self.k = w.shape[1] * (1 if self.column else tp)
        self.m = w.shape[0] * (tp if self.column else 1)
        self.calls = 0
        self.w_errors: dict = {}
        self.w_quantized: dict = {}  # precision -> Q(W) = W + E_W, for dY of every micro-batch
        self.pending_dy: dict = {}  # micro-batch -> {precision: dY on the token sample}, until its backward
        self.handles = [module.register_forward_pre_hook(_plain(self._pre)),
                        module.register_forward_hook(_plain(self._post))]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def reset(self) -> None:
        self.calls = 0
        self.w_errors = {}
        self.w_quantized = {}
        self.pending_dy = {}

    # -- helpers -------------------------------------------------------------------------------
    def _add(self, name: str, value: float, p: "Precision | None" = None) -> None:
        self.c.table.add(self.key, precision_field(name, p) if p is not None else name, value)

    def _noise(self, shape, mb: int, stream: int, sharded: bool, stride: int, like: torch.Tensor):
        return noise.layer_noise(shape, seed=self.c.seed, key=self.key, microbatch=mb, stream=stream,
                                 tp_rank=self.c.tp_rank, tp_size=self.c.tp_size, sharded=sharded,
                                 stride=stride, device=like.device)

    def _err(self, t: torch.Tensor, p: Precision, role: str, sharded: bool) -> torch.Tensor:
        group = self.c.tp_group if sharded and self.c.tp_size > 1 else None
        return self.c.error_fn(t, p, role, group=group)

    def _output_error(self, xs: torch.Tensor, ex: torch.Tensor, p: Precision) -> torch.Tensor:
        """dY = Q(X) Q(W)^T - X W^T on the token sample; a row-parallel layer's partial products
        are summed over TP, as its output is."""
        dy = ex @ self.w_quantized[p].t() + xs @ self.w_errors[p].t()
        if not self.column and self.c.tp_size > 1:
            torch.distributed.all_reduce(dy, group=self.c.tp_group)
        return dy

    def _weight_stats(self) -> None:
        w = self.module.weight.detach().float()
        self._add("w_sq", _sq(w))
        for p in self.c.precisions:
            e = self._err(w, p, "fprop_weight", True)
            self._add("ew", _sq(e), p)
            self._add("ew_d", _sq(self._err(w, p, "dgrad_weight", True)), p)
            self.w_errors[p] = e
            self.w_quantized[p] = w + e

    # -- hooks ---------------------------------------------------------------------------------
    def _pre(self, module, args):
        if self.c.mode is None:
            return None
        x = args[0]
        if not x.requires_grad:  # parameters are frozen: make the input a leaf so gradients flow
            x = x.detach().requires_grad_(True)
        mb = self.calls
        self.calls += 1
        gmb = self.c.global_microbatch(mb)
        mode = self.c.mode_of(gmb)
        if mode == "clean":
            x2 = x.detach().reshape(-1, x.shape[-1]).float()
            if mb == 0:
                self._weight_stats()
            self._add("x_sq", _sq(x2))
            self._add("n", float(x2.shape[0]))
            stride = self.c.token_stride
            xs, scale = _token_subsample(x2, stride)
            xb, scale_b = _token_subsample(x2, self.c.grad_token_stride)
            e_fprop, dys = {}, {}
            for p in self.c.precisions:
                e = self._err(xs, p, "fprop_input", not self.column)
                self._add("ex", scale * _sq(e), p)
                self._add("ex_w", scale_b * _sq(self._err(xb, p, "wgrad_input", not self.column)), p)
                if self.c.first_order:
                    e_fprop[p] = e
                dys[p] = self._output_error(xs, e, p)
                self._add("dy_sq", scale * _sq(dys[p]), p)
            self.pending_dy[mb] = dys

            def on_gx(g):
                self._add("gx_sq", _sq(g))
                gs, _ = _token_subsample(g.reshape(-1, g.shape[-1]), stride)
                for p, e in e_fprop.items():
                    self._add("gx_ex", scale * _dot(gs, e), p)

            x.register_hook(_plain(on_gx))
        elif mode == "bwd_noise":
            t = self.c.scales[self.key][1]
            eta = self._noise(x.shape, gmb, noise.BACKWARD, not self.column, 1, x) * t
            self._add("bwd_eta_sq", _sq(eta))
            x.register_hook(lambda g: g + eta.to(g.dtype))
        return (x,) + tuple(args[1:])

    def _post(self, module, args, output):
        if self.c.mode is None:
            return None
        y, rest = (output[0], tuple(output[1:])) if isinstance(output, tuple) else (output, None)
        x = args[0]
        mb = self.calls - 1
        gmb = self.c.global_microbatch(mb)
        mode = self.c.mode_of(gmb)
        if mode == "clean":
            self._add("y_sq", _sq(y.detach()))

            def on_gy(g):
                g2 = g.reshape(-1, g.shape[-1]).float()
                x2 = x.detach().reshape(-1, x.shape[-1]).float()
                self._add("gy_sq", _sq(g2))
                gs, scale = _token_subsample(g2, self.c.token_stride)
                for p, dy in self.pending_dy.pop(mb, {}).items():
                    along = (gs * dy).sum(1)  # <G_Y,t, dY_t> per sampled token
                    if self.column and self.c.tp_size > 1:  # G_Y and dY are column shards
                        torch.distributed.all_reduce(along, group=self.c.tp_group)
                    self._add("gdy_sq", scale * _sq(along), p)
                gb, scale_b = _token_subsample(g2, self.c.grad_token_stride)
                for p in self.c.precisions:
                    self._add("egy_d", scale_b * _sq(self._err(gb, p, "dgrad_grad_output", self.column)), p)
                    self._add("egy_w", scale_b * _sq(self._err(gb, p, "wgrad_grad_output", self.column)), p)
                gw = g2.t() @ x2  # wgrad: G_W = G_Y^T X
                self._add("gw_sq", _sq(gw))
                for p, e in self.w_errors.items():
                    self._add("gw_ew", _dot(gw, e), p)
                if self.c.gets_forward_noise(gmb):
                    gz, zmb = self.c.forward_noise_part(g, gmb)
                    z = self._noise(gz.shape, zmb, noise.FORWARD, self.column, self.stride, g)
                    self._add("fwd_zg_clean", _dot(z, gz))

            y.register_hook(_plain(on_gy))
            return None
        if mode == "fwd_noise":
            z = self._noise(y.shape, gmb, noise.FORWARD, self.column, self.stride, y)
            self._add("fwd_z_sq", _sq(z))
            y = y + (self.c.scales[self.key][0] * z).to(y.dtype)
            y.register_hook(_plain(lambda g: self._add("fwd_zg_noisy", _dot(z, g))))
            return (y,) + rest if rest is not None else y
        # bwd_noise: G_Y is the propagated noise only (zero loss gradient)

        def on_dgy(g):
            g2 = g.reshape(-1, g.shape[-1]).float()
            self._add("bwd_dgw_sq", _sq(g2.t() @ x.detach().reshape(-1, x.shape[-1]).float()))

        y.register_hook(_plain(on_dgy))
        return None


class Collector:
    """Attach probes to a rank's planned linears; `begin(mode)` ... run a pass ... `end()`."""

    def __init__(self, linears: list, *, num_layers: int, error_fn: ErrorFn, precisions=None,
                 seed: int = 0, first_order: bool = True, tp_rank: int = 0, tp_size: int = 1,
                 tp_group=None, token_stride: int = 1, grad_token_stride: int = 1,
                 interleave_noise: bool = False,
                 noise_on_halves: bool = False, microbatch_offset: int = 0, microbatch_stride: int = 1):
        from snip_megatron.plan import all_keys
        from snip_megatron.stats.table import CANDIDATES

        self.precisions = tuple(Precision.parse(p) for p in (precisions or CANDIDATES))
        self.keys = all_keys(num_layers)
        self.error_fn, self.seed, self.first_order = error_fn, seed, first_order
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.token_stride, self.grad_token_stride = token_stride, grad_token_stride
        self.interleaved = interleave_noise  # the noise passes run as one "noise" pass
        # ... on micro-batches cut in two along the batch dim (the clean pass keeps them whole)
        self.halves = noise_on_halves
        if noise_on_halves and not interleave_noise:
            raise ValueError("noise_on_halves needs interleave_noise")
        # This rank's micro-batch i is the step's micro-batch offset + stride * i (a data-parallel
        # rank's share, in Megatron's sampler order): noise and the interleaving follow the sample,
        # so a DP=2 step gets the noise a single process gives the same samples.
        self.microbatch_offset, self.microbatch_stride = microbatch_offset, microbatch_stride
        self.mode = None
        self.scales: dict = {}
        self.table = StatsTable(keys=self.keys, precisions=self.precisions)
        self.probes = [LinearProbe(LayerKey(*k), m, self) for k, m in linears]

    def begin(self, mode: str, table: "StatsTable | None" = None) -> StatsTable:
        """Start a pass; statistics accumulate into `table` (a fresh one by default)."""
        if mode not in MODES:
            raise ValueError(f"unknown collector mode {mode!r}; valid: {', '.join(MODES)}")
        if mode != "clean" and (mode == "noise") != self.interleaved:
            raise ValueError(f"noise pass {mode!r} does not match this collector: interleave_noise="
                             f"{self.interleaved} runs " + ("one 'noise' pass" if self.interleaved
                                                           else "'fwd_noise' and 'bwd_noise'"))
        missing = [p.key for p in self.probes if mode != "clean" and p.key not in self.scales]
        if missing:
            raise ValueError(f"noise pass {mode} needs noise scales from a clean pass for {missing[:3]}")
        self.table = table if table is not None else StatsTable(keys=self.keys, precisions=self.precisions)
        for p in self.probes:
            p.reset()
            self.table.set(p.key, "present", 1.0)
            self.table.set(p.key, "k", float(p.k))
            self.table.set(p.key, "m", float(p.m))
        self.mode = mode
        return self.table

    def global_microbatch(self, mb: int) -> int:
        """The step-wide index of this rank's micro-batch `mb` in the current pass (with halves,
        noise micro-batch 2i + h is half h of clean micro-batch i)."""
        if self.mode == "noise" and self.halves:
            i, half = divmod(mb, 2)
            return 2 * (self.microbatch_offset + self.microbatch_stride * i) + half
        return self.microbatch_offset + self.microbatch_stride * mb

    def mode_of(self, mb: int) -> str:
        """The mode of (step-wide) micro-batch `mb` in the current pass."""
        if self.mode == "noise":
            return "fwd_noise" if mb % 2 == 0 else "bwd_noise"
        return self.mode

    def gets_forward_noise(self, mb: int) -> bool:
        """Whether (part of) clean micro-batch `mb` gets forward noise (then the clean pass keeps
        <z, G_Y> for it): all of them, every other one, or with halves the first half of each."""
        return not self.interleaved or self.halves or mb % 2 == 0

    def forward_noise_part(self, g: torch.Tensor, mb: int) -> tuple[torch.Tensor, int]:
        """The rows of clean micro-batch `mb`'s G_Y that get forward noise, and their micro-batch
        index in the noise pass. With halves, noise micro-batch 2 mb is the first half of clean
        micro-batch mb along the batch dim (Megatron's [s, b, h] activations)."""
        if not self.halves:
            return g, mb
        if g.dim() != 3 or g.shape[1] < 2:
            raise ValueError(f"noise on micro-batch halves needs [seq, batch, hidden] activations with "
                             f"batch >= 2, got shape {tuple(g.shape)}; set MeasureConfig(interleave_noise=False)")
        return g[:, : g.shape[1] // 2], 2 * mb

    def end(self) -> StatsTable:
        self.mode = None
        for p in self.probes:
            p.reset()
        return self.table

    def set_scales(self, reduced_clean: StatsTable, noise_frac: float, bwd_noise_frac: float) -> None:
        """Noise scales from the TP/DP-reduced clean statistics: s = frac * rms(Y), t = frac * rms(G_X)."""
        for p in self.probes:
            r = reduced_clean.row(p.key)
            s = noise_frac * (r["y_sq"] / max(r["n"] * r["m"], 1.0)) ** 0.5
            t = bwd_noise_frac * (r["gx_sq"] / max(r["n"] * r["k"], 1.0)) ** 0.5
            self.scales[p.key] = (s, t)

    def remove(self) -> None:
        for p in self.probes:
            p.remove()
