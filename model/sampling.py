"""How a continuation's tokens are chosen (``model.generate``): greedy or sampled. Imports no JAX:
flag parsers read it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each next token is chosen: greedy (``temperature`` 0), or drawn from the softmax of the
    logits over ``temperature``, among the ``top_k`` most likely (0: all) and the fewest whose
    probabilities reach ``top_p`` (1: all); ``seed`` with each sample's id gives its draws."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def problem(self) -> str | None:
        """What is wrong with these settings (None: nothing)."""
        if not self.temperature >= 0:
            return f"temperature must be >= 0 (0: greedy), got {self.temperature}"
        if not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1], got {self.top_p}"
        if self.top_k < 0:
            return f"top_k must be >= 0 (0: every token), got {self.top_k}"
        if self.greedy and (self.top_p != 1 or self.top_k):
            return "top_p and top_k choose among sampled tokens: give a temperature above 0"
        return None


GREEDY = Sampling()  # the default: the most likely token each step
