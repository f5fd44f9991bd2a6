"""The privacy ledger: every round's DP event, the epsilon spent so far, and a budget.

The coordinator asks the ledger *before* a round runs. ``ledger.spend(event)`` composes the
round into a copy of the accountant, and either commits it (returning the new epsilon) or
raises :class:`PrivacyBudgetExceeded` with the numbers, leaving the ledger unchanged, so the
round that would overshoot the budget is never run.

The ledger's state is plain data (``to_dict``: a dict of floats, ints, strings and lists;
``to_json``) for checkpoints; ``from_dict`` rebuilds the accountant by replaying the events.

Example:
  >>> ledger = PrivacyLedger(delta=1e-5, budget=3.0)
  >>> event = PrivacyEvent(noise_multiplier=1.0, sampling_rate=0.01, clip_norm=0.5)
  >>> eps = ledger.spend(event)  # raises PrivacyBudgetExceeded once the budget would be exceeded
  >>> 0.0 < eps < 3.0
  True
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from consensus.privacy._checks import check_delta, check_epsilon, check_rounds, check_sampling_rate
from consensus.privacy.pld import DEFAULT_DISCRETISATION, PldAccountant
from consensus.privacy.rdp import RdpAccountant

_FORMAT = "meta-consensus/privacy-ledger/v1"


class PrivacyBudgetExceeded(ValueError):
    """Running the next round would spend more epsilon than the ledger's budget allows."""


@dataclasses.dataclass(frozen=True)
class PrivacyEvent:
    """One DP release (or ``rounds`` identical ones) of the sampled Gaussian mechanism.

    Attributes:
      noise_multiplier: z >= 0, noise std divided by the L2 sensitivity of the release
        (for adaptive clipping: the combined multiplier of the sum and the count). z = 0 is
        a release without noise: epsilon becomes infinite.
      sampling_rate: q in (0, 1], the Poisson sampling probability actually used.
      clip_norm: the clip norm C of the round (recorded for audit; epsilon depends on z and q).
      rounds: how many identical rounds this event stands for.
    """

    noise_multiplier: float
    sampling_rate: float = 1.0
    clip_norm: float | None = None
    rounds: int = 1

    def __post_init__(self) -> None:
        z = float(self.noise_multiplier)
        if not (math.isfinite(z) and z >= 0.0):
            raise ValueError(f"noise_multiplier must be finite and >= 0, got {self.noise_multiplier}")
        object.__setattr__(self, "noise_multiplier", z)
        object.__setattr__(self, "sampling_rate", check_sampling_rate(self.sampling_rate))
        object.__setattr__(self, "rounds", check_rounds(self.rounds))
        if self.clip_norm is not None:
            c = float(self.clip_norm)
            if not (math.isfinite(c) and c > 0.0):
                raise ValueError(f"clip_norm must be finite and > 0, got {self.clip_norm}")
            object.__setattr__(self, "clip_norm", c)

    def to_dict(self) -> dict[str, Any]:
        """Return the event as a plain dict of its fields (JSON-compatible)."""
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> PrivacyEvent:
        """Rebuild an event from :meth:`to_dict` (keys that are not fields are ignored).

        Args:
          d: A dict holding the event's fields (a ledger entry also holds ``epsilon``).

        Returns:
          The :class:`PrivacyEvent`.

        Raises:
          ValueError: If a field is out of range.
        """
        return PrivacyEvent(**{f.name: d[f.name] for f in dataclasses.fields(PrivacyEvent) if f.name in d})


