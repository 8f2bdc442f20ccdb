"""Published models at full size, for planning and measurement models (nothing here trains them):
their whole inventory is enumerated from the widths, without weights."""

from __future__ import annotations

from dataclasses import dataclass

from snip_megatron.models import gpt
from snip_megatron.models.inventory import Inventory
from snip_megatron.shapes import ModelShape


@dataclass(frozen=True)
class PublishedGPT:
    """A GPT's shape with its attention, experts and multi-token prediction."""

    shape: ModelShape
    mla: "gpt.MLADims | None" = None
    moe: "gpt.MoEDims | None" = None
    mtp_num_layers: int = 0

    def inventory(self, *, sequence_parallel: bool = False) -> Inventory:
        return gpt.inventory(self.shape, sequence_parallel=sequence_parallel, mla=self.mla, moe=self.moe,
                             mtp_num_layers=self.mtp_num_layers)


DEEPSEEK_V3 = PublishedGPT(
    shape=ModelShape(name="deepseek_v3", num_layers=61, hidden_size=7168, ffn_hidden_size=18432,
                     num_attention_heads=128, num_query_groups=128, vocab_size=129280, seq_length=4096,
                     kv_channels=128),
    mla=gpt.MLADims(q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128),
    moe=gpt.MoEDims(num_experts=256, topk=8, ffn_hidden_size=2048, shared_ffn_hidden_size=2048,
                    layer_freq=(0,) * 3 + (1,) * 58),
    mtp_num_layers=1)
"""DeepSeek-V3 (671B) as Megatron-Bridge's DeepSeek-V3 bridge builds it from the Hugging Face config
(megatron/bridge/models/deepseek, recipes/deepseek/h100/deepseek_v3.py): 61 layers, the first 3
dense; MLA (q_lora 1536, kv_lora 512, head dims 128 + 64 rope, v 128); 256 routed experts of FFN
2048 top-8 and one shared expert; one MTP layer (an MoE layer, as the last decoder layer is)."""
