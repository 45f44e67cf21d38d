"""Generates ``fables.txt``: the small character-level training corpus shipped with dilax.

The text is synthetic (written by this script, no third-party text, so no licence question),
deterministic (``python -m dilax.data.make_corpus`` rewrites the same file byte for byte), and
has structure at several ranges for a language model to learn:

- spelling and a closed vocabulary (local, n-gram structure);
- sentence templates and punctuation (phrase structure);
- per-story entities: each story draws a hero, a companion, a place and an object, names them
  in its title and refers back to them, with the right pronoun, many sentences later;
- counting lists (``one, two, three.``) whose length is repeated in a later sentence, and a
  closing line that repeats the opening place: dependencies across hundreds of characters.
"""

from __future__ import annotations

import random
from pathlib import Path

HEROES = {
    "Anna": "she", "Bruno": "he", "Clara": "she", "Dario": "he", "Elena": "she", "Felix": "he",
    "Greta": "she", "Hugo": "he", "Ida": "she", "Jonas": "he", "Kira": "she", "Leo": "he",
    "Mira": "she", "Nico": "he", "Olga": "she", "Pablo": "he", "Rosa": "she", "Sami": "he",
    "Tilda": "she", "Ugo": "he", "Vera": "she", "Walter": "he", "Yara": "she", "Zeno": "he",
}
ANIMALS = ["fox", "hare", "owl", "badger", "crow", "mouse", "bear", "otter", "goat", "heron",
           "wolf", "deer", "frog", "swan", "lynx", "beaver", "sparrow", "tortoise", "squirrel",
           "hedgehog"]
ADJECTIVES = ["little", "old", "clever", "brave", "shy", "proud", "gentle", "curious", "lazy",
              "quick", "grey", "young", "wise", "hungry", "stubborn", "kind"]
PLACES = ["the dark forest", "the green valley", "the quiet lake", "the high mountain",
          "the old mill", "the wide meadow", "the stone bridge", "the river bank",
          "the windy hill", "the deep cave", "the village square", "the apple orchard"]
OBJECTS = ["lantern", "golden key", "silver bell", "wooden box", "red apple", "blue feather",
           "small boat", "old map", "copper coin", "warm blanket", "glass jar", "long rope"]
