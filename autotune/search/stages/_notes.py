"""What the planner decided to leave out, said once each: the lines the search prints before its next trial."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Notes:
    """Lines not yet taken, and the keys already said (a decision is said once per search)."""

    lines: list[str] = field(default_factory=list)
    said: set[str] = field(default_factory=set)

    def note(self, key: str, text: str) -> None:
        if key not in self.said:
            self.said.add(key)
            self.lines.append(text)

    def said_elsewhere(self, key: str) -> None:
        """``key`` was said in another line (the outline): the planner's own note would say it again."""
        self.said.add(key)

    def take(self) -> list[str]:
        """What was decided since last asked, one line each."""
        out, self.lines = self.lines, []
        return out
