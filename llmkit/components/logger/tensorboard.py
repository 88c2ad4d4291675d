"""``tensorboard``: scalars for TensorBoard (``tensorboard --logdir RUN/tensorboard``)."""

from __future__ import annotations

import math
from typing import Any

from llmkit.components.logger.options import TensorBoardOptions as Options
from llmkit.contracts import LoggerContext, MetricsLogger
from llmkit.errors import LlmkitError


class TensorBoardLogger(MetricsLogger):
    """Every numeric value of a record as a scalar at the record's step (tags as keys,
    ``/`` grouping them); a resumed run purges the events after its restart step."""

    Options = Options

    def __init__(self, options: Options, ctx: LoggerContext) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise LlmkitError(
                "logger tensorboard needs the tensorboard package: pip install "
                "'llmkit[tensorboard]'"
            ) from None
        purge = None if ctx.resume_step is None else ctx.resume_step + 1
        self.writer = SummaryWriter(str(ctx.run_dir / options.dir), purge_step=purge)

    def log(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        for key, value in record.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isfinite(value):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()
