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
            return [{"role": "user",
                     "content": f"Summarize the following text in two sentences.\n\n{rng.choice(passages)}"}]
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


# -- the broad training pool ------------------------------------------------------------------------------------
# A draft trained on the base pool's 80 topics learns them well and generalises poorly to new ones: what it lacks
# is breadth, not steps. The broad pool adds several hundred topics, more phrasings and code tasks, weighted toward
# chat and code. Held-out topics/tasks/prompts (above) and the benchmark's own prompts (models/benchmark_prompts.py)
# stay out of it; tests/test_models.py checks both.
BROAD_TOPICS = TOPICS + [
    "the Byzantine Empire", "ancient Greece", "the Vikings", "the Aztecs", "the Inca Empire", "the Ming dynasty",
    "the Cold War", "World War I", "the American Civil War", "the Magna Carta", "the Berlin Wall", "the Ottoman Empire",
    "the Black Death", "the Apollo program", "the Hubble Space Telescope", "the International Space Station",
    "comets", "asteroids", "the Big Bang", "neutron stars", "exoplanets", "the Milky Way", "solar eclipses",
    "the northern lights", "Jupiter", "Saturn's rings", "Venus", "the speed of sound", "quantum mechanics",
    "relativity", "atoms", "the periodic table", "chemical reactions", "acids and bases", "friction", "energy",
    "nuclear power", "wind power", "hydroelectric dams", "geothermal energy", "fossil fuels", "carbon capture",
    "air pollution", "ocean acidification", "deforestation", "biodiversity", "endangered species", "wetlands",
    "mangroves", "the ozone layer", "soil erosion", "composting", "organic farming", "irrigation", "beekeeping",
    "fungi", "mushrooms", "bacteria", "viruses", "the digestive system", "the lungs", "the skeleton", "muscles",
    "the eye", "hearing", "the sense of smell", "memory", "emotions", "stress", "habits", "motivation",
    "creativity", "curiosity", "friendship", "empathy", "leadership", "teamwork", "negotiation", "budgeting",
    "saving for retirement", "credit cards", "taxes", "interest rates", "banks", "insurance", "entrepreneurship",
    "marketing", "advertising", "customer service", "remote work", "job interviews", "writing a resume",
    "learning a new language", "studying for exams", "online courses", "libraries", "museums", "newspapers",
    "podcasts", "photography", "painting", "sculpture", "architecture", "poetry", "novels", "theater", "opera",
    "ballet", "hip hop", "classical music", "the drums", "film making", "animation", "comic books", "board games",
    "card games", "football", "basketball", "tennis", "swimming", "running", "yoga", "cycling races", "skiing",
    "mountaineering", "camping", "fishing", "sailing", "surfing", "scuba diving", "birdwatching", "astronomy as a "
    "hobby", "knitting", "woodworking", "pottery", "cooking pasta", "spices", "cheese making", "fermentation",
    "vegetarian diets", "vitamins", "drinking water", "food safety", "restaurants", "street food", "rice", "olive oil",
    "honey", "tomatoes", "potatoes", "apples", "bananas", "citrus fruits", "wheat", "corn", "cotton", "silk",
    "wool", "glass", "steel", "plastic", "concrete", "wood", "paper", "rubber", "aluminium", "copper", "gold",
    "diamonds", "salt", "oil refineries", "shipping containers", "ports", "highways", "traffic lights", "electric cars",
    "car engines", "helicopters", "rockets", "satellites", "GPS", "radio", "television", "smartphones", "the telephone",
    "cameras", "3D printing", "drones", "self-driving cars", "artificial intelligence", "neural networks",
    "programming languages", "Python", "JavaScript", "open source software", "version control", "software testing",
    "cybersecurity", "passwords", "computer viruses", "web browsers", "search engines", "data privacy", "algorithms",
    "sorting algorithms", "recursion", "binary numbers", "computer memory", "processors", "quantum computers",
    "the cloud", "spreadsheets", "statistics", "probability", "geometry", "algebra", "calculus", "prime numbers",
    "fractions", "percentages", "the number zero", "maps", "time zones", "calendars", "clocks", "languages of the "
    "world", "writing systems", "the alphabet", "grammar", "sign language", "translation", "philosophy", "ethics",
    "logic", "the scientific method", "economics", "psychology", "sociology", "anthropology", "archaeology",
    "human rights", "elections", "the United Nations", "cities", "villages", "public transport", "housing",
    "parks", "zoos", "national parks", "islands", "rivers", "lakes", "waterfalls", "caves", "canyons", "forests",
    "grasslands", "the Arctic", "Antarctica", "the Sahara", "the Alps", "the Himalayas", "the Nile", "the Pacific "
    "Ocean", "Iceland", "Japan's culture", "Italian food", "Indian cuisine", "Mexican history", "Chinese New Year",
    "festivals", "weddings", "birthdays", "holidays", "tourism", "hotels", "airports", "passports", "lions", "tigers",
    "whales", "dolphins", "sharks", "turtles", "frogs", "snakes", "owls", "eagles", "parrots", "ants", "butterflies",
    "spiders", "horses", "cows", "sheep", "cats", "dogs as pets", "rabbits", "hamsters", "goldfish", "bats",
    "kangaroos", "giraffes", "polar bears", "camels", "trees", "flowers", "cactus plants", "bamboo", "seeds",
    "weather forecasting", "thunderstorms", "tornadoes", "floods", "droughts", "fog", "wind", "clouds", "snow",
]
BROAD_CHAT_TEMPLATES = CHAT_TEMPLATES + [
    "Tell me about {t}.", "What is {t}?", "How does {t} work?", "Describe {t} in a few sentences.",
    "What should everyone know about {t}?", "Write a short essay about {t}.", "What are the benefits of {t}?",
    "What are some fun facts about {t}?", "Explain the basics of {t}.", "Why do people care about {t}?",
    "Give me five key points about {t}.", "What is the future of {t}?", "How has {t} changed over time?",
    "Write a short poem about {t}.", "Write a short story that involves {t}.", "Compare {t} and {u}.",
    "What is the connection between {t} and {u}?", "I'm curious about {t}. Where should I start?",
    "Explain {t} like I'm five years old.", "What are common questions people ask about {t}?",
    "Summarize what you know about {t} in three bullet points.", "What would happen without {t}?",
    "Can you write a blog post introduction about {t}?", "What are the biggest challenges related to {t}?",
    "How can I learn more about {t}?", "Give me a quiz with three questions about {t}.",
]
BROAD_FOLLOW_UPS = FOLLOW_UPS + [
    "Can you explain it more simply?", "What is the most important point?", "Tell me more.", "Why does it matter?",
    "Can you make that shorter?", "Can you give me a list instead?", "What do experts disagree about?",
    "How is that used in everyday life?", "Thanks! Anything else I should know?", "Can you give another example?",
]
BROAD_CODE_TASKS = CODE_TASKS + [
    "returns the n-th prime number", "checks whether a year is a leap year", "converts a decimal number to binary",
    "converts a binary string to an integer", "counts the words in a sentence", "reverses the order of words in a "
    "sentence", "removes all whitespace from a string", "finds the intersection of two lists", "finds the union of "
    "two sets", "returns the most common element of a list", "splits a list into chunks of size n",
    "computes the power set of a list", "checks whether a list is sorted", "implements bubble sort",
    "implements insertion sort", "implements merge sort", "implements quicksort", "computes the dot product of "
    "two vectors", "multiplies two matrices", "computes the mean and standard deviation of a list",
    "finds all divisors of a number", "checks whether a number is a perfect square", "computes the least common "
    "multiple of two numbers", "converts a string to title case", "counts the uppercase letters in a string",
    "replaces every vowel in a string with a star", "checks whether a string contains only digits",
    "returns the first non-repeating character of a string", "compresses a string using run-length encoding",
    "decodes a run-length encoded string", "finds the missing number in a list from 1 to n", "returns the sum of "
    "a list without using sum()", "finds the maximum subarray sum", "checks whether parentheses are balanced",
    "converts a Roman numeral to an integer", "converts an integer to a Roman numeral", "generates the first n "
    "rows of Pascal's triangle", "computes the Collatz sequence of a number", "shuffles a list",
    "picks a random password of a given length", "writes a list of strings to a text file", "reads a JSON file "
    "into a dictionary", "merges two dictionaries", "inverts a dictionary", "groups words by their first letter",
    "sorts a dictionary by its values", "counts the characters of a string", "finds the index of an element in a "
    "list", "removes None values from a list", "zips two lists into a dictionary", "computes compound interest",
    "converts kilometers to miles", "calculates the area of a circle", "calculates the body mass index",
    "checks whether a number is even or odd", "prints the multiplication table of a number",
    "returns the distance between two points", "validates a phone number", "formats a date as YYYY-MM-DD",
    "computes the number of days between two dates", "implements a stack class", "implements a queue class",
    "implements a simple linked list", "implements a binary search tree insert", "computes the depth of a tree",
]
CODE_QUESTIONS = [
    "What is the difference between a list and a tuple in Python?", "How do I read a file line by line in Python?",
    "What does the yield keyword do in Python?", "Explain list comprehensions in Python with an example.",
    "What is a Python decorator?", "How do I handle exceptions in Python?", "What is a lambda function?",
    "How do dictionaries work in Python?", "What is the difference between == and is in Python?",
    "How do I install a package with pip?", "What is a virtual environment in Python?", "Explain recursion with a "
    "Python example.", "What are *args and **kwargs?", "How do I sort a list of dictionaries by a key?",
    "What is object-oriented programming?", "Explain the difference between a class and an object.",
    "How do I write a unit test in Python?", "What is a generator in Python?", "How do I format strings in Python?",
    "What is the time complexity of binary search?", "What is Big O notation?", "How does a hash table work?",
    "What is the difference between a process and a thread?", "What does git commit do?", "What is an API?",
    "Explain what JSON is.", "How do I reverse a list in Python?", "What is a for loop?", "What is a while loop?",
    "How do I create a class in Python?", "What is inheritance in programming?", "What is a SQL query?",
]
BROAD_QUESTIONS = QUESTIONS + [
    "Who invented the telephone?", "What is the largest desert in the world?", "How many bones are in the human "
    "body?", "What is the longest river in the world?", "Who was the first person on the Moon?", "What is the "
    "chemical formula of water?", "How many hours are in a week?", "What is the square root of 144?", "Who wrote "
    "Hamlet?", "What is the hardest natural substance?", "How far is the Moon from Earth?", "What is the largest "
    "mammal?", "Who developed the theory of relativity?", "What is the currency of {c}?", "What is the population "
    "of {c}?", "What is a famous dish from {c}?", "What is the official language of {c}?", "Where is {c}?",
    "How many sides does a hexagon have?", "What is the main gas in the air we breathe?", "What is the capital "
    "city of {c} known for?", "Why do leaves change color in autumn?", "How do airplanes stay in the air?",
    "What causes earthquakes?", "How do vaccines work?", "Why do we need sleep?", "How do plants grow?",
    "What is the difference between a virus and a bacterium?", "Why is the ocean salty?", "How do magnets work?",
]
BROAD_COUNTRIES = COUNTRIES + ["Argentina", "Sweden", "Poland", "Turkey", "Thailand", "Nigeria", "Morocco",
                               "South Korea", "Indonesia", "New Zealand", "Finland", "Colombia"]
