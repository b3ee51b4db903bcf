"""The receiver agent's part that faces SGLang: what SGLang holds as far as the agent knows, and the loads.

Runs in: box.

The agent's buffer (:mod:`rollout_manager.weights.receiver`) hands tensors over; this part alone writes
what SGLang is believed to hold (its version, the tensors that may differ from the buffer, a failed
activation), so a full load through ``/commit`` and an activation
(:mod:`rollout_manager.weights.activation`) change that state through one owner and its methods.
"""

from __future__ import annotations

import logging

import aiohttp

from rollout_manager.sglang.auth import SGLangAuth
from rollout_manager.sglang.checkpoint import ServedModel
from rollout_manager.sglang.weight_loader import (
    FlushWhen,
    LoadRefused,
    LoadReport,
    LoadSettings,
    NamedTensors,
    SGLangWeights,
)
from rollout_manager.weights.layout import WeightLayout
from rollout_manager.weights.refused import CommitRefused

log = logging.getLogger("rollout_manager.receiver")


class Loader:
    """SGLang as the receiver agent knows it, and every load into it (``session`` is set by the agent's start)."""

    def __init__(self, sglang_url: str, auth: SGLangAuth, settings: LoadSettings) -> None:
        self.sglang_url = sglang_url
        self.auth = auth  # SGLang's --api-key/--admin-api-key, where it runs with them
        self.settings = settings
        self.session: aiohttp.ClientSession | None = None
        self.served: ServedModel | None = None  # the served checkpoint's names and shapes (None: unknown)
        self._served_path: str | None = None  # the model_path they were read for
        self.version: int | None = None  # last version loaded into SGLang
        self.dirty: set[str] | None = None  # tensors whose bytes may differ from SGLang's (None: all)
        self.reloaded = 0  # tensors the last load sent to SGLang
        self.readback = 0  # tensors the last load read back from SGLang and found equal
        # Why the last activation failed after SGLang was paused (SGLang left paused: out of service until a
        # full load succeeds); None: no such failure.
        self.failed: str | None = None

    # ------------------------------------------------------------ what SGLang holds
    def changed(self) -> set[str] | None:
        """The tensors a load must send (None: all of them; also when no version was loaded here)."""
        return None if self.dirty is None or self.version is None else set(self.dirty)

    def may_differ(self, names: set[str]) -> None:
        """``names`` were rewritten in the buffer: the next load sends them too."""
        if self.dirty is not None:
            self.dirty |= names

    def forget(self) -> None:
        """What SGLang holds is no longer known relative to the buffer: the next load sends every tensor."""
        self.dirty = None

    def loaded(self, version: int, report: LoadReport) -> None:
        """A load of ``version`` succeeded completely: SGLang holds the buffer's bytes."""
        self.version, self.dirty, self.readback = version, set(), report.readback

    def fail_activation(self, why: str) -> None:
        """An activation failed after the pause: SGLang stays paused and holds what nobody knows."""
        self.dirty, self.failed = None, why

    # ------------------------------------------------------------ loads
    def weights(self) -> SGLangWeights:
        assert self.session is not None
        return SGLangWeights(self.session, self.sglang_url, self.auth, self.settings)

    async def check_layout(self, layout: WeightLayout, *, strict: bool = True) -> None:
        """Refuse (409) a layout SGLang would load silently partially (a name its model does not know) or
        die on (a shape other than its own), judged by the served checkpoint's headers; a server whose
        checkpoint is not readable on this box is not judged (the read-back after the load still is).
        An SGLang that does not answer is a refusal when ``strict`` (a load needs it), else not judged."""
        try:
            weights = self.weights()
            facts = await weights.server_facts()
            if facts.model_path != self._served_path:
                self.served, self._served_path = await weights.served_model(facts), facts.model_path
        except LoadRefused as exc:
            if not strict:
                log.info("layout not checked before the transfer: %s", exc)
                return
            raise CommitRefused(exc.status, str(exc)) from None
        if self.served is None:
            return
        problems = self.served.problems((s.name, s.shape) for s in layout.specs)
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise CommitRefused(409, f"the layout does not fit the model SGLang serves ({self.served.path}): "
                                     f"{'; '.join(problems[:5])}{more}; nothing loaded")

    async def commit(self, layout: WeightLayout, named: NamedTensors, version: int) -> int:
        """The full load behind ``/commit``, inside a ``retract`` pause: the manager drained the box, but a
        request that reaches SGLang some other way must not run between two buckets on a half-loaded model
        (unpaused, SGLang takes its writer lock per call, not for the load). Generation continues after the
        load, also after a failed one (as before the pause: the manager keeps the box out of service and
        pushes again), except where a failed activation had left SGLang paused, which only a complete load
        continues. Returns the buckets."""
        names = self.changed()
        weights = self.weights()
        try:
            await self.check_layout(layout)
            await weights.pause("retract")
        except LoadRefused as exc:
            self.forget()
            raise CommitRefused(exc.status, f"{exc}; nothing loaded") from None
        except BaseException:
            self.forget()
            raise
        try:
            buckets = await self.load(named, version, names, flush="now")
        except BaseException:
            self.forget()  # what SGLang holds now is not known: the next load sends every tensor
            if self.failed is None:
                await self._resume_after_failed_load(weights)
            raise
        try:
            await weights.resume()
        except LoadRefused as exc:
            raise CommitRefused(exc.status, str(exc)) from None
        if self.failed is not None:  # an activation failed with SGLang paused: a full load is in, serve again
            log.info("version %d fully loaded after a failed activation; SGLang continues", version)
            self.failed = None
        return buckets

    async def _resume_after_failed_load(self, weights: SGLangWeights) -> None:
        try:
            await weights.resume()
        except LoadRefused as exc:  # the load's own failure is what the caller reports
            log.warning("SGLang at %s could not continue generation after a failed load: %s", self.sglang_url, exc)

    async def load(self, named: NamedTensors, version: int, names: set[str] | None = None,
                   flush: FlushWhen = "when_idle") -> int:
        """Load the tensors of ``named`` in ``names`` (None: all; none: the smallest one) into SGLang (see
        rollout_manager/sglang/weight_loader.py), and read a sample back where ``readback_tensors`` asks. A
        partial load happens only when SGLang still reports the version this agent last loaded: a server that
        restarted under the agent (or was loaded by someone else) gets every tensor. Returns the buckets; ``reloaded``
        says how many tensors went."""
        weights = self.weights()
        loading = await self.selection(weights, named, names)
        self.reloaded = len(loading)
        try:
            report = await weights.load(loading, version, served=self.served, flush=flush,
                                        sample=readback_sample(named, self.settings.readback_tensors, version))
        except LoadRefused as exc:
            raise CommitRefused(exc.status, str(exc)) from None
        self.loaded(version, report)
        return report.buckets

    async def selection(self, weights: SGLangWeights, named: NamedTensors, names: set[str] | None) -> NamedTensors:
        """The tensors of ``named`` to load: ``names`` (None: all; none: the smallest one), or all when
        SGLang does not report the version this agent last loaded."""
        if names is not None:
            try:
                reported = await weights.reported_version()
            except LoadRefused as exc:
                raise CommitRefused(exc.status, str(exc)) from None
            if reported != str(self.version):
                log.warning("SGLang at %s reports weight_version %r, not %s as last loaded by this agent (it "
                            "restarted?): loading every tensor, not only the %d changed", self.sglang_url, reported,
                            self.version, len(names))
                names = None
        if names is None:
            return named
        chosen = [(n, t) for n, t in named if n in names]
        return chosen or ([min(named, key=lambda item: item[1].nbytes)] if named else [])


def readback_sample(named: NamedTensors, count: int, version: int) -> NamedTensors:
    """``count`` tensors spread over all of them (every tensor must equal what SGLang holds after a load,
    not only those just sent), starting at a point that moves with the version."""
    if count <= 0 or not named:
        return []
    if count >= len(named):
        return list(named)
    step = len(named) / count
    return [named[(version + int(i * step)) % len(named)] for i in range(count)]
