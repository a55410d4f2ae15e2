"""What a client-chosen request id may hold, on both doors.

An id is the client's label: it is echoed in the answer, written in the request log, and on
the HTTP door sent back in the `x-request-id` header. So it is short, and holds no control
characters (a CR/LF would split a header or a text log line, a NUL ends C strings) and no
lone surrogates (not encodable text). The HTTP door further needs it to be latin-1, the only
text a header value carries as is.
"""

from __future__ import annotations

import re

from router.domain import InvalidInput

MAX_ID_LEN = 256
# Unicode's control characters (C0, DEL, C1) and the surrogate range.
_FORBIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def check_request_id(value: str, field: str = "request_id") -> None:
    """Raise InvalidInput naming `field` for an id over `MAX_ID_LEN` characters or one holding
    a control character or a lone surrogate."""
    if len(value) > MAX_ID_LEN:
        raise InvalidInput(f"{field} is {len(value)} characters; at most {MAX_ID_LEN}")
    bad = _FORBIDDEN.search(value)
    if bad is not None:
        raise InvalidInput(
            f"{field} must hold no control characters or lone surrogates: character "
            f"{bad.start()} is U+{ord(bad.group()):04X}"
        )


def check_header_id(value: str, field: str = "request_id") -> None:
    """As `check_request_id`, and the id must be latin-1 (it is sent back in a header)."""
    check_request_id(value, field)
    try:
        value.encode("latin-1")
    except UnicodeEncodeError as exc:
        raise InvalidInput(
            f"{field} must be latin-1 text (it is sent back in the x-request-id header): "
            f"character {exc.start} is U+{ord(value[exc.start]):04X}"
        ) from None
