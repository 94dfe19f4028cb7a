"""Iterator-like test objects for checkpoints: ``get_state``/``set_state`` of any JSON-like value."""

from __future__ import annotations

from typing import Any


class Statistics:
    """An iterator-like object whose state holds whatever JSON-like value it is given (NaN, infinities)."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def get_state(self) -> Any:
        return self.state

    def set_state(self, state: Any) -> None:
        self.state = state
