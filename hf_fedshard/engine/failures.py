"""A cross-group collective that failed, said in the user's terms: which step, which setting, what to check."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def peer_died(err: BaseException) -> bool:
    """Whether a collective failed because a peer's process is gone (its sockets closed), not because it is slow."""
    return any(text in str(err) for text in _PEER_GONE)


@contextlib.contextmanager
def explain_failures(step: int, timeout: str) -> Iterator[None]:
    """Turn a failed inter-group collective (a timeout, a peer gone) into an error that says what to do.

    ``timeout`` names the limit that expired, e.g. ``"fed_timeout_s=30"``.
    """
    try:
        yield
    except RuntimeError as err:
        if peer_died(err):
            raise RuntimeError(
                f"hf_fedshard: an exchange across federation groups failed at step {step}: a rank of another "
                f"group died (its connection closed). Check that group's logs for its error. Cause: {err}"
            ) from err
        raise RuntimeError(
            f"hf_fedshard: an exchange across federation groups failed at step {step}: another group stopped "
            f"answering (no reply within {timeout} seconds). Check that group's logs; if it is only slow, raise "
            f"--fed_timeout_s. Cause: {err}"
        ) from err
