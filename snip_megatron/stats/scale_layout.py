"""The layout the measurement's cost model (stats/scale_model.py) reads: a rank's parallel sizes,
its pipeline chunks and their layers, the planned linears it holds and their shapes, and the
order the pipeline schedule runs its micro-batches in. Pure Python: no torch, nothing allocated."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import cached_property

from snip_megatron.models import gpt
from snip_megatron.models.inventory import ParallelKind
from snip_megatron.shapes import ModelShape

WEIGHT_BLOCK_ELEMS = 1 << 22  # weights.MAX_BLOCK_ELEMS

# Peak bytes per input element of one error E = Q(T) - T of a float32 operand (output included),
# by precision and role: measured on the CPU with bench/measure_scale.py --calibrate (NVFP4 and
# FP8 blockwise, the defaults); the bench re-measures them and uses its own figures.
DEFAULT_QUANT_BYTES = {
    ("fp8", "fprop_input"): 16.0, ("fp8", "wgrad_input"): 20.0, ("fp8", "dgrad_grad_output"): 16.0,
    ("fp8", "wgrad_grad_output"): 20.0, ("fp8", "fprop_weight"): 16.0,
    ("fp4", "fprop_input"): 16.0, ("fp4", "wgrad_input"): 28.0, ("fp4", "dgrad_grad_output"): 16.0,
    ("fp4", "wgrad_grad_output"): 28.0, ("fp4", "fprop_weight"): 16.0,
}


DISPATCHER_SYNCS = {"alltoall": 1, "allgather": 2}
"""Host syncs of Megatron's dropless token dispatchers per MoE layer forward (megatron-core 0.19
token_dispatcher.py): alltoall waits once for its device-to-host copies of the routed token counts
(at `cuda_sync_point`); allgather copies the local experts' counts with `.cpu()` and sizes its
probabilities with `masked_select`."""


@dataclass(frozen=True, kw_only=True)
class MeasureLayout:
    """A rank's layout and the measurement's settings."""

    shape: ModelShape
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    """"none", "selective" (attention core) or "full" (every layer)."""
    micro_batch_size: int = 1
    seq_length: int = 0
    """0: the shape's."""
    global_batch: int = 1
    """Sequences per step over all replicas."""
    micro_batches: "int | None" = 8
    """MeasureConfig.micro_batches (None: all)."""
    token_stride: int = 4
    grad_token_stride: int = 8
    precisions: int = 2
    act_bytes: int = 2
    """Bytes per activation element (2: BF16; 4: the FP32 CPU models)."""
    weight_bytes: int = 2
    moment_bytes: int = 4
    """Bytes per stored AdamW moment (4: FP32; 2 or 1: --use-precision-aware-optimizer, then
    dequantized to a float32 copy, see adam.py)."""
    distributed_optimizer: bool = True
    first_order: bool = True
    plan_rate: str = "fp8"
    """The training step's linears run at this rate (the initial all-FP8 plan)."""
    quant_bytes: dict = field(default_factory=lambda: dict(DEFAULT_QUANT_BYTES))
    weight_block_elems: int = WEIGHT_BLOCK_ELEMS
    """weights.MAX_BLOCK_ELEMS (the validation lowers it to make small models block)."""
    mla: "gpt.MLADims | None" = None
    """Multi-latent attention's widths (None: grouped-query attention)."""
    moe: "gpt.MoEDims | None" = None
    """The MoE layers' experts (None: a dense model)."""
    ep: int = 1
    """Expert-parallel size: each rank holds num_experts / ep experts of every MoE layer."""
    etp: int = 1
    """Expert tensor-parallel size (shards one expert's linears as TP shards a dense one's)."""
    expert_imbalance: float = 1.0
    """Routed rows of the busiest local expert over the balanced share (1.0: balanced routing)."""
    mtp_num_layers: int = 0
    """Multi-token-prediction layers after the decoder (an MoE layer when the last decoder layer
    is one): Megatron builds them on the last pipeline stage, or where `pipeline_layout` puts them."""
    vpp: "int | None" = None
    """Virtual pipeline stages per rank (the interleaved schedule); None: one chunk per rank."""
    pipeline_layout: "tuple | None" = None
    """Megatron's custom pipeline layout (`pipeline_model_parallel_layout`): PP x VPP chunks, each a
    list of "embedding", "decoder", "mtp", "loss", in the model's order; chunk i runs on pipeline
    rank i % pp as its virtual stage i // pp. None: Megatron's even split."""
    stage: "int | None" = None
    """The pipeline rank modelled (its chunks' layers). None: a stage of ceil(layers / pp) decoder
    layers, as many of them MoE as fit, without MTP (an upper bound for a plain split; `stages`
    gives every rank of an explicit one)."""
    has_optimizer: bool = True
    """The measurement reads AdamW's state (an optimizer is passed)."""
    dispatcher: str = "alltoall"
    """Megatron's token dispatcher (moe_token_dispatcher_type): "alltoall" or "allgather"."""

    def __post_init__(self):
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"MeasureLayout.recompute must be none, selective or full, got {self.recompute!r}")
        if self.global_batch % (self.micro_batch_size * self.dp):
            raise ValueError("MeasureLayout.global_batch must be a multiple of micro_batch_size * dp")
        if self.moe is not None and self.moe.num_experts % self.ep:
            raise ValueError(f"MeasureLayout.ep={self.ep} must divide the {self.moe.num_experts} experts")
        if self.moe is not None and (self.tp * self.dp * self.cp) % (self.etp * self.ep):
            raise ValueError(f"MeasureLayout: etp x ep = {self.etp * self.ep} must divide tp x dp x cp = "
                             f"{self.tp * self.dp * self.cp} (Megatron's expert groups fold the dense ones)")
        if self.dispatcher not in DISPATCHER_SYNCS:
            raise ValueError(f"MeasureLayout.dispatcher must be one of {sorted(DISPATCHER_SYNCS)}, got {self.dispatcher!r}")
        if self.stage is not None and not 0 <= self.stage < self.pp:
            raise ValueError(f"MeasureLayout.stage={self.stage} is not a pipeline rank of pp={self.pp}")
        if self.pipeline_layout is not None and len(self.pipeline_layout) != self.pp * (self.vpp or 1):
            raise ValueError(f"MeasureLayout.pipeline_layout has {len(self.pipeline_layout)} chunks, "
                             f"pp x vpp = {self.pp * (self.vpp or 1)}")

    # -- derived ---------------------------------------------------------------------------------
    @property
    def seq(self) -> int:
        return self.seq_length or self.shape.seq_length

    @property
    def num_microbatches(self) -> int:
        """M: micro-batches per replica per step."""
        return self.global_batch // (self.micro_batch_size * self.dp)

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (it shards tokens over TP only when TP > 1)."""
        return self.sequence_parallel and self.tp > 1

    @property
    def spans(self) -> bool:
        """Whether an expert group is wider than TP (EP over data-parallel replicas): every replica
        then measures alike and the noise passes are not interleaved (measure.py `spans`)."""
        return self.moe is not None and self.tp % (self.etp * self.ep) != 0

    @property
    def group(self) -> int:
        """Micro-batches the interleaved schedule runs per virtual stage at a time (Megatron's
        default microbatch_group_size_per_vp_stage: PP); 1 without VPP."""
        return self.pp if self.vpp and self.vpp > 1 else 1

    def _shares(self) -> "list[int] | None":
        """Each replica's measured micro-batches (stats/microbatches.py); None: every one."""
        m, total = self.num_microbatches, self.num_microbatches * self.dp
        k = self.micro_batches
        if k and self.spans:
            k = -(-k // self.dp) * self.dp
        if not k or k >= total:
            return None
        shares = [(d + 1) * k // self.dp - d * k // self.dp for d in range(self.dp)]
        return [min(m, -(-s // self.group) * self.group) if s and self.group > 1 else s for s in shares]

    @property
    def measured(self) -> int:
        """K_d: micro-batches the busiest replica measures (a multiple of the interleaved
        schedule's group under VPP)."""
        shares = self._shares()
        return self.num_microbatches if shares is None else max(shares)

    @property
    def measured_total(self) -> int:
        """K: micro-batches measured over all replicas."""
        shares = self._shares()
        return self.num_microbatches * self.dp if shares is None else sum(shares)

    @property
    def halves(self) -> bool:
        """Whether the noise pass runs the step's lone measured micro-batch as its two halves
        along the batch dim (a dense model's, of an even micro-batch size; measure.py)."""
        return self.measured_total == 1 and self.micro_batch_size % 2 == 0 and self.moe is None

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch in a TP group (CP splits the sequence)."""
        return self.micro_batch_size * self.seq // self.cp

    @property
    def layers(self) -> int:
        """Layers of the modelled pipeline stage (decoder and MTP layers)."""
        if self.stage is None and self.pp > 1:
            return math.ceil(self.shape.num_layers / self.pp)
        return sum(len(c) for c in self.stage_chunks())

    @cached_property
    def inventory(self):
        """The planned units of the whole model (models.gpt.inventory)."""
        return gpt.inventory(self.shape, mla=self.mla, moe=self.moe, mtp_num_layers=self.mtp_num_layers)

    def pipeline_chunks(self) -> list:
        """Every chunk of the pipeline in the model's order (chunk i: rank i % pp, virtual stage
        i // pp), each a list of ("decoder", layer) and ("mtp", depth): from `pipeline_layout`, or
        Megatron's even split (the MTP layers on the last rank's last chunk)."""
        n = self.pp * (self.vpp or 1)
        if self.pipeline_layout is not None:
            out, layer, depth = [], 0, 0
            for chunk in self.pipeline_layout:
                items = []
                for kind in chunk:
                    if kind == "decoder":
                        layer += 1
                        items.append(("decoder", layer))
                    elif kind == "mtp":
                        depth += 1
                        items.append(("mtp", depth))
                    elif kind not in ("embedding", "loss"):
                        raise ValueError(f"pipeline_layout: unknown entry {kind!r}")
                out.append(items)
            if (layer, depth) != (self.shape.num_layers, self.mtp_num_layers):
                raise ValueError(f"pipeline_layout places {layer} decoder and {depth} MTP layers; the model has "
                                 f"{self.shape.num_layers} and {self.mtp_num_layers}")
            return out
        if self.shape.num_layers % n:
            raise ValueError(f"{self.shape.num_layers} layers do not split evenly over pp x vpp = {n} chunks: "
                             "give a pipeline_layout")
        per = self.shape.num_layers // n
        out = [[("decoder", i * per + j) for j in range(1, per + 1)] for i in range(n)]
        out[-1] += [("mtp", d) for d in range(1, self.mtp_num_layers + 1)]
        return out

    def stages(self) -> list:
        """This layout at each of its pipeline ranks (`stage` set: their chunks' own layers)."""
        return [dataclasses.replace(self, stage=s) for s in range(self.pp)]

    def stage_chunks(self) -> list:
        """The modelled rank's chunks (its virtual stages in order), each a list of layers as in
        `pipeline_chunks`."""
        return self.pipeline_chunks()[self.stage or 0::self.pp]

    def stage_keys(self) -> list:
        """The planned units the modelled rank holds (its chunks' decoder layers and MTP layers)."""
        mine = {item for chunk in self.stage_chunks() for item in chunk}
        return [e.key for e in self.inventory
                if (("mtp", e.layer) if gpt.is_mtp(e.key) else ("decoder", e.layer)) in mine]

    @cached_property
    def _entries(self) -> dict:
        """name -> the inventory entry of that linear (one layer's; every layer of a kind alike)."""
        return {e.key.name: e for e in self.inventory}

    def column(self, name: str) -> bool:
        """Whether TP shards the output dim of a layer's linear `name`."""
        return self._entries[name].kind is ParallelKind.COLUMN

    def is_expert(self, name: str) -> bool:
        """Whether `name` is an MoE layer's routed-expert unit (its entry has one expert's shape)."""
        return self._entries[name].experts > 0

    def linears(self) -> dict:
        """name -> (weight rows, weight cols, X features, G_Y features) on this rank, for one expert of
        an expert unit (ETP shards it; TP every other linear)."""
        out = {}
        for name, e in self._entries.items():
            (m, k), tp = e.shape, self.etp if e.experts else self.tp
            if e.kind is ParallelKind.COLUMN:
                out[name] = (m // tp, k, k, m // tp)
            elif e.kind is ParallelKind.ROW:
                out[name] = (m, k // tp, k // tp, m)
            else:  # duplicated over TP (MLA's down-projections)
                out[name] = (m, k, k, m)
        return out

    @property
    def local_experts(self) -> int:
        return self.moe.num_experts // self.ep if self.moe is not None else 0

    @property
    def expert_tokens(self) -> int:
        """Routed rows one local expert gets from one micro-batch: every rank of the EP group
        dispatches its tokens (SP-sharded over TP) x top-k over all experts, and ETP gathers them."""
        if self.moe is None:
            return 0
        local = self.tokens // self.tp if self.sp else self.tokens
        return math.ceil(local * self.moe.topk * self.ep * self.etp / self.moe.num_experts * self.expert_imbalance)

    def view(self, name: str) -> "MeasureLayout":
        """The layout a hook of linear `name` sees: itself, or for an expert unit one expert's GEMM
        (its routed rows as one sequence, ETP as the TP, no sequence-parallel gather)."""
        if not self.is_expert(name):
            return self
        return dataclasses.replace(self, tp=self.etp, sequence_parallel=False, cp=1, dp=1, micro_batch_size=1,
                                   global_batch=1, seq_length=self.expert_tokens, ep=1, etp=self.etp)

    def _kind(self, item) -> str:
        what, n = item
        L = self.shape.num_layers
        if what == "mtp":
            return "mtp"
        return "moe" if self.moe is not None and self.moe.is_moe_layer(n, L) else "dense"

    def stage_layers(self, chunk: "int | None" = None) -> dict:
        """Layers of each kind ("moe", "dense", "mtp") on the modelled stage (or one of its
        chunks). stage None at PP > 1: ceil(layers / pp), as many MoE as fit (an upper bound)."""
        if self.stage is None and self.pp > 1:
            layers = self.shape.num_layers
            moe_layers = sum(self.moe.is_moe_layer(i, layers) for i in range(1, layers + 1)) if self.moe is not None else 0
            moe = min(self.layers, moe_layers)
            return {"moe": moe, "dense": self.layers - moe, "mtp": 0}
        out = {"moe": 0, "dense": 0, "mtp": 0}
        for i, c in enumerate(self.stage_chunks()):
            for item in c if chunk is None or chunk == i else ():
                out[self._kind(item)] += 1
        return out

    def moe_layers(self, chunk: "int | None" = None) -> int:
        """MoE layers (with a token dispatcher) on the stage: MoE decoder layers and MoE MTP layers."""
        n = self.stage_layers(chunk)
        mtp_moe = self.moe is not None and self.moe.is_moe_layer(self.shape.num_layers, self.shape.num_layers)
        return n["moe"] + (n["mtp"] if mtp_moe else 0)

    def layer_names(self, kind: str) -> list:
        """The linears of one layer of `kind` ("moe", "dense" or "mtp")."""
        if kind == "dense":
            return [s.name for s in gpt.layer_slots(self.mla, None)]
        if kind == "mtp":
            L = self.shape.num_layers
            moe = self.moe if self.moe is not None and self.moe.is_moe_layer(L, L) else None
            return [s.name for s in gpt.mtp_slots(self.mla, moe)]
        return [s.name for s in gpt.layer_slots(self.mla, self.moe)]

    def copies(self, chunk: "int | None" = None) -> dict:
        """name -> how many GEMMs of that linear run per micro-batch on the modelled stage (or one
        of its chunks): layers x local experts for an expert unit."""
        out = {}
        for kind, n in self.stage_layers(chunk).items():
            for name in self.layer_names(kind) if n else ():
                out[name] = out.get(name, 0) + n * (self.local_experts if self.is_expert(name) else 1)
        return out

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp


def schedule(lay: MeasureLayout) -> list:
    """The modelled rank's forwards and backwards in one pass over the K_d measured micro-batches,
    in Megatron's order: ("F" or "B", micro-batch, chunk). Without VPP, 1F1B after
    pp - rank - 1 warm-up forwards (stage None: the first rank's); with VPP, the interleaved
    schedule's table (schedules.py get_schedule_table: groups of `group` micro-batches, each
    through every chunk) after (pp - rank - 1) x 2 + (vpp - 1) x group warm-up forwards
    (get_pp_rank_microbatches), backwards through the chunks in reverse."""
    m, rank = lay.measured, lay.stage or 0
    chunks = len(lay.stage_chunks()) if (lay.stage is not None or lay.pp == 1) else 1
    if lay.pp == 1:
        return [step for mb in range(m) for step in (("F", mb, 0), ("B", mb, 0))]
    if chunks == 1:
        table = [(mb, 0) for mb in range(m)]
        warmup = lay.pp - rank - 1
    else:
        g = lay.group
        table = [(mb, c) for start in range(0, m, g)
                 for c in range(chunks) for mb in range(start, m if start + g >= m else start + g)]
        warmup = (lay.pp - rank - 1) * 2 + (chunks - 1) * g
    total = len(table)
    warmup = min(warmup, total)
    out = [("F", *table[k]) for k in range(warmup)]
    for k in range(total - warmup):
        out.append(("F", *table[k + warmup]))
        mb, c = table[k]
        out.append(("B", mb, chunks - 1 - c))
    for k in range(total - warmup, total):
        mb, c = table[k]
        out.append(("B", mb, chunks - 1 - c))
    return out
