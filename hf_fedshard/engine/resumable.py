"""Whether a checkpoint's averaging state fits this averager, and the settings history it continues.

Every refusal is one line naming the setting to change, raised before the state is used.
"""

from __future__ import annotations

import logging

from hf_fedshard.engine.fragments import Schedule
from hf_fedshard.engine.settings_history import AveragingSettings, History, settings_of_outer_state
from hf_fedshard.errors import ConfigError

logger = logging.getLogger(__name__)


def check_state(state: dict, schedule: Schedule, fragments: int | None = None) -> None:
    """Refuse a state written with another number of fragments or another schedule."""
    counters = state["counters"]
    if len(counters["synced_at"]) != schedule.fragments:
        raise ConfigError(
            f"fed_sync_fragments={schedule.fragments}, but the checkpoint was written with "
            f"{len(counters['synced_at'])} fragment(s). Resume with --fed_sync_fragments {len(counters['synced_at'])}."
        )
    _check_in_flight(state.get("in_flight"), schedule)
    if fragments is not None:
        _check_outer(state["outer"], fragments)


def _check_in_flight(flight: dict | None, schedule: Schedule) -> None:
    if flight is not None and "begun" in flight:
        flight = {**flight["begun"], "fragment": flight["begun"]["fragments"][0]}
    if flight is not None and (
        flight["apply_step"] - flight["start_step"] != schedule.overlap
        or schedule.starting(flight["start_step"]) != flight["fragment"]
    ):
        raise ConfigError(
            f"the checkpoint holds an exchange started at step {flight['start_step']} for step "
            f"{flight['apply_step']}, which fed_sync_steps={schedule.sync_steps}, fed_sync_fragments="
            f"{schedule.fragments}, fed_sync_overlap={schedule.overlap} do not schedule. Resume with "
            "the schedule the checkpoint was written with."
        )


def _check_outer(outer: dict, fragments: int) -> None:
    if len(outer["fragments"]) != fragments:
        raise ConfigError(
            f"fed_sync_fragments={fragments}, but the checkpoint holds {len(outer['fragments'])} fragment(s). "
            f"Resume with --fed_sync_fragments {len(outer['fragments'])}."
        )


def continue_history(saved: History | None, outer: dict, settings: AveragingSettings, step: int, log: bool) -> History:
    """The checkpoint's settings history, plus ``settings`` from ``step`` on where they differ (said if ``log``)."""
    history = saved or [(0, settings_of_outer_state(outer, settings.sync_dtype))]
    if history[-1][1] == settings:
        return history
    if log:
        logger.warning(
            "hf_fedshard: resuming at step %d with other averaging settings than the checkpoint's, honoured from "
            "this step on: %s.",
            step,
            history[-1][1].changes_to(settings),
        )
    return [*history, (step, settings)]