THINGS = ["stones", "acorns", "stars", "berries", "shells", "leaves", "pebbles", "mushrooms",
          "feathers", "seeds"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
WEATHER = ["The sun was warm", "A cold wind was blowing", "Rain fell softly", "Snow covered "
           "the ground", "The morning was misty", "The sky was clear and blue"]
TIMES = ["At dawn", "In the evening", "Before noon", "After a long walk", "Late at night",
         "On the third day"]
FEELINGS = ["happy", "tired", "afraid", "surprised", "sad", "glad", "worried", "calm"]
MORALS = [
    "Slow and steady wins the race.", "A friend in need is a friend indeed.",
    "Look before you leap.", "Kindness is never wasted.", "Pride comes before a fall.",
    "Many hands make light work.", "Honesty is the best policy.",
    "Do not count your eggs before they hatch.", "Little by little, one travels far.",
    "Patience is a tree with sweet fruit.",
]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def story(rng: random.Random) -> str:
    """One fable: a title line, four to seven paragraphs and a moral."""
    hero, companion = rng.sample(sorted(HEROES), 2)
    he = HEROES[hero]
    his = {"he": "his", "she": "her"}[he]
    her = {"he": "his", "she": "her"}[HEROES[companion]]
    a1, a2 = rng.sample(ANIMALS, 2)
    adj1, adj2 = rng.sample(ADJECTIVES, 2)
    home, goal = rng.sample(PLACES, 2)
    obj = rng.choice(OBJECTS)
    things = rng.choice(THINGS)
    count = rng.randint(2, 9)
    title = f"The {adj1.title()} {a1.title()} and the {obj.title()}"
    paras = [
        f"Once upon a time there was {_article(adj1)} {adj1} {a1} named {hero}. {hero} lived "
        f"near {home}. {rng.choice(WEATHER)}, and {he} was {rng.choice(FEELINGS)}.",
        f"One day {hero} found {_article(obj)} {obj} near {home}. \"What a strange {obj},\" "
        f"{he} said. {he.title()} wanted to take the {obj} to {goal}.",
        f"On the way the {a1} met {_article(adj2)} {adj2} {a2} called {companion}. \"Where are "
        f"you going, {hero}?\" asked {companion}. \"I am going to {goal},\" said {hero}. "
        f"\"May I come with you?\" asked the {a2}. \"Yes,\" said the {a1}.",
    ]
    middle = [
        f"{rng.choice(TIMES)} they stopped to rest. {companion} counted the {things}: "
        + ", ".join(NUMBERS[:count]) + f". \"There are {NUMBERS[count - 1]} {things},\" said "
        f"{companion}.",
        f"{rng.choice(TIMES)} the path became narrow. {hero} held the {obj} and {companion} "
        f"held {her} breath. The {adj1} {a1} was {rng.choice(FEELINGS)}, but {he} did not stop.",
        f"{rng.choice(WEATHER)}. {companion} told a story about {rng.choice(PLACES)}, and "
        f"{hero} listened. \"You are a good friend, {companion},\" said {hero}.",
        f"{rng.choice(TIMES)} they lost the way. {companion} looked at the {obj} and said, "
        f"\"Follow me, {hero}.\" The {a2} knew the way to {goal}.",
    ]
    rng.shuffle(middle)
    paras += middle[: rng.randint(1, len(middle))]
    paras.append(
        f"At last {hero} and {companion} came to {goal}. {hero} put {his} {obj} on a stone "
        f"and smiled. Then the {a1} and the {a2} walked back to {home} together."
    )
    paras.append(f"The moral of the story: {rng.choice(MORALS)}")
    return title + "\n\n" + "\n\n".join(paras) + "\n"


def corpus(seed: int = 0, num_bytes: int = 300_000) -> str:
    """Concatenated fables until the text holds at least ``num_bytes`` characters."""
    rng = random.Random(seed)
    parts, size = [], 0
    while size < num_bytes:
        s = story(rng)
        parts.append(s)
        size += len(s) + 1
    return "\n".join(parts)


def documents(seed: int = 1, count: int = 60) -> list[str]:
    """``count`` documents of mixed lengths for packed training (``--pack``): each holds one
    to four fables (about 0.7k to 4k characters)."""
    rng = random.Random(seed)
    return ["\n".join(story(rng) for _ in range(rng.randint(1, 4))) for _ in range(count)]


def write_documents(directory: str | Path, seed: int = 1, count: int = 60) -> list[Path]:
    """Writes :func:`documents` into ``directory``, one file each (``doc-000.txt``, ...)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, doc in enumerate(documents(seed, count)):
        paths.append(out / f"doc-{i:03d}.txt")
        paths[-1].write_text(doc, encoding="ascii")
    return paths


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m dilax.data.make_corpus",
                                description="Rewrite dilax/data/fables.txt, or (--documents) "
                                            "write a directory of documents for --pack.")
    p.add_argument("--documents", metavar="DIR", default=None,
                   help="write documents of mixed lengths (1 to 4 fables each) into DIR, one "
                        "file per document, instead of rewriting fables.txt")
    p.add_argument("--count", type=int, default=60, help="documents to write (--documents)")
    args = p.parse_args(argv)
    if args.documents is not None:
        paths = write_documents(args.documents, count=args.count)
        size = sum(q.stat().st_size for q in paths)
        print(f"wrote {len(paths)} documents into {args.documents} ({size} bytes)")
        return
    path = Path(__file__).with_name("fables.txt")
    path.write_text(corpus(), encoding="ascii")
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
