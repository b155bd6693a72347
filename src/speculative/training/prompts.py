"""Chat prompts for self-distillation: the target answers them, the head learns from the
answers (the distribution it meets at inference).

Prompts are built from templates over topics plus passages taken from local text (for the
summarization, translation, retrieval and code styles). They are written for training
and deliberately differ from the benchmark's evaluation prompts.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Container, Sequence

TOPICS = (
    "photosynthesis",
    "volcanoes",
    "the water cycle",
    "black holes",
    "vaccines",
    "tides",
    "earthquakes",
    "the immune system",
    "rainbows",
    "coral reefs",
    "the moon's phases",
    "electric cars",
    "solar panels",
    "wind turbines",
    "recycling plastic",
    "compound interest",
    "inflation",
    "supply and demand",
    "the stock market",
    "credit scores",
    "budgeting",
    "sleep hygiene",
    "healthy breakfast ideas",
    "running a first 5k",
    "learning to swim",
    "meditation",
    "stretching after exercise",
    "houseplants",
    "composting",
    "beekeeping",
    "baking sourdough",
    "making pasta from scratch",
    "brewing coffee",
    "growing tomatoes",
    "the Roman Empire",
    "the printing press",
    "the Industrial Revolution",
    "ancient Egypt",
    "the invention of the telephone",
    "the history of chess",
    "the Silk Road",
    "the Renaissance",
    "how airplanes fly",
    "how refrigerators work",
    "how GPS works",
    "how the internet works",
    "how batteries store energy",
    "how microwaves heat food",
    "how a bicycle gear works",
    "public speaking",
    "writing a cover letter",
    "preparing for a job interview",
    "time management",
    "working from home",
    "learning a new language",
    "studying for exams",
    "saving money on groceries",
    "planning a birthday party",
    "training a puppy",
    "caring for a cat",
    "keeping chickens",
    "birdwatching",
    "stargazing",
    "camping in the rain",
    "packing for a long flight",
    "visiting Japan",
    "a road trip across Canada",
    "recursion",
    "binary search",
    "hash tables",
    "linked lists",
    "sorting algorithms",
    "object-oriented programming",
    "unit testing",
    "version control with git",
    "SQL joins",
    "regular expressions",
    "REST APIs",
    "Python decorators",
    "Python generators",
    "list comprehensions",
    "exception handling",
    "type hints in Python",
    "virtual environments",
    "memory leaks",
    "concurrency and threads",
    "big-O notation",
    "floating-point rounding",
    "prime numbers",
    "fractions",
    "percentages",
    "the Pythagorean theorem",
    "probability",
    "averages and medians",
    "simple interest",
    "unit conversion",
    "area of a circle",
    "climate change",
    "ocean currents",
    "deserts",
    "rainforests",
    "glaciers",
    "migration of birds",
    "dinosaurs",
    "the human heart",
    "digestion",
    "dreams",
    "memory and learning",
    "friendship",
    "dealing with stress",
    "giving feedback",
    "negotiating a salary",
    "starting a small business",
    "writing a short story",
    "poetry",
    "jazz music",
    "learning guitar",
    "photography basics",
    "painting with watercolors",
    "chess openings",
    "board games for families",
    "video game design",
    # everyday life, nature, science, history, work and hobbies (a wide spread of prose
    # matters more than depth: the head must learn the model's own phrasing)
    "washing dishes by hand",
    "ironing a shirt",
    "fixing a leaky faucet",
    "painting a room",
    "hanging a picture frame",
    "cleaning a kitchen oven",
    "choosing a mattress",
    "organizing a closet",
    "moving to a new city",
    "renting a first apartment",
    "buying a used car",
    "changing a flat tire",
    "driving in snow",
    "saving for retirement",
    "paying off debt",
    "opening a bank account",
    "filing taxes",
    "writing a resume",
    "asking for a raise",
    "running a team meeting",
    "remote team communication",
    "writing clear emails",
    "taking notes in class",
    "reading faster",
    "keeping a journal",
    "building a morning routine",
    "drinking enough water",
    "eating more vegetables",
    "meal prepping for the week",
    "cooking rice",
    "making soup",
    "grilling vegetables",
    "baking cookies",
    "making pizza dough",
    "fermenting vegetables",
    "storing fresh herbs",
    "choosing a ripe avocado",
    "yoga for beginners",
    "strength training",
    "cycling to work",
    "hiking safety",
    "rock climbing",
    "skiing",
    "surfing",
    "playing tennis",
    "the rules of soccer",
    "basketball",
    "marathon training",
    "first aid for burns",
    "the common cold",
    "allergies",
    "sunscreen",
    "the human skeleton",
    "the nervous system",
    "the lungs",
    "blood types",
    "DNA",
    "evolution",
    "cells",
    "bacteria",
    "fungi",
    "honeybees",
    "ants",
    "butterflies",
    "whales",
    "dolphins",
    "elephants",
    "wolves",
    "sharks",
    "octopus intelligence",
    "frogs",
    "trees in autumn",
    "seeds and germination",
    "soil",
    "rivers",
    "mountains",
    "caves",
    "hurricanes",
    "tornadoes",
    "lightning",
    "fog",
    "the seasons",
    "the sun",
    "Mars",
    "Jupiter",
    "comets",
    "the speed of light",
    "gravity",
    "friction",
    "sound waves",
    "electricity at home",
    "nuclear power",
    "hydroelectric dams",
    "steam engines",
    "the wheel",
    "clocks",
    "paper money",
    "the alphabet",
    "maps",
    "the Great Wall of China",
    "the pyramids of Giza",
    "ancient Greece",
    "the Vikings",
    "the Aztecs",
    "the Middle Ages",
    "castles",
    "the age of exploration",
    "the space race",
    "the first computers",
    "smartphones",
    "social media",
    "online privacy",
    "strong passwords",
    "phishing emails",
    "cloud storage",
    "spreadsheets",
    "3D printing",
    "robots",
    "machine learning",
    "search engines",
    "open source software",
    "databases",
    "web browsers",
    "HTML and CSS",
    "JavaScript",
    "command-line tools",
    "debugging a program",
    "code reviews",
    "writing documentation",
    "APIs",
    "caching",
    "encryption",
    "compilers",
    "operating systems",
    "the Python standard library",
    "dictionaries in Python",
    "string formatting in Python",
    "reading CSV files",
    "logging in Python",
    "async programming",
    "volunteering",
    "making friends as an adult",
    "apologizing",
    "listening well",
    "parenting toddlers",
    "teaching kids to read",
    "homework habits",
    "choosing a college major",
    "learning math as an adult",
    "museums",
    "theater",
    "classical music",
    "film photography",
    "drawing portraits",
    "pottery",
    "woodworking",
    "sewing a button",
    "gardening in small spaces",
    "bird feeders",
    "aquariums",
    "adopting a rescue dog",
    "horse riding",
    "fishing",
    "sailing",
    "trains",
    "airports",
    "hotels",
    "traveling on a budget",
    "learning Spanish",
    "sign language",
    "writing poetry",
    "famous inventors",
    "the scientific method",
    "statistics",
    "geometry",
    "algebra",
    "negative numbers",
    "decimals",
    "measuring ingredients",
    "time zones",
    "calendars",
    "recycling glass",
    "saving energy at home",
    "electric bikes",
    "public transport",
    "city parks",
    "farming",
    "wheat and bread",
    "chocolate",
    "cheese making",
    "spices",
)

# Topics no training prompt uses: the target's answers about them are held-out open-ended
# prose (--eval-data), the text chat and QA decoding meets. A split of the training records
# instead averages in text a head finds much easier (documentation answers that restate
# the question, templated code and arithmetic tasks close to training ones) and overstates
# what chat gets (docs/heads-diagnosis.md).
EVAL_TOPICS = (
    "origami",
    "the French Revolution",
    "owls",
    "knitting",
    "magnets",
    "public libraries",
    "bicycles",
    "the Byzantine Empire",
    "hedgehogs",
    "wind chimes",
    "lighthouses",
    "penguins",
    "tea ceremonies",
    "submarines",
    "the Olympic Games",
    "snowflakes",
)

TEMPLATES = (
    "Explain {t} in simple terms.",
    "Can you give me a short introduction to {t}?",
    "What are the most important things to know about {t}?",
    "Write a short paragraph about {t}.",
    "What are three common misconceptions about {t}?",
    "I'm a beginner. How should I get started with {t}?",
    "Give me five tips about {t}.",
    "Why is {t} important?",
    "Describe {t} to a ten-year-old.",
    "What are the pros and cons of {t}?",
    "Summarize the key ideas behind {t} in a few sentences.",
    "Write a short blog post introduction about {t}.",
    "What questions should I ask to learn more about {t}?",
    "Tell me an interesting fact about {t} and explain it.",
    "How would you explain {t} to a friend over coffee?",
    "How does {t} work?",
    "What is {t}, and why does it matter?",
    "What should everyone know about {t}?",
    "Can you help me understand {t}?",
    "What is the history of {t}?",
    "Write a short guide to {t}.",
    "List the main steps involved in {t}.",
    "What are some common problems with {t}, and how can I avoid them?",
    "Compare {t} with something similar and explain the difference.",
    "I have five minutes. Tell me about {t}.",
)

FOLLOW_UPS = (
    "Thanks! Can you give me an example?",
    "Interesting. Can you explain that in more detail?",
    "What is the most common mistake people make with that?",
    "Can you make that shorter?",
    "How would that work in practice?",
    "Why is that?",
    "Can you say more about the first point?",
    "What would you recommend for a beginner?",
    "Could you put that as a short list?",
    "Is there anything I should be careful about?",
    "That helps. What should I do next?",
)

CODE_TASKS = (
    "Write a Python function that returns the {n} largest numbers in a list.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that reverses the words in a sentence.",
    "Write a Python function that merges two sorted lists.",
    "Write a Python function that flattens a nested list.",
    "Write a Python function that computes the factorial of {n}.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Write a Python function that removes duplicates from a list while keeping order.",
    "Write a Python function that converts Celsius to Fahrenheit.",
    "Write a Python function that reads a text file and returns the number of lines.",
    "Write a Python function that finds the most common word in a text.",
    "Write a Python function that checks if two strings are anagrams.",
    "Write a Python function that returns the Fibonacci numbers below {n}0.",
    "Write a Python function that validates an email address with a regular expression.",
)

MATH_TASKS = (
    "A train travels {a} km in {b} hours. What is its average speed? Show your work.",
    "If a shirt costs ${a} and is discounted by {b}%, what is the new price? Explain.",
    "What is {a} multiplied by {b}? Explain step by step.",
    "A recipe needs {b} eggs for {a} people. How many eggs for {c} people? Explain.",
    "Sara has {a} apples and gives away {b}. How many are left? Explain your reasoning.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "What is {a} percent of {c}0? Show the steps.",
)

LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese")


def passages(texts: Sequence[str], min_chars: int = 200, max_chars: int = 700) -> list[str]:
    """Plain-prose paragraphs of reasonable length from documentation texts."""
    found = []
    for text in texts:
        for block in re.split(r"\n\s*\n", text):
            block = " ".join(block.split())
            if min_chars <= len(block) <= max_chars and _is_prose(block):
                found.append(block)
    return found


def _is_prose(block: str) -> bool:
    letters = sum(c.isalpha() or c == " " for c in block)
    return letters / len(block) > 0.9 and block.count(".") >= 2 and not block.startswith("..")


def code_snippets(sources: Sequence[str], max_lines: int = 14) -> list[str]:
    """Short top-level Python functions taken from source files."""
    found = []
    pattern = re.compile(r"^def [\s\S]*?(?=^\S)", re.MULTILINE)
    for source in sources:
        for match in pattern.finditer(source):
            body = match.group(0).rstrip()
            if 3 <= body.count("\n") + 1 <= max_lines:
                found.append(body)
    return found


def prompt_key(messages: Sequence[dict[str, str]]) -> str:
    """A transcript's identity (equal messages, equal key)."""
    return json.dumps(list(messages), sort_keys=True)


