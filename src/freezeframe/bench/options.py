"""The options of ``freezeframe bench`` (:class:`BenchOptions`), checked once when made."""

from __future__ import annotations

import dataclasses

from freezeframe.bench.modes import ALL_MODES, DEFAULT_MODES, TP_MODES
from freezeframe.errors import ConfigError
from freezeframe.models import LlamaConfig
from freezeframe.models.attention import check_attention_kernel

__all__ = ["DEFAULT_CONTEXTS", "BenchOptions"]

#: decode context lengths timed side by side (``--contexts``)
DEFAULT_CONTEXTS = (128, 1024, 4096)


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    preset: str = "tiny"
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    modes: tuple[str, ...] = DEFAULT_MODES
    steps: int = 20
    warmup: int = 3
    context: int | None = None  # decode context per request (default: by preset)
    prefill_len: int | None = None
    mixed_chunk: int = 16
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS  # decode rows by context length
    attention_kernel: str = "auto"  # KVCacheConfig.attention_kernel
    compiler: str | None = None  # "eager" | "inductor"; default: inductor on CUDA, else eager
    device: str = "auto"
    out: str | None = None
    seed: int = 0
    tp: int = 1  # tensor-parallel ranks (bench/tp.py launches them)
    grid: bool = False  # decode at every context and batch size (not only the two lines)
    hf_new_tokens: int = 64  # tokens each HF mode's generate adds per prompt

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in ALL_MODES]
        if bad:
            raise ConfigError(f"--modes: unknown mode(s) {bad}; choose from {list(ALL_MODES)}")
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ConfigError(f"--tp must be an int >= 1, got {self.tp!r}")
        bad = [m for m in self.modes if m not in TP_MODES] if self.tp > 1 else []
        if bad:
            raise ConfigError(f"--tp {self.tp}: mode(s) {bad} do not run tensor-parallel; "
                              f"choose from {list(TP_MODES)}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ConfigError(f"--batch-sizes: give at least one, each >= 1; got "
                              f"{list(self.batch_sizes)}")
        if self.steps < 1 or self.warmup < 0:
            raise ConfigError(f"--steps must be >= 1 and --warmup >= 0, got {self.steps} and "
                              f"{self.warmup}")
        if self.compiler not in (None, "eager", "inductor"):
            raise ConfigError(f"--compiler must be 'eager' or 'inductor', got {self.compiler!r}")
        if self.preset not in LlamaConfig.PRESETS:
            raise ConfigError(f"--preset: unknown preset {self.preset!r}; choose one of "
                              f"{sorted(LlamaConfig.PRESETS)}")
        for name in ("context", "prefill_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.mixed_chunk < 1:
            raise ConfigError(f"mixed_chunk must be >= 1, got {self.mixed_chunk}")
        if any(c < 1 for c in self.contexts):
            raise ConfigError(f"--contexts: each context length must be >= 1, got "
                              f"{list(self.contexts)}")
        check_attention_kernel(self.attention_kernel, "--attention-kernel")
        if self.hf_new_tokens < 2:
            raise ConfigError(f"hf_new_tokens must be >= 2, got {self.hf_new_tokens}")
