"""The logger adapters: what SNIP calls on a TensorBoard SummaryWriter and on a W&B run."""

import numpy as np
import pytest

from snip_megatron.loggers import RunLoggers, TensorBoardWriter, WandbWriter, markdown_table, writers_of


class Recorder:
    """Records every call made on it: `calls` holds (method name, args, kwargs)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


class FakeWandb:
    """The `wandb` module as Megatron's writer is (after wandb.init): log, Image, Table."""

    def __init__(self):
        self.logged = []

    def log(self, data, step=None):
        self.logged.append((step, data))

    class Image:
        def __init__(self, data):
            self.data = data

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data


def test_tensorboard_adapter_calls_the_summary_writer():
    tb = Recorder()
    writer = TensorBoardWriter(tb)
    image = np.zeros((4, 5, 3), dtype=np.uint8)
    writer.scalars(7, {"snip/a": 1.0, "snip/b": 2.0})
    writer.image(7, "snip/img", image)
    writer.table(7, "snip/t", ["layer", "cost"], [[1, 0.123456]])
    writer.flush()
    assert [c[0] for c in tb.calls] == ["add_scalar", "add_scalar", "add_image", "add_text", "flush"]
    assert tb.calls[0][1] == ("snip/a", 1.0, 7)
    assert tb.calls[2][1][:3] == ("snip/img", image, 7) and tb.calls[2][2] == {"dataformats": "HWC"}
    assert tb.calls[3][1] == ("snip/t", "| layer | cost |\n|---|---|\n| 1 | 0.1235 |", 7)


def test_wandb_adapter_logs_images_and_tables_of_the_writer():
    run = FakeWandb()
    writer = WandbWriter(run)
    writer.scalars(3, {"snip/a": 1.0})
    writer.image(3, "snip/img", np.zeros((2, 2, 3), dtype=np.uint8))
    writer.table(3, "snip/t", ("layer", "precision"), [(1, "fp4")])
    steps = [s for s, _ in run.logged]
    assert steps == [3, 3, 3] and run.logged[0][1] == {"snip/a": 1.0}
    assert isinstance(run.logged[1][1]["snip/img"], FakeWandb.Image)
    table = run.logged[2][1]["snip/t"]
    assert table.columns == ["layer", "precision"] and table.data == [[1, "fp4"]]


def test_writers_of_only_what_is_there():
    assert writers_of() == []
    kinds = [type(w) for w in writers_of(tensorboard=Recorder(), wandb=FakeWandb())]
    assert kinds == [TensorBoardWriter, WandbWriter]
    assert RunLoggers().writers() == [] and not RunLoggers().enabled


def test_markdown_table_rounds_floats():
    assert markdown_table(["a"], [[float("nan")], [2.0]]).splitlines()[2:] == ["| nan |", "| 2 |"]


@pytest.mark.timeout(60)
def test_a_real_summary_writer_reads_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    tb = SummaryWriter(str(tmp_path))
    writer = TensorBoardWriter(tb)
    writer.scalars(2, {"snip/x": 0.5})
    writer.image(2, "snip/img", np.full((6, 8, 3), 200, dtype=np.uint8))
    writer.table(2, "snip/t", ["layer"], [[1]])
    tb.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "tensors": 0}).Reload()
    assert [(e.step, e.value) for e in events.Scalars("snip/x")] == [(2, 0.5)]
    image = events.Images("snip/img")[0]
    assert (image.step, image.width, image.height) == (2, 8, 6)
    text = events.Tensors("snip/t/text_summary")[0]
    assert text.tensor_proto.string_val[0].decode().startswith("| layer |")
