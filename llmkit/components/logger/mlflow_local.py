"""``mlflow``: an MLflow run, by default in a local SQLite store in the run directory (the
``mlflow`` extra); ``mlflow ui --backend-store-uri sqlite:///RUN/mlflow.db`` shows it."""

from __future__ import annotations

import math
import time
from typing import Any

from llmkit.components.logger.options import MlflowOptions as Options
from llmkit.contracts import LoggerContext, MetricsLogger
from llmkit.errors import LlmkitError

#: MLflow accepts at most this many parameters per batch call.
PARAMS_PER_CALL = 100


class MlflowLogger(MetricsLogger):
    """Numeric values as metrics at the record's step; the spec, flattened, as parameters.
    A resumed run continues as a new MLflow run of the same name."""

    Options = Options

    def __init__(self, options: Options, ctx: LoggerContext) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise LlmkitError(
                "logger mlflow needs the mlflow package: pip install 'llmkit[mlflow]'"
            ) from None
        from mlflow.entities import Param

        self.uri = options.tracking_uri or f"sqlite:///{(ctx.run_dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=self.uri)
        found = self.client.get_experiment_by_name(options.experiment)
        exp = found.experiment_id if found else self.client.create_experiment(options.experiment)
        self.run_id = self.client.create_run(exp, run_name=ctx.run_name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in _flatten(ctx.config).items()]
        for i in range(0, len(params), PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[i : i + PARAMS_PER_CALL])

    def log(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step, now = int(record.get("step", 0)), int(time.time() * 1000)
        metrics = [
            Metric(k, float(v), now, step)
            for k, v in record.items()
            if k != "step"
            and isinstance(v, int | float)
            and not isinstance(v, bool)
            and math.isfinite(v)
        ]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out