def build_prompts(
    count: int,
    seed: int = 0,
    prose: Sequence[str] = (),
    code: Sequence[str] = (),
    exclude: Container[str] = frozenset(),
) -> list[list[dict[str, str]]]:
    """``count`` chat transcripts (each ending with a user turn) in several styles, none
    repeated and none whose :func:`prompt_key` is in ``exclude`` (earlier runs' prompts:
    every answer to these is then new text). An empty ``exclude`` draws what it always
    drew for a seed."""
    rng = random.Random(seed)
    makers = [_topic_prompt, _topic_prompt, _topic_prompt, _code_prompt, _math_prompt]
    if prose:
        makers += [_summary_prompt, _translation_prompt, _retrieval_prompt]
    if code:
        makers += [_edit_prompt]
    seen: set[str] = set()
    prompts: list[list[dict[str, str]]] = []
    while len(prompts) < count:
        messages = rng.choice(makers)(rng, prose, code)
        key = prompt_key(messages)
        if key in exclude:
            continue
        if key not in seen or len(seen) > 50 * count:
            seen.add(key)
            prompts.append(messages)
    return prompts


def follow_ups(
    transcripts: Sequence[list[dict[str, str]]], seed: int = 0
) -> list[list[dict[str, str]]]:
    """Multi-turn prompts: each answered transcript plus a follow-up question (the target
    answers again, as in a chat's second turn)."""
    rng = random.Random(seed)
    return [[*messages, *_user(rng.choice(FOLLOW_UPS))] for messages in transcripts]


