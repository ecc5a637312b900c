"""Per-tenant estimates that no tenant can move for another, and that a tenant cannot talk down.

It answers: *how many prompt tokens does this body hold for the engine, and how much output will
this tenant's request produce?* Both are learned from what the engine reports, and both feed
decisions that protect others (a tenant's ``maxInputTokens`` cap, how many requests an endpoint
takes at once), so how they are learned is decided on purpose:

- **Per tenant, never shared.** A calibration shared by all tenants let one tenant's cheap
  requests carry another's prompt past its cap, or push another's honest prompts over it. Each
  tenant's estimate is learned only from its own requests, so the most a tenant can move is its
  own.
- **Bounded.** The prompt calibration (engine ``prompt_tokens`` ÷ the body's estimate, which
  ``picker.openai`` makes by script and counts images, audio, files and tools in) is clamped to
  ``[SCALE_MIN, SCALE_MAX]``, and each sample too, so one absurd report moves the average by a
  bounded step. A byte-level tokenizer comes within 0.7-1.4 of the body's estimate
  (bench/results/estimates.md); the band leaves room below for tokenizers with larger
  vocabularies (CJK at about half the estimate) and above for what the estimate misses.
- **Caps and budgets judged on a floor that cannot be gamed.** A tenant could teach its own
  calibration that its prompts are tiny (very compressible text, digits an engine counts three
  a token), then send a long normal one, or images. So caps and budget reservations are judged
  on ``max(body estimate, calibrated estimate)``: calibration may only *raise* what a request is
  held to, never lower it below the body's own size (``prompt_floor``); only the queue's order
  and an endpoint's room use the calibrated estimate as learned.
- **Stream output learned from streams, rising fast and falling slowly.** A stream's estimate
  decides how many streams an endpoint takes at once, so it is learned from the output the
  tenant's streams actually produced, not from its non-streaming answers. A stream that was cut
  short (cancelled, failed, or stopped by its own ``max_tokens``) says nothing about how long the
  next one runs: it may raise the estimate, never lower it. Only streams that ended on their own
  lower it, and slowly (``FALL_ALPHA``); it rises at ``RISE_ALPHA``.
- **Forgettable exactly.** An estimate not refreshed for ``ttl`` seconds *is* the default (that is
  the rule, not an approximation), so ``prune`` drops it without changing any later decision: a
  never-forgetting copy would read the default too. A tenant that waits out the ttl gets what a
  brand-new tenant gets, no less.
- **Shared, last learned wins.** With a shared state store every replica learns from the
  requests it served and sends what it learned; the last estimate learned anywhere is everyone's.
  Samples two replicas took in the same interval are not averaged together: the estimate is a
  moving average, and losing a few samples moves it less than one sample does.
- **Bounded under a flood.** Within the ttl, each table holds at most ``max_tenants`` tenants;
  past that the least recently updated one reverts to the default. That can change a decision,
  but only to what a fresh tenant id gets, which any client in header mode can have anyway.

Pure: time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

SCALE_MIN = 0.5
"""The lowest prompt calibration believed: engine tokens ÷ the body's estimate."""
SCALE_MAX = 4.0
"""The highest: what the body's estimate may miss by (a model whose images cost more than its
``models[]`` entry says, a chat template longer than ``MESSAGE_OVERHEAD_TOKENS``)."""
PROMPT_ALPHA = 0.1
"""How fast a tenant's prompt calibration follows its samples."""
OUTPUT_ALPHA = 0.2
"""How fast a non-streaming output average follows its samples."""
RISE_ALPHA = 0.5
"""How fast an output estimate follows a sample above it."""
FALL_ALPHA = 0.05
"""How fast it follows a sample below it: slowly, so a burst of short answers cannot pull it
down before a burst of long ones."""
MAX_MODELS = 8
"""Models a tenant's prompt calibration is kept for at once."""
MAX_TENANTS = 50_000
"""Tenants each table holds at most (least recently updated dropped first)."""
DEFAULT_TTL = 600.0
"""Seconds after which an estimate that was not refreshed reverts to the default."""


