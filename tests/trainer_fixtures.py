"""A crash of a TRL / transformers trainer at a chosen point, for the resume tests."""

from __future__ import annotations

from transformers import TrainerCallback


class Killed(Exception):
    pass


class KillAfterSave(TrainerCallback):
    """A crash right after the checkpoint of optimizer step ``step`` is written."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise Killed