def eval_prompts(count: int, topics: Sequence[str] = EVAL_TOPICS) -> list[list[dict[str, str]]]:
    """``count`` topic prompts over ``topics`` (default EVAL_TOPICS: held-out chat prompts
    on topics the training prompts never name)."""
    pairs = [(t, topic) for t in TEMPLATES for topic in topics]
    rng = random.Random(0)
    rng.shuffle(pairs)
    return [_user(template.format(t=topic)) for template, topic in pairs[:count]]


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _topic_prompt(rng: random.Random, *_: Sequence[str]) -> list[dict[str, str]]:
    return _user(rng.choice(TEMPLATES).format(t=rng.choice(TOPICS)))


def _code_prompt(rng: random.Random, *_: Sequence[str]) -> list[dict[str, str]]:
    return _user(rng.choice(CODE_TASKS).format(n=rng.randint(2, 9)))


def _math_prompt(rng: random.Random, *_: Sequence[str]) -> list[dict[str, str]]:
    a, b, c = rng.randint(2, 90), rng.randint(2, 40), rng.randint(2, 30)
    return _user(rng.choice(MATH_TASKS).format(a=a, b=b, c=c))


def _summary_prompt(rng: random.Random, prose: Sequence[str], _: Sequence[str]) -> list[dict]:
    style = rng.choice(("in one sentence", "in two sentences", "briefly", "in simple words"))
    return _user(f"Summarize the following text {style}.\n\n{rng.choice(prose)}")


def _translation_prompt(rng: random.Random, prose: Sequence[str], _: Sequence[str]) -> list[dict]:
    sentence = rng.choice(rng.choice(prose).split(". ")).strip().rstrip(".") + "."
    return _user(f"Translate into {rng.choice(LANGUAGES)}: {sentence}")


def _retrieval_prompt(rng: random.Random, prose: Sequence[str], _: Sequence[str]) -> list[dict]:
    question = rng.choice(
        (
            "What is the main point of the passage?",
            "What does the passage describe?",
            "What should a reader remember from the passage?",
        )
    )
    return _user(
        f"Answer the question using only the passage.\n\nPassage: {rng.choice(prose)}\n\n"
        f"Question: {question}"
    )


def _edit_prompt(rng: random.Random, _: Sequence[str], code: Sequence[str]) -> list[dict]:
    task = rng.choice(
        (
            "Add type hints to this function and return the code:",
            "Add a docstring to this function:",
            "Explain what this function does:",
            "Rewrite this function to be easier to read:",
        )
    )
    return _user(f"{task}\n\n{rng.choice(code)}\n")
