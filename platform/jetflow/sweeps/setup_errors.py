"""Setup errors are not retried: a sweep trial that fails with a `JetFlowError` (a tracking server its node
cannot reach, a head it cannot load, a bad setting) would fail the same way on every retry, and Tune's
`FailureConfig(max_failures=N)` is there for lost nodes and workers. The trainable, wrapped by
`not_retried_on_setup_error`, reports the error before raising it; the `SetupErrorsNotRetried` callback, on that
report, leaves the trial no retries, so Tune records the error after one attempt. A resumed sweep runs the trial
again, as it does every errored trial (`resume_errored`), with the configured retries.

Ray is imported here at the top: import this module inside the functions that run a sweep.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ray import tune

from jetflow.errors import JetFlowError

SETUP_ERROR = "setup_error"  # the result key that carries a trial's setup error ("Type: message")


def not_retried_on_setup_error(trainable: Callable[[dict], None], **also_report) -> Callable[[dict], None]:
    """`trainable` (a Tune function trainable) whose `JetFlowError` is reported as `SETUP_ERROR`, then raised.
    `also_report`: values the report needs besides (the metric a scheduler requires in every result)."""

    @functools.wraps(trainable)
    def run(config: dict) -> None:
        try:
            trainable(config)
        except JetFlowError as exc:
            tune.report({SETUP_ERROR: f"{type(exc).__name__}: {exc}", **also_report})
            raise

    return run


class SetupErrorsNotRetried(tune.Callback):
    """Gives a trial that reported `SETUP_ERROR` no retries (Tune reruns a failed trial while it has failed at
    most `max_failures` times); every trial starts with the sweep's `max_failures`, a resumed one included."""

    def __init__(self, max_failures: int):
        self.max_failures = max_failures

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        trial.max_failures = self.max_failures

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        if SETUP_ERROR in result:
            trial.max_failures = 0
