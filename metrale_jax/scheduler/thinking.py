"""Thinking budgets: after so many thinking tokens, the end-of-thinking tokens are forced.

A request's `ThinkingBudgetSpec` names the budget and the token ids of the tags; the
scheduler keeps one `ThinkingBudget` per running request, host side:

    budget = ThinkingBudget(spec)
    ...each step, before the slot's next token is drawn:
    forced = budget.forced()      # an id the next token must be (None = sample freely)
    ...after the token is known:
    budget.observe(token_id)

Outputs are read one step late: `needs_sync(inflight)` says when a slot must wait for its
in-flight token (as a constrained slot does) because the next token may be a forced one;
before that the slot runs unhindered. The mask row that forces an id is
`metrale_jax.engine.bitmask.pack([forced], V)`.

Counting starts after the opening tag (or at the first token, when the prompt already opened
the thinking: `spec.open`). When the model closes its thinking itself, nothing is forced;
when `budget` thinking tokens have been generated first, `forced()` returns the end ids one by
one (the closing tag and the whitespace the model would write), then the answer follows.
Forcing one id is a mask that allows only that id: the constrained-decoding bitmask does it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ThinkingBudgetSpec:
    """A thinking budget: at most `budget` tokens between the opening and the closing tag.

    start_ids: the opening tag's ids (`<think>`). close_ids: the closing tag's ids
    (`</think>`): when the model writes them the thinking is over. end_ids: what is forced
    when the budget runs out (the closing tag with the whitespace around it).
    open: the prompt ended inside the thinking (the first generated token is thinking).
    """

    budget: int
    start_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    open: bool = False

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise ValueError(f"thinking budget must be ≥ 0, got {self.budget}")
        if not self.end_ids or not self.close_ids:
            raise ValueError("a thinking budget needs the end-of-thinking token ids")


class ThinkingBudget:
    """The state of one request's budget: "before", "thinking", "forcing" or "done"."""

    def __init__(self, spec: ThinkingBudgetSpec):
        self.spec = spec
        self.state = "thinking" if spec.open else "before"
        self.count = 0  # thinking tokens so far
        self._forced = 0  # end ids forced so far
        self._recent: list[int] = []  # the last tokens, to match multi-token tags

    def forced(self) -> int | None:
        """The id the next token must be, or None."""
        if self.state == "thinking" and self.count >= self.spec.budget:
            self.state = "forcing"
        if self.state == "forcing":
            return self.spec.end_ids[self._forced]
        return None

    def needs_sync(self, inflight: int) -> bool:
        """True when the next token may have to be forced, counting `inflight` tokens not yet
        observed as thinking: the slot must then wait for them before its next step."""
        if self.state == "forcing":
            return True
        return self.state == "thinking" and self.count + inflight >= self.spec.budget

    def observe(self, token_id: int) -> None:
        """Records one generated token (forced or sampled)."""
        spec = self.spec
        self._recent = [*self._recent, token_id][-max(len(spec.start_ids), len(spec.close_ids)):]
        if self.state == "before":
            if spec.start_ids and self._ends_with(spec.start_ids):
                self.state, self.count = "thinking", 0
        elif self.state == "thinking":
            if self._ends_with(spec.close_ids):
                self.state = "done"
            else:
                self.count += 1
        elif self.state == "forcing":
            self._forced += 1
            if self._forced >= len(spec.end_ids):
                self.state = "done"

    def _ends_with(self, ids: tuple[int, ...]) -> bool:
        return bool(ids) and tuple(self._recent[-len(ids):]) == ids

