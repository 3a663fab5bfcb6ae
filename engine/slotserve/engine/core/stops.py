"""Stop strings, matched incrementally: each piece of text costs O(longest stop), not O(output).

A stream of text arrives a piece at a time (one detokenized token, usually a few characters).
:class:`StopStringFilter` passes on the text that is safe to send: everything before the first
stop string, except a tail that could still grow into one (held back until it cannot). It keeps,
per stop string, a Knuth-Morris-Pratt state: the length of the longest prefix of that stop that
the text so far ends with. Feeding a character updates that state in amortised O(1), so a piece
of ``d`` characters costs O(num_stops x (d + longest stop)) at worst, and the held-back tail is
exactly the largest state. No step ever looks at the text already sent.

It answers exactly what searching the whole text would: the cut is at the earliest starting stop
string (``text.find`` per stop, the minimum), and the held-back tail is the longest suffix of the
text that is a proper prefix of some stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FilteredText:
    text: str  # safe to send now
    stopped: bool  # a stop string matched: ``text`` ends just before it, nothing follows


def failure_table(pattern: str) -> list[int]:
    """KMP's table: ``table[i]`` is the longest proper prefix of ``pattern[: i + 1]`` that is
    also its suffix."""
    table = [0] * len(pattern)
    state = 0
    for index in range(1, len(pattern)):
        char = pattern[index]
        while state and pattern[state] != char:
            state = table[state - 1]
        if pattern[state] == char:
            state += 1
        table[index] = state
    return table


class StopStringFilter:
    """Cuts a stream of text at the first stop string; see the module docstring."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = list(stops)
        self._tables = [failure_table(stop) for stop in self._stops]
        self._states = [0] * len(self._stops)
        self._held_back = ""  # text received but not yet sent: a proper prefix of some stop

    def add(self, text: str, *, final: bool = False) -> FilteredText:
        """Take the next piece; return what may be sent (everything left when ``final``)."""
        if not self._stops:
            return FilteredText(text, stopped=False)
        buffer = self._held_back + text
        # Where in ``buffer`` the earliest stop string starts, if one ends in ``text``. A stop
        # that started in the held-back tail started there, never in text already sent: the
        # tail is at least as long as every state.
        stop_at: int | None = None
        offset = len(self._held_back)
        for index, stop in enumerate(self._stops):
            end = self._advance(index, stop, text)
            if end is not None:
                start = offset + end + 1 - len(stop)
                stop_at = start if stop_at is None else min(stop_at, start)
        if stop_at is not None:
            self._held_back = ""
            return FilteredText(buffer[:stop_at], stopped=True)
        if final:
            self._held_back = ""
            return FilteredText(buffer, stopped=False)
        num_held = max(self._states)
        # The cut point never moves back: a held-back tail is always within the previous one
        # plus the new text (the state of each stop grows by at most one per character).
        self._held_back = buffer[len(buffer) - num_held :] if num_held else ""
        return FilteredText(buffer[: len(buffer) - num_held], stopped=False)

    def _advance(self, index: int, stop: str, text: str) -> int | None:
        """Feed ``text`` to one stop's automaton; the index in ``text`` where its first match
        ends, if any (later matches of the same stop start later, so they never win)."""
        table = self._tables[index]
        state = self._states[index]
        last = len(stop)
        position = 0
        size = len(text)
        while position < size:
            if not state:
                # Nothing matched yet: skip straight to the next possible first character
                # (str.find runs in C, so ordinary text costs almost nothing per character).
                position = text.find(stop[0], position)
                if position < 0:
                    break
            char = text[position]
            while state and stop[state] != char:
                state = table[state - 1]
            if stop[state] == char:
                state += 1
                if state == last:
                    self._states[index] = state
                    return position
            position += 1
        self._states[index] = state
        return None
