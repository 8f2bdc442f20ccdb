"""Test double of `transformer_engine.pytorch.DotProductAttention` (TE 2.14
`attention/dot_product_attention/dot_product_attention.py`).

Plain softmax attention in torch (TE's unfused backend, not its flash/cuDNN kernels): scores in
the input dtype, softmax in FP32, GQA by repeating each key/value group over its query heads,
heads split over the TP group, dropout under the RNG tracker's fork. Formats 'sbhd' and 'bshd';
masks 'no_mask', 'causal', 'causal_bottom_right', 'padding', 'padding_causal', 'arbitrary'
(boolean mask, True = masked out). Context parallelism as TE's cp_comm_type 'p2p' computes it
(context_parallel.py: each rank's queries over the whole sequence's keys and values, Megatron's
load-balanced split; the group set at construction or by `set_context_parallel_group`, as TE
takes it, dot_product_attention.py:370-373, 536-575). Always high precision: FP8 attention
(`fp8_dpa`), packed (THD) sequences, sliding windows, attention bias, KV caches, softmax offsets
and max-logit output are refused with NotImplementedError.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from transformer_engine.pytorch.attention import context_parallel as cp
from transformer_engine.pytorch.quantization import FP8GlobalStateManager

MASK_TYPES = ("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal", "arbitrary")


def _refuse(what: str):
    raise NotImplementedError(f"transformer_engine test double: DotProductAttention {what} is "
                              f"not modelled")


class DotProductAttention(torch.nn.Module):
    """softmax(Q K^T * scale + mask) V per head."""

    def __init__(self, num_attention_heads: int, kv_channels, num_gqa_groups: Optional[int] = None,
                 attention_dropout: float = 0.0, qkv_format: str = "sbhd",
                 attn_mask_type: str = "causal", window_size=None, bottom_right_diagonal=None,
                 sequence_parallel: bool = False, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None, tp_group=None,
                 layer_number: Optional[int] = None, attention_type: str = "self",
                 cp_group=None, cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p",
                 softmax_scale: Optional[float] = None, softmax_type: str = "vanilla",
                 return_max_logit: Optional[bool] = False) -> None:
        super().__init__()
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        if softmax_type != "vanilla":
            _refuse(f"softmax_type={softmax_type!r}")
        if return_max_logit:
            _refuse("return_max_logit (qk-clip)")
        if window_size is not None and tuple(window_size) not in ((-1, -1), (-1, 0)):
            _refuse(f"sliding window attention (window_size={window_size})")
        self.qkv_format = qkv_format
        self.attn_mask_type = attn_mask_type
        self.tp_size = tp_size if tp_group is None else torch.distributed.get_world_size(tp_group)
        self.tp_group = tp_group
        self.layer_number = 1 if layer_number is None else layer_number
        self.attention_type = attention_type
        self.sequence_parallel = sequence_parallel
        self.get_rng_state_tracker = get_rng_state_tracker
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        if num_attention_heads % self.num_gqa_groups:
            raise AssertionError("The number of attention heads must be divisible by the number "
                                 "of GQA groups!")
        self.num_gqa_groups_per_partition = self.num_gqa_groups // self.tp_size
        k_channels, v_channels = (kv_channels if isinstance(kv_channels, tuple)
                                  else (kv_channels, kv_channels))
        self.hidden_size_per_attention_head_k = k_channels
        self.hidden_size_per_attention_head_v = v_channels
        self.softmax_scale = 1.0 / math.sqrt(k_channels) if softmax_scale is None else softmax_scale
        self.attention_dropout = attention_dropout
        self.last_tokens: Optional[tuple] = None

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream,
                                   cp_comm_type="p2p") -> None:
        """TE's CP attributes (None: no CP); what the double does not model is refused here."""
        self.cp_size = cp.cp_size_of(cp_group, cp_global_ranks, cp_comm_type)
        self.cp_group, self.cp_global_ranks = cp_group, cp_global_ranks
        self.cp_stream, self.cp_comm_type = cp_stream, cp_comm_type

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor,
                value_layer: torch.Tensor, attention_mask=None, qkv_format: Optional[str] = None,
                cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None,
                cu_seqlens_kv_padded=None, max_seqlen_q=None, max_seqlen_kv=None,
                attn_mask_type: Optional[str] = None, window_size=None,
                bottom_right_diagonal=None, checkpoint_core_attention: bool = False,
                core_attention_bias_type: str = "no_bias", core_attention_bias=None,
                alibi_slopes=None, fast_zero_fill: bool = True, inference_params=None,
                pad_between_seqs=None, fp8_output: Optional[bool] = False,
                num_splits: Optional[int] = 1) -> torch.Tensor:
        qkv_format = qkv_format or self.qkv_format
        mask_type = attn_mask_type or self.attn_mask_type
        if qkv_format not in ("sbhd", "bshd"):
            _refuse(f"qkv_format={qkv_format!r} (packed sequences)")
        if mask_type not in MASK_TYPES:
            _refuse(f"attn_mask_type={mask_type!r}")
        if cu_seqlens_q is not None or cu_seqlens_kv is not None:
            _refuse("packed sequences (cu_seqlens)")
        if core_attention_bias_type != "no_bias" or alibi_slopes is not None:
            _refuse(f"attention bias ({core_attention_bias_type})")
        if inference_params is not None:
            _refuse("KV caching (inference_params)")
        if window_size is not None and tuple(window_size) not in ((-1, -1), (-1, 0)):
            _refuse(f"sliding window attention (window_size={window_size})")
        if FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.get_fp8_recipe().fp8_dpa:
            _refuse("in FP8 (recipe fp8_dpa=True)")
        if fp8_output:
            _refuse("fp8_output")
        if self.cp_size > 1:
            cp.check_inputs(qkv_format, mask_type, query_layer, key_layer)

        # -> [b, heads, s, d]
        to_bhsd = (lambda t: t.permute(1, 2, 0, 3)) if qkv_format == "sbhd" else (lambda t: t.transpose(1, 2))
        q, k, v = to_bhsd(query_layer), to_bhsd(key_layer), to_bhsd(value_layer)
        heads, groups = q.shape[1], k.shape[1]
        if heads % groups:
            raise ValueError(f"{heads} query heads are not a multiple of {groups} key/value groups")
        if self.cp_size > 1:  # the whole sequence's K and V; queries masked by global position
            k, v = cp.gather_kv(k, v, 2, self.cp_group)
            mask = cp.causal_mask_on_rank(self.cp_group, q.shape[2], q.device) if mask_type == "causal" else None
        else:
            mask = self._mask(mask_type, attention_mask, q.shape[2], k.shape[2], q.device)
        if groups != heads:
            k = k.repeat_interleave(heads // groups, dim=1)
            v = v.repeat_interleave(heads // groups, dim=1)
        self.last_tokens = (q.shape[2], k.shape[2])  # what it attended (tests read it): queries, keys
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.softmax_scale
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        if self.training and self.attention_dropout > 0.0:
            fork = self.get_rng_state_tracker().fork if self.get_rng_state_tracker else nullcontext
            with fork():
                probs = F.dropout(probs, p=self.attention_dropout, training=True)
        context = torch.matmul(probs, v)  # [b, heads, sq, dv]
        if qkv_format == "sbhd":
            context = context.permute(2, 0, 1, 3)  # [sq, b, heads, dv]
        else:
            context = context.transpose(1, 2)  # [b, sq, heads, dv]
        return context.reshape(*context.shape[:2], -1)

    @staticmethod
    def _mask(mask_type: str, attention_mask, sq: int, sk: int, device) -> "torch.Tensor | None":
        """Boolean [.., sq, sk] mask, True where a score is dropped."""
        mask = None
        if "causal" in mask_type:
            # causal: query i sees keys j <= i (top-left aligned); bottom_right: aligned to the end
            offset = sk - sq if mask_type == "causal_bottom_right" else 0
            mask = torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1 + offset)
        if mask_type in ("padding", "padding_causal", "arbitrary"):
            if attention_mask is None:
                raise ValueError(f"attn_mask_type={mask_type!r} needs an attention_mask")
            if isinstance(attention_mask, tuple):
                _refuse("separate query / key padding masks")
            given = attention_mask.to(torch.bool)
            mask = given if mask is None else (mask | given)
        return mask
