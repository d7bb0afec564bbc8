"""Prompt sets written for this project: a training set for distillation and a disjoint evaluation set.

Both are built from templates and word lists by a seeded generator, in the six Spec-Bench task kinds (multi-turn
chat, translation, summarisation, question answering, math reasoning, retrieval-augmented QA) plus code. The
evaluation prompts use held-out topics, so acceptance measured on them is not measured on training prompts.
Passages for summarisation and RAG come from Python's own documentation (pydoc_data), which every machine has.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

Messages = list[dict[str, str]]

TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "machine learning", "volcanoes",
    "the immune system", "climate change", "the stock market", "democracy", "the internet", "electricity",
    "gravity", "the Roman Empire", "DNA", "earthquakes", "vaccines", "renewable energy", "the moon landing",
    "inflation", "recycling", "honey bees", "the human heart", "rainbows", "the printing press", "glaciers",
    "coral reefs", "the Olympic Games", "jazz music", "the Great Wall of China", "antibiotics", "solar panels",
    "cloud computing", "the theory of evolution", "supply and demand", "the Renaissance", "tides", "hurricanes",
    "meditation", "sleep", "nutrition", "exercise", "time management", "public speaking", "chess", "coffee",
    "bread baking", "gardening", "the solar system", "plate tectonics", "the Industrial Revolution", "bridges",
    "airplanes", "submarines", "batteries", "magnets", "microscopes", "telescopes", "robots", "video games",
    "social media", "cryptography", "databases", "operating systems", "compilers", "encryption", "email",
    "the human brain", "dinosaurs", "rain forests", "deserts", "the ocean", "penguins", "elephants", "wolves",
    "the Eiffel Tower", "the Amazon river", "Mount Everest", "the pyramids of Egypt", "the Moon", "Mars",
]
HELD_OUT_TOPICS = [
    "tea", "lighthouses", "origami", "bicycles", "the violin", "paper money", "the compass", "snowflakes",
    "octopuses", "windmills", "the Silk Road", "chocolate", "fireworks", "the piano", "trains", "umbrellas",
]
CHAT_TEMPLATES = [
    "Explain {t} in simple terms.", "What are three interesting facts about {t}?", "Why is {t} important?",
    "Give me a short introduction to {t}.", "How would you explain {t} to a child?",
    "What are the main advantages and disadvantages of {t}?", "Write a short paragraph about {t}.",
    "What is the history of {t}?", "Can you tell me something surprising about {t}?",
    "List some common misconceptions about {t}.",
]
FOLLOW_UPS = ["Can you say more about that?", "Can you give an example?", "Summarize that in one sentence.",
              "Why is that?", "What should I read next about it?"]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "counts the vowels in a string", "removes duplicates from a list",
    "finds the largest element of a list", "checks whether a string is a palindrome", "sorts a list of tuples by "
    "their second element", "merges two sorted lists", "converts Celsius to Fahrenheit", "flattens a nested list",
    "counts word frequencies in a text", "computes the greatest common divisor of two numbers",
    "reads a CSV file and returns its rows", "returns the sum of the digits of an integer",
    "checks whether two strings are anagrams", "generates all permutations of a list", "implements binary search",
    "computes the average of a list of numbers", "capitalizes every word of a sentence",
    "finds the second smallest number in a list", "transposes a matrix", "validates an email address",
]
HELD_OUT_CODE_TASKS = ["rotates a list by k positions", "computes the median of a list",
                       "counts the lines in a file", "returns the longest word in a sentence"]
LANGUAGES = ["French", "Spanish", "German", "Italian"]
SENTENCES = [
    "I like to read books in the evening.", "The weather is beautiful today.", "Where is the train station?",
    "My brother works in a hospital.", "We are going to the beach tomorrow.", "This restaurant serves good food.",
    "Can you help me find my keys?", "The children are playing in the garden.", "I have been learning to cook.",
    "The museum opens at nine o'clock.", "She bought a new car last week.", "Please close the window.",
    "How much does this cost?", "I would like a cup of coffee.", "The meeting was cancelled.",
]
HELD_OUT_SENTENCES = ["The library is closed on Sundays.", "My favourite colour is green.",
                      "We missed the last bus home.", "The cat is sleeping on the sofa."]
QUESTIONS = [
    "What is the capital of {c}?", "Who wrote Romeo and Juliet?", "How many days are in a leap year?",
    "What is the boiling point of water?", "What is the largest planet in our solar system?",
    "How many continents are there?", "What language is spoken in {c}?", "What is the chemical symbol for gold?",
    "Who painted the Mona Lisa?", "What is the speed of light?", "What is the tallest mountain in the world?",
    "How many legs does a spider have?", "What is the main ingredient of guacamole?",
]
HELD_OUT_QUESTIONS = [
    "What is the capital of {c}?", "What is the freezing point of water?", "Who discovered penicillin?",
    "How many planets are in the solar system?", "What is the smallest prime number?",
    "Which ocean is the largest?", "What gas do plants absorb from the air?",
]
COUNTRIES = ["France", "Japan", "Italy", "Germany", "Spain", "Canada", "Brazil", "Egypt", "India", "Mexico",
             "Australia", "Kenya", "Norway", "Peru", "Greece"]
HELD_OUT_COUNTRIES = ["Portugal", "Chile", "Vietnam", "Ireland"]
NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonas"]
ITEMS = ["apples", "books", "pencils", "marbles", "stickers", "cookies", "coins", "cards"]
HELD_OUT_NAMES = ["Kira", "Leo", "Mina", "Noah"]
HELD_OUT_ITEMS = ["oranges", "shells", "buttons", "stamps"]


@dataclass(frozen=True)
class Prompt:
    kind: str  # chat, multi_turn, translation, summarisation, qa, math, rag, code
    messages: Messages


def _passages() -> list[str]:
    """Plain-prose paragraphs of 40-120 words from Python's documentation topics."""
    from pydoc_data.topics import topics

    out = []
    for text in topics.values():
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            if 40 <= len(para.split()) <= 120 and para[0].isupper() and "::" not in para and ">>>" not in para:
                out.append(para)
    return sorted(set(out))


