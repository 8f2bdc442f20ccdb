"""Hooks on the planned linears that collect the statistics of one pass.

A pass is the forward and backward of every measured micro-batch, in one of four modes:
  clean      norms of X, W, Y, G_Y, G_X, G_W, quantization errors per precision and role, the
             first-order products, dY of the quantized forward GEMM and its per-token projection
             on G_Y, and <z, G_Y> for the curvature (on micro-batches that get forward noise);
  fwd_noise  s_l * z_l added to every layer output at once; <z, G~_Y>;
  bwd_noise  t_l * eta_l added to every layer's input gradient at once, with a zero loss
             gradient, so every G_Y is exactly the propagated noise; ||G_Y^T X||^2 and ||eta||^2;
  noise      fwd_noise on even micro-batches, bwd_noise on odd ones (independent micro-batches:
             one pass does the work of two on half the data).
Parameters get no gradients (measure.py freezes them; the decoder input requires grad instead).

At scale (docs/method.md section 10): only X waits for the backward (G_Y's hook does the rest on the
token sample; noise regenerated from its seed); weight errors a block of rows at a time; no host sync.
- Activation recompute: the no-grad first forward only injects the forward noise; the recompute
  registers the hooks, with the index of the oldest micro-batch waiting for its backward.
- SP / CP: token-sharded operands are gathered over TP and CP in token order before the sample
  (token_layout.py), local norms summed (reduce.py); an expert under CP by its router's counts.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import torch
import torch.distributed as dist

from snip_megatron.formats.precision import Precision
from snip_megatron.plan import LayerKey
from snip_megatron.stats import noise, token_layout, tokens, weights
from snip_megatron.stats.hook_tools import MicrobatchIds
from snip_megatron.stats.hook_tools import plain as _plain  # (benchmarks wrap collector._plain)
from snip_megatron.stats.accumulator import Accumulator
from snip_megatron.stats.quant_error import ErrorFn
from snip_megatron.models.inventory import ParallelKind

MODES = ("clean", "fwd_noise", "bwd_noise", "noise")


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class LinearProbe:
    """The hooks of one planned linear (a Megatron Column/RowParallelLinear or subclass)."""

    def __init__(self, key: LayerKey, module, collector: "Collector", noise_key: "LayerKey | None" = None,
                 expert: bool = False):
        self.key, self.module, self.c = key, module, collector
        # the key of its noise streams: the unit's, or for one expert of an MoE unit its own
        self.noise_key = key if noise_key is None else noise_key
        kind = ParallelKind(collector.kinds[key])
        self.column = kind is ParallelKind.COLUMN
        self.row = kind is ParallelKind.ROW
        # the group sharding its features: TP, or for a routed expert the expert-TP group. An
        # expert's rows are the tokens routed to it, whole on every expert-TP rank (Megatron's
        # dispatcher gathers them), so sequence parallelism does not split them; its row-parallel
        # output is a partial sum (the dispatcher's combine reduces it).
        g = collector.expert_group if expert else collector.dense_group
        self.tp_rank, self.tp_size, self.tp_group = g.rank, g.size, g.group
        self.cp_rank, self.cp_size, self.cp_group = (0, 1, None) if expert else \
            (collector.cp_rank, collector.cp_size, collector.cp_group)
        # ... but under context parallelism each CP rank's experts run its own tokens: the rows of
        # this forward (stats/expert_rows.py) say where they lie among the micro-batch's
        self.rows_of = None
        if expert and collector.cp_size > 1:
            if id(module) not in collector.expert_rows:
                raise ValueError(f"{key}: an expert under context parallelism without its router's rows")
            self.rows_of = collector.expert_rows[id(module)]
        self.partial_y = expert and self.row and self.tp_size > 1
        # ... and its column-parallel input gradient too (the dispatcher's backward reduces it)
        self.partial_gx = expert and self.column and self.tp_size > 1
        # duplicated (MLA's down-projections in the TE spec): the whole weight on every TP rank,
        # nothing sharded by features; under SP both X and Y hold this rank's tokens only
        w = module.weight
        tp = self.tp_size
        self.stride = int(getattr(module, "partition_stride", None) or getattr(w, "partition_stride", 1) or 1)
        self.k = w.shape[1] * (tp if self.row else 1)
        self.m = w.shape[0] * (tp if self.column else 1)
        # sequence parallelism: which operand is token-sharded
        sp = collector.sequence_parallel and not expert
        self.x_local = sp and not self.row
        self.y_local = sp and not self.column
        self.reset()
        self.handles = [module.register_forward_pre_hook(self._hook(self._pre)),
                        module.register_forward_hook(self._hook(self._post))]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def reset(self) -> None:
        self.ids = MicrobatchIds()
        self.current = (0, True)
        self.rows = None  # this forward's ExpertRows (an expert under CP)
        self.weights_done = False
        self.pending_ex = None  # (sample, {p: E_X}) of the clean micro-batch between its G_Y and G_X hooks

    # -- helpers -------------------------------------------------------------------------------
    def _hook(self, fn):
        return _plain(fn, self.c.errors, str(self.key))

    def _add(self, name: str, value, p: "Precision | None" = None) -> None:
        acc = self.c.acc
        acc.add(acc.row(self.key), acc.col(f"{name}.{p.value}" if p is not None else name), value)

    def _weight_group(self):
        """The TP group a weight's shards span (None: whole on this rank, as a duplicated one)."""
        return self.tp_group if self.tp_size > 1 and (self.column or self.row) else None

    def _err(self, t: torch.Tensor, p: Precision, role: str, sharded: bool) -> torch.Tensor:
        if not (sharded and self.tp_size > 1):
            return self.c.error_fn(t, p, role)
        if not self.column:  # a row-parallel X: sharded along the contraction dim
            return self.c.error_fn(t, p, role, group=self.tp_group)
        # a column-parallel G_Y: its columns are this rank's features (stochastic rounding draws
        # the whole G_Y's noise at them)
        return self.c.error_fn(t, p, role, group=self.tp_group, shard=(self.tp_rank, self.tp_size, self.stride))

    def _field(self, shape, mb: int, stream: int, side: str, device, rows=None) -> noise.NoiseField:
        """The noise of this rank's part of the layer's X (side "x") or Y (side "y"); `rows`: an
        expert's ExpertRows under CP (its rows' places among the micro-batch's)."""
        c = self.c
        features = self.column if side == "y" else self.row  # column: Y's features sharded; row: X's
        local = self.x_local if side == "x" else self.y_local
        if rows is not None:
            positions, full_len = rows.positions(device), rows.whole
        else:
            positions = noise.token_positions(shape[0], sp_rank=self.tp_rank if local else 0,
                                              sp_size=self.tp_size if local else 1, cp_rank=self.cp_rank,
                                              cp_size=self.cp_size, device=device)
            full_len = shape[0] * (self.tp_size if local else 1) * self.cp_size
        return noise.NoiseField(seed=c.seed, key=self.noise_key, microbatch=mb, stream=stream,
                                local_shape=tuple(int(d) for d in shape), tp_rank=self.tp_rank,
                                tp_size=self.tp_size, sharded=features,
                                stride=self.stride if side == "y" else 1,
                                positions=positions, full_len=full_len)

    def _gather(self, t2: torch.Tensor) -> torch.Tensor:
        """Rows of every TP rank, in rank order (= token order under sequence parallelism)."""
        if self.tp_size == 1:
            return t2
        out = t2.new_empty((t2.shape[0] * self.tp_size, t2.shape[1]))
        dist.all_gather_into_tensor(out, t2.contiguous(), group=self.tp_group)
        return out

    def _noise_dot(self, field: noise.NoiseField, g: torch.Tensor) -> torch.Tensor:
        if g.numel() == 0:  # an MoE expert routed no tokens
            return torch.zeros((), dtype=torch.float32, device=g.device)
        total = None
        for rows, z in field.chunks(g.device):
            d = torch.dot(z.reshape(-1), g[rows].reshape(-1).float())
            total = d if total is None else total + d
        return total

    @staticmethod
    def _plus_noise(t: torch.Tensor, field: noise.NoiseField, scale: torch.Tensor) -> torch.Tensor:
        """t + scale * noise, the noise assembled block by block in t's dtype (+-1 is exact)."""
        if t.numel() == 0:  # an MoE expert routed no tokens
            return t
        blocks = field.chunks(t.device)
        rows, part = next(blocks)
        if rows.stop == t.shape[0] and t.is_contiguous():  # one block: it is the noise tensor
            z = part.to(t.dtype)
        else:
            z = torch.empty_like(t)
            z[rows] = part.to(t.dtype)
            for rows, part in blocks:
                z[rows] = part.to(t.dtype)
        return z.mul_(scale).add_(t)  # in place: one tensor the size of t

    # -- hooks ---------------------------------------------------------------------------------
    def _pre(self, module, args):
        c = self.c
        if c.mode is None:
            return None
        local, grad = self.ids.forward()
        self.current = mb, grad = c.step_microbatch(local), grad
        if self.rows_of is not None:  # its router has just run this forward
            layer_rows, expert = self.rows_of
            self.rows = layer_rows.rows(expert)
        if not grad:  # first forward of a checkpointed layer: statistics come from its recompute
            return None
        x = args[0]
        if not x.requires_grad:  # parameters are frozen: make the input a leaf so gradients flow
            x = x.detach().requires_grad_(True)
        else:  # a node of its own: G_X is this linear's dgrad, not the sum over every linear that
            x = x.view_as(x)  # reads the same tensor (MLA's down-projections share their input)
        mode = c.mode_of(mb)
        if mode == "clean":
            self._add("x_sq", tokens.sum_sq(x.detach()))
            self._add("n", float(_rows(x).shape[0]))
            x.register_hook(self._hook(functools.partial(self._on_gx_clean, mb, self.rows)))
        elif mode == "bwd_noise":
            t = c.scales[c.acc.row(self.key), 1]
            self._add("bwd_eta_sq", t * t * float(x.numel()))  # +-1 entries: ||t eta||^2 = t^2 numel
            if not (self.partial_gx and self.tp_rank > 0):  # partial sums: the noise goes in once
                field = self._field(x.shape, mb, noise.BACKWARD, "x", x.device, self.rows)
                x.register_hook(self._hook(lambda g: self._plus_noise(g, field, t)))
        return (x,) + tuple(args[1:])

    def _post(self, module, args, output):
        c = self.c
        if c.mode is None:
            return None
        y, rest = (output[0], tuple(output[1:])) if isinstance(output, tuple) else (output, None)
        mb, grad = self.current
        mode = c.mode_of(mb)
        if mode == "fwd_noise":  # in both forwards of a checkpointed layer, so the recompute matches
            if self.partial_y and self.tp_rank > 0:  # a partial sum: the noise goes in once, on rank 0
                return None
            field = self._field(y.shape, mb, noise.FORWARD, "y", y.device, self.rows)
            y = self._plus_noise(y, field, c.scales[c.acc.row(self.key), 0])
            if grad:
                self._add("fwd_z_sq", float(y.numel()))
                y.register_hook(self._hook(lambda g: self._add("fwd_zg_noisy", self._noise_dot(field, g))))
            return (y,) + rest if rest is not None else y
        if not grad:
            return None
        x = args[0]
        if mode == "clean":
            self._add("y_sq", tokens.sum_sq(self._full_output(y.detach())))
            y.register_hook(self._hook(functools.partial(self._on_gy_clean, mb, x, self.rows)))
        else:  # bwd_noise: G_Y is the propagated noise only (zero loss gradient)
            y.register_hook(self._hook(functools.partial(self._on_gy_bwd_noise, x, self.rows)))
        return None

    def _full_output(self, y: torch.Tensor) -> torch.Tensor:
        """Y itself, or an expert's row-parallel partial sums added over expert TP (Megatron's
        experts leave that reduction to the token dispatcher's combine)."""
        if not self.partial_y:
            return y
        y = y.clone()
        dist.all_reduce(y, group=self.tp_group)
        return y

    # -- backward: the clean pass --------------------------------------------------------------
    def _full_tokens(self, x, g, rows=None):
        """X and G_Y as [tokens, features] rows over every token of the micro-batch, in its order
        (an expert under CP: the micro-batch's rows of the expert, gathered by its `rows`)."""
        x2, g2 = _rows(x.detach()), _rows(g)
        if rows is not None:
            return rows.gather(x2), rows.gather(g2)
        x2, g2 = (self._gather(x2) if self.x_local else x2), (self._gather(g2) if self.y_local else g2)
        return tuple(token_layout.gather_cp_rows(t, self.cp_size, self.cp_group) for t in (x2, g2))

    def _on_gy_clean(self, mb: int, x: torch.Tensor, rows, g: torch.Tensor) -> None:
        c = self.c
        self._add("gy_sq", tokens.sum_sq(g))
        if c.gets_forward_noise(mb):
            gz, zmb = c.forward_noise_part(g, mb)
            self._add("fwd_zg_clean", self._noise_dot(self._field(gz.shape, zmb, noise.FORWARD, "y", g.device, rows),
                                                      gz))
        x2, g2 = self._full_tokens(x, g, rows)
        n, dev = x2.shape[0], x2.device
        if n == 0:  # an MoE expert routed no tokens: no GEMM, nothing to add (weights: weight_stats)
            self.pending_ex = None
            return
        fwd = tokens.sample_rows(n, c.token_stride, dev)
        bwd = tokens.sample_rows(n, c.grad_token_stride, dev)
        xs, gs = fwd.take(x2), fwd.take(g2)
        xb, gb = bwd.take(x2), bwd.take(g2)
        ex = {}
        for p in c.precisions:
            ex[p] = self._err(xs, p, "fprop_input", self.row)
            self._add("ex", fwd.scale * tokens.sum_sq(ex[p]), p)
            self._add("ex_w", bwd.scale * tokens.sum_sq(self._err(xb, p, "wgrad_input", self.row)), p)
            self._add("egy_d", bwd.scale * tokens.sum_sq(self._err(gb, p, "dgrad_grad_output", self.column)), p)
            self._add("egy_w", bwd.scale * tokens.sum_sq(self._err(gb, p, "wgrad_grad_output", self.column)), p)
        del xb, gb
        self.pending_ex = (fwd, ex) if c.first_order else None
        # G_W on a token sample of at least two chunks (the estimate's cross term needs them)
        gw_sample = fwd if fwd.rows is None or fwd.picked >= 2 else tokens.sample_rows(n, 1, dev)
        gw_norm = tokens.WgradNormEstimate(g2, x2, gw_sample)
        gws_x, gws_g = (xs, gs) if gw_sample is fwd else (gw_sample.take(x2), gw_sample.take(g2))
        along = {p: torch.zeros(xs.shape[0], dtype=torch.float32, device=dev) for p in c.precisions}
        gw_sampled_sq = torch.zeros((), dtype=torch.float32, device=dev)
        first = not self.weights_done
        self.weights_done = True
        roles = {p: ("fprop_weight", "dgrad_weight") if first else ("fprop_weight",) for p in c.precisions}
        for rows, w_blk, errs in weights.error_blocks(self.module.weight, c.error_fn, roles,
                                                      group=self._weight_group()):
            if first:
                self._weight_norms(w_blk, errs)
            gw_blk = gws_g[:, rows].t() @ gws_x  # wgrad G_W = G_Y^T X, on the sample, these rows
            gw_sampled_sq = gw_sampled_sq + tokens.sum_sq(gw_blk)
            for p in c.precisions:
                e = errs[p]["fprop_weight"]
                self._add("gw_ew", gw_sample.scale * tokens.dot(gw_blk, e), p)
                # dY = Q(X) Q(W)^T - X W^T on the token sample, these output features
                dy = torch.addmm(xs @ e.t(), ex[p], (w_blk + e).t())  # fused: no third temporary
                if self.row and self.tp_size > 1:  # a row-parallel layer's partial products
                    dist.all_reduce(dy, group=self.tp_group)
                self._add("dy_sq", fwd.scale * tokens.sum_sq(dy), p)
                along[p] += (gs[:, rows] * dy).sum(1)  # <G_Y,t, dY_t> per sampled token
                del dy  # before the next precision's
            del gw_blk, errs
        for p in c.precisions:
            if self.column and self.tp_size > 1:  # G_Y and dY are column shards
                dist.all_reduce(along[p], group=self.tp_group)
            self._add("gdy_sq", fwd.scale * tokens.sum_sq(along[p]), p)
        self._add("gw_sq", gw_norm.value(gw_sampled_sq))

    def _weight_norms(self, w_blk: torch.Tensor, errs: dict) -> None:
        self._add("w_sq", tokens.sum_sq(w_blk))
        for p, e in errs.items():
            self._add("ew", tokens.sum_sq(e["fprop_weight"]), p)
            self._add("ew_d", tokens.sum_sq(e["dgrad_weight"]), p)

    def weight_stats(self) -> None:
        """||W||^2 and its errors, on a rank whose replica measured no micro-batch (a measured
        one takes them in its first backward hook)."""
        if self.weights_done:
            return
        self.weights_done = True
        roles = {p: ("fprop_weight", "dgrad_weight") for p in self.c.precisions}
        for _, w_blk, errs in weights.error_blocks(self.module.weight, self.c.error_fn, roles,
                                                   group=self._weight_group()):
            self._weight_norms(w_blk, errs)

    def _on_gx_clean(self, mb: int, rows, g: torch.Tensor) -> None:
        if self.partial_gx:  # an expert's partial input gradient: the whole one
            g = g.clone()
            dist.all_reduce(g, group=self.tp_group)
        self._add("gx_sq", tokens.sum_sq(g))
        if self.pending_ex is None:
            return
        sample, ex = self.pending_ex
        self.pending_ex = None
        g2 = _rows(g)
        sp = (self.tp_rank, self.tp_size) if self.x_local else (0, 1)
        # this rank's tokens are rows of the micro-batch's sample (whose errors E_X were taken)
        segments = rows.segments() if rows is not None else \
            token_layout.row_segments(g2.shape[0], sp_rank=sp[0], sp_size=sp[1], cp_rank=self.cp_rank,
                                      cp_size=self.cp_size)
        for seg in segments:
            j0, j1 = sample.count_below(seg.whole), sample.count_below(seg.whole + seg.rows)
            part = g2[seg.local:seg.local + seg.rows] if sample.rows is None else \
                g2.index_select(0, sample.rows[j0:j1] - seg.whole + seg.local)
            gs = part.float()
            for p, e in ex.items():
                self._add("gx_ex", sample.scale * tokens.dot(gs, e[j0:j1]), p)

    # -- backward: the backward-noise pass -----------------------------------------------------
    def _on_gy_bwd_noise(self, x: torch.Tensor, rows, g: torch.Tensor) -> None:
        x2, g2 = self._full_tokens(x, g, rows)
        n, dev = x2.shape[0], x2.device
        if n == 0:  # an MoE expert routed no tokens
            return
        sample = tokens.sample_rows(n, self.c.token_stride, dev, min_chunks=2)
        estimate = tokens.WgradNormEstimate(g2, x2, sample)
        xs, gs = sample.take(x2), sample.take(g2)
        sampled_sq = torch.zeros((), dtype=torch.float32, device=dev)
        m_rows = gs.shape[1]
        step = weights.block_rows(m_rows, xs.shape[1])
        for r0 in range(0, m_rows, step):
            sampled_sq = sampled_sq + tokens.sum_sq(gs[:, r0:r0 + step].t() @ xs)
        self._add("bwd_dgw_sq", estimate.value(sampled_sq))


