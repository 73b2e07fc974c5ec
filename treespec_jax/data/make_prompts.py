"""Writes the training prompt set `train_prompts.jsonl` (deterministic; run from the repo root).

    python -m treespec_jax.data.make_prompts [--out treespec_jax/data/train_prompts.jsonl] [--count 6000]

The prompts are templates crossed with topic lists written for this project, in the kinds a chat
model is asked for: explanations, how-tos, code in several languages, lists, short factual
answers, comparisons, step-by-step arithmetic, short creative pieces, emails, and rewriting or
summarising a paragraph. The paragraphs come from the docstrings of Python standard-library
modules (`inspect.getdoc`), which every Python has offline; docstrings differ a little between
Python versions, so the committed file, not a fresh run, is the training set. No prompt comes
from a public benchmark: those are kept for evaluation. Every prompt is checked against the
held-out set (`heldout_prompts.jsonl`) and a clash is an error.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import itertools
import json
import random
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN_FILE = HERE / "train_prompts.jsonl"
HELDOUT_FILE = HERE / "heldout_prompts.jsonl"

CONCEPTS = [
    "photosynthesis", "the water cycle", "plate tectonics", "inflation", "compound interest", "supply and demand",
    "the greenhouse effect", "vaccination", "natural selection", "DNA replication", "the immune system",
    "black holes", "gravity", "electric current", "magnetism", "nuclear fission", "solar panels", "wind turbines",
    "the internet", "encryption", "public-key cryptography", "a hash function", "a database index", "recursion",
    "object-oriented programming", "functional programming", "garbage collection", "virtual memory", "caching",
    "a compiler", "an interpreter", "version control", "unit testing", "continuous integration", "containers",
    "virtual machines", "load balancing", "DNS", "HTTP", "TCP", "an API", "machine learning", "neural networks",
    "overfitting", "gradient descent", "a decision tree", "linear regression", "probability", "the median",
    "standard deviation", "prime numbers", "fractions", "the Pythagorean theorem", "derivatives", "integrals",
    "logarithms", "matrices", "exponential growth", "the scientific method", "a hypothesis", "photosynthesis in algae",
    "the nitrogen cycle", "erosion", "volcanoes", "earthquakes", "tides", "the seasons", "the phases of the Moon",
    "rainbows", "sound waves", "the speed of light", "evaporation", "friction", "buoyancy", "the food chain",
    "pollination", "migration of birds", "hibernation", "the human heart", "digestion", "sleep", "memory",
    "habits", "motivation", "stress", "meditation", "a budget", "a credit score", "taxes", "a mortgage",
    "insurance", "a stock market", "bonds", "a startup", "marketing", "branding", "negotiation", "leadership",
    "teamwork", "time management", "critical thinking", "a democracy", "the separation of powers", "elections",
    "the printing press", "the industrial revolution", "the Silk Road", "the Renaissance", "ancient Rome",
    "the invention of writing", "agriculture", "urbanisation", "globalisation", "renewable energy", "recycling",
    "composting", "climate change", "biodiversity", "coral reefs", "rainforests", "deserts", "glaciers",
    "ocean currents", "clouds", "lightning", "hurricanes", "batteries", "transistors", "a CPU", "RAM",
    "an operating system", "a file system", "open-source software", "a spreadsheet", "a search engine",
    "recommendation systems", "GPS", "3D printing", "robots", "electric cars", "airplane lift", "rockets",
    "satellites", "telescopes", "microscopes", "antibiotics", "fermentation", "baking bread", "coffee roasting",
    "music scales", "rhythm", "perspective in drawing", "colour mixing", "poetry meter", "a metaphor",
    "an essay outline", "active listening", "public speaking", "learning a language", "spaced repetition",
]

# Concepts named in the plural take plural verbs in the templates ("What are black holes?").
PLURAL_CONCEPTS = {
    "black holes", "neural networks", "prime numbers", "fractions", "derivatives", "integrals", "logarithms",
    "matrices", "volcanoes", "earthquakes", "tides", "the seasons", "the phases of the Moon", "rainbows",
    "sound waves", "batteries", "transistors", "satellites", "telescopes", "microscopes", "antibiotics",
    "coral reefs", "rainforests", "deserts", "glaciers", "ocean currents", "clouds", "hurricanes", "electric cars",
    "rockets", "robots", "music scales", "taxes", "bonds", "elections", "recommendation systems", "habits",
    "containers", "virtual machines", "solar panels", "wind turbines",
}
PLURAL_VERBS = (("What is", "What are"), ("How does", "How do"), ("Why is", "Why are"))


def explain_prompt(template: str, concept: str) -> str:
    if concept in PLURAL_CONCEPTS:
        for one, many in PLURAL_VERBS:
            template = template.replace(one, many)
    return template.format(x=concept)


EXPLAIN_TEMPLATES = [
    "Explain {x} in simple terms.",
    "What is {x}?",
    "How does {x} work?",
    "Why is {x} important?",
    "Explain {x} to a ten-year-old.",
    "Give me a short overview of {x}.",
    "What are the main ideas behind {x}?",
    "Can you describe {x} in one paragraph?",
    "What is a common misconception about {x}?",
    "Explain {x} with an everyday example.",
]

TASKS = [
    "make a cup of tea", "boil an egg", "plant tomatoes", "change a flat bicycle tyre", "write a cover letter",
    "prepare for a job interview", "start running", "learn to juggle", "clean a laptop keyboard",
    "organise a small closet", "plan a weekend trip", "save money on groceries", "make a simple budget",
    "study for an exam", "take better notes", "fall asleep faster", "write a thank-you note", "fold a paper plane",
    "set up a new email account", "back up my photos", "create a strong password", "install Python",
    "create a virtual environment in Python", "undo the last git commit", "resolve a git merge conflict",
    "read a CSV file in Python", "centre a div with CSS", "write a good commit message", "debug a slow web page",
    "make pancakes", "cook rice on the stove", "make a vegetable soup", "keep houseplants alive", "paint a room",
    "hang a picture frame", "care for a cat", "train a puppy to sit", "start a vegetable garden",
    "give constructive feedback", "run an effective meeting", "write a short speech", "learn to touch type",
    "memorise a poem", "start journaling", "reduce screen time", "prepare for a long flight", "pack a suitcase",
    "choose a laptop", "set up a home network", "speed up an old computer", "make a cold brew coffee",
    "make a paper notebook", "start a book club", "teach a child to ride a bike", "write a haiku",
    "improve my handwriting", "stay focused while working from home", "learn the basics of chess",
    "make a simple website", "write a README file", "name variables well", "review someone's code",
]

HOWTO_TEMPLATES = [
    "How do I {x}?",
    "Give me step-by-step instructions to {x}.",
    "What is the easiest way to {x}?",
    "I want to {x}. Where should I start?",
    "List the steps needed to {x}.",
]

LANGUAGES = ["Python", "JavaScript", "TypeScript", "C", "C++", "Rust", "Go", "Java", "Ruby", "Bash", "Kotlin",
             "Haskell", "Lua"]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a string", "finds the largest element of a list", "removes duplicates from a list",
    "checks whether a string is a palindrome", "computes the factorial of a number", "sorts a list with insertion sort",
    "merges two sorted lists", "performs binary search on a sorted array", "counts word frequencies in a text",
    "converts Celsius to Fahrenheit", "computes the greatest common divisor of two integers",
    "flattens a nested list", "transposes a matrix", "checks whether two strings are anagrams",
    "returns the sum of the digits of an integer", "generates all subsets of a list", "rotates an array by k positions",
    "finds the second largest number in a list", "capitalises the first letter of every word",
    "parses a date in YYYY-MM-DD format", "validates an email address with a simple rule",
    "implements a stack with push and pop", "implements a queue using two stacks", "computes a running average",
    "converts a decimal number to binary", "counts the lines of a file", "finds the longest word in a sentence",
    "computes the median of a list", "returns the intersection of two lists", "chunks a list into groups of n",
    "implements FizzBuzz up to n", "checks whether parentheses in a string are balanced",
    "computes the dot product of two vectors", "finds the most common element in a list",
    "converts a Roman numeral to an integer", "computes the power set size of a set", "implements a linked list",
    "reads a JSON file and prints one field", "retries a function call up to three times",
    "measures how long a function takes", "builds a frequency table of characters", "clamps a value to a range",
    "pads a string to a given width", "splits a sentence into words without punctuation",
    "computes the area of a circle", "generates a random password", "checks whether a year is a leap year",
]

CODE_TEMPLATES = [
    "Write a {lang} function that {x}.",
    "Show me how to write a function in {lang} that {x}.",
    "Implement a {lang} program that {x}, with a short explanation.",
    "In {lang}, write code that {x}. Add comments.",
]

CODE_QUESTIONS = [
    "What is the difference between a list and a tuple in Python?",
    "What does the `static` keyword mean in C?",
    "Explain what a closure is in JavaScript.",
    "What is ownership in Rust?",
    "What are goroutines in Go?",
    "What is a pointer in C?",
    "What does `async` and `await` do in JavaScript?",
    "What is a generator in Python?",
    "What is the difference between `==` and `===` in JavaScript?",
    "What is a segmentation fault?",
    "What is a race condition?",
    "What does SQL JOIN do?",
    "What is the difference between a process and a thread?",
    "What is Big O notation?",
    "What is a hash map and when should I use one?",
    "What does a decorator do in Python?",
    "Why are global variables considered bad practice?",
    "What is dependency injection?",
    "What is the difference between an interface and an abstract class in Java?",
    "What is tail recursion?",
    "What is memoization?",
    "What is a REST API?",
    "What does `git rebase` do?",
    "What is the difference between a shallow copy and a deep copy?",
    "What is a lambda function?",
    "What is type inference?",
    "What does the `yield` keyword do?",
    "What is an off-by-one error?",
    "What is the purpose of a Makefile?",
    "What is a regular expression?",
]

SQL_TASKS = [
    "selects all customers from the city of Lyon", "counts the orders per customer",
    "finds the ten most expensive products", "returns employees hired after 2020",
    "computes the average salary per department", "finds customers who have never placed an order",
    "deletes rows older than 30 days from a logs table", "lists products that are out of stock",
]

LIST_THINGS = [
    "fruits that are rich in vitamin C", "ways to reduce stress", "tips for writing clearly", "common kitchen herbs",
    "benefits of regular exercise", "ideas for a rainy day", "board games for families", "ways to save energy at home",
    "questions to ask in a job interview", "habits of productive people", "animals that live in the Arctic",
    "famous bridges", "types of clouds", "planets of the solar system", "musical instruments in an orchestra",
    "programming languages and what they are used for", "reasons to learn a second language", "healthy breakfast ideas",
    "things to pack for a camping trip", "ways to make a small room look bigger", "common logical fallacies",
    "tips for a first-time manager", "ways to practise gratitude", "indoor plants that need little light",
    "sources of protein for vegetarians", "safety tips for cycling in a city", "classic novels worth reading",
    "ways to improve a CV", "common mistakes in public speaking", "useful keyboard shortcuts",
    "ways to keep a conversation going", "features of a good password", "ideas for a birthday party",
    "ways to stay warm in winter", "signs of dehydration", "things to check before buying a used car",
    "ingredients for a simple salad", "renewable energy sources", "uses of vinegar around the house",
    "hobbies that can be done at home", "skills every programmer should learn", "ways to learn faster",
    "rules for a tidy desk", "things that make a good teacher", "ways to reduce plastic waste",
]

LIST_TEMPLATES = [
    "List {n} {x}.",
    "Give me {n} {x}.",
    "What are {n} {x}? Answer as a bulleted list.",
    "Name {n} {x} with one sentence about each.",
]

COUNTRIES = [
    ("France", "Paris"), ("Japan", "Tokyo"), ("Kenya", "Nairobi"), ("Canada", "Ottawa"), ("Brazil", "Brasilia"),
    ("Egypt", "Cairo"), ("Norway", "Oslo"), ("Peru", "Lima"), ("Vietnam", "Hanoi"), ("Portugal", "Lisbon"),
    ("Australia", "Canberra"), ("Argentina", "Buenos Aires"), ("Poland", "Warsaw"), ("Thailand", "Bangkok"),
    ("Ghana", "Accra"), ("Sweden", "Stockholm"), ("Chile", "Santiago"), ("India", "New Delhi"), ("Spain", "Madrid"),
    ("Mexico", "Mexico City"), ("Greece", "Athens"), ("Ireland", "Dublin"), ("Turkey", "Ankara"), ("Italy", "Rome"),
]

SHORT_QUESTIONS = [
    "How many days are in a leap year?", "How many minutes are in a day?", "What is the boiling point of water in "
    "Fahrenheit?", "What is the chemical symbol for gold?", "How many legs does a spider have?",
    "What gas do plants absorb from the air?", "What is the largest ocean on Earth?", "How many sides does a hexagon "
    "have?", "What is the freezing point of water in Celsius?", "Which planet is known as the Red Planet?",
    "What is the square root of 144?", "How many continents are there?", "What is the longest river in Africa?",
    "What language has the most native speakers?", "What is the hardest natural material?",
    "How many bones are in the adult human body?", "What is the smallest prime number?",
    "What is H2O commonly called?", "How many hours are in a week?", "What is the main ingredient of guacamole?",
    "Which organ pumps blood through the body?", "What is the opposite of 'ancient'?",
    "What is 15 percent of 200?", "How many centimetres are in a metre?", "What colour do you get by mixing blue "
    "and yellow?", "What is the plural of 'mouse'?", "Which metal is liquid at room temperature?",
    "What is the capital letter of the Greek alphabet that looks like a triangle?", "How many strings does a "
    "standard guitar have?", "What is a baby kangaroo called?", "What is the past tense of 'swim'?",
    "Which instrument has 88 keys?", "What is the largest planet in the solar system?",
    "How many zeros are in one million?", "What does CPU stand for?", "What does HTML stand for?",
    "What is the binary representation of the number 10?", "How many bits are in a byte?",
]

COUNTRY_TEMPLATES = [
    "What is the capital of {c}?",
    "Tell me three interesting facts about {c}.",
    "What languages are spoken in {c}?",
    "What is the climate like in {c}?",
    "Describe a traditional dish from {c}.",
    "What is {cap} known for?",
]

COMPARE_PAIRS = [
    ("cats", "dogs as pets"), ("Python", "JavaScript"), ("tea", "coffee"), ("renting", "buying a home"),
    ("trains", "planes for travel in Europe"), ("SQL", "NoSQL databases"), ("reading books", "listening to audiobooks"),
    ("solar power", "wind power"), ("a laptop", "a desktop computer"), ("running", "swimming for fitness"),
    ("TCP", "UDP"), ("lists", "arrays"), ("classical music", "jazz"), ("weather", "climate"), ("viruses", "bacteria"),
    ("mitosis", "meiosis"), ("a crocodile", "an alligator"), ("stocks", "bonds"), ("Git", "SVN"),
    ("electric cars", "petrol cars"), ("a city", "the countryside to live in"), ("static typing", "dynamic typing"),
    ("C", "Rust"), ("Java", "Kotlin"), ("email", "instant messaging at work"), ("speed", "velocity"),
    ("mass", "weight"), ("a simile", "a metaphor"), ("baking soda", "baking powder"), ("a crocodile", "a lizard"),
    ("working from home", "working in an office"), ("paper books", "e-readers"), ("a virus", "a worm in computing"),
    ("HTTP", "HTTPS"), ("RAM", "storage"), ("a loan", "a lease"), ("an apple", "an orange nutritionally"),
    ("butter", "margarine"), ("a bicycle", "a scooter for commuting"), ("unit tests", "integration tests"),
]

COMPARE_TEMPLATES = [
    "Compare {a} and {b}.",
    "What are the differences between {a} and {b}?",
    "What are the pros and cons of {a} versus {b}?",
    "Which is better, {a} or {b}? Explain briefly.",
]

POEM_TOPICS = [
    "the sea", "autumn leaves", "a city at night", "a cup of coffee", "the first snow", "friendship", "a lighthouse",
    "an old library", "morning birdsong", "a thunderstorm", "a garden in spring", "the Moon", "a long train journey",
    "a lost umbrella", "mountains", "a busy market", "a sleepy cat", "a summer evening", "a river", "the stars",
    "a new beginning", "a quiet forest", "a kite in the wind", "a rainy Monday", "a robot learning to dance",
]

CREATIVE_TEMPLATES = [
    "Write a short poem about {x}.",
    "Write a haiku about {x}.",
    "Write a four-line rhyming verse about {x}.",
    "Write a very short story (under 150 words) about {x}.",
    "Describe {x} in three vivid sentences.",
]

EMAILS = [
    ("my manager", "asking for a day off next Friday"), ("a colleague", "thanking them for their help on a project"),
    ("a landlord", "reporting a leaking tap"), ("a teacher", "asking about my child's homework"),
    ("a customer", "apologising for a late delivery"), ("a friend", "inviting them to dinner"),
    ("a hotel", "asking whether early check-in is possible"), ("a team", "announcing a new meeting time"),
    ("a client", "following up on an unpaid invoice"), ("a recruiter", "declining a job offer politely"),
    ("my neighbour", "about a parcel I received for them"), ("a library", "asking to renew a book"),
    ("a professor", "requesting a short meeting"), ("a supplier", "asking for a price quote"),
]

EMAIL_TEMPLATES = [
    "Write a short email to {to} {about}.",
    "Draft a polite message to {to} {about}.",
]

ITEMS = [("apples", "apple"), ("pencils", "pencil"), ("notebooks", "notebook"), ("tickets", "ticket"),
         ("bottles of water", "bottle of water"), ("loaves of bread", "loaf of bread"), ("stamps", "stamp")]
NAMES = ["Ana", "Ben", "Chloe", "David", "Elif", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Liam", "Mei",
         "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tomas"]

REWRITE_TEMPLATES = [
    "Summarise the following paragraph in two sentences:\n\n{p}",
    "Rewrite the following text in plain, simple English:\n\n{p}",
    "What is the main point of this paragraph?\n\n{p}",
    "Turn the following paragraph into a short bulleted list of its key points:\n\n{p}",
    "Explain this documentation excerpt to a beginner:\n\n{p}",
    "Give this paragraph a short title and a one-sentence summary:\n\n{p}",
]

STDLIB_MODULES = [
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bisect", "calendar", "cmath", "collections", "colorsys",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "enum", "filecmp",
    "fnmatch", "fractions", "functools", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html",
    "http", "imaplib", "inspect", "io", "ipaddress", "itertools", "json", "keyword", "locale", "logging", "lzma",
    "mailbox", "mimetypes", "numbers", "operator", "optparse", "os", "pathlib", "pickle", "pkgutil", "platform",
    "plistlib", "pprint", "queue", "random", "re", "sched", "secrets", "selectors", "shelve", "shlex", "shutil",
    "signal", "smtplib", "socket", "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "timeit", "tokenize", "trace", "traceback", "types", "typing", "unittest", "urllib",
    "uuid", "warnings", "wave", "weakref", "xml", "zipfile", "zlib",
]


def stdlib_paragraphs(min_chars: int = 180, max_chars: int = 700) -> list[str]:
    """Prose paragraphs from stdlib docstrings (modules and their public classes / functions)."""
    out = []
    seen = set()
    for name in STDLIB_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception:  # a module absent from this Python build is simply skipped
            continue
        docs = [inspect.getdoc(mod) or ""]
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == name:
                docs.append(inspect.getdoc(obj) or "")
        for doc in docs:
            for para in re.split(r"\n\s*\n", doc):
                text = " ".join(line.strip() for line in para.splitlines()).strip()
                # Prose only: no doctest lines, option tables, signatures or code.
                if not min_chars <= len(text) <= max_chars or text in seen:
                    continue
                if any(s in text for s in (">>>", "::", "--", "=>", "{", "}")) or text.count("(") > 4:
                    continue
                if sum(c.isalpha() or c.isspace() for c in text) / len(text) < 0.9:
                    continue
                seen.add(text)
                out.append(text)
    return out


def arithmetic_prompts(rng: random.Random, count: int) -> list[str]:
    """Word problems with fresh numbers, asked for step-by-step answers."""
    forms = [
        "{a} buys {n} {items} at {p} cents each and pays with a {bill}-euro note. How much change does {a} get? "
        "Think step by step.",
        "{a} reads {n} pages a day. How many days does {a} need to finish a book of {m} pages? Explain your reasoning.",
        "A train travels at {s} km per hour for {h} hours and then at {s2} km per hour for {h2} hours. How far does it "
        "travel in total? Show your steps.",
        "{a} has {n} {items} and gives {k} to {b}. {b} then gives half of them back. How many {items} does {a} have "
        "now? Work it out step by step.",
        "A recipe needs {n} eggs for {k} people. How many eggs are needed for {m} people? Explain step by step.",
        "A rectangle is {n} cm long and {k} cm wide. What are its area and perimeter? Show the calculation.",
        "{a} saves {n} euros every week. How many weeks does it take to save {m} euros? Reason step by step.",
        "What is {n} multiplied by {k}, minus {m}? Show each step.",
        "A shop gives a {pct} percent discount on a jacket that costs {m} euros. What is the new price? Explain.",
        "{a} is {n} years old and {b} is {k} years older. How old will {b} be in {h} years? Think it through.",
    ]
    out = []
    for i in range(count):
        f = forms[i % len(forms)]
        items, _ = rng.choice(ITEMS)
        a, b = rng.sample(NAMES, 2)
        n = rng.randint(3, 40)
        k = rng.randint(2, max(2, n - 1))
        out.append(f.format(a=a, b=b, items=items, n=n, k=k, m=rng.randint(50, 600), p=rng.randint(15, 95),
                            bill=rng.choice([5, 10, 20, 50]), s=rng.choice([60, 80, 90, 120]),
                            s2=rng.choice([40, 70, 100]), h=rng.randint(2, 6), h2=rng.randint(1, 4),
                            pct=rng.choice([10, 15, 20, 25, 30, 40])))
    return out


def build(count: int, seed: int = 0) -> list[dict]:
    """The training prompts as chat requests, deterministic in (count, seed, this Python's docstrings)."""
    rng = random.Random(seed)
    groups: dict[str, list[str]] = {}
    groups["explain"] = [explain_prompt(t, x) for x, t in itertools.product(CONCEPTS, EXPLAIN_TEMPLATES)]
    groups["howto"] = [t.format(x=x) for x, t in itertools.product(TASKS, HOWTO_TEMPLATES)]
    code = [t.format(lang=lang, x=x) for x, lang, t in itertools.product(CODE_TASKS, LANGUAGES, CODE_TEMPLATES)]
    code += [f"Write an SQL query that {x}." for x in SQL_TASKS]
    groups["code"] = code
    groups["code_questions"] = list(CODE_QUESTIONS)
    groups["lists"] = [t.format(n=n, x=x) for x, t, n in itertools.product(LIST_THINGS, LIST_TEMPLATES, (3, 5, 7))]
    groups["short"] = list(SHORT_QUESTIONS) + [t.format(c=c, cap=cap) for (c, cap), t in
                                               itertools.product(COUNTRIES, COUNTRY_TEMPLATES)]
    groups["compare"] = [t.format(a=a, b=b) for (a, b), t in itertools.product(COMPARE_PAIRS, COMPARE_TEMPLATES)]
    groups["creative"] = [t.format(x=x) for x, t in itertools.product(POEM_TOPICS, CREATIVE_TEMPLATES)]
    groups["email"] = [t.format(to=to, about=about) for (to, about), t in itertools.product(EMAILS, EMAIL_TEMPLATES)]
    groups["reasoning"] = arithmetic_prompts(rng, 900)
    paras = stdlib_paragraphs()
    # Each paragraph under two different instructions: the reply differs, the paragraph repeats.
    groups["rewrite"] = [t.format(p=p) for p in paras for t in rng.sample(REWRITE_TEMPLATES, 2)]
    # Prompts kept per kind at most; the kinds with short lists give everything they have.
    caps = {"explain": 1200, "howto": 400, "code": 1500, "code_questions": 100, "lists": 600, "short": 300,
            "compare": 200, "creative": 200, "email": 100, "reasoning": 900, "rewrite": 800}
    chosen = []
    for kind, cap in caps.items():
        pool = sorted(set(groups[kind]))
        rng.shuffle(pool)
        chosen += [(kind, p) for p in pool[:cap]]
    rng.shuffle(chosen)
    return [{"kind": kind, "messages": [{"role": "user", "content": p}]} for kind, p in chosen[:count]]


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def prompt_text(item: dict) -> str:
    """The user text of a prompt record (the last user message, or `prompt`)."""
    if "messages" in item:
        users = [m["content"] for m in item["messages"] if m.get("role") == "user"]
        return users[-1] if users else ""
    return item.get("prompt", "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=TRAIN_FILE)
    ap.add_argument("--count", type=int, default=8000, help="prompts at most")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    prompts = build(args.count, args.seed)
    held = {prompt_text(p).strip().lower() for p in read_jsonl(HELDOUT_FILE)} if HELDOUT_FILE.exists() else set()
    clash = [p for p in prompts if prompt_text(p).strip().lower() in held]
    if clash:
        print(f"{len(clash)} training prompt(s) also in the held-out set, e.g. {prompt_text(clash[0])!r}",
              file=sys.stderr)
        return 1
    with open(args.out, "w") as f:
        for p in prompts:
            f.write(json.dumps(p, ensure_ascii=False) + "\n")
    kinds = {}
    for p in prompts:
        kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
    print(f"wrote {len(prompts)} prompts to {args.out}: {kinds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
