"""Streaming detokenization on a window: `IncrementalDetokenizer` turns a growing sequence of
token ids into text deltas at a cost per delta that does not grow with the output.

What it shows after each delta is what decoding the whole output would show: the decode of
every id so far, less any trailing U+FFFD (an incomplete UTF-8 character waits for its next
bytes; a genuinely invalid byte shows once something follows it, or at the end), less a tail
that could still become a stop string, cut at the first stop string.

How: the text of `ids[:read_at]` is settled. Each delta decodes only `ids[prefix_at:]`, where
`ids[prefix_at:read_at]` is the last settled stretch, kept as context so that decoders which
treat the start of a text specially (SentencePiece's leading-space strip) see the same start in
both decodes; the new text is what that decode adds past the context's own decode. The read
offset moves once the new text ends on a whole character. Special ids are dropped before they
enter the window, as the decode skips them anyway, so a run of them costs nothing. Should the
text keep ending in U+FFFD for `_MAX_PENDING` ids (garbage bytes), the ids but the last few are
settled anyway: an incomplete character spans at most 3 bytes, so text that far back is final.

Exact for byte-level BPE and for SentencePiece byte fallback while its byte runs are valid
UTF-8 (tests/router/test_detokenizer.py compares it with the whole decode on random ids).
Where a byte-fallback run turns invalid, the whole decode rewrites characters already shown;
the stream, like the previous whole-decode detokenizer, never takes text back.

API: `IncrementalDetokenizer`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcluster.router.api.tokenizer import RouterTokenizer

REPLACEMENT = "\ufffd"
_MAX_PENDING = 64  # ids decoded again while the text ends in U+FFFD, before settling them
_SETTLE_KEEP = 4  # ids left unsettled when forced: more than one UTF-8 character's bytes


class IncrementalDetokenizer:
    """Text deltas of a growing token sequence, cut at the first stop string."""

    def __init__(self, tokenizer: RouterTokenizer, stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._longest = max((len(s) for s in self._stop), default=0)
        self._hold = max(self._longest - 1, 0)
        self._ids: list[int] = []  # decodable ids only (special ids dropped)
        self._prefix_at = 0
        self._read_at = 0
        self._prefix_len = 0  # len(decode(ids[prefix_at:read_at]))
        self._settled = ""  # settled text from char `_settled_at` on
        self._settled_at = 0
        self._emitted = 0
        self.stopped = False

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Feed new ids; returns the new text safe to show (everything when `final`)."""
        if self.stopped:
            return ""
        self._ids += self._tokenizer.decodable_ids(token_ids)
        fresh = self._tokenizer.decode(self._ids[self._prefix_at:])[self._prefix_len:]
        if final:
            self._settled += fresh
            text = self._settled
        else:
            if self._can_settle(fresh):
                self._settle(len(self._ids), fresh)
                fresh = ""
            elif len(self._ids) - self._read_at > _MAX_PENDING:
                fresh = self._force_settle(fresh)
            text = (self._settled + fresh).rstrip(REPLACEMENT)
        return self._cut(text, final)

    def _can_settle(self, fresh: str) -> bool:
        """New text that ends on a whole character, and not inside a run of byte-fallback
        ids: a later invalid byte makes the decode replace the whole run."""
        return (bool(fresh) and not fresh.endswith(REPLACEMENT)
                and self._ids[-1] not in self._tokenizer.byte_token_ids)

    def _settle(self, read_at: int, fresh: str) -> None:
        self._settled += fresh
        self._prefix_at, self._read_at = self._read_at, read_at
        self._prefix_len = len(self._tokenizer.decode(self._ids[self._prefix_at:read_at]))

    def _force_settle(self, fresh: str) -> str:
        """Settle all but the last few ids, at a cut whose text is already part of `fresh`;
        returns the part of `fresh` left unsettled."""
        for keep in range(_SETTLE_KEEP, 2 * _SETTLE_KEEP):
            read_at = len(self._ids) - keep
            head = self._tokenizer.decode(self._ids[self._prefix_at:read_at])[self._prefix_len:]
            if fresh.startswith(head) and (len(head) < len(fresh) or keep == _SETTLE_KEEP):
                self._settle(read_at, head)
                return fresh[len(head):]
        return fresh  # the decoder rewrote earlier text: wait for a clean end instead

    def _cut(self, text: str, final: bool) -> str:
        """The stop-string cut and hold-back on `text` (the visible text from char
        `_settled_at` on), then drops settled text that no stop search can reach again."""
        base = self._settled_at
        for stop in self._stop:
            at = text.find(stop, max(0, self._emitted - len(stop)) - base)
            if at != -1:
                self.stopped = True
                text = text[:at]
        size = base + len(text)
        end = size if final or self.stopped else max(self._emitted, size - self._hold)
        delta = text[self._emitted - base:end - base]
        self._emitted = max(self._emitted, end)
        drop = min(len(self._settled), max(0, self._emitted - self._longest - base))
        if drop:
            self._settled = self._settled[drop:]
            self._settled_at += drop
        return delta