SCALE, OUTPUT, STREAM = "scale", "output", "stream"
"""The kinds of estimate, as shared with other pickers."""


@dataclass(slots=True)
class _Learned:
    value: float
    updated: float


def _clamp(value: float, low: float, high: float) -> float:
    return min(high, max(low, value))


class TenantEstimates:
    """Per-tenant prompt calibration and output estimates (non-streaming and streaming)."""

    def __init__(self, default_output: float, *, ttl: float = DEFAULT_TTL,
                 max_tenants: int = MAX_TENANTS) -> None:
        if not default_output >= 0:
            raise ValueError(f"default_output must be >= 0, not {default_output!r}")
        if not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds, not {ttl!r}")
        self.default_output = float(default_output)
        self.ttl = float(ttl)
        if not max_tenants >= 1:
            raise ValueError(f"max_tenants must be >= 1, not {max_tenants!r}")
        self.max_tenants = int(max_tenants)
        self._scale: dict[str, dict[str, _Learned]] = {}
        self._output: dict[str, _Learned] = {}
        self._stream: dict[str, _Learned] = {}
        self._changed: set[tuple[str, str, str]] | None = None
        """With a shared state store (``track_changes``): ``(kind, tenant, model)`` of the
        estimates learned here since ``take_learned``."""

    def _put(self, table: dict, tenant: str, value: object) -> None:
        """Store as the most recently updated (dicts keep insertion order), dropping the least
        recently updated past ``max_tenants``."""
        table.pop(tenant, None)
        table[tenant] = value
        while len(table) > self.max_tenants:
            del table[next(iter(table))]

    def _read(self, table: dict[str, _Learned], tenant: str, default: float,
              now: float) -> float:
        learned = table.get(tenant)
        if learned is None or now - learned.updated > self.ttl:
            return default
        return learned.value

    # -- prompt size --

    def prompt_scale(self, tenant: str, model: str, now: float) -> float:
        """The tenant's calibration for ``model``: engine prompt tokens per body-estimated token
        (1 when not learned)."""
        learned = self._scale.get(tenant, {}).get(model)
        if learned is None or now - learned.updated > self.ttl:
            return 1.0
        return learned.value

    def prompt_tokens(self, tenant: str, model: str, body_estimate: int, now: float) -> int:
        """The calibrated prompt estimate (ordering, reservations, endpoint room)."""
        return max(1, round(body_estimate * self.prompt_scale(tenant, model, now)))

    @staticmethod
    def prompt_floor(body_estimate: int, calibrated: int) -> int:
        """What caps are judged on: calibration may raise the body's own estimate, not lower it."""
        return max(body_estimate, calibrated)

    def learn_prompt(self, tenant: str, model: str, body_estimate: int, reported: int,
                     now: float) -> None:
        """The engine counted ``reported`` prompt tokens for a body of ``tenant`` for ``model``
        estimated at ``body_estimate``. Tokenizers differ per model, so each model has its own
        calibration; a tenant keeps at most ``MAX_MODELS`` (model names come from clients), and
        a further model stays uncalibrated (1) until one of them expires."""
        if body_estimate <= 0 or reported <= 0:
            return
        models = self._scale.get(tenant, {})
        learned = models.get(model)
        if learned is None and len(models) >= MAX_MODELS:
            return
        sample = _clamp(reported / body_estimate, SCALE_MIN, SCALE_MAX)
        if learned is None or now - learned.updated > self.ttl:
            value = sample
        else:
            value = learned.value + PROMPT_ALPHA * (sample - learned.value)
        models[model] = _Learned(_clamp(value, SCALE_MIN, SCALE_MAX), now)
        self._put(self._scale, tenant, models)
        if self._changed is not None:
            self._changed.add((SCALE, tenant, model))

    # -- output --

    def output(self, tenant: str, now: float, *, stream: bool = False) -> float:
        """The tenant's expected output per request (uncapped), for streams or not."""
        return self._read(self._stream if stream else self._output, tenant,
                          self.default_output, now)

    def learn_output(self, tenant: str, produced: int, now: float, *, stream: bool = False,
                     complete: bool = True) -> None:
        """A request produced ``produced`` output tokens. ``complete``: it ended on its own (not
        cancelled, failed, or stopped by its ``max_tokens``); an incomplete one only raises."""
        sample = float(produced) if produced > 0 else 0.0
        if not stream:
            # Non-streaming output is reserved whole at dispatch and settled on the actual, so
            # a low estimate costs only the tenant itself: a plain moving average, the first
            # sample replacing the default.
            learned = self._output.get(tenant)
            value = sample if learned is None or now - learned.updated > self.ttl else \
                learned.value + OUTPUT_ALPHA * (sample - learned.value)
            self._put(self._output, tenant, _Learned(value, now))
            if self._changed is not None:
                self._changed.add((OUTPUT, tenant, ""))
            return
        # ``self.output(tenant, now, stream=True)`` and ``_put``, inline (per request).
        table = self._stream
        learned = table.get(tenant)
        current = self.default_output if learned is None or now - learned.updated > self.ttl \
            else learned.value
        if sample < current and not complete:
            return
        alpha = RISE_ALPHA if sample >= current else FALL_ALPHA
        table.pop(tenant, None)
        table[tenant] = _Learned(current + alpha * (sample - current), now)
        while len(table) > self.max_tenants:
            del table[next(iter(table))]
        if self._changed is not None:
            self._changed.add((STREAM, tenant, ""))

    # -- shared state (``picker.core.shared``) --

    def track_changes(self) -> None:
        """From now on record which estimates are learned here, for ``take_learned``."""
        if self._changed is None:
            self._changed = set()

    def take_learned(self) -> list[tuple[str, str, str, float, float]]:
        """``(kind, tenant, model, value, updated)`` of each estimate learned here since the
        last call (``model`` is empty but for ``scale``)."""
        if not self._changed:
            return []
        taken = []
        for kind, tenant, model in self._changed:
            learned = self._learned(kind, tenant, model)
            if learned is not None:
                taken.append((kind, tenant, model, learned.value, learned.updated))
        self._changed = set()
        return taken

    def set_learned(self, kind: str, tenant: str, model: str, value: float,
                    updated: float) -> None:
        """An estimate learned elsewhere (the last one learned anywhere wins), unless this
        picker learned a newer one that it has not sent yet."""
        if self._changed and (kind, tenant, model) in self._changed:
            return
        current = self._learned(kind, tenant, model)
        if current is not None and current.value == value:
            return
        if kind == SCALE:
            models = self._scale.get(tenant, {})
            if model not in models and len(models) >= MAX_MODELS:
                return
            models[model] = _Learned(_clamp(value, SCALE_MIN, SCALE_MAX), updated)
            self._put(self._scale, tenant, models)
        elif kind in (OUTPUT, STREAM):
            self._put(self._output if kind == OUTPUT else self._stream, tenant,
                      _Learned(max(0.0, value), updated))

    def _learned(self, kind: str, tenant: str, model: str) -> _Learned | None:
        if kind == SCALE:
            return self._scale.get(tenant, {}).get(model)
        return (self._output if kind == OUTPUT else self._stream).get(tenant)

    # -- memory --

    def prune(self, now: float) -> int:
        """Drop estimates older than the ttl (they read as the default already); returns how
        many."""
        dropped = 0
        for tenant, models in list(self._scale.items()):
            for model in [m for m, learned in models.items() if now - learned.updated > self.ttl]:
                del models[model]
                dropped += 1
            if not models:
                del self._scale[tenant]
        for table in (self._output, self._stream):
            stale = [t for t, learned in table.items() if now - learned.updated > self.ttl]
            for tenant in stale:
                del table[tenant]
            dropped += len(stale)
        if dropped:
            # A dict keeps its largest table after deletions: copy them to give a flood back.
            self._scale, self._output, self._stream = \
                dict(self._scale), dict(self._output), dict(self._stream)
        return dropped

    def tenants(self) -> set[str]:
        """Tenants with any learned estimate (memory use)."""
        return set(self._scale) | set(self._output) | set(self._stream)
