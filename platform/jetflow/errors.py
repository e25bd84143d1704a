"""Errors a user can cause. Each message says what to do; CLIs exit 2, servers answer 4xx."""


class JetFlowError(Exception):
    """Base class of every user-caused error."""


class UnknownModelError(JetFlowError):
    """A target name that is neither bundled, a local directory, nor loadable from a hub."""


class HeadNotFoundError(JetFlowError):
    """A head path without a config.json / model.safetensors."""


class HeadMismatchError(JetFlowError):
    """A head whose hidden size, vocabulary or tapped layers do not fit the target."""


class InvalidSettingError(JetFlowError, ValueError):
    """A decoding setting out of range (budget < 1, width < 1, temperature < 0, ...)."""


class PromptTooLongError(JetFlowError):
    """Prompt plus requested tokens exceed what the target can attend to."""


class PromptSetUnavailableError(JetFlowError):
    """A registered prompt set whose package (or a file in it) is not installed."""


class VllmUnavailableError(JetFlowError):
    """A vLLM path (export check, regeneration backend, serving option) on a machine without vLLM."""


class ExportUnsupportedError(JetFlowError):
    """A head with an option the export target cannot load exactly (e.g. vLLM's DFlash has no per-tap norms)."""


class TrackingUnreachableError(JetFlowError):
    """An MLflow tracking server that does not answer where work is told to log (a loopback address handed to
    another node, a Host header it refuses, a server down, a firewall): the driver, before any work, or the
    worker fails with the reason instead of losing the logs (`jetflow.tracking.probe`)."""
