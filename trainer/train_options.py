"""What ``python -m trainer.train`` was asked to do, as typed options the engines take, and the
error an engine raises for options it refuses (the command reports it as a usage error)."""

from __future__ import annotations

from dataclasses import dataclass, fields


class OptionError(ValueError):
    """The options ask for a run the engine cannot do; the message names the option. The
    command reports it as a usage error (its usage line, the message, exit code 2)."""


@dataclass(frozen=True)
class TrainOptions:
    """The training command's options (``trainer.train --help`` says what each means)."""

    schema: str
    train_data: str
    out: str
    eval_data: str | None = None
    config: str | None = None
    model: str = "mlp"
    hidden: str | None = None
    compute: str | None = None
    batch_size: int | None = None
    epochs: int | None = None
    patience: int = 0
    eval_every: int | None = None
    seed: int | None = None
    export_dir: str | None = None
    export_format: str | None = None
    overwrite: bool = False
    resume: bool = False
    debug: bool = False
    no_progress: bool = False
    workers: int = 1
    shards: int = 1
    ray_address: str | None = None

    @classmethod
    def from_parsed(cls, parsed: dict) -> "TrainOptions":
        """The options of the command line's parsed values (by option name)."""
        return cls(**{f.name: parsed[f.name] for f in fields(cls) if f.name in parsed})

    @property
    def distributed(self) -> bool:
        """Whether the run is on Ray (``--workers``/``--shards`` above 1, or a cluster)."""
        return self.workers > 1 or self.shards > 1 or bool(self.ray_address)
