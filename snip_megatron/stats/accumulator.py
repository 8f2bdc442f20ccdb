"""The sums of one pass, kept on the device until the measurement ends.

One float64 tensor in the StatsTable layout ([rows + 1, fields], the run-level scalars in the last
row) on the model's device receives every statistic as a 0-dim tensor, so no hook waits for the
GPU; values the host already knows (token counts, shapes) go into a host array of the same
layout, added in once by `tensor()`. Device values are queued and added by one `index_put_`
(accumulate, in the order they came: a CPU run sums exactly as one add each would) every
FLUSH_EVERY values and when the sums are read: an indexed in-place add per statistic cost several
tensor ops each. A measurement moves its statistics to the host once, after the last reduction
(`to_table`).
"""

from __future__ import annotations

import numpy as np
import torch

from snip_megatron.stats.table import StatsTable

FLUSH_EVERY = 4096  # queued device values at most (a 70B pass adds ~10^5: bounded memory)


class Accumulator:
    def __init__(self, keys, precisions, device):
        self.layout = StatsTable(keys=keys, precisions=precisions)  # names -> columns, keys -> rows
        self.device = torch.device(device)
        shape = (len(self.layout.keys) + 1, len(self.layout.fields))
        self.values = torch.zeros(shape, dtype=torch.float64, device=self.device)
        self.host = np.zeros(shape)
        self.pending: list = []  # (row, col, 0-dim device tensor) not yet added into `values`

    def row(self, key) -> int:
        return self.layout.row_index(key)

    def col(self, name: str) -> int:
        return self.layout.col(name)

    def add(self, row: int, col: int, value) -> None:
        """Add a 0-dim tensor (stays on the device) or a host number."""
        if isinstance(value, torch.Tensor):
            self.pending.append((row, col, value))
            if len(self.pending) >= FLUSH_EVERY:
                self._flush()
        else:
            self.host[row, col] += value

    def set_host(self, row: int, col: int, value: float) -> None:
        self.host[row, col] = value

    def _flush(self) -> None:
        if not self.pending:
            return
        rows, cols, vals = zip(*self.pending)
        self.pending = []
        # non_blocking: a pageable host-to-device copy is staged at once, without waiting for the device
        index = torch.tensor([rows, cols], dtype=torch.int64).to(self.device, non_blocking=True)
        self.values.index_put_((index[0], index[1]), torch.stack(vals).to(self.values.dtype), accumulate=True)

    def tensor(self) -> torch.Tensor:
        """Device and host parts together, on the device."""
        self._flush()
        return self.values + torch.from_numpy(self.host).to(self.device)


def to_table(t: torch.Tensor, layout: StatsTable) -> StatsTable:
    """The one device-to-host transfer of a measurement."""
    return StatsTable.from_array(layout.keys, t.cpu().numpy(), layout.precisions)
