"""JSON that arrives from outside (request bodies, uploaded result files), read in one place so
every way it can be unusable becomes one clear error instead of a crash later."""

from __future__ import annotations

import json
from typing import Any


class UnreadableJson(ValueError):
    """The text is not JSON pathgate can keep; the message says why, for the sender."""


def load_json(raw: bytes | str) -> Any:
    try:
        data = json.loads(raw)
    except RecursionError:
        raise UnreadableJson("JSON nested too deeply") from None
    except ValueError as exc:  # UnicodeDecodeError, JSONDecodeError, integers of 4300+ digits
        raise UnreadableJson(f"not JSON: {exc}") from None
    try:
        # "\ud800" is valid JSON but decodes to a lone surrogate, which neither a database nor
        # a response can encode: stored, it would break every later read of its row.
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise UnreadableJson("JSON nested too deeply") from None
    except UnicodeEncodeError:
        raise UnreadableJson("the JSON holds a lone surrogate (\\ud800-\\udfff)") from None
    return data
