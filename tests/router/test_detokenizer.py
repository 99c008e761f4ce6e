"""The router's windowed detokenizer against the whole-output decode, delta for delta, on
random ids: a byte-level BPE (ids that split UTF-8 characters, invalid bytes, special tokens)
and the SentencePiece tokenizer of the tiny models (byte-fallback runs, a character cut at the
end, the leading-space strip, special tokens); plus its cost per delta, counted in decoded ids."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest

from pdcluster.router.api.detokenizer import IncrementalDetokenizer
from pdcluster.router.api.tokenizer import RouterTokenizer
from tests.router.detok_reference import WholeDecodeDetokenizer, write_byte_level_model

NUM_SEQUENCES = 1000
UNICODE = "éüß€£中文日本語한국😀🎉🚀∑√ЖЯ"


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> RouterTokenizer:
    return RouterTokenizer(write_byte_level_model(tmp_path_factory.mktemp("bbpe")))


@pytest.fixture(scope="module")
def sentencepiece(model_dir: Path) -> RouterTokenizer:
    return RouterTokenizer(model_dir)


class CountingTokenizer(RouterTokenizer):
    """Counts the ids each decode is given: the detokenizer's work."""

    num_decoded = 0

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.num_decoded += len(token_ids)
        return super().decode(token_ids, skip_special_tokens)


def byte_level_ids(tok: RouterTokenizer, rng: random.Random) -> list[int]:
    """Any id, with high bytes (halves of UTF-8 characters, invalid bytes) and specials
    over-represented."""
    high_bytes = [byte_level_id(tok, b) for b in range(0x80, 0x100)]
    ids = []
    for _ in range(rng.randint(1, 120)):
        kind = rng.random()
        if kind < 0.4:
            ids.append(rng.randrange(tok.vocab_size))
        elif kind < 0.6:
            ids.append(rng.choice(high_bytes))
        elif kind < 0.9:
            ids += tok.encode(rng.choice(UNICODE) + rng.choice(" ab.,"), add_special_tokens=False)
        else:
            ids.append(rng.choice([0, 1]))
    return ids


@functools.cache
def byte_level_id(tok: RouterTokenizer, byte: int) -> int:
    """The id of one raw byte's token in a byte-level BPE (GPT-2's byte-to-character map)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    char = chr(byte) if byte in printable else chr(256 + others.index(byte))
    names = tok.token_strings(list(range(tok.vocab_size)))
    return names.index(char)


def sentencepiece_ids(tok: RouterTokenizer, rng: random.Random) -> list[int]:
    """Ordinary pieces, "▁" alone, specials and valid UTF-8 byte-fallback runs; the last
    character may be cut short."""
    byte_id = byte_token_ids(tok)
    space = tok.encode("▁", add_special_tokens=False)[-1]
    ids: list[int] = []
    for _ in range(rng.randint(1, 80)):
        kind = rng.random()
        if kind < 0.5:
            ids.append(rng.randrange(259, tok.vocab_size))
        elif kind < 0.8:
            ids += [byte_id[b] for b in rng.choice(UNICODE).encode()]
        else:
            ids.append(rng.choice([1, 2, space]))
    if rng.random() < 0.3:
        ids += [byte_id[b] for b in rng.choice("€中😀").encode()[:rng.randint(1, 2)]]
    return ids


@functools.cache
def byte_token_ids(tok: RouterTokenizer) -> dict[int, int]:
    """byte -> the id of its byte-fallback token ("<0xE2>")."""
    names = tok.token_strings(list(range(tok.vocab_size)))
    ids = {name: i for i, name in enumerate(names)}
    return {b: ids[f"<0x{b:02X}>"] for b in range(256)}


def random_stops(tok: RouterTokenizer, ids: list[int], rng: random.Random) -> list[str]:
    text = tok.decode(ids)
    if not text or rng.random() < 0.3:
        return []
    stops = []
    for _ in range(rng.randint(1, 2)):
        at = rng.randrange(len(text))
        stops.append(text[at:at + rng.randint(1, 6)])
    return stops


def feed(detok, ids: list[int], rng: random.Random) -> list[str]:
    deltas, at = [], 0
    while at < len(ids) and not detok.stopped:
        step = rng.randint(1, 4)
        deltas.append(detok.add(ids[at:at + step], final=at + step >= len(ids)))
        at += step
    return deltas


def assert_matches_whole_decode(tok: RouterTokenizer, make_ids, seed: int) -> None:
    for case in range(NUM_SEQUENCES):
        rng = random.Random(seed * 100_000 + case)
        ids = make_ids(tok, rng)
        stops = random_stops(tok, ids, rng)
        split = random.Random(case)
        got = feed(IncrementalDetokenizer(tok, stops), ids, split)
        split = random.Random(case)
        want = feed(WholeDecodeDetokenizer(tok, stops), ids, split)
        assert got == want, (case, ids, stops)
        if not stops and decode_only_grows(tok, ids):
            assert "".join(got) == tok.decode(ids)


def decode_only_grows(tok: RouterTokenizer, ids: list[int]) -> bool:
    """Whether the decode of each prefix (less trailing U+FFFD) begins the decode of all:
    false where a byte-fallback run turns invalid (the decode then replaces every byte of
    the run, characters already shown included: no stream can match that)."""
    whole = tok.decode(ids)
    return all(whole.startswith(tok.decode(ids[:k]).rstrip("\ufffd")) for k in range(len(ids)))


@pytest.mark.parametrize("seed", [1, 2])
def test_byte_level_matches_the_whole_decode(byte_level, seed) -> None:
    assert_matches_whole_decode(byte_level, byte_level_ids, seed)


@pytest.mark.parametrize("seed", [1, 2])
def test_sentencepiece_matches_the_whole_decode(sentencepiece, seed) -> None:
    assert_matches_whole_decode(sentencepiece, sentencepiece_ids, seed)


def test_a_character_in_byte_tokens_shows_whole(sentencepiece) -> None:
    euro = [byte_token_ids(sentencepiece)[b] for b in "€".encode()]
    detok = IncrementalDetokenizer(sentencepiece, [])
    hello = sentencepiece.encode("Hello", add_special_tokens=False)
    deltas = [detok.add(hello)] + [detok.add([i]) for i in euro] + [detok.add([], final=True)]
    assert deltas == ["Hello", "", "", "€", ""]


def test_long_garbage_is_settled_and_shown(byte_level) -> None:
    invalid = [byte_level_id(byte_level, 0x80)]
    bad = byte_level.decode(invalid * 3)
    assert bad.endswith("\ufffd")
    detok = IncrementalDetokenizer(byte_level, [])
    shown = "".join(detok.add(invalid) for _ in range(500))
    assert shown == byte_level.decode(invalid * 500).rstrip("\ufffd")
    assert shown + detok.add([], final=True) == byte_level.decode(invalid * 500)


@pytest.mark.parametrize("text", ["plain words, one by one. " * 40, "中文😀é€ " * 60])
def test_work_per_delta_does_not_grow_with_the_output(byte_level, tmp_path, text) -> None:
    tok = CountingTokenizer(write_byte_level_model(tmp_path / "m"))
    ids = tok.encode(text, add_special_tokens=False) * 20
    ids += [byte_level_id(tok, 0x80)] * 2000 + [0] * 2000
    detok = IncrementalDetokenizer(tok, ["never appears"])
    for i in ids:
        detok.add([i])
    assert tok.num_decoded <= 80 * len(ids), tok.num_decoded / len(ids)
