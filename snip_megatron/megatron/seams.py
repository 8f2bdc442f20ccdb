"""Every place SNIP joins Megatron's code, with the check that proves it still holds: one table.

SNIP wraps a few of Megatron-LM's and Megatron-Bridge's loop functions (the step boundary, the
checkpoint save, the MTP block spec) and overrides or replaces a few private methods and attributes
of Megatron-Core (the local linears' `_forward_impl`, the MTP loss scaler, a router's replay, the
TE grouped experts' forward, the CUDA RNG on CPU). A Megatron release can change any of them
without an error on SNIP's side: a wrapper Megatron no longer calls, a keyword silently dropped.
So each is listed here, once, with what is checked at start-up (`seam_check.check`, which the
loops run before wrapping anything, and `scripts/check_megatron_drift.sh` against a checkout):

- `params`: the leading parameters SNIP relies on (`exact`: the whole list);
- `called_by`: the Megatron functions that must still look the wrapped name up as a global of its
  module (so the wrapper SNIP puts there is the one they call);
- `read_by`: the Megatron functions that must still read the replaced attribute;
- `keywords_of`: the Megatron forward whose keywords to `_forward_impl` must all be known
  (snip_megatron.emulation.forward_impl);
- `is_a`: the type the attribute must have;

and `at_run`, what proves at run time that the seam ran (snip_megatron.pretrain.proof).
docs/seams.md is this table (`python -m snip_megatron.megatron.seam_check --write-doc`).
No Megatron at import.
"""

from __future__ import annotations

from dataclasses import dataclass

LOOPS = ("megatron-lm", "bridge", "core")
"""Whose seam: Megatron-LM's loop (megatron.training), Megatron-Bridge's, or Megatron-Core's
(every loop that builds SNIP's linears or measures)."""


@dataclass(frozen=True)
class Seam:
    """One place SNIP joins Megatron (see the module docstring for the checks)."""

    loop: str
    target: str
    """"module:qualname" of what SNIP wraps, overrides, replaces or reads."""
    use: str
    """What SNIP does there, and where (a file under snip_megatron/)."""
    params: tuple = ()
    exact: bool = False
    called_by: tuple = ()
    read_by: tuple = ()
    keywords_of: "str | None" = None
    is_a: "str | None" = None
    at_run: str = ""

    @property
    def module(self) -> str:
        return self.target.split(":")[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":")[1]

    @property
    def name(self) -> str:
        """The target's own name (its last dotted part)."""
        return self.qualname.rsplit(".", 1)[-1]

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.qualname}"


_TRAIN = "megatron.training.training"
_STEP_PARAMS = ("forward_step_func", "data_iterator", "model", "optimizer", "opt_param_scheduler", "config",
                "forward_backward_func", "iteration")
_INVENTORY = "step 1: the planned linears Megatron built are the ones the plan covers, and run it"

