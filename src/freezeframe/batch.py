"""The batch descriptor: the key a captured graph is stored under."""

from __future__ import annotations

import dataclasses

__all__ = ["BatchDescriptor"]


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    """Describes the (padded) shape of one forward step.

    ``num_tokens`` is the padded size of the dynamic dimension. ``num_reqs`` and ``uniform``
    matter only to FULL graphs, whose attention metadata depends on the request layout;
    :meth:`relax_for_piecewise` drops them because piecewise graphs never contain attention.
    """

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    has_lora: bool = False
    num_active_loras: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.num_tokens, int) or isinstance(self.num_tokens, bool):
            raise TypeError(f"BatchDescriptor.num_tokens must be an int, got {self.num_tokens!r}")
        if self.num_tokens < 0:
            raise ValueError(f"BatchDescriptor.num_tokens must be >= 0, got {self.num_tokens}")
        if self.num_reqs is not None and self.num_reqs < 0:
            raise ValueError(f"BatchDescriptor.num_reqs must be >= 0 or None, got {self.num_reqs}")

    def relax_for_piecewise(self) -> BatchDescriptor:
        """The key a PIECEWISE graph uses: request count and uniformity do not matter there."""
        return BatchDescriptor(
            num_tokens=self.num_tokens,
            num_reqs=None,
            uniform=False,
            has_lora=self.has_lora,
            num_active_loras=self.num_active_loras,
        )
