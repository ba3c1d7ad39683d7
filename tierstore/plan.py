"""An access plan: the keys a workload reads and updates, in the order it does, over and over.

A training step visits its state in a known order (the optimizer's parameter groups, the layers
of a forward pass). Given that order, ``store.plan(keys)``, the RAM tier keeps what is needed
soonest and lets go of what is needed last (the chunks just used, in a cycle: Belady's choice,
which an LRU cache gets exactly wrong), writes back the dirty chunks needed last first, and reads
ahead along the plan. With state of ``S`` bytes in a budget of ``B`` a cycle then reads and
writes ``S - B`` bytes, the minimum, instead of all of ``S``.

Keys the workload reads more often than once a cycle (a model's weights: read by the forward
pass, by the backward pass and by the update) are declared ``hot``: they are kept ahead of the
rest, which cycles through the room they leave. A training step whose RAM holds its weights and
its gradients then reads only the moments that do not fit, the fewest bytes its budget allows.
Among themselves hot keys go in plan order too: the one updated last goes first, and a weight
whose backward pass is done and whose update is next stays (ranked alike, the least recently
used went first: the weights waiting for their update, read by backward before the ones it had
just updated).

The plan is a ``dict`` from key to position and a cursor (the position of the last plan key
read or updated); the distance of a key is how many plan steps until it is needed again. Owned
by the store's event loop thread.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from tierstore.errors import StoreError
from tierstore.keys import validate_key

#: eviction ranks of hot keys lie in (HOT_RANK, 0): below every plan key's distance (0 for the
#: key in use), so hot keys go only once nothing else can; an eviction ``above=HOT_RANK`` may
#: take any of them
HOT_RANK = -1.0


class AccessPlan:
    """A cyclic order of keys and where in it the workload is now."""

    def __init__(self, keys: Sequence[str], hot: Sequence[str] = ()) -> None:
        if isinstance(keys, str):
            raise StoreError("plan() takes a sequence of keys, not one key")
        self.keys = list(keys)
        self.position: dict[str, int] = {}
        for i, k in enumerate(self.keys):
            validate_key(k)
            if k in self.position:
                raise StoreError(f"plan(): key {k!r} appears twice; a plan visits each key once a cycle")
            self.position[k] = i
        self.cursor = -1
        if isinstance(hot, str):
            raise StoreError("plan(hot=) takes a sequence of keys, not one key")
        for k in hot:
            validate_key(k)
        #: keys read more often than once a cycle: kept in RAM ahead of the others
        self.hot = frozenset(hot)

    def touch(self, key: str) -> bool:
        """``key`` is being read or updated now; False if it is not in the plan."""
        i = self.position.get(key)
        if i is None:
            return False
        self.cursor = i
        return True

    def distance(self, key: str | None) -> float:
        """Plan steps until ``key`` is needed (0: the key in use now, the last one touched; the
        one before it is needed last); infinite for a key not in the plan."""
        i = self.position.get(key) if key is not None else None
        if i is None:
            return math.inf
        return (i - self.cursor) % len(self.keys)

    def rank(self, key: str | None) -> float:
        """Eviction rank of a chunk of ``key`` (the highest goes first): its distance, or for a
        hot key, below every other key and in the order of the distances among hot keys."""
        # ``distance`` inline: an eviction ranks every chunk in RAM
        i = self.position.get(key) if key is not None else None
        if i is None:
            return math.inf
        d = (i - self.cursor) % len(self.keys)
        return HOT_RANK + (d + 1.0) / (len(self.keys) + 2.0) if key in self.hot else d

    def next_key(self) -> str:
        """The key after the one in use now."""
        return self.keys[(self.cursor + 1) % len(self.keys)]

    def upcoming(self) -> Iterator[str]:
        """The plan's keys from the next one on, once round (lazily: callers stop early)."""
        n = len(self.keys)
        for j in range(n):
            yield self.keys[(self.cursor + 1 + j) % n]
