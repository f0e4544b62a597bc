"""A cross-group collective that failed, said in the user's terms: which step, what failed, what to check."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
_TIMED_OUT = ("timed out", "timeout", "deadline exceeded")


def peer_died(err: BaseException) -> bool:
    """Whether a collective failed because a peer's process is gone (its sockets closed), not because it is slow."""
    return any(text in str(err) for text in _PEER_GONE)


def timed_out(err: BaseException) -> bool:
    """Whether a collective failed because a peer did not answer within its time limit."""
    return any(text in str(err).lower() for text in _TIMED_OUT)


@contextlib.contextmanager
def explain_failures(step: int, timeout: str) -> Iterator[None]:
    """Turn a failed inter-group collective into an error that says what failed and what to do: a peer gone, a
    peer silent past ``timeout`` (the limit's name, e.g. ``"fed_timeout_s=30"``), or anything else (the groups
    disagree, e.g. on a tensor's shape), with its cause first. hf_fedshard's own errors pass as they are."""
    try:
        yield
    except RuntimeError as err:
        first = f"hf_fedshard: an exchange across federation groups failed at step {step}"
        if str(err).startswith("hf_fedshard:"):
            raise
        if peer_died(err):
            raise RuntimeError(
                f"{first}: a rank of another group died (its connection closed). Check that group's logs for its "
                f"error. Cause: {err}"
            ) from err
        if timed_out(err):
            raise RuntimeError(
                f"{first}: another group stopped answering (no reply within {timeout} seconds). Check that group's "
                f"logs; if it is only slow, raise --fed_timeout_s. Cause: {err}"
            ) from err
        raise RuntimeError(
            f"{first}: {str(err).splitlines()[0][:300]} (the groups sent tensors that do not fit together: check that "
            "every group runs the same model and fed_* settings)."
        ) from err