SEAMS = (
    # -- Megatron-LM's loop (pretrain/seams.py) --------------------------------------------------
    Seam("megatron-lm", f"{_TRAIN}:train_step", "wrapped: the controller measures and re-plans before each step",
         params=_STEP_PARAMS, called_by=(f"{_TRAIN}:train",),
         at_run="the first training forward stops the run unless SNIP's step hook ran first"),
    Seam("megatron-lm", f"{_TRAIN}:save_checkpoint", "wrapped: snip_state.json beside each checkpoint",
         params=("iteration", "model", "optimizer", "opt_param_scheduler", "num_floating_point_operations_so_far"),
         called_by=(f"{_TRAIN}:save_checkpoint_and_time",),
         at_run="the step after a --save-interval save stops the run unless SNIP saw that save; the first "
                "save stops it unless snip_state.json is in the folder Megatron's tracker names"),
    Seam("megatron-lm", "megatron.training.checkpointing:schedule_async_save",
         "wrapped during a save: snip_state.json as the last finalize step of an --async-save",
         params=("async_request",), called_by=("megatron.training.checkpointing:save_checkpoint",),
         at_run="an --async-save that schedules no finalize step stops the run (rank 0)"),
    Seam("megatron-lm", "megatron.training.models.gpt:mtp_block_spec",
         "wrapped: the MTP block gets SNIP's planned linears (pretrain/model.py)",
         params=("config", "transformer_layer_spec"),
         called_by=("megatron.training.models.gpt:GPTModelBuilder.build_model",), at_run=_INVENTORY),
    Seam("megatron-lm", "megatron.training.models.hybrid:HybridModelBuilder.build_model",
         "overridden: each pipeline stage's quant_recipe set before it is built (pretrain/model.py)",
         params=("self", "pg_collection", "pre_process", "post_process", "vp_stage"), at_run=_INVENTORY),
    # -- Megatron-Bridge's loop (bridge/seams.py) ----------------------------------------------------
    Seam("bridge", "megatron.bridge.training.train:train_step",
         "wrapped: the controller measures and re-plans before each step",
         params=("forward_step_func", "data_iterator", "model", "optimizer", "scheduler", "global_state"),
         called_by=("megatron.bridge.training.train:train",)),
    Seam("bridge", "megatron.bridge.models.gpt_provider:mtp_block_spec",
         "wrapped: the MTP block gets SNIP's emulated linears (bridge/model.py)", params=("config", "vp_stage"),
         called_by=("megatron.bridge.models.gpt_provider:GPTModelProvider.provide",)),
    # -- Megatron-Core, every loop -------------------------------------------------------------------
    *(Seam("core", f"megatron.core.tensor_parallel.layers:{cls}._forward_impl",
           "overridden: the emulated linears' quantized GEMMs (emulation/parallel_linear.py)",
           params=("self", "input", "weight"), keywords_of=f"megatron.core.tensor_parallel.layers:{cls}.forward",
           at_run="a keyword SNIP does not know is refused at construction and at the call")
      for cls in ("ColumnParallelLinear", "RowParallelLinear")),
    Seam("core", "megatron.core.transformer.multi_token_prediction:MTPLossAutoScaler.forward",
         "its apply(output, mtp_loss) replaced while measuring: the MTP loss scaled per pass (megatron/mtp_loss.py)",
         params=("ctx", "output", "mtp_loss"), exact=True),
    Seam("core", "megatron.core.transformer.multi_token_prediction:MTPLossLoggingHelper.tracker",
         "read and restored around a measurement (megatron/mtp_loss.py)", is_a="dict"),
    Seam("core", "megatron.core.transformer.moe.router_replay:RouterReplay.get_replay_topk",
         "stood in for while measuring: routing recorded and replayed (stats/routing.py FrozenRouting)",
         params=("self", "scores", "topk", "num_groups", "group_topk", "default_compute_topk"), exact=True),
    Seam("core", "megatron.core.transformer.moe.router:TopKRouter.router_replay",
         "replaced on every router while measuring (stats/routing.py)",
         read_by=("megatron.core.transformer.moe.router:TopKRouter.routing",)),
    Seam("core", "megatron.core.transformer.moe.experts:TEGroupedMLP.forward",
         "hooked: token splits padded for each module's recipe (megatron/grouped_padding.py)",
         params=("self", "permuted_local_hidden_states", "tokens_per_expert", "permuted_probs")),
    Seam("core", "megatron.core.tensor_parallel.random:_get_cuda_rng_state",
         "replaced on CPU by the CPU generator's (megatron/cpu_shim.py)",
         params=("device", "clone", "graph_safe"), exact=True),
    Seam("core", "megatron.core.tensor_parallel.random:_set_cuda_rng_state",
         "replaced on CPU by the CPU generator's (megatron/cpu_shim.py)",
         params=("new_state", "device", "graph_safe"), exact=True),
)
"""Every seam and private override, with its checks."""


def of_loop(loop: str) -> tuple:
    """The seams a run of `loop` ("megatron-lm" or "bridge") relies on: its own and Megatron-Core's;
    "core": Megatron-Core's alone; "all": every one."""
    if loop not in (*LOOPS, "all"):
        raise ValueError(f"unknown loop {loop!r}; valid: {', '.join(LOOPS)}, all")
    return tuple(s for s in SEAMS if loop == "all" or s.loop in (loop, "core"))


def wrapped(loop: str) -> dict:
    """{(module, name): leading parameters} of the functions `loop` wraps."""
    return {(s.module, s.qualname): s.params for s in SEAMS if s.loop == loop and s.use.startswith("wrapped")}


def checks_of(seam: Seam) -> list:
    """The start-up checks of `seam`, in words (docs/seams.md)."""
    out = []
    if seam.params:
        out.append(f"{'parameters exactly' if seam.exact else 'leading parameters'} ({', '.join(seam.params)})")
    out += [f"looked up by `{c.split(':')[1]}`" for c in seam.called_by]
    out += [f"read by `{r.split(':')[1]}`" for r in seam.read_by]
    if seam.keywords_of:
        out.append(f"every keyword `{seam.keywords_of.split(':')[1]}` passes is known")
    if seam.is_a:
        out.append(f"a {seam.is_a}")
    return out or ["exists"]


def document() -> str:
    """docs/seams.md."""
    lines = ["# Where SNIP joins Megatron", "",
             "Generated by `python -m snip_megatron.megatron.seam_check --write-doc` from "
             "`snip_megatron/megatron/seams.py`. Every row is checked at start-up by the loops that rely on it "
             "(`seam_check.check`), and against a Megatron-LM checkout by `scripts/check_megatron_drift.sh`.", "",
             "| loop | Megatron | SNIP's use | start-up check | run-time proof |", "|---|---|---|---|---|"]
    for s in SEAMS:
        lines.append(f"| {s.loop} | `{s.dotted}` | {s.use} | {'; '.join(checks_of(s))} | {s.at_run or '-'} |")
    return "\n".join(lines) + "\n"