def _math(rng: random.Random, held_out: bool) -> str:
    a, b, c = rng.randint(2, 30), rng.randint(2, 20), rng.randint(1, 10)
    name = rng.choice(HELD_OUT_NAMES if held_out else NAMES)
    item = rng.choice(HELD_OUT_ITEMS if held_out else ITEMS)
    return rng.choice([
        f"{name} has {a} {item} and buys {b} more. Then {name} gives away {c}. How many {item} are left?",
        f"A box holds {b} {item}. How many {item} are in {a} boxes?",
        f"What is {a} times {b} plus {c}? Show your steps.",
        f"{name} reads {b} pages a day. How many days does it take to read {a * b} pages?",
        f"If a train travels {a * 10} kilometers in {c} hours, what is its average speed?",
    ])


def build(n: int, seed: int = 0, held_out: bool = False) -> list[Prompt]:
    """`n` prompts cycling through the task kinds; held_out=True draws topics the training set never sees."""
    rng = random.Random(seed + (1000 if held_out else 0))
    topics = HELD_OUT_TOPICS if held_out else TOPICS
    tasks = HELD_OUT_CODE_TASKS if held_out else CODE_TASKS
    sentences = HELD_OUT_SENTENCES if held_out else SENTENCES
    countries = HELD_OUT_COUNTRIES if held_out else COUNTRIES
    passages = _passages()
    passages = passages[: len(passages) // 5] if held_out else passages[len(passages) // 5:]

    def make(kind: str) -> Messages:
        if kind == "chat":
            return [{"role": "user", "content": rng.choice(CHAT_TEMPLATES).format(t=rng.choice(topics))}]
        if kind == "multi_turn":  # the assistant turn is filled in by the target before use (see datagen)
            return [{"role": "user", "content": rng.choice(CHAT_TEMPLATES).format(t=rng.choice(topics))},
                    {"role": "assistant", "content": ""}, {"role": "user", "content": rng.choice(FOLLOW_UPS)}]
        if kind == "translation":
            return [{"role": "user", "content": f"Translate to {rng.choice(LANGUAGES)}: {rng.choice(sentences)}"}]
        if kind == "summarisation":
            return [{"role": "user", "content": f"Summarize the following text in two sentences.\n\n{rng.choice(passages)}"}]
        if kind == "qa":
            questions = HELD_OUT_QUESTIONS if held_out else QUESTIONS
            return [{"role": "user", "content": rng.choice(questions).format(c=rng.choice(countries))}]
        if kind == "math":
            return [{"role": "user", "content": _math(rng, held_out)}]
        if kind == "rag":
            return [{"role": "user", "content": f"Answer the question using the passage.\n\nPassage: "
                                                f"{rng.choice(passages)}\n\nQuestion: What is this passage about?"}]
        return [{"role": "user", "content": f"Write a Python function that {rng.choice(tasks)}."}]

    kinds = ("chat", "code", "translation", "summarisation", "qa", "math", "rag", "multi_turn")
    return [Prompt(kinds[i % len(kinds)], make(kinds[i % len(kinds)])) for i in range(n)]
