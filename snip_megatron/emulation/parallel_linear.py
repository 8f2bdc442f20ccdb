"""Megatron local Column/RowParallelLinear whose GEMMs run in a planned precision (emulated).

Drop-in subclasses (same constructor) for Megatron's local layer spec. The precision comes from
`finish_init(quant_config)` (GPTModel.__init__ calls it with the module's match from
`TransformerConfig.quant_recipe`) and, when re-planning, from `set_precision`, which keeps the same
nn.Parameter objects. In BF16 the parent's forward runs unchanged, so the layer is bit-identical to
Megatron's own.

Tensor parallelism: each rank quantizes its shard, so blocks never straddle shards; per-tensor
amaxes (NVFP4 global scale, tensorwise FP8) are all-reduced over the TP group, as Transformer Engine
does; stochastic-rounding noise is the whole gradient's, counted from its first column
(formats/sr_noise.py). TP=N then reproduces TP=1 exactly when every sharded dimension is a
multiple of the block length along it (e.g. 128 for FP8 blockwise, 16 for NVFP4): a misaligned
shard pads its last block, and a warning says so.

Stochastic rounding draws its seeds from one dedicated stream per layer, counted on the host
(formats/sr_noise.py SeedStream: no device sync, the same seeds on CPU and GPU), never from the
global RNG streams. Its seed is `quant_config.config["sr_seed"]` if given, else a CRC32 of the module
path Megatron passes to finish_init, else the layer's construction index; so every TP rank of a
layer, and the TP=1 run, draw the same bits.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
import zlib

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
)

from snip_megatron.emulation import forward_impl
from snip_megatron.emulation.quantized_linear import QuantRuntime, quantized_linear
from snip_megatron.formats import Formats, FormatSpec, Precision, Role
from snip_megatron.formats.sr_noise import SeedStream

FORMAT_KEYS = ("fp8_recipe", "fp4_recipe", "fp8_format", "fp8_block_scales", "fp4_gradient_rounding")
"""Formats fields a quant_recipe config may carry (the others keep the layer's formats)."""
CONFIG_KEYS = ("precision", *FORMAT_KEYS, "sr_seed")
_CONSTRUCTED = itertools.count()


class _QuantLinearMixin:
    """Precision state and the quantized `_forward_impl`. Subclasses say which operands TP
    shards (`_sharded_operands`) and how long each role's sharded dimension is."""

    precision: Precision
    format_spec: FormatSpec

    def _init_quant(self) -> None:
        # Megatron's forward passes only keywords SNIP knows; the layer asks for nothing refused
        megatron_class = next(c for c in type(self).__mro__ if c is ColumnParallelLinear or c is RowParallelLinear)
        forward_impl.check_module(self, megatron_class)
        self.formats = Formats()
        self._sr_seed = next(_CONSTRUCTED)
        self._sr_stream: SeedStream | None = None
        self.precision = Precision.BF16
        self.format_spec = FormatSpec.for_precision(Precision.BF16)

    # ---- configuration -------------------------------------------------------------------------
    def finish_init(self, quant_config) -> None:
        """Megatron's hook: `quant_config.config` = {"precision": "bf16"|"fp8"|"fp4", optional
        Formats fields (FORMAT_KEYS) and "sr_seed"}; None -> BF16."""
        if quant_config is None:
            self.set_precision(Precision.BF16)
            return
        config = dict(quant_config.config)
        unknown = sorted(set(config) - set(CONFIG_KEYS))
        if unknown or "precision" not in config:
            raise ValueError(f"{type(self).__name__}: quant config {config} needs 'precision' and "
                             f"only these keys: {', '.join(CONFIG_KEYS)} (unknown: {unknown})")
        path = getattr(getattr(quant_config, "match_input", None), "module_path", None)
        seed = config.get("sr_seed", zlib.crc32(path.encode()) if path else None)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"{type(self).__name__}: sr_seed must be an int, got {seed!r}")
        recipes = {k: config[k] for k in FORMAT_KEYS if k in config}
        # A recipe's variants travel only when set (emulated_params): absent means the default.
        if "fp8_recipe" in config:
            recipes = {"fp8_format": None, "fp8_block_scales": "fp32", **recipes}
        if "fp4_recipe" in config:
            recipes = {"fp4_gradient_rounding": None, **recipes}
        self.set_precision(config["precision"], dataclasses.replace(self.formats, **recipes))
        if seed is not None:
            self.set_sr_seed(seed)

    def set_precision(self, precision, formats: Formats | None = None) -> None:
        """Switch precision (re-planning), in `formats` (None keeps the layer's formats).
        Parameters, gradients and optimizer state are untouched."""
        formats = self.formats if formats is None else formats
        spec = formats.spec(precision)
        self.formats, self.precision, self.format_spec = formats, spec.precision, spec
        self._warn_if_shards_split_blocks()

    def set_sr_seed(self, seed: int) -> None:
        """Seed the stochastic-rounding stream; a new seed restarts it, the same seed keeps it
        running (finish_init may be called again with the same config)."""
        seed = int(seed) & 0x7FFF_FFFF_FFFF_FFFF
        if seed != self._sr_seed:
            self._sr_seed = seed
            self._sr_stream = None

    def sr_stream(self) -> SeedStream:
        """This layer's stochastic-rounding seeds (one per stochastic cast), whatever its device."""
        if self._sr_stream is None:
            self._sr_stream = SeedStream(self._sr_seed)
        return self._sr_stream

    def extra_repr(self) -> str:
        return f"formats={self.format_spec.short_str()}"

    def __repr__(self) -> str:
        # compat: megatron-core 0.16 defines __repr__ on these layers, which hides extra_repr.
        base, extra = super().__repr__(), self.extra_repr()
        return base if extra in base else f"{base[:-1]}, {extra})"

    # ---- forward -------------------------------------------------------------------------------
    def _forward_impl(self, input, weight, *args, **kwargs):
        # Megatron passes keywords only; each one is known (forward_impl.FORWARD_IMPL_KEYWORDS)
        if args:
            raise TypeError(f"{type(self).__name__}._forward_impl takes Megatron's keyword arguments only, "
                            f"got {len(args)} more positional")
        forward_impl.check_keywords(type(self).__name__, kwargs)
        # Megatron's own path; also for an MoE expert routed no tokens this micro-batch (an empty
        # product is exact in every format, and there is nothing to quantize)
        if not self.format_spec.is_quantized or input.numel() == 0:
            return super()._forward_impl(input, weight, **kwargs)
        return self._quantized_forward_impl(input, weight, **kwargs)

    def _quantized_forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False,
                                allreduce_dgrad=False, sequence_parallel=False, tp_group=None,
                                grad_output_buffer=None, wgrad_deferral_limit=None, gtp_remat_size=1,
                                output_dtype=None):
        forward_impl.check_values(type(self).__name__, input.dtype, grad_output_buffer, gtp_remat_size,
                                  output_dtype)
        group = self._tp_group()
        comm_group = group if tp_group is None else tp_group
        # The communication Megatron's fused linear does around its GEMMs, as autograd mappings.
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True,
                                                         group=comm_group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=comm_group)
        runtime = self._runtime(group, gradient_accumulation_fusion)
        return quantized_linear(input, weight, bias, self.format_spec, runtime)

    def _tp_group(self):
        group = getattr(self, "tp_group", None)
        if group is None:
            from megatron.core import parallel_state

            group = parallel_state.get_tensor_model_parallel_group()
        return group

    def _tp_rank_world(self) -> tuple[int, int]:
        if not torch.distributed.is_initialized():
            return 0, 1
        group = self._tp_group()
        return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)

    def _runtime(self, group, accumulate) -> QuantRuntime:
        rank, world = self._tp_rank_world()
        sharded = self._sharded_operands()
        pick = lambda operand: group if world > 1 and operand in sharded else None  # noqa: E731
        return QuantRuntime(
            input_group=pick("input"), weight_group=pick("weight"),
            grad_output_group=pick("grad_output"),
            grad_output_shard=((rank, world, int(getattr(self.weight, "partition_stride", 1) or 1))
                               if "grad_output" in sharded else (0, 1, 1)),
            generator=self.sr_stream(), accumulate_into_main_grad=accumulate)

    def _warn_if_shards_split_blocks(self) -> None:
        _, world = self._tp_rank_world()
        if world == 1 or not self.format_spec.is_quantized:
            return
        for role, length in self._sharded_lengths().items():
            cast = self.format_spec.cast(role)
            block = None if cast is None or cast.block is None else cast.block
            if block is None:
                continue
            # The sharded dim is the contraction dim (block[1]) or the other one (block[0]).
            along = block[1] if role in self._sharded_along_k() else block[0]
            if length % along:
                warnings.warn(f"{type(self).__name__}: TP shard length {length} of {role.value} is not "
                              f"a multiple of its block ({along}); TP={world} will not reproduce "
                              f"TP=1 bit for bit")


