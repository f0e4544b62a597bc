"""A failed collective across groups says which failure it was: a peer that died, or one that stopped answering
within the timeout (in-process: gloo's own error texts raised by hand)."""

from __future__ import annotations

import pytest

from hf_fedshard.engine.failures import explain_failures
from hf_fedshard.integrations.timeouts import explain_stalled_collectives

CLOSED = "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234"
RESET = "[gloo/transport/tcp/pair.cc:598] Read error [127.0.0.1]:23456: Connection reset by peer"
TIMED_OUT = "[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation to complete"


def explained(context, cause: str) -> str:
    with pytest.raises(RuntimeError) as err, context:
        raise RuntimeError(cause)
    assert err.value.__cause__ is not None and cause in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("cause", [CLOSED, RESET])
def test_a_dead_peer_is_said_to_have_died(cause):
    message = explained(explain_failures(7, "fed_timeout_s=5"), cause)
    assert message.startswith(
        "hf_fedshard: an exchange across federation groups failed at step 7: a rank of another group died (its "
        "connection closed). Check that group's logs for its error."
    )
    assert "timeout" not in message.split("Cause:")[0]
    world = explained(explain_stalled_collectives(lambda: 3, 1800), cause)
    assert world.startswith("hf_fedshard: a collective across ranks failed at step 3: a rank died (its connection")
    assert "ddp_timeout" not in world


def test_a_silent_peer_is_said_to_have_timed_out():
    assert "another group stopped answering (no reply within fed_timeout_s=5 seconds). Check" in explained(
        explain_failures(7, "fed_timeout_s=5"), TIMED_OUT
    )
    world = explained(explain_stalled_collectives(lambda: 3, 20), f"gloo: {TIMED_OUT}")
    assert "a rank stopped answering (no reply within ddp_timeout=20 seconds). Check" in world


def test_a_failure_that_is_neither_says_what_failed_first():
    """A shape mismatch (groups of different models) is no timeout: the message says what failed, then what to
    check; hf_fedshard's own errors (the check of the groups' steps) pass as they are."""
    shape = "The expanded size of the tensor (2) must match the existing size (4) at non-singleton dimension 0"
    message = explained(explain_failures(20, "fed_timeout_s=20"), shape)
    assert message.startswith(f"hf_fedshard: an exchange across federation groups failed at step 20: {shape} (the")
    assert "stopped answering" not in message and "fed_timeout_s" not in message
    own = "hf_fedshard: the groups of the averaging at step 8 are not all at that step"
    with pytest.raises(RuntimeError, match=f"^{own}$"), explain_failures(8, "fed_timeout_s=20"):
        raise RuntimeError(own)
