"""The planner's one error type.

A :class:`PlannerError` is raised for input the planner cannot plan for: an unknown
preset, a malformed model or calibration file, a request no layout can satisfy. Its
message names what is at fault (a flag, a file field, the binding limit) and the
smallest change that would work; the structured fields let callers (the CLI's ``--json``
mode, the training script's ``--ulysses-degree auto``) report the same facts.
"""

from __future__ import annotations

from typing import List, Optional

from megatron.errors import UsageError


class PlannerError(UsageError, ValueError):
    """Bad planner input, or a request no layout can satisfy.

    Attributes:
        binding_limit: short name of the limit that rules everything out
            (``"memory"``, ``"attention heads"``, ``"sequence length"``, ...), or None.
        suggestions: smallest changes that would give a plan, most direct first.
    """

    def __init__(
        self,
        message: str,
        binding_limit: Optional[str] = None,
        suggestions: Optional[List[str]] = None,
    ) -> None:
        super().__init__(message)
        self.binding_limit = binding_limit
        self.suggestions = list(suggestions or [])
