"""A replica that follows the registry's alias: promotions reach running replicas without a redeploy.

Each replica re-reads `alias` (default `champion`) every `champion_poll_s` seconds (default 30) on a thread of
its own — one registry read. When the alias points at another version (or at none), it loads that head and
hands it to the replica (`switch`), which serves it from its next request on; requests already running finish
on the head they started with.

Why polling and not Serve's `reconfigure`/`user_config`: the alias is moved by `jobs/promote.py` (or the main
job) wherever it runs, against MLflow; it knows nothing of the Serve applications serving that target, and a
`user_config` change needs someone to `serve deploy` again. Polling makes the registry the one place a
promotion happens — as TF Serving and Triton poll their model repositories. The interval can be relaxed:
speculative decoding is lossless, so a replica serving the previous head a few seconds longer changes speed,
never outputs.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from jetflow.serving.config import ServeConfig
from jetflow.serving.selection import HeadChoice, alias_version, choose_head

log = logging.getLogger("ray.serve")


class ChampionFollower:
    """Polls `cfg.alias` for `target` every `cfg.champion_poll_s` seconds; on a new version calls
    `switch(choice)` with the head loaded on the CPU (the replica's engine thread moves it to the target's device).
    A registry that cannot be read is logged (once per outage) and the current head stays served."""

    def __init__(self, cfg: ServeConfig, target, served: str | None, switch: Callable[[HeadChoice], None]):
        self.cfg, self.target, self.served, self.switch = cfg, target, served, switch
        self._stop = threading.Event()
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="jetflow-champion", daemon=True)
        self._thread.start()

    def check(self) -> bool:
        """One poll; True when the replica switched head. Raises RegistryUnavailableError."""
        version = alias_version(self.cfg, self.target.model_id)
        if version == self.served:
            return False
        choice = choose_head(self.cfg, self.target, device="cpu")  # the version the alias holds now
        if choice.version == self.served:
            return False
        log.info("alias %s of %s's heads moved: %s → %s; new requests get it, running ones finish on %s",
                 self.cfg.alias, self.target.model_id, _v(self.served), _v(choice.version), _v(self.served))
        self.switch(choice)
        self.served = choice.version
        return True

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.champion_poll_s):
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 - keep serving the current head; the next poll retries
                if not self._failing:
                    log.warning("could not follow alias %s (still serving %s; retrying every %g s): %s",
                                self.cfg.alias, _v(self.served), self.cfg.champion_poll_s, exc)
                self._failing = True
                continue
            if self._failing:
                log.info("registry readable again: following %s", self.cfg.alias)
            self._failing = False


def _v(version: str | None) -> str:
    return f"v{version}" if version is not None else "no version (plain decoding)"
