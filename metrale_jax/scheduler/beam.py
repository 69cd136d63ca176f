"""Beam search over one request's beams, on the host, from the device's top log-probabilities.

Each step, every running beam (a sequence row) has fed its last token and the engine returned
that row's `N` most likely next tokens with their log-softmax (`StepOutput.top_ids`,
`top_logprobs`: the model's raw distribution). The best `K = max(2, 1 + #eos) * W`
continuations of all `W * V` are among each beam's own `K` best, so `N >= K` is enough to
pick exactly what a search over the whole vocabulary picks. The choice follows transformers'
`generate(num_beams=W, length_penalty=..., early_stopping=...)` step for step (its
`_beam_search`, float32 scores, the same heuristics), so the returned ids are transformers'.

`BeamSearch.step` takes the W rows' top lists and answers which beams continue, each as
(parent beam, token): the scheduler then points each beam's row at its parent's KV pages
(`Engine.fork`) and feeds the new token. Nothing here touches the device.
"""

from __future__ import annotations

import numpy as np

_NEG = np.float32(-1.0e9)


class BeamSearch:
    """The search state of one request.

    Args:
        width: W, the beams (num_beams).
        max_new: the most tokens a hypothesis may generate (max_tokens).
        eos: the ids that end a hypothesis (eos and stop_token_ids; empty with ignore_eos).
        min_new: eos is not allowed before this many generated tokens (min_tokens).
        length_penalty: a finished hypothesis scores sum_logprobs / len ** length_penalty.
        early_stopping: True (stop once W hypotheses are finished), False (stop when the best
            running beam at its current length cannot beat the worst finished one) or
            "never" (the same with the longest possible length when length_penalty > 0).
        length_offset: prompt tokens counted as generated in the lengths the penalty and the
            "never" heuristic use (1 for a translation's forced target language token, which
            transformers generates).
    """

    def __init__(self, width: int, max_new: int, eos: frozenset[int], min_new: int = 0,
                 length_penalty: float = 1.0, early_stopping: bool | str = False,
                 length_offset: int = 0):
        self.width = width
        self.max_new = max_new
        self.eos = eos
        self.min_new = min_new
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.length_offset = length_offset
        self.keep = max(2, 1 + len(eos)) * width
        self.generated = 0  # tokens generated so far by every running beam
        self.running: list[tuple[int, ...]] = [()] * width
        self.scores = np.full(width, _NEG, np.float32)
        self.scores[0] = 0.0  # only the first beam's continuations count at first
        self.finished: list[tuple[tuple[int, ...], np.float32, bool]] = \
            [((), _NEG, False)] * width
        self.improvable = True
        self.done = False

    @property
    def candidates_needed(self) -> int:
        """How many top tokens per beam a step must return: K, plus the eos ids (masked
        before min_new)."""
        return self.keep + len(self.eos)

    def step(self, top_ids: np.ndarray, top_logprobs: np.ndarray) -> list[tuple[int, int]]:
        """One search step from each running beam's top tokens (`[W, N]`, best first, N >=
        `candidates_needed`). Returns the new running beams as (parent beam, token), best
        first; `done` tells whether the search has ended (then `results`)."""
        W, K = self.width, self.keep
        rows = []
        for b in range(W):
            for tok, lp in zip(top_ids[b], top_logprobs[b], strict=True):
                tok = int(tok)
                if tok in self.eos and self.generated < self.min_new:
                    continue  # transformers' MinNewTokensLengthLogitsProcessor: -inf
                rows.append((np.float32(self.scores[b] + np.float32(lp)), b, tok))
        # The top K of W * V, ties in flattened (beam, token) order as torch.topk gives them.
        rows.sort(key=lambda r: (-r[0], r[1], r[2]))
        top = rows[:K]
        scores = np.array([r[0] for r in top], np.float32)
        seqs = [self.running[b] + (tok,) for _, b, tok in top]
        at_max = self.generated + 1 >= self.max_new
        hits = np.array([tok in self.eos or at_max for _, _, tok in top], bool)
        # The W best continuations that did not stop keep running.
        order = np.argsort(-(scores + hits.astype(np.float32) * _NEG), kind="stable")[:W]
        parents = [(top[i][1], top[i][2]) for i in order]
        running_scores = (scores + hits.astype(np.float32) * _NEG)[order]
        # The W best finished hypotheses so far, merged with the ones that just stopped.
        just = hits & (np.arange(len(top)) < W)
        length = np.float32((self.generated + 1 + self.length_offset) ** self.length_penalty)
        fin = scores / length
        if all(f for _, _, f in self.finished) and self.early_stopping is True:
            fin = fin + _NEG
        if not self.improvable:
            fin = fin + _NEG
        fin = fin + (~just).astype(np.float32) * _NEG
        merged = self.finished + [(seqs[i], fin[i], bool(just[i])) for i in range(len(top))]
        merged_scores = np.array([s for _, s, _ in merged], np.float32)
        pick = np.argsort(-merged_scores, kind="stable")[:W]
        self.finished = [merged[i] for i in pick]
        self.running = [seqs[i] for i in order]
        self.scores = running_scores.astype(np.float32)
        self.generated += 1
        # Whether the search goes on (transformers' _check_early_stop_heuristic and
        # _beam_search_has_unfinished_sequences).
        if self.early_stopping == "never" and self.length_penalty > 0:
            best_len = self.max_new + self.length_offset
        else:
            best_len = self.generated + self.length_offset
        best_possible = self.scores[0] / np.float32(best_len ** self.length_penalty)
        is_finished = np.array([f for _, _, f in self.finished], bool)
        fin_scores = np.array([s for _, s, _ in self.finished], np.float32)
        worst = np.where(is_finished, fin_scores.min(), _NEG)
        self.improvable = bool(self.improvable and np.any(best_possible > worst))
        open_beam = not (is_finished.all() and self.early_stopping is True)
        self.done = not (self.improvable and open_beam and not hits.all())
        return parents

    def results(self, n: int) -> list[tuple[tuple[int, ...], float, str]]:
        """The `n` best hypotheses, best first (after `done`): (generated ids, score,
        finish reason: "stop" when it ended on an eos id, else "length")."""
        out = []
        for ids, score, _ in self.finished[:n]:
            ended = bool(ids) and ids[-1] in self.eos
            out.append((tuple(ids), float(score), "stop" if ended else "length"))
        return out
