"""``FairLevel.first``: the first entries of a level in fair order, read from its lazy heap."""

from __future__ import annotations

import random

from slotserve.gateway.admission.fair_share import FairLevel


def test_first_equals_the_tags_sorted_after_adds_removals_and_demotions() -> None:
    rng = random.Random(26)
    for _ in range(300):
        level, made = FairLevel(), 0
        for _ in range(rng.randrange(1, 200)):
            roll = rng.random()
            if roll < 0.6:
                level.add(f"r{made}", rng.choice("abc"), rng.choice([1, 2, 5]), 1)
                made += 1
            elif roll < 0.8 and level.tags:
                level.remove(rng.choice(list(level.tags)))  # leaves a stale heap entry
            elif level.tags:
                level.demote(rng.choice(list(level.tags)))  # a second heap entry, re-tagged
        in_order = sorted(level.tags.items(), key=lambda item: (item[1], item[0]))
        for size in (0, 1, 3, 8, 500):
            assert level.first(size) == in_order[:size]
