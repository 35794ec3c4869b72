"""Small English-like text corpus for tokenizer, packing and language-model tests.

``make_text_corpus`` writes ``out/doc_<i:05d>.txt``: short stories produced by a probabilistic
grammar over a few hundred words. The structure is there to be learned: templated sentences,
Zipf-distributed word choice, a recurring cast of named people, places and organisations per
document, and day numbers that count up. A byte-level model therefore gets well below the unigram
entropy quickly. Every 50th document adds accented words ("café", "naïve", "Zürich") so that
UTF-8 handling is exercised; all others are plain ASCII.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .images import fresh_out_dir

log = logging.getLogger(__name__)

NON_ASCII_EVERY = 50

PEOPLE = (
    "Ada Moss", "Bruno Vale", "Clara Finch", "Dmitri Orlov", "Elena Brook", "Farid Haddad",
    "Grace Holt", "Hugo Lind", "Ines Costa", "Jonas Berg", "Keiko Sato", "Liam Reed",
    "Maya Stone", "Nils Dahl", "Olga Petrova", "Pavel Novak",
)  # fmt: skip
PLACES = (
    "the harbor", "the old mill", "Northfield", "the market", "the library", "Riverton",
    "the station", "the north bridge", "Eastwick", "the orchard", "the lighthouse",
    "the town hall", "Millbrook", "the quarry", "the museum", "Westport",
)  # fmt: skip
ORGS = (
    "the Guild of Clockmakers", "Harbor Bank", "the River Council", "the Lantern Society",
    "Northfield School", "the Weavers Union", "the Postal Office", "the Garden Club",
)  # fmt: skip
NOUNS = (
    "lantern", "boat", "letter", "clock", "garden", "bridge", "window", "river", "map", "key",
    "basket", "candle", "bell", "ledger", "kettle", "ribbon", "ladder", "barrel", "compass",
    "blanket", "wagon", "feather", "mirror", "anchor", "bottle", "button", "carpet", "drum",
    "engine", "fence", "gate", "hammer", "jacket", "kite", "lamp", "needle", "oven", "parcel",
    "rope", "saddle", "shovel", "table", "tower", "trumpet", "umbrella", "violin", "wheel",
    "whistle", "apple", "bucket", "chair", "door", "flag", "glove", "hat", "jar", "knot",
    "leaf", "market stall", "notebook", "pebble", "quilt", "scarf", "stone", "ticket", "cup",
    "coin", "brush", "pillow", "crate", "thread", "mask", "shell", "stamp", "spoon", "plate",
)  # fmt: skip
ADJECTIVES = (
    "old", "small", "bright", "quiet", "heavy", "red", "green", "broken", "tall", "narrow",
    "warm", "cold", "strange", "careful", "golden", "silver", "wooden", "dusty", "lucky",
    "gentle", "famous", "hidden", "empty", "crowded", "sharp", "soft", "rusty", "polished",
    "wet", "dry", "early", "late", "patient", "curious", "clever", "simple", "ancient", "blue",
    "fragile", "sturdy", "noisy", "silent", "round", "square", "faded", "fresh", "hollow",
    "humble", "proud", "rare", "steady", "tiny", "vast", "wild", "brave", "plain",
)  # fmt: skip
VERBS = (
    "repaired", "painted", "carried", "found", "opened", "closed", "counted", "cleaned",
    "lifted", "moved", "sold", "bought", "borrowed", "returned", "measured", "polished",
    "wrapped", "followed", "watched", "described", "ordered", "collected", "checked", "marked",
    "packed", "pulled", "pushed", "guarded", "visited", "studied", "weighed", "tested",
    "replaced", "mended", "traded", "noticed", "shared", "hid", "kept", "built", "drew",
    "sent", "brought", "took", "gave", "made", "held", "left",
)  # fmt: skip
ADVERBS = (
    "slowly", "quickly", "carefully", "quietly", "again", "twice", "gladly", "early",
    "at once", "before noon", "after dark", "in the rain", "without a word", "with care",
    "by hand", "for the last time",
)  # fmt: skip
COUNT_WORDS = ("two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "twelve")
ACCENTED = (
    "{p} ordered a café au lait in Zürich.",
    "The naïve {n} read her résumé aloud at the crêperie.",
    "At the façade of the old museum, {p} paid 4 € for a jalapeño.",
    "Zoë and José met Søren near the fjord, where the coöperative sold piñatas.",
    "{p} wrote “déjà vu” on the {n} — then crossed it out.",
)


def _zipf(rng: np.random.Generator, words: Sequence[str]) -> str:
    # Word frequency 1/rank, as in natural text: a few words carry most of the mass.
    weights = 1.0 / np.arange(1, len(words) + 1)
    return words[int(rng.choice(len(words), p=weights / weights.sum()))]


@dataclass
class _Story:
    """Per-document state: the recurring cast and the day counter."""

    rng: np.random.Generator
    cast: list[str]
    place: str
    org: str
    topics: list[str]
    day: int

    def person(self) -> str:
        return self.cast[int(self.rng.integers(len(self.cast)))]

    def noun(self) -> str:
        # Stick to the document's topics most of the time, so documents have a subject.
        if self.rng.random() < 0.6:
            return self.topics[int(self.rng.integers(len(self.topics)))]
        return _zipf(self.rng, NOUNS)

    def pick(self, words: Sequence[str]) -> str:
        return _zipf(self.rng, words)


def _first_name(name: str) -> str:
    return name.split()[0]


def _acted(s: _Story) -> str:
    return f"{s.person()} {s.pick(VERBS)} the {s.pick(ADJECTIVES)} {s.noun()} near {s.place}."


def _described(s: _Story) -> str:
    return f"The {s.noun()} was {s.pick(ADJECTIVES)} and {s.pick(ADJECTIVES)}."


def _together(s: _Story) -> str:
    first, second = _first_name(s.cast[0]), _first_name(s.cast[-1])
    count = s.pick(COUNT_WORDS)
    return f"{first} and {second} {s.pick(VERBS)} {count} {s.noun()}s {s.pick(ADVERBS)}."


def _ledger(s: _Story) -> str:
    s.day += 1
    amount = int(s.rng.integers(2, 40))
    return f"On day {s.day}, {_first_name(s.person())} counted {amount} {s.noun()}s at {s.place}."


def _employer(s: _Story) -> str:
    return f"{s.person()} works for {s.org}."


def _quoted(s: _Story) -> str:
    adjective = s.pick(ADJECTIVES)
    return f'"{adjective.capitalize()} {s.noun()}s are {s.pick(ADJECTIVES)}," said {s.person()}.'


def _later(s: _Story) -> str:
    return f"Later, {_first_name(s.person())} {s.pick(VERBS)} the {s.noun()} {s.pick(ADVERBS)}."


_SENTENCES: tuple[Callable[[_Story], str], ...] = (
    _acted, _described, _together, _ledger, _employer, _quoted, _later,
)  # fmt: skip
_SENTENCE_WEIGHTS = np.array([5.0, 3.0, 2.0, 3.0, 1.0, 2.0, 3.0])


def _sentence(story: _Story) -> str:
    p = _SENTENCE_WEIGHTS / _SENTENCE_WEIGHTS.sum()
    return _SENTENCES[int(story.rng.choice(len(_SENTENCES), p=p))](story)


def _new_story(rng: np.random.Generator) -> _Story:
    cast_size = int(rng.integers(2, 4))
    cast = [PEOPLE[int(k)] for k in rng.choice(len(PEOPLE), size=cast_size, replace=False)]
    topics = [NOUNS[int(k)] for k in rng.choice(len(NOUNS), size=5, replace=False)]
    place, org = PLACES[int(rng.integers(len(PLACES)))], ORGS[int(rng.integers(len(ORGS)))]
    return _Story(rng, cast, place, org, topics, day=int(rng.integers(1, 300)))


def render_document(rng: np.random.Generator, number: int, accented: bool = False) -> str:
    """Return one document: a title line, then 1-4 paragraphs of 2-6 sentences."""
    story = _new_story(rng)
    subject = f"the {story.pick(ADJECTIVES)} {story.topics[0]}"
    title = f"Chronicle {number}: {story.cast[0]} and {subject}"
    paragraphs = []
    for _ in range(int(rng.integers(1, 5))):
        sentences = [_sentence(story) for _ in range(int(rng.integers(2, 7)))]
        paragraphs.append(" ".join(sentences))
    if accented:
        extra = [t.format(p=story.person(), n=story.noun()) for t in ACCENTED]
        paragraphs.append(" ".join(extra))
    return "\n\n".join([title, *paragraphs]) + "\n"


def make_text_corpus(out: str | Path, *, docs: int = 400, seed: int = 0) -> Path:
    """Write ``docs`` UTF-8 documents as ``out/doc_<i:05d>.txt``.

    Documents with ``i % 50 == 0`` contain non-ASCII text; the rest are ASCII. The same arguments
    give byte-identical files.
    """
    out = fresh_out_dir(out)
    for i in range(docs):
        rng = np.random.default_rng([seed, i])
        text = render_document(rng, number=i, accented=i % NON_ASCII_EVERY == 0)
        (out / f"doc_{i:05d}.txt").write_bytes(text.encode("utf-8"))
    log.info("wrote %d text documents to %s", docs, out)
    return out
