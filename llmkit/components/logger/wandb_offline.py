"""``wandb``: Weights & Biases in offline mode: the run is written under the run directory
and uploaded later, if ever, with ``wandb sync`` (the ``wandb`` extra)."""

from __future__ import annotations

import math
from typing import Any

from llmkit.components.logger.options import WandbOptions as Options
from llmkit.contracts import LoggerContext, MetricsLogger
from llmkit.errors import LlmkitError


class WandbLogger(MetricsLogger):
    """Numeric values logged at the record's step, the spec as the run's config. Always
    offline: nothing leaves the machine until the user runs ``wandb sync``. A resumed run
    continues as a new W&B run of the same name (offline runs cannot be reopened)."""

    Options = Options

    def __init__(self, options: Options, ctx: LoggerContext) -> None:
        try:
            import wandb
        except ImportError:
            raise LlmkitError(
                "logger wandb needs the wandb package: pip install 'llmkit[wandb]'"
            ) from None
        self.run = wandb.init(
            project=options.project,
            group=options.group,
            tags=options.tags or None,
            name=ctx.run_name,
            config=ctx.config,
            dir=str(ctx.run_dir),
            mode="offline",
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )
        self.dir = ctx.run_dir / "wandb"

    def log(self, record: dict[str, Any]) -> None:
        values = {
            k: v
            for k, v in record.items()
            if k != "step"
            and isinstance(v, int | float)
            and not isinstance(v, bool)
            and math.isfinite(v)
        }
        if values:
            self.run.log(values, step=int(record.get("step", 0)))

    def close(self) -> None:
        self.run.finish()