BROAD_KINDS = ("chat", "code", "multi_turn", "chat", "code", "qa", "multi_turn", "math", "chat", "translation",
               "summarisation", "rag")


def build_broad(n: int, seed: int = 0) -> list[Prompt]:
    """`n` prompts from the broad pool, cycling through BROAD_KINDS (chat, code and multi-turn weighted up)."""
    rng = random.Random(seed + 2000)
    passages = _passages()
    passages = passages[len(passages) // 5:]  # the first fifth is the held-out prompts' passages

    def chat() -> str:
        t, u = rng.sample(BROAD_TOPICS, 2)
        return rng.choice(BROAD_CHAT_TEMPLATES).format(t=t, u=u)

    def make(kind: str) -> Messages:
        if kind == "chat":
            return [{"role": "user", "content": chat()}]
        if kind == "multi_turn":
            return [{"role": "user", "content": chat()}, {"role": "assistant", "content": ""},
                    {"role": "user", "content": rng.choice(BROAD_FOLLOW_UPS)}]
        if kind == "code":
            if rng.random() < 0.3:
                return [{"role": "user", "content": rng.choice(CODE_QUESTIONS)}]
            verb = rng.choice(["Write a Python function that", "Write a short Python program that",
                               "Show me Python code that", "Write a function in Python that"])
            return [{"role": "user", "content": f"{verb} {rng.choice(BROAD_CODE_TASKS)}."}]
        if kind == "qa":
            return [{"role": "user", "content": rng.choice(BROAD_QUESTIONS).format(c=rng.choice(BROAD_COUNTRIES))}]
        if kind == "math":
            return [{"role": "user", "content": _math(rng, held_out=False)}]
        if kind == "translation":
            return [{"role": "user", "content": f"Translate to {rng.choice(LANGUAGES)}: {rng.choice(SENTENCES)}"}]
        if kind == "summarisation":
            return [{"role": "user",
                     "content": f"Summarize the following text in two sentences.\n\n{rng.choice(passages)}"}]
        return [{"role": "user", "content": f"Answer the question using the passage.\n\nPassage: "
                                            f"{rng.choice(passages)}\n\nQuestion: What is this passage about?"}]

    # Math prompts without a name or item ("What is 3 times 4 plus 5?") can coincide with held-out ones: skipped.
    # Repeats are skipped too: the pool has fewer code, QA and translation prompts than chat.
    return _distinct(n, _cycling(BROAD_KINDS, make), _held_out_keys(seed))


def _cycling(kinds: tuple[str, ...], make):
    """make(kind) -> messages, as the prompt maker `_distinct` calls: prompt i is of kind kinds[i % len(kinds)]."""
    def prompt(i: int) -> Prompt:
        kind = kinds[i % len(kinds)]
        return Prompt(kind, make(kind))

    return prompt


def _held_out_keys(seed: int) -> set[str]:
    """The held-out prompts' messages, as `_distinct` keys them: no training pool may hold one."""
    return {repr(p.messages) for p in build(800, seed, held_out=True)}


def _distinct(n: int, make, exclude: set[str]) -> list[Prompt]:
    """The first `n` distinct prompts of make(0), make(1), ... (at most 50 n tries) whose messages are not in
    `exclude`: how every training pool skips its repeats."""
    out: list[Prompt] = []
    seen = set(exclude)
    for i in range(50 * n):
        if len(out) == n:
            break
        prompt = make(i)
        key = repr(prompt.messages)
        if key not in seen:
            seen.add(key)
            out.append(prompt)
    return out


# -- the everyday pool: the task kinds the broad pool is thin in -------------------------------------------------
# The broad pool cycles its kinds but skips repeats, and its translation, summarisation, QA and RAG prompts come from
# short lists: a few hundred of its tens of thousands of prompts are translations or summaries (of pydoc passages,
# not everyday prose), and a draft trained on it drafts worst exactly there (docs/training.md). This pool writes
# those kinds from prose the target wrote itself: paragraphs of its own chat answers (training records only) become
# the passages, their sentences the text to translate.
EVERYDAY_KINDS = ("translation", "summarisation", "rag", "translation", "qa", "rag", "summarisation", "translation")
EVERYDAY_LANGUAGES = LANGUAGES + ["Portuguese", "Dutch", "Swedish", "Polish"]
SUMMARY_INSTRUCTIONS = [
    "Summarize the following text in two sentences.", "Summarize the following text in one sentence.",
    "Give a short summary of the following text.", "Summarize the main points of this text.",
    "Write a brief summary of the text below.", "What is the main idea of the following text?",
]
RAG_INSTRUCTIONS = ["Answer the question using only the passage.", "Answer the question using the passage.",
                    "Read the passage and answer the question."]
RAG_QUESTIONS = [
    "What is this passage about?", "What are the main points of the passage?", "What is the most important fact "
    "in the passage?", "Which examples does the passage give?", "According to the passage, why does this matter?",
    "What problem does the passage describe?", "What can we learn from this passage?", "List two facts from the "
    "passage.", "What does the passage say about {t}?", "According to the passage, what is {t}?",
    "How does the passage describe {t}?", "Does the passage say anything about the history of {t}?",
]
QA_TEMPLATES = [
    "Why is {t} useful?", "How does {t} affect everyday life?", "What is {t} made of?", "Where does {t} come "
    "from?", "Who uses {t}, and why?", "When did {t} first appear?", "What problems does {t} solve?",
    "How do scientists study {t}?", "What is a common mistake people make about {t}?", "Is {t} good or bad for "
    "the environment?", "Why do people like {t}?", "What is the difference between {t} and {u}?",
]
_LIST_MARK = re.compile(r"^\s*(\d+[.)]|[-*#•])")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def prose(texts: list[str]) -> tuple[list[str], list[str]]:
    """Paragraphs of 40-120 words and sentences of 6-18 words from answer texts: plain prose only (no lists, no
    headings, no first-person assistant talk, no paragraph that repeats a sentence: the target sometimes loops)."""
    passages, sentences = [], []
    for text in texts:
        for para in re.split(r"\n\s*\n", text):
            if _LIST_MARK.match(para) or "\n" in para.strip() or not para.strip().isascii():
                continue
            para = " ".join(para.split())
            parts = _SENTENCE_END.split(para)
            if not para[:1].isupper() or para[-1] not in ".!?" or len(set(parts)) < len(parts):
                continue
            if re.search(r"\b(I|I'm|I'll|I've|my|me)\b", para) or any(c in para for c in ":*#`"):
                continue
            if 40 <= len(para.split()) <= 120:
                passages.append(para)
            sentences += [s for s in parts if 6 <= len(s.split()) <= 18 and s[-1] == "." and '"' not in s]
    return sorted(set(passages)), sorted(set(sentences))


def build_everyday(n: int, texts: list[str], seed: int = 0) -> list[Prompt]:
    """`n` translation, summarisation, QA and RAG prompts, cycling through EVERYDAY_KINDS, on the prose of `texts`
    (the target's own answers: models/training/answers.py answer_texts)."""
    rng = random.Random(seed + 3000)
    passages, sentences = prose(texts)
    if not passages or not sentences:
        raise ValueError("the everyday pool needs answer texts with plain-prose paragraphs")
    topics = BROAD_TOPICS

    def make(kind: str) -> Messages:
        if kind == "translation":
            return [{"role": "user",
                     "content": f"Translate to {rng.choice(EVERYDAY_LANGUAGES)}: {rng.choice(sentences)}"}]
        if kind == "summarisation":
            return [{"role": "user", "content": f"{rng.choice(SUMMARY_INSTRUCTIONS)}\n\n{rng.choice(passages)}"}]
        if kind == "qa":
            t, u = rng.sample(topics, 2)
            return [{"role": "user", "content": rng.choice(QA_TEMPLATES).format(t=t, u=u)}]
        passage = rng.choice(passages)
        # a topic the passage names, where one of the pool's topics occurs in it
        named = [t for t in topics if t.lower() in passage.lower()]
        questions = RAG_QUESTIONS if named else [q for q in RAG_QUESTIONS if "{t}" not in q]
        question = rng.choice(questions).format(t=rng.choice(named) if named else "")
        return [{"role": "user", "content": f"{rng.choice(RAG_INSTRUCTIONS)}\n\nPassage: {passage}\n\n"
                                            f"Question: {question}"}]

    return _distinct(n, _cycling(EVERYDAY_KINDS, make), _held_out_keys(seed))


# -- the code pool: code tasks from the standard library's own functions ------------------------------------------
# Code is thin in every pool (the broad pool has a few hundred distinct code prompts), and a draft trained on prose
# loses it (docs/training.md). The standard library documents thousands of functions: each public function with a
# one-line summary becomes a task, asked as a stub to complete or as a function to write. (HumanEval, the public
# check, is not among them: it is not shipped with Python.)
CODE_MODULES = (
    "string", "textwrap", "itertools", "functools", "math", "statistics", "os.path", "shutil", "json", "re",
    "collections", "heapq", "bisect", "random", "datetime", "calendar", "fractions", "decimal", "operator", "copy",
    "difflib", "html", "urllib.parse", "base64", "binascii", "hashlib", "zlib", "gzip", "csv", "fnmatch", "glob",
    "shlex", "colorsys", "struct", "ipaddress", "uuid", "secrets", "email.utils", "posixpath", "unicodedata",
    "time", "queue", "contextlib", "dataclasses", "enum", "inspect", "types", "tokenize", "ast", "pathlib",
    "tempfile", "filecmp", "zipfile", "tarfile", "configparser", "argparse", "logging", "warnings", "traceback",
    "linecache", "pprint", "keyword", "mimetypes", "quopri", "graphlib", "cmath", "numbers", "array", "weakref",
)
CODE_TEMPLATES = ("stub", "write", "write", "explain")


def library_functions() -> list[tuple[str, str, str]]:
    """(name, signature, one-line summary) of the public functions and methods of CODE_MODULES that have both,
    sorted by qualified name (the pool is the same where the same Python is)."""
    import importlib
    import inspect

    found: dict[str, tuple[str, str, str]] = {}
    for module_name in CODE_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        members = [(n, m) for n, m in vars(module).items() if not n.startswith("_")]
        for cls_name, cls in [(n, m) for n, m in members if inspect.isclass(m)]:
            members += [(f"{cls_name}.{n}", m) for n, m in vars(cls).items() if not n.startswith("_")]
        for qual, fn in members:
            if not (inspect.isfunction(fn) or inspect.isbuiltin(fn)) or not fn.__doc__:
                continue
            summary = " ".join(fn.__doc__.strip().split("\n\n")[0].split())
            try:
                # a default's repr may hold a memory address ("<weakref at 0x7f...>"), which differs per process
                signature = re.sub(r" at 0x[0-9a-fA-F]+", "", str(inspect.signature(fn)))
            except (TypeError, ValueError):
                continue
            if not 20 <= len(summary) <= 200 or not summary[:1].isupper() or "(" in summary[:len(qual) + 2]:
                continue
            found[f"{module_name}.{qual}"] = (qual.split(".")[-1], signature, summary)
    return [found[k] for k in sorted(found)]


def build_code(n: int, seed: int = 0) -> list[Prompt]:
    """`n` code prompts on the standard library's functions (library_functions), cycling through CODE_TEMPLATES:
    complete a stub, write the function from its summary, explain what such a function does."""
    rng = random.Random(seed + 4000)
    functions = library_functions()
    rng.shuffle(functions)
    verbs = ["Write a Python function that does the following:", "Implement this in Python:",
             "Write Python code for this task:", "Show me a Python function for this:"]

    def make(i: int) -> Prompt:
        name, signature, summary = functions[i % len(functions)]
        template = CODE_TEMPLATES[(i // len(functions) + i) % len(CODE_TEMPLATES)]
        if template == "stub":
            text = f'Complete this Python function:\n\n```python\ndef {name}{signature}:\n    """{summary}"""\n```'
        elif template == "write":
            text = f"{rng.choice(verbs)} {summary}"
        else:
            text = f"Explain what a Python function `{name}{signature}` does, given its documentation: {summary}"
        return Prompt("code", [{"role": "user", "content": text}])

    return _distinct(n, make, set())  # a function comes round again under another template: a repeat is skipped


# -- the advice pool: practical how-to chat, asked once and followed up -------------------------------------------
# People ask a chat model how to do things: start a habit, fix something at home, care for a plant or a pet, plan a
# trip, learn a skill. No other pool asks that (the broad pool's chat is "explain a topic"), and the benchmark's
# multi-turn prompts, which are exactly such advice, were the kind the feature draft drafted worst. Subjects and
# problems are written here by hand; the benchmark's own subjects (a journal, houseplants, a puppy, hiking, a slow
# laptop, breakfast, remembering names, sourdough, guitar or keyboard, groceries) and the held-out topics stay out
# (ADVICE_EXCLUDED; tests/test_models.py checks it).
ADVICE_EXCLUDED = ("journal", "houseplant", "puppy", "puppies", "hiking", "hike", "laptop", "breakfast", "name",
                   "sourdough", "guitar", "keyboard", "grocery", "groceries", "tea", "bicycle", "violin", "piano",
                   "origami", "chocolate", "umbrella", "train", "compass", "lighthouse", "firework", "windmill",
                   "snowflake", "octopus")  # whole words, singular or plural
ADVICE_GOALS = [
    "start running", "learn to cook simple meals", "grow tomatoes on a balcony", "sleep better", "learn Spanish",
    "organize my closet", "paint a small room", "fix a leaking tap", "write a cover letter", "prepare for a job "
    "interview", "get better at public speaking", "stop procrastinating", "drink more water during the day",
    "read more books", "learn to swim as an adult", "make friends in a new city", "plan a road trip",
    "pack light for a week away", "study for an exam", "keep my kitchen clean", "start meditating",
    "cut down on sugar", "learn to draw", "take better photos with my phone", "set up a home office",
    "keep my cat entertained", "care for a goldfish", "grow herbs on a windowsill", "start a vegetable garden",
    "make my own pasta", "bake a simple cake", "clean my oven", "remove a coffee stain from a shirt",
    "save for a holiday", "make a monthly budget", "pay off a small debt", "negotiate a higher salary",
    "ask my manager for feedback", "work from home without getting distracted", "wake up earlier",
    "build a reading habit with my kids", "teach my child to ride a scooter", "help my kid with homework",
    "host a dinner party", "plan a birthday party for a ten-year-old", "choose a good mattress",
    "keep my plants alive while I travel", "get rid of fruit flies", "unclog a drain", "hang a heavy mirror",
    "put up shelves", "reduce the noise from my neighbours", "make my small flat feel bigger",
    "start strength training at home", "stretch after a workout", "improve my posture at a desk",
    "stay warm in winter without a big heating bill", "keep my home cool in summer", "learn to knit",
    "start a podcast", "write a short story", "learn basic photo editing", "back up the photos on my phone",
    "make a strong password that I can remember", "spot a phishing email", "sell old clothes online",
    "declutter my home", "move house with less stress", "prepare my car for winter", "change a flat tire",
    "learn to parallel park", "take care of a leather jacket", "wash a wool sweater", "iron a shirt quickly",
    "cook rice that is not sticky", "make a good cup of coffee at home", "meal prep for the week",
    "eat more vegetables", "cook for one person without waste", "store fresh bread", "keep herbs fresh",
    "teach my dog to walk on a loose lead", "introduce a new cat to my home", "clean a fish tank",
    "choose a first pet for a child", "learn to play the drums", "sing in tune", "memorize a speech",
    "learn to type faster", "keep a conversation going", "say no politely", "apologize to a friend",
    "deal with a difficult coworker", "run a good meeting", "write a clear email", "give a short presentation",
    "learn to juggle", "start birdwatching", "go camping for the first time", "build a campfire safely",
    "plan a picnic", "keep mosquitoes away", "learn to ice skate", "ski for the first time",
    "prepare for a long flight", "beat jet lag", "learn the basics of chess", "solve a Rubik's cube",
    "start volunteering", "look after my mental health during exams", "stay motivated to exercise",
    "prepare for a half marathon", "recover after a long run", "make a smoothie without a blender",
]
ADVICE_PROBLEMS = [
    "My tomato plants have yellow leaves.", "My shower drain is slow.", "My bike chain keeps slipping.",
    "My cat scratches the sofa.", "My dog barks at every noise outside.", "I wake up tired every morning.",
    "I can never finish my to-do list.", "My phone battery runs out by lunchtime.", "My rice always burns at the "
    "bottom of the pot.", "My cookies spread too much in the oven.", "My cake sinks in the middle.",
    "My wooden table has a water ring on it.", "My windows fog up every morning.", "My wifi is slow in the bedroom.",
    "My basil plant keeps wilting.", "I get nervous before every presentation.", "I spend too much money on "
    "takeaway food.", "My kids fight over screen time.", "I always arrive late to meetings.",
    "My running shoes give me blisters.", "My back hurts after working at my desk.", "My jeans are too tight.",
    "My fridge smells bad.", "My white shirts are turning grey.", "My car makes a squeaking noise when I brake.",
    "My neighbour's music keeps me awake.", "I forget to water my plants.", "I feel lonely since I moved.",
    "My coffee tastes bitter.", "My hands get very dry in winter.", "I lose my keys all the time.",
    "My email inbox has thousands of unread messages.", "My bread goes mouldy too fast.",
    "My goldfish tank turns green.", "My hamster bites when I pick it up.", "My bathroom grout is black.",
]
ADVICE_ASKS = [
    "I want to {g}. Any tips?", "How do I {g}?", "What is the best way to {g}?", "I'm a beginner. How should I {g}?",
    "Can you give me a simple plan to {g}?", "What mistakes should I avoid when I try to {g}?",
    "I have never tried to {g}. Where do I start?", "What do I need to {g}?", "Give me three tips to {g}.",
    "How long does it usually take to {g}?", "Is it hard to {g}?", "My friend told me to {g}. How do I begin?",
]
ADVICE_PROBLEM_ASKS = ["{p} What can I do?", "{p} Any advice?", "{p} How do I fix this?", "{p}",
                       "{p} Why does this happen?", "{p} What should I try first?"]
ADVICE_FOLLOW_UPS = [
    "What should I do if that does not work?", "How long will it take to see a difference?",
    "Which of those steps matters most?", "Is it expensive?", "What do I need to buy?", "Can I do it on my own?",
    "How often should I do it?", "What if I only have ten minutes a day?", "Is there a cheaper way?",
    "What is the most common mistake?", "Can you turn that into a step-by-step list?", "How do I know it is working?",
    "Is it safe for children?", "Thanks! What should I do first?", "What if I live in a small flat?",
    "Could you explain the second point in more detail?", "What should I avoid?", "How do I stay motivated?",
]
ADVICE_KINDS = ("multi_turn", "chat", "multi_turn", "multi_turn", "chat")


def build_advice(n: int, seed: int = 0) -> list[Prompt]:
    """`n` practical how-to and advice prompts, cycling through ADVICE_KINDS: a goal or a problem asked about
    ("chat"), or asked, answered by the target (left empty here, as in the broad pool) and followed up."""
    rng = random.Random(seed + 5000)

    def ask() -> str:
        if rng.random() < 0.3:
            return rng.choice(ADVICE_PROBLEM_ASKS).format(p=rng.choice(ADVICE_PROBLEMS))
        return rng.choice(ADVICE_ASKS).format(g=rng.choice(ADVICE_GOALS))

    def make(kind: str) -> Messages:
        if kind == "chat":
            return [{"role": "user", "content": ask()}]
        return [{"role": "user", "content": ask()}, {"role": "assistant", "content": ""},
                {"role": "user", "content": rng.choice(ADVICE_FOLLOW_UPS)}]

    return _distinct(n, _cycling(ADVICE_KINDS, make), _held_out_keys(seed))


# -- the dialogue pool: follow-ups to a short earlier reply -------------------------------------------------------
# The benchmark's multi-turn prompts carry an earlier assistant turn written by hand, two short sentences; every
# multi-turn prompt of the other pools carries the target's own full first answer. The draft drafts the target's
# answer to the follow-up far better after the latter, and better after that answer cut short than after a
# hand-written reply (docs/training.md). So this pool asks the advice pool's questions again, with the target's first
# answer cut to its first one or two plain sentences as the earlier turn, and a follow-up: the answer to the
# follow-up is what the target generates here.
DIALOGUE_FOLLOW_UPS = ADVICE_FOLLOW_UPS + [
    "How long does that usually take?", "Which of these would you try first?", "Does that work for beginners too?",
    "What if I have no time during the week?", "Is there anything I should buy first?", "How do I keep it up?",
    "What should I do when it goes wrong?", "Can you give me an example?", "Is this also true in winter?",
    "How do I explain this to my kids?", "What is the cheapest option?", "Can I do this with a friend?",
]


def short_reply(answer: str, rng: random.Random) -> str | None:
    """The first one or two plain sentences of an answer (no list item, heading or markup), or None if it opens
    with none."""
    first = re.split(r"\n\s*\n", answer.strip())[0]
    if _LIST_MARK.match(first) or any(c in first for c in "*#`|") or "\n" in first.strip():
        return None
    parts = [p for p in _SENTENCE_END.split(" ".join(first.split())) if p]
    if not parts or parts[0][-1] not in ".!?":
        return None
    reply = " ".join(parts[: rng.choice((1, 2))])
    return reply if 5 <= len(reply.split()) <= 60 and reply[-1] in ".!?" else None


def build_dialogue(n: int, exchanges: list[tuple[str, str]], seed: int = 0) -> list[Prompt]:
    """`n` multi-turn prompts over `exchanges` (a question and the target's first answer to it: the advice pool's
    training records), the answer cut to a short reply (short_reply), then a follow-up."""
    rng = random.Random(seed + 7000)
    usable = [(q, a) for q, a in exchanges if a]

    def make(i: int) -> Prompt:
        question, answer = usable[i % len(usable)]
        reply = short_reply(answer, rng)
        if reply is None:
            return Prompt("multi_turn", [])  # skipped: `_distinct` keys it once, and empty prompts are dropped
        return Prompt("multi_turn", [{"role": "user", "content": question}, {"role": "assistant", "content": reply},
                                     {"role": "user", "content": rng.choice(DIALOGUE_FOLLOW_UPS)}])

    return [p for p in _distinct(n + 1, make, _held_out_keys(seed)) if p.messages][:n]
