"""The options of the built-in experiment trackers (torch-free: a spec is checked without
them or their packages)."""

from __future__ import annotations

from pydantic import Field

from llmkit.options import ComponentOptions


class CsvOptions(ComponentOptions):
    """Options of the csv logger."""

    file: str = Field(
        "metrics.csv",
        pattern=r"^[^/\\]+\.csv$",
        description="File name in the run directory",
    )


class TensorBoardOptions(ComponentOptions):
    """Options of the tensorboard logger."""

    dir: str = Field(
        "tensorboard", pattern=r"^[^/\\]+$", description="Directory in the run directory"
    )


class WandbOptions(ComponentOptions):
    """Options of the wandb logger."""

    project: str = Field("llmkit", min_length=1, description="W&B project name")
    group: str | None = Field(None, description="W&B group (default: none)")
    tags: list[str] = Field(default_factory=list, description="W&B tags")


class MlflowOptions(ComponentOptions):
    """Options of the mlflow logger."""

    experiment: str = Field("llmkit", min_length=1, description="MLflow experiment name")
    tracking_uri: str | None = Field(
        None,
        description="Tracking store (default: sqlite:///RUN/mlflow.db, local and offline; a "
        "server URL sends the run there)",
    )
