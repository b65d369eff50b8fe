"""Run a model step by step on captured graphs: dispatch, padding, static buffers, capture.

``Dispatcher`` decides which graph a step replays; ``GraphRunner`` owns the static input buffers
(described by ``Tokens`` / ``Requests`` / ``Static`` input specs), captures every graph the
dispatcher knows and runs steps through them.
"""

from __future__ import annotations

from freezeframe.runtime.dispatcher import Dispatcher, LoraCase, lora_cases
from freezeframe.runtime.dist import agree_across_ranks
from freezeframe.runtime.inputs import InputSpec, Requests, Static, Tokens
from freezeframe.runtime.runner import CaptureReport, GraphCapture, GraphRunner

__all__ = [
    "CaptureReport",
    "Dispatcher",
    "GraphCapture",
    "GraphRunner",
    "InputSpec",
    "LoraCase",
    "Requests",
    "Static",
    "Tokens",
    "agree_across_ranks",
    "lora_cases",
]
