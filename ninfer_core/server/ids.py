"""Unique ids for responses, messages and tool calls (clients correlate on them across turns)."""

from __future__ import annotations

import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"
