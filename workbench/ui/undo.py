"""Undoable placement edits: each command's redo/undo call Session methods (orange-canvas style)."""

from __future__ import annotations

from PySide6.QtGui import QUndoCommand

from workbench.core.placement import Assignment, Placement
from workbench.core.units import UnitKey
from workbench.session import Session


def _describe(keys: list[UnitKey]) -> str:
    if len(keys) == 1:
        return str(keys[0])
    layers = {k.layer for k in keys}
    return f"{len(keys)} units of {len(layers)} layer{'s' if len(layers) != 1 else ''}"


class MoveUnits(QUndoCommand):
    """Move units to one assignment; undo restores each unit's previous assignment.

    The first ``redo`` (run by ``QUndoStack.push``) checks the budget and raises PlacementError
    before anything changed, so a refused move never reaches the stack."""

    def __init__(self, session: Session, keys: list[UnitKey], assignment: Assignment, force: bool = False):
        super().__init__(f"Move {_describe(keys)} to {assignment}")
        self.session, self.keys, self.assignment, self.force = session, list(keys), assignment, force
        self.previous: dict[UnitKey, Assignment] | None = None

    def redo(self) -> None:
        prev = self.session.move_units(self.keys, self.assignment, force=self.force or self.previous is not None)
        if self.previous is None:
            self.previous = prev

    def undo(self) -> None:
        self.session.set_assignments(self.previous or {})


class SetPlacement(QUndoCommand):
    """Replace the whole placement (a planner strategy, a project's placement)."""

    def __init__(self, session: Session, placement: Placement, text: str):
        super().__init__(text)
        self.session, self.placement = session, placement.copy()
        self.previous: Placement | None = None

    def redo(self) -> None:
        self.previous = self.session.set_placement(self.placement)

    def undo(self) -> None:
        if self.previous is not None:
            self.session.set_placement(self.previous)


def push_checked(stack, command: MoveUnits) -> str:
    """Push ``command`` unless its budget check refuses it; returns the refusal reason or ""."""
    reason = ""
    if not command.force:
        _, reason = command.session.check_move(command.keys, command.assignment)
    if reason:
        return reason
    command.force = True  # checked just now
    stack.push(command)
    return ""
