"""Per-sequence output text: incremental detokenisation, stop tokens and stop strings.

Semantics (vLLM's):
- a stop token (EOS unless ``ignore_eos``, or one of ``stop_token_ids``) ends the sequence; it stays
  in the token ids, and its text is left out unless ``include_stop_str_in_output``;
- a stop string ends the sequence at the token that completes it; the text is cut before it
  (``include_stop_str_in_output``: after it); ``stop_reason`` is the string;
- streamed deltas never show text that may still turn out to start a stop string: the longest tail
  that is a prefix of some stop string is held back until it is ruled out (or the sequence ends).
  Concatenating every delta gives the final text.
"""

from __future__ import annotations

from collections.abc import Iterable

from moetier.engine.sampling import SamplingParams


def held_back(text: str, stops: Iterable[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``stops``."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class IncrementalText:
    """Text of one sequence, fed a token at a time; :meth:`take_delta` returns what may be shown now."""

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int], tokenizer) -> None:
        self.params = params
        self.stop_strings = params.stop_strings
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.decoder = None if tokenizer is None else tokenizer.stream_decoder(params.skip_special_tokens)
        self.text = ""
        self.emitted = 0  # self.text[:emitted] has been returned by take_delta
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(self, token: int) -> bool:
        """Record a generated token; True when it ends the sequence (stop token or stop string)."""
        if token in self.stop_ids:
            if self.params.include_stop_str_in_output:
                self._append(token, check_stops=False)
            self._finish("stop", token if token in self.params.stop_token_ids else None)
            return True
        return self._append(token)

    def _append(self, token: int, check_stops: bool = True) -> bool:
        if self.decoder is None:
            return False
        return self._extend(self.decoder.push(token), check_stops)

    def _extend(self, piece: str, check_stops: bool = True) -> bool:
        if not piece:
            return False
        self.text += piece
        if not check_stops or not self.stop_strings:
            return False
        # A match cannot start inside emitted text: any tail that could begin one was held back.
        found = [(at, s) for s in self.stop_strings if (at := self.text.find(s, self.emitted)) >= 0]
        if not found:
            return False
        at, stop = min(found)
        self.text = self.text[: at + (len(stop) if self.params.include_stop_str_in_output else 0)]
        self._finish("stop", stop)
        return True

    def finish_length(self) -> None:
        self._finish("length", None)

    def abort(self) -> None:
        self.finished, self.finish_reason, self.stop_reason = True, "abort", None

    def _finish(self, reason: str, stop_reason: int | str | None) -> None:
        # An unfinished character the decoder still holds belongs to the text; it may even complete a
        # stop string, which then decides the reason (that call passes a string stop_reason, so it
        # does not come back here).
        if not isinstance(stop_reason, str) and self.decoder is not None and self._extend(self.decoder.flush()):
            return
        self.finished, self.finish_reason, self.stop_reason = True, reason, stop_reason

    def take_delta(self) -> str:
        """The text not yet returned, minus (while running) a tail that may still start a stop string."""
        end = len(self.text)
        if not self.finished:
            end -= held_back(self.text[self.emitted :], self.stop_strings)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
