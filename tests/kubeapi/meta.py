"""Pure helpers on Kubernetes objects as dicts: merge patches, label selectors, generation."""

from __future__ import annotations

import copy
import datetime
from typing import Any


def now() -> str:
    """A timestamp as the API server writes it (RFC 3339, seconds, UTC)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """``patch`` applied to ``target`` as an RFC 7386 JSON merge patch; neither is modified.

    Objects merge key by key, ``null`` removes a key, anything else (lists included) replaces.
    The result may share unchanged parts with ``target``.
    """
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def label_matches(term: str, labels: dict[str, str]) -> bool:
    """One equality-based term of a label selector: key, !key, key=value, key==value, key!=value."""
    if "!=" in term:
        key, value = term.split("!=", 1)
        return labels.get(key) != value
    if "=" in term:
        key, value = term.replace("==", "=").split("=", 1)
        return labels.get(key) == value
    if term.startswith("!"):
        return term[1:] not in labels
    return term in labels


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """A comma-separated label selector (every term must hold; "" selects everything).

    Set-based terms (``env in (a,b)``) are not supported: their commas split the selector.
    """
    terms = [term.strip() for term in selector.split(",")]
    return all(label_matches(term, labels) for term in terms if term)


def essence(obj: dict[str, Any]) -> dict[str, Any]:
    """What bumps ``metadata.generation`` when it changes: everything but metadata and status."""
    return {key: value for key, value in obj.items() if key not in {"metadata", "status"}}
