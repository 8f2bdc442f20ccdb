"""MegatronStep: the StepContext (snip_megatron.hooks) of Megatron-LM's loop at a step boundary."""

from __future__ import annotations


class MegatronStep:
    """This rank's chunks, optimizer and forward step, and the step's micro-batches.

    `current_batch` reads the step's micro-batches ahead on first access; train_step then trains
    on exactly those (`data_iterator()`), so a measurement never moves the data position."""

    def __init__(self, *, step: int, chunks: list, optimizer, forward_step_func, data_iterator,
                 num_microbatches: int, seq_length: int, micro_batch_size: int, formats, num_layers: int,
                 sm: "int | None" = None, inventory=None):
        self.step = step
        self.chunks = chunks
        self.optimizer = optimizer
        self.forward_step_func = outside_rerun(forward_step_func)
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.formats = formats
        self.num_layers = num_layers
        self.sm = sm
        self.inventory = inventory
        """The model's planned linears (models.inventory.Inventory); None: a dense GPT of num_layers."""
        """The GPU's compute capability for TE linears' dicts (None: emulated linears only)."""
        self._source = data_iterator
        self._n = num_microbatches
        self._buffered = None

    @property
    def current_batch(self) -> list:
        """The step's micro-batches (None items on ranks that read no data)."""
        if self._buffered is None:
            self._buffered = buffer_step(self._source, self._n)
        return self._buffered[1]

    def data_iterator(self):
        """What train_step must read this step: the original, or a replay of the buffered batches."""
        return self._source if self._buffered is None else self._buffered[0]

    def set_plan(self, plan) -> None:
        """This rank's planned linears run `plan` from now on (snip_megatron.megatron.apply)."""
        from snip_megatron.megatron.apply import apply_plan

        apply_plan(self.chunks, plan, formats=self.formats, sm=self.sm,
                   num_layers=self.num_layers if self.inventory is None else self.inventory)


def outside_rerun(forward_step_func):
    """The forward step for passes outside a training step (the measurement): Megatron-LM's loss
    functions validate the loss through the rerun state machine, which asserts it is inside a
    training pass; like Megatron's own `evaluate`, these passes run with it DISABLED (a NaN loss
    still raises, and the machine's mode comes back as it was)."""
    import functools

    @functools.wraps(forward_step_func)
    def forward_step(data_iterator, model, *args, **kwargs):
        output, loss_func = forward_step_func(data_iterator, model, *args, **kwargs)

        def loss(*largs, **lkwargs):
            from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

            machine = get_rerun_state_machine()
            mode = machine.get_mode()
            machine.set_mode(RerunMode.DISABLED)
            try:
                return loss_func(*largs, **lkwargs)
            finally:
                machine.set_mode(mode)

        return output, loss

    return forward_step


def buffer_step(data_iterator, n: int):
    """Read the step's `n` micro-batches ahead; returns (an iterator over them, the list).

    Megatron hands ranks that read no data a None iterator (they get None items), and a list of
    iterators with virtual pipelining (the micro-batches of the first chunk that reads data are
    returned: every chunk that reads gets the same ones)."""
    if isinstance(data_iterator, list):
        pairs = [buffer_step(it, n) for it in data_iterator]
        reading = [p[1] for p in pairs if any(b is not None for b in p[1])]
        return [p[0] for p in pairs], reading[0] if reading else [None] * n
    if data_iterator is None:
        return None, [None] * n
    from megatron.core.rerun_state_machine import RerunDataIterator

    batches = [next(data_iterator) for _ in range(n)]
    if isinstance(data_iterator, RerunDataIterator):
        data_iterator.advance()  # drop its copies: the replay iterator below keeps its own
    return RerunDataIterator(iter(batches)), batches