class PrivacyLedger:
    """Records DP events round by round and enforces an (epsilon, delta) budget.

    Args:
      delta: the delta at which epsilon is reported and the budget is enforced.
      budget: maximum epsilon (None: record only, never refuse).
      accountant: "rdp" or "pld"; the accountant that turns events into epsilon.
      discretization: PLD grid step (PLD only).

    Attributes:
      entries: one plain dict per spent event: the event's fields and ``epsilon`` (spent
        so far, including this event).
    """

    def __init__(
        self,
        delta: float,
        budget: float | None = None,
        accountant: str = "rdp",
        *,
        discretization: float = DEFAULT_DISCRETISATION,
    ):
        self.delta = check_delta(delta)
        self.budget = None if budget is None else check_epsilon(budget, "budget")
        if accountant not in ("rdp", "pld"):
            raise ValueError(f"unknown accountant {accountant!r}; choose 'rdp' or 'pld'")
        self.accountant = accountant
        self.discretization = float(discretization)
        self.entries: list[dict[str, Any]] = []
        self._acc = self._new_accountant()
        self._noiseless = False  # a z = 0 event makes epsilon infinite for good

    def _new_accountant(self) -> RdpAccountant | PldAccountant:
        if self.accountant == "rdp":
            return RdpAccountant()
        return PldAccountant(self.discretization)

    @property
    def events(self) -> list[PrivacyEvent]:
        """The recorded events, in order."""
        return [PrivacyEvent.from_dict(e) for e in self.entries]

    @property
    def rounds(self) -> int:
        """Number of rounds recorded (events count ``rounds`` each)."""
        return sum(int(e["rounds"]) for e in self.entries)

    def epsilon(self) -> float:
        """Epsilon spent so far at ``self.delta`` (0 before any event)."""
        if self._noiseless:
            return math.inf
        return self._acc.epsilon(self.delta)

    def epsilon_after(self, event: PrivacyEvent) -> float:
        """Return the epsilon that would be spent if ``event`` were recorded now (the ledger is unchanged).

        Args:
          event: The coming round's event.

        Returns:
          Epsilon at ``self.delta`` after the event (inf once a noiseless round is composed).

        Raises:
          TypeError: If ``event`` is not a :class:`PrivacyEvent`.
        """
        return self._compose(event)[1]

    def _compose(self, event: PrivacyEvent) -> tuple[RdpAccountant | PldAccountant, float]:
        if not isinstance(event, PrivacyEvent):
            raise TypeError(f"expected a PrivacyEvent, got {type(event).__name__}")
        acc = self._acc.copy()
        if event.rounds == 0:
            return acc, self.epsilon()
        if event.noise_multiplier == 0.0 or self._noiseless:
            return acc, math.inf
        acc.compose(event.noise_multiplier, event.sampling_rate, event.rounds)
        return acc, acc.epsilon(self.delta)

    def can_spend(self, event: PrivacyEvent) -> bool:
        """Tell whether recording ``event`` keeps epsilon within the budget.

        Args:
          event: The coming round's event.

        Returns:
          True when there is no budget or epsilon after the event is at most the budget.
        """
        return self.budget is None or self.epsilon_after(event) <= self.budget

    def spend(self, event: PrivacyEvent) -> float:
        """Record ``event`` and return the epsilon spent so far, or refuse it.

        Args:
          event: The coming round's event.

        Returns:
          Epsilon spent so far at ``self.delta``, this event included.

        Raises:
          TypeError: If ``event`` is not a :class:`PrivacyEvent`.
          PrivacyBudgetExceeded: if the event would take epsilon above the budget. Nothing is
            recorded, so the round must not run.
        """
        acc, eps = self._compose(event)
        if self.budget is not None and eps > self.budget:
            raise PrivacyBudgetExceeded(
                f"privacy budget exceeded: round {self.rounds + 1} "
                f"(noise_multiplier={event.noise_multiplier}, "
                f"sampling_rate={event.sampling_rate}, rounds={event.rounds}) would bring epsilon from "
                f"{self.epsilon():.6g} to {eps:.6g} at delta={self.delta:g}, above the budget "
                f"{self.budget:g} ({self.accountant} accountant); the round was not run"
            )
        self._acc = acc
        if event.noise_multiplier == 0.0 and event.rounds > 0:
            self._noiseless = True
        self.entries.append({**event.to_dict(), "epsilon": eps})
        return eps

    # -- checkpointing: plain data only ---------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Return the ledger's plain-data state (JSON-compatible; infinite epsilons are floats ``inf``)."""
        return {
            "format": _FORMAT,
            "delta": self.delta,
            "budget": self.budget,
            "accountant": self.accountant,
            "discretization": self.discretization,
            "entries": [dict(e) for e in self.entries],
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> PrivacyLedger:
        """Rebuild a ledger (and its accountant, by replaying the events) from :meth:`to_dict`.

        Args:
          d: The dict :meth:`to_dict` wrote.

        Returns:
          The :class:`PrivacyLedger`.

        Raises:
          ValueError: If ``d`` is not a privacy ledger state (wrong ``format``) or holds
            invalid settings or events.
        """
        if d.get("format") != _FORMAT:
            raise ValueError(f"not a privacy ledger state: format {d.get('format')!r}, expected {_FORMAT!r}")
        ledger = PrivacyLedger(
            d["delta"],
            d["budget"],
            d["accountant"],
            discretization=d.get("discretization", DEFAULT_DISCRETISATION),
        )
        # Replay runs of identical (z, q) events as one self-composition: exact for RDP, and
        # for PLD one binary-power composition instead of one convolution per round.
        runs: list[list[float]] = []
        for entry in d["entries"]:
            event = PrivacyEvent.from_dict(entry)
            if event.noise_multiplier == 0.0 and event.rounds > 0:
                ledger._noiseless = True
            elif event.rounds > 0:
                key = [event.noise_multiplier, event.sampling_rate]
                if runs and runs[-1][:2] == key:
                    runs[-1][2] += event.rounds
                else:
                    runs.append([*key, event.rounds])
            ledger.entries.append({**event.to_dict(), "epsilon": float(entry["epsilon"])})
        for z, q, count in runs:
            ledger._acc.compose(z, q, int(count))
        return ledger

    def to_json(self) -> str:
        """Return :meth:`to_dict` as a JSON string."""
        return json.dumps(self.to_dict())

    @staticmethod
    def from_json(text: str) -> PrivacyLedger:
        """Rebuild a ledger from :meth:`to_json`'s text.

        Args:
          text: The JSON text.

        Returns:
          The :class:`PrivacyLedger`.

        Raises:
          ValueError: If the text is not JSON (``json.JSONDecodeError`` is a ValueError) or not
            a ledger state.
        """
        return PrivacyLedger.from_dict(json.loads(text))