@dataclasses.dataclass(frozen=True)
class ShardGroup:
    """The process group that shards a linear's features (TP, or expert TP), and this rank's place."""
    rank: int
    size: int
    group: object


class Collector:
    """Attach probes to a rank's planned linears; `begin(mode)` ... run a pass ... `end()`."""

    def __init__(self, linears: list, *, keys, kinds, error_fn: ErrorFn, precisions=None,
                 seed: int = 0, first_order: bool = True, tp_rank: int = 0, tp_size: int = 1,
                 tp_group=None, token_stride: int = 1, grad_token_stride: int = 1,
                 interleave_noise: bool = False, noise_on_halves: bool = False,
                 sequence_parallel: bool = False, cp_rank: int = 0, cp_size: int = 1, cp_group=None,
                 device=None,
                 step_positions: "list[int] | None" = None, expert_keys=(),
                 expert_group: "ShardGroup | None" = None, ep_rank: int = 0, expert_rows=None):
        from snip_megatron.stats.table import CANDIDATES

        self.precisions = tuple(Precision.parse(p) for p in (precisions or CANDIDATES))
        self.keys = list(keys)  # every planned linear of the model: the table's rows
        self.kinds = dict(kinds)  # LayerKey -> ParallelKind of this rank's linears
        self.error_fn, self.seed, self.first_order = error_fn, seed, first_order
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.dense_group = ShardGroup(tp_rank, tp_size, tp_group)
        # routed experts: their keys, the expert-TP group, and the EP rank, whose local expert i is
        # global expert ep_rank x (local experts) + i (Megatron's numbering), which keys its noise
        self.expert_keys = {LayerKey(*k) for k in expert_keys}
        self.expert_group = expert_group or ShardGroup(0, 1, None)
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.cp_rank, self.cp_size, self.cp_group = cp_rank, cp_size, cp_group
        # under CP: {id(expert module): (its layer's LayerRows, local expert index)} (stats/expert_rows.py)
        self.expert_rows = dict(expert_rows or {})
        self.token_stride, self.grad_token_stride = token_stride, grad_token_stride
        self.interleaved = interleave_noise  # the noise passes run as one "noise" pass
        # ... on micro-batches cut in two along the batch dim (the clean pass keeps them whole)
        self.halves = noise_on_halves
        if noise_on_halves and not interleave_noise:
            raise ValueError("noise_on_halves needs interleave_noise")
        # the step-wide position of each micro-batch this rank measures (microbatches.step_positions):
        # noise and the interleaving follow the sample, not the rank; None: 0, 1, ...
        self.positions = None if step_positions is None else list(step_positions)
        if device is None:
            device = linears[0][1].weight.device if linears else torch.device("cpu")
        self.device = torch.device(device)
        self.mode = None
        self.scales = None  # [rows + 1, 2] device tensor: s (forward), t (backward) per layer row
        self.acc = Accumulator(self.keys, self.precisions, self.device)
        self.errors: list[str] = []  # exceptions the hooks caught, "<layer>: <type>: <message>"
        # several modules of one key (the local experts of an MoE unit) add into its row; each has
        # noise of its own, so the experts' noise is independent as a grouped GEMM's rows would be
        counts = collections.Counter(LayerKey(*k) for k, _ in linears)
        seen: collections.Counter = collections.Counter()
        self.probes = []
        for k, m in linears:
            k = LayerKey(*k)
            expert = k in self.expert_keys
            if expert:  # numbered globally, so any EP layout draws the noise one process draws
                noise_key = LayerKey(k.layer, f"{k.name}_{ep_rank * counts[k] + seen[k]}")
            else:
                noise_key = None if counts[k] == 1 else LayerKey(k.layer, f"{k.name}_{seen[k]}")
            seen[k] += 1
            self.probes.append(LinearProbe(k, m, self, noise_key, expert=expert))

    def begin(self, mode: str, acc: "Accumulator | None" = None) -> Accumulator:
        """Start a pass; statistics accumulate into `acc` (a fresh one by default)."""
        if mode not in MODES:
            raise ValueError(f"unknown collector mode {mode!r}; valid: {', '.join(MODES)}")
        if mode != "clean" and (mode == "noise") != self.interleaved:
            raise ValueError(f"noise pass {mode!r} does not match this collector: interleave_noise="
                             f"{self.interleaved} runs " + ("one 'noise' pass" if self.interleaved
                                                           else "'fwd_noise' and 'bwd_noise'"))
        if mode != "clean" and self.scales is None:
            raise ValueError(f"noise pass {mode} needs noise scales from a clean pass (set_scales)")
        self.acc = acc if acc is not None else Accumulator(self.keys, self.precisions, self.device)
        for p in self.probes:
            p.reset()
            row = self.acc.row(p.key)
            self.acc.set_host(row, self.acc.col("present"), 1.0)
            self.acc.set_host(row, self.acc.col("k"), float(p.k))
            self.acc.set_host(row, self.acc.col("m"), float(p.m))
        self.mode = mode
        return self.acc

    def step_microbatch(self, mb: int) -> int:
        """The step-wide index of this rank's micro-batch `mb` in the current pass (with halves,
        noise micro-batch 2i + h is half h of clean micro-batch i)."""
        if self.positions is None:
            return mb
        if self.mode == "noise" and self.halves:
            i, half = divmod(mb, 2)
            return 2 * self.positions[i] + half
        return self.positions[mb]

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

    def end(self) -> Accumulator:
        self.mode = None
        for p in self.probes:
            p.reset()
        return self.acc

    def set_scales(self, reduced_clean: torch.Tensor, noise_frac: float, bwd_noise_frac: float) -> None:
        """Noise scales from the TP/DP-reduced clean statistics (a table tensor, on the device):
        s = frac * rms(Y), t = frac * rms(G_X)."""
        col = self.acc.col
        r = reduced_clean
        n = r[:, col("n")]
        s = noise_frac * (r[:, col("y_sq")] / (n * r[:, col("m")]).clamp(min=1.0)).sqrt()
        t = bwd_noise_frac * (r[:, col("gx_sq")] / (n * r[:, col("k")]).clamp(min=1.0)).sqrt()
        self.scales = torch.stack([s, t], 1)

    def remove(self) -> None:
        for p in self.probes:
            p.remove()
