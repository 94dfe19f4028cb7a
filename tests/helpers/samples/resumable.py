"""Shared by the checkpoint sample jobs (they run as scripts from this folder)."""


class Position:
    """The smallest iterator-like object: a global position, the same on every rank."""

    def __init__(self) -> None:
        self.position = 0

    def get_state(self) -> dict:
        return {"position": self.position}

    def set_state(self, state: dict) -> None:
        self.position = state["position"]
