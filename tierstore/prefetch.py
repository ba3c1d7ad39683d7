"""Next-access prediction from the read order of past steps.

The store records the keys read between two ``mark_step()`` calls. The predictor answers
"after reading K, which keys come next?" from the last recorded step: steps of a training loop
repeat their access order, so one step of history is enough to prefetch the next. Accuracy is the
share of reads that the predictor had announced in advance.

Memory: a step's trace holds at most ``MAX_STEP_READS`` keys (one list entry, 8 bytes, per
read, plus the key string where the caller builds a new one per read: about 70 bytes a read),
and the predictor keeps two steps (the one recorded and the one learned from), so at most
about 10 MiB whatever the caller does. Reads past the cap are still scored and still trigger
predictions, but are not recorded (``dropped`` counts them, ``stats()["predictor_dropped_reads"]``
reports it): a caller that never calls ``mark_step()`` gets a bounded trace of its first reads
instead of a list that grows by every get. The trainer calls it once per optimizer step.
"""

from __future__ import annotations

#: reads recorded per step (the trainer's step of a large model reads a few thousand keys)
MAX_STEP_READS = 65_536


class AccessPredictor:
    """Learns the read order of a step and predicts the keys that follow a read."""

    def __init__(self, ahead: int, max_reads: int | None = None):
        self.ahead = ahead
        #: the cap on the current step's recorded reads
        self.max_reads = MAX_STEP_READS if max_reads is None else max_reads
        self._current: list[str] = []
        self._last: list[str] = []
        self._position: dict[str, list[int]] = {}
        self._predicted: set[str] = set()
        self._reads_this_step: dict[str, int] = {}
        self.hits = 0
        self.reads_scored = 0
        #: reads not recorded because their step's trace was full (since open)
        self.dropped = 0

    def record(self, key: str) -> list[str]:
        """Note a read of ``key``; return the keys predicted to follow it."""
        if self._last:
            self.reads_scored += 1
            if key in self._predicted:
                self.hits += 1
                self._predicted.discard(key)
        seen = self._reads_this_step.get(key, 0)
        if len(self._current) < self.max_reads:
            self._current.append(key)
            self._reads_this_step[key] = seen + 1
        else:
            self.dropped += 1
        positions = self._position.get(key)
        if not positions:
            return []
        # the occurrence of `key` matching how often it was read so far in this step
        pos = positions[min(seen, len(positions) - 1)]
        upcoming = self._last[pos + 1 : pos + 1 + self.ahead]
        self._predicted.update(upcoming)
        return upcoming

    def mark_step(self) -> None:
        """Close the current step: its order becomes the model for the next one."""
        if self._current:
            self._last = self._current
            self._position = {}
            for i, k in enumerate(self._last):
                self._position.setdefault(k, []).append(i)
        self._current = []
        self._reads_this_step = {}
        self._predicted = set()

    @property
    def accuracy(self) -> float | None:
        """Share of reads predicted in advance; None until a step has been learned."""
        if not self._last or self.reads_scored == 0:
            return None
        return self.hits / self.reads_scored