class QuantColumnParallelLinear(_QuantLinearMixin, ColumnParallelLinear):
    """ColumnParallelLinear (W split by output rows, G_Y by columns) with planned formats."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_quant()

    def _sharded_operands(self):
        return ("weight", "grad_output")

    def _sharded_lengths(self) -> dict:
        m = self.output_size_per_partition
        return {Role.FPROP_WEIGHT: m, Role.DGRAD_WEIGHT: m, Role.DGRAD_GRAD_OUTPUT: m}

    def _sharded_along_k(self):
        return (Role.DGRAD_WEIGHT, Role.DGRAD_GRAD_OUTPUT)  # dgrad contracts the split dim m


class QuantRowParallelLinear(_QuantLinearMixin, RowParallelLinear):
    """RowParallelLinear (X and W split by input columns) with planned formats."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_quant()

    def _sharded_operands(self):
        return ("input", "weight")

    def _sharded_lengths(self) -> dict:
        k = self.input_size_per_partition
        return {Role.FPROP_INPUT: k, Role.FPROP_WEIGHT: k, Role.DGRAD_WEIGHT: k,
                Role.WGRAD_INPUT: k}

    def _sharded_along_k(self):
        return (Role.FPROP_INPUT, Role.FPROP_WEIGHT)  # fprop contracts the split dim k
