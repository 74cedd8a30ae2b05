"""The drag payload of selected units: MIME type ``application/x-moe-workbench-units``.

JSON ``{"model": fingerprint, "units": [[layer, kind, expert], ...]}`` so that a drop can check it
comes from the open model."""

from __future__ import annotations

import json

from PySide6.QtCore import QMimeData

from workbench.core.units import UnitKey

UNITS_MIME = "application/x-moe-workbench-units"


def units_to_mime(keys: list[UnitKey], fingerprint: str) -> QMimeData:
    data = QMimeData()
    payload = {"model": fingerprint, "units": [[k.layer, k.kind, k.expert] for k in keys]}
    data.setData(UNITS_MIME, json.dumps(payload, separators=(",", ":")).encode())
    data.setText(f"{len(keys)} units")
    return data


def units_from_mime(data: QMimeData) -> tuple[list[UnitKey], str] | None:
    """(keys, model fingerprint) of a payload, or None if it is not ours or is malformed."""
    if not data.hasFormat(UNITS_MIME):
        return None
    try:
        payload = json.loads(bytes(data.data(UNITS_MIME)).decode())
        keys = [UnitKey(layer, kind, expert) for layer, kind, expert in payload["units"]]
        return keys, str(payload.get("model", ""))
    except (ValueError, KeyError, TypeError):
        return None
