"""Seeded user requests whose natural answers range from one word to a page: the prompts the
length ranker's dataset is made of (disagg.ranking.dataset).

Each request comes from a template (a kind of request: yes/no, arithmetic, one sentence, a list
of N items, a story, code, a summary...) filled with words from banks. Every bank is split in
two halves, "train" and "heldout": a held-out request is filled only with held-out words, so a
ranker tested on them cannot have memorised the fill words it saw in training. The templates
themselves are shared by both halves (a ranker may learn that "Write an essay" means long).
The text is written for this project, no downloads.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

SPLITS = ("train", "heldout")

ANIMALS = ["dog", "cat", "horse", "eagle", "shark", "frog", "whale", "bee", "snake", "owl",
           "rabbit", "dolphin", "penguin", "spider", "goat", "crow", "tiger", "salmon", "bat", "ant"]  # fmt: skip
COUNTRIES = ["France", "Japan", "Brazil", "Canada", "Egypt", "India", "Italy", "Kenya", "Mexico", "Norway",
             "Peru", "Spain", "Chile", "Greece", "Poland", "Turkey", "Sweden", "Ghana", "Vietnam", "Ireland"]  # fmt: skip
TOPICS = ["photosynthesis", "gravity", "the internet", "rainbows", "volcanoes", "vaccines", "electricity",
          "tides", "inflation", "democracy", "recycling", "earthquakes", "the immune system", "solar power",
          "black holes", "bread baking", "the water cycle", "money", "sleep", "music"]  # fmt: skip
THINGS = ["fruits", "colors", "countries in Europe", "programming languages", "musical instruments",
          "kitchen tools", "sports", "planets", "birds", "vegetables", "board games", "trees",
          "famous painters", "rivers", "car brands", "flowers", "breakfast foods", "jobs", "hobbies", "tools"]  # fmt: skip
ADJECTIVES = ["happy", "big", "fast", "cold", "angry", "smart", "tiny", "bright", "quiet", "brave",
              "tired", "rich", "old", "strong", "funny", "calm", "dark", "soft", "loud", "clean"]  # fmt: skip
CHARACTERS = ["a lonely robot", "a young wizard", "an old fisherman", "a curious cat", "a brave knight",
              "a lost astronaut", "a tiny dragon", "a clever fox", "a shy ghost", "a retired pirate",
              "a talking tree", "a baker", "a time traveller", "a detective", "a princess",
              "a farmer", "a mermaid", "a giant", "a student", "a musician"]  # fmt: skip
GOALS = ["finds a hidden door", "learns to fly", "loses a friend", "wins a race", "discovers a secret",
         "travels to the moon", "builds a house", "meets a stranger", "saves a village", "opens a shop",
         "forgets everything", "finds treasure", "starts a band", "climbs a mountain", "writes a letter",
         "plants a garden", "solves a mystery", "crosses the sea", "tames a storm", "goes home"]  # fmt: skip
CODE_TASKS = ["reverses a string", "checks if a number is prime", "sorts a list of numbers",
              "counts the words in a text", "computes the factorial of n", "finds the largest item in a list",
              "merges two sorted lists", "removes duplicates from a list", "converts Celsius to Fahrenheit",
              "checks if a word is a palindrome", "computes Fibonacci numbers", "parses a CSV line",
              "flattens a nested list", "counts vowels in a string", "computes the mean of a list",
              "finds common items of two lists", "implements binary search", "capitalizes every word",
              "computes the GCD of two numbers", "validates an email address"]  # fmt: skip
SENTENCES = ["The city council met on Monday to discuss the new park.",
             "Many residents asked for more trees and a playground.",
             "The budget for the project is smaller than last year.",
             "Engineers said the work could start in the spring.",
             "A local school offered to help plant the gardens.",
             "Some shop owners worried about parking during construction.",
             "The mayor promised to publish the final plan next month.",
             "Scientists measured the river level every day for a year.",
             "The results showed that floods are becoming more common.",
             "Farmers near the river have already changed their crops.",
             "The team recommends building higher walls along the banks.",
             "Volunteers cleaned the beach after the summer festival.",
             "They collected more than two hundred bags of plastic.",
             "The festival organizers plan to ban single use cups.",
             "A new bus line will connect the airport to the center.",
             "Tickets will cost the same as on other city lines.",
             "The company reported higher sales in the last quarter.",
             "Its new phone sold better than analysts had expected.",
             "The museum opened a new room for ancient coins.",
             "Visitors can see coins that are two thousand years old."]  # fmt: skip


@dataclass(frozen=True)
class PromptSpec:
    template: str  # which kind of request
    text: str
    split: str  # "train" or "heldout": which half of the word banks filled it


def _half(bank: list[str], split: str) -> list[str]:
    """The bank's words that `split` may use: the first half for train, the second for held-out."""
    middle = len(bank) // 2
    return bank[:middle] if split == "train" else bank[middle:]


def _pick(rng: random.Random, bank: list[str], split: str) -> str:
    return rng.choice(_half(bank, split))


def _paragraph(rng: random.Random, split: str) -> str:
    sentences = _half(SENTENCES, split)
    return " ".join(rng.sample(sentences, rng.randint(3, min(6, len(sentences)))))


# Roughly from shortest natural answer to longest; each takes (rng, split) and returns the text.
TEMPLATES: dict[str, Callable[[random.Random, str], str]] = {
    "yes_no": lambda r, s: f"Answer only yes or no: is a {_pick(r, ANIMALS, s)} a mammal?",
    "number": lambda r, s: f"What is {r.randint(2, 99)} plus {r.randint(2, 99)}? Reply with the number only.",
    "one_word": lambda r, s: f"Give one word that means the opposite of {_pick(r, ADJECTIVES, s)}. One word only.",
    "capital": lambda r, s: f"What is the capital of {_pick(r, COUNTRIES, s)}?",
    "one_sentence": lambda r, s: f"Explain {_pick(r, TOPICS, s)} in one short sentence.",
    "summary": lambda r, s: f"Summarize this paragraph in one sentence: {_paragraph(r, s)}",
    "list": lambda r, s: f"List {r.randint(3, 12)} {_pick(r, THINGS, s)}.",
    "code": lambda r, s: f"Write a Python function that {_pick(r, CODE_TASKS, s)}.",
    "poem": lambda r, s: f"Write a poem about {_pick(r, TOPICS, s)}.",
    "explain": lambda r, s: f"Explain in detail how {_pick(r, TOPICS, s)} works, step by step.",
    "story": lambda r, s: f"Write a long story about {_pick(r, CHARACTERS, s)} who {_pick(r, GOALS, s)}.",
    "essay": lambda r, s: (
        f"Write an essay about {_pick(r, TOPICS, s)} with an introduction, three parts and a conclusion."
    ),
}


def make_prompts(n: int, seed: int = 0, heldout_fraction: float = 0.2) -> list[PromptSpec]:
    """`n` requests, templates in turn; every 1/heldout_fraction-th one is filled from the
    held-out halves of the banks. Request i depends only on (seed, i)."""
    every = max(1, round(1 / heldout_fraction))
    names = list(TEMPLATES)
    specs = []
    for i in range(n):
        rng = random.Random(f"ranking-{seed}-{i}")
        split = "heldout" if i % every == every - 1 else "train"
        name = names[i % len(names)] if i % every != every - 1 else names[(i // every) % len(names)]
        specs.append(PromptSpec(name, TEMPLATES[name](rng, split), split))
    return specs
