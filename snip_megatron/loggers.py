"""The run's own loggers, as SNIP writes to them: TensorBoard and Weights & Biases.

SNIP never opens a logger of its own in a Megatron run: it writes into the writers the loop
already has (Megatron-LM's `get_tensorboard_writer()` / `get_wandb_writer()`, Bridge's
`GlobalState.tensorboard_logger` / `wandb_logger`, the compact loop's `--tensorboard-dir`).
Each writer is wrapped in one small adapter with the three calls SNIP needs:

    scalars(step, {tag: value})             TensorBoard add_scalar / one W&B log
    image(step, tag, HxWx3 uint8 array)     TensorBoard add_image / wandb.Image
    table(step, tag, columns, rows)         TensorBoard text (a markdown table) / wandb.Table

Nothing here imports tensorboard or wandb: the adapters call the objects they are given (W&B's
`Image` and `Table` come from that object when it is the `wandb` module, as Megatron's writer is,
else from `wandb` itself, imported only then).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class FigureWriter(Protocol):
    """One logger, as SNIP writes to it."""

    def scalars(self, step: int, values: Mapping[str, float]) -> None: ...

    def image(self, step: int, tag: str, image) -> None:
        """`image`: an H x W x 3 uint8 array."""

    def table(self, step: int, tag: str, columns: Sequence[str], rows: Sequence[Sequence]) -> None: ...

    def flush(self) -> None: ...


class TensorBoardWriter:
    """A `torch.utils.tensorboard.SummaryWriter` (or anything with its add_scalar, add_image,
    add_text and flush)."""

    def __init__(self, writer):
        self.writer = writer

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def image(self, step: int, tag: str, image) -> None:
        self.writer.add_image(tag, image, step, dataformats="HWC")

    def table(self, step: int, tag: str, columns: Sequence[str], rows: Sequence[Sequence]) -> None:
        self.writer.add_text(tag, markdown_table(columns, rows), step)

    def flush(self) -> None:
        # SummaryWriter flushes every two minutes; a plan is rare and worth seeing now.
        if hasattr(self.writer, "flush"):
            self.writer.flush()


class WandbWriter:
    """A W&B run: the `wandb` module after `wandb.init` (Megatron's writer), a `wandb.Run`, or
    anything with `log(data, step=...)`."""

    def __init__(self, run):
        self.run = run

    def _wandb(self, name: str):
        """wandb.Image / wandb.Table: from the writer when it is the wandb module, else from wandb."""
        found = getattr(self.run, name, None)
        if found is None:
            import wandb  # only reached with a real W&B run, which means wandb is installed

            found = getattr(wandb, name)
        return found

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def image(self, step: int, tag: str, image) -> None:
        self.run.log({tag: self._wandb("Image")(image)}, step=step)

    def table(self, step: int, tag: str, columns: Sequence[str], rows: Sequence[Sequence]) -> None:
        self.run.log({tag: self._wandb("Table")(columns=list(columns), data=[list(r) for r in rows])}, step=step)

    def flush(self) -> None:
        """W&B sends in the background."""


MEASURE_FAILURES = "snip/measure_failures"
"""The scalar counting a run's failed measurements (snip_megatron.failures)."""


def write_scalars(loggers: "RunLoggers | None", step: int, values: Mapping[str, float]) -> None:
    """`values` at `step` in each of this rank's writers of `loggers` (none: nothing); a writer that
    fails is reported on this rank and never stops training."""
    if loggers is None or not loggers.enabled:
        return
    for writer in loggers.writers():
        try:
            writer.scalars(step, values)
            writer.flush()
        except Exception as exc:  # noqa: BLE001 - a logger's failure never stops training
            print(f"[snip] writing {', '.join(values)} of step {step} to the run's loggers failed: "
                  f"{type(exc).__name__}: {exc}", flush=True)


def writers_of(tensorboard=None, wandb=None) -> list[FigureWriter]:
    """Adapters for the writers given (None: that logger is off)."""
    out: list[FigureWriter] = []
    if tensorboard is not None:
        out.append(TensorBoardWriter(tensorboard))
    if wandb is not None:
        out.append(WandbWriter(wandb))
    return out


@dataclass
class RunLoggers:
    """The run's loggers, as a training loop hands them to SNIP.

    Loops create their writers on one rank (Megatron: the last), and only once training starts,
    so SNIP asks `writers()` each time it writes; `enabled` says whether the run has any logger at
    all, and must be the same on every rank (the rank that plans sends its figures to the others)."""

    writers: Callable[[], list] = field(default=list)
    """This rank's writers now (FigureWriter adapters); [] where this rank has none."""
    enabled: bool = False
    """The run logs to TensorBoard or W&B (its flags say so), on whichever rank."""


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A markdown table (TensorBoard's text plugin renders it); floats in 4 significant digits."""
    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
