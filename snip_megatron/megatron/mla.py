"""What Megatron's local spec lacks to build multi-latent attention on SNIP's emulated linears.

- Megatron's local core attention (DotProductAttention) does not take the `k_channels` /
  `v_channels` that MLASelfAttention passes it (megatron-core 0.16 and 0.19 alike): `LocalMLACore`
  takes them, and sizes its output by the value heads.
- Its down-projections are column-parallel there, which gives the shared rotary key a gradient
  from this rank's heads only at TP > 1; `DuplicatedDownProjection` (and `QuantDownProjection` on
  SNIP's emulated linears) is duplicated over TP as in Megatron's TE spec.
- MLASelfAttention picks the down-projections' arguments by identity (`cls in [Linear,
  TEColumnParallelLinear, ColumnParallelLinear]`, multi_latent_attention.py), so a subclass of
  ColumnParallelLinear is refused there: these classes compare equal to ColumnParallelLinear.
"""

from __future__ import annotations

from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention

from snip_megatron.emulation.parallel_linear import _QuantLinearMixin


class LocalMLACore(DotProductAttention):
    """Megatron's DotProductAttention with MLA's query/key and value head widths."""

    def __init__(self, *args, k_channels: "int | None" = None, v_channels: "int | None" = None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None:  # the context is [s, b, local heads * v_channels]
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels
        # every MLA head has its own key and value (no query groups, whatever --num-query-groups says)
        self.num_query_groups_per_partition = self.num_attention_heads_per_partition


class _CountsAsColumnParallelLinear(type):
    def __eq__(cls, other):
        return other is ColumnParallelLinear or type.__eq__(cls, other) is True

    __hash__ = type.__hash__


class _Alone:
    """A one-process stand-in for the TP group Megatron hands a column-parallel linear: the
    down-projection keeps its whole weight, and every TP mapping Megatron runs on it is the
    identity (they ask only `size()` and `rank()` of it)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


class DuplicatedDownProjection(ColumnParallelLinear, metaclass=_CountsAsColumnParallelLinear):
    """An MLA down-projection duplicated over TP, as Megatron's TE spec builds it
    (TELinear(parallel_mode="duplicated")): the whole weight on every TP rank, no TP communication,
    this rank's tokens in and out under SP, its weight gradient summed over TP by Megatron's
    finalize_model_grads under SP (the `sequence_parallel` mark, as TE sets it).

    Megatron's local spec builds a ColumnParallelLinear there instead, whose output MLA gathers over
    TP; the gradient of the shared rotary key (k_pos_emb) then comes from this rank's heads only
    (multi_latent_attention.py, the `gather_from_tensor_model_parallel_region` path), so TP=2 trains
    another model than TP=1. The duplicated path is the one Megatron's TE spec runs."""

    parallel_mode = None  # as TE's duplicated linear reports it (models.gpt.module_kind)

    def __init__(self, *args, tp_group=None, **kwargs):
        super().__init__(*args, tp_group=_Alone(), **kwargs)
        self._checkpoint_tp_group = tp_group  # Megatron's TP group (None: its default one)
        self.weight.tensor_model_parallel = False
        self.weight.partition_dim = -1
        self.weight.sequence_parallel = bool(self.config.sequence_parallel)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The whole weight, replicated over TP and DP (one main replica), as TE's duplicated TELinear
        saves it (Megatron reads the DP group only when it is given neither group)."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        group = self._checkpoint_tp_group or ps.get_tensor_model_parallel_group()
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, None,
                                                   sharded_offsets, tp_group=group,
                                                   dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True))


class QuantDownProjection(_QuantLinearMixin, DuplicatedDownProjection):
    """DuplicatedDownProjection on SNIP's emulated linears: nothing of it is sharded over TP."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_quant()

    def _tp_rank_world(self) -> tuple[int, int]:
        return 0, 1

    def _sharded_operands(self):
        return ()

    def _sharded_lengths(self) -> dict:
        return {}

    def _sharded_along_k(self):
        return ()
