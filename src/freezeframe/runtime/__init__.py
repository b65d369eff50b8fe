"""Run a model step by step on captured graphs: dispatch, padding, static buffers, capture.

``Dispatcher`` decides which graph a step replays; ``GraphRunner`` owns the static input buffers,
captures every graph the dispatcher knows and runs steps through them.
"""

from __future__ import annotations

from freezeframe.runtime.dispatcher import Dispatcher, LoraCase, lora_cases

__all__ = ["Dispatcher", "LoraCase", "lora_cases"]
