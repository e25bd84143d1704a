"""The options of `jobs/promote.py` (`PromoteJob`) and `jobs/register.py` (`RegisterJob`). Imports no MLflow,
so that both jobs answer `--help` fast; what they do is `jetflow.tracking.promotion` and
`jetflow.tracking.runs`."""

from __future__ import annotations

from dataclasses import dataclass, field

from jetflow.errors import InvalidSettingError


@dataclass
class PromoteJob:
    """`jobs/promote.py`'s options."""

    target: str = "smollm2-135m"         # target id whose registered heads to promote among
    version: str = ""                    # challenger: a version number, or an alias such as challenger (required)
    metric: str = "speedup"              # what the challenger must beat the champion on: speedup (vs AR) or tau
    margin: float = 0.02                 # relative margin, 0.02 = 2 % better
    eval_sets: list[str] = field(default_factory=list)  # eval sets to compare on (default: all shared)
    json: bool = False                   # print the decision as JSON

    def __post_init__(self) -> None:
        if not self.version:
            raise InvalidSettingError("--version is required: a version number or an alias such as challenger")


@dataclass
class RegisterJob:
    """`jobs/register.py`'s options."""

    head: str = ""                       # head folder, or a name under $JETFLOW_HOME/heads/ (required)
    target: str | None = None            # target id (default: the one in the head's config.json)
    revision: str | None = None          # target revision (default: the one in the head's config.json)
    alias: str | None = None             # also point this alias at the version: challenger (skipped if it is
                                         # already the champion)
    run_name: str | None = None          # name of the training run (default: train <folder name>)

    def __post_init__(self) -> None:
        if not self.head:
            raise InvalidSettingError("--head is required: a head folder or a name under $JETFLOW_HOME/heads/")
        if self.alias not in (None, "challenger"):
            raise InvalidSettingError(f"--alias may only be challenger (champion moves through the gate), "
                                      f"got {self.alias!r}")
