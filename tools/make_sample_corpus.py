#!/usr/bin/env python
"""Write the sample corpus: deterministic English documents from a small template grammar.

The text is generated, not collected, so it may be redistributed freely. It has real
structure a tiny model can learn in a few dozen steps: a fixed vocabulary, consistent facts
(animals keep their legs, sounds and food), correct arithmetic, ordered sequences (days,
months, numbers) and short stories whose pronouns agree with their characters.

    python -m tools.make_sample_corpus --output data/sample.jsonl
"""

from __future__ import annotations

import argparse
import json
import random

NAMES = [("Anna", "she", "her"), ("Ben", "he", "his"), ("Clara", "she", "her"), ("David", "he", "his"),
         ("Emma", "she", "her"), ("Finn", "he", "his"), ("Grace", "she", "her"), ("Henry", "he", "his"),
         ("Ida", "she", "her"), ("Jack", "he", "his"), ("Lena", "she", "her"), ("Max", "he", "his"),
         ("Mia", "she", "her"), ("Noah", "he", "his"), ("Olivia", "she", "her"), ("Paul", "he", "his"),
         ("Rosa", "she", "her"), ("Sam", "he", "his"), ("Tara", "she", "her"), ("Tom", "he", "his")]
PLACES = ["a small village near the river", "a busy town by the sea", "a quiet farm on the hill",
          "a big city with tall towers", "a house at the edge of the forest", "a cabin in the mountains"]
OBJECTS = ["key", "book", "box", "map", "ring", "bell", "lamp", "coin", "stone", "letter"]
COLORS = ["red", "blue", "green", "yellow", "white", "black", "golden", "silver"]
FINDSPOTS = ["under a stone", "behind the door", "in the old barn", "near the well",
             "in the garden", "on the top shelf", "under the bridge", "in a hollow tree"]
OPENS = {"key": "opens the old gate", "map": "shows the way to the lake", "book": "tells the story of the town",
         "box": "holds a secret", "ring": "belonged to the queen", "bell": "calls the birds",
         "lamp": "lights the dark cave", "coin": "is older than the town", "stone": "glows at night",
         "letter": "was written by the baker"}
REWARDS = ["a garden full of apples", "a room full of old books", "a small boat", "a sleeping cat",
           "a box of warm bread", "a field of flowers", "a hidden spring", "a friendly dog"]
FEELINGS = ["happy", "surprised", "proud", "tired but happy", "very glad"]

# name, plural, legs, sound, food, home, can
ANIMALS = [("cat", "cats", 4, "meows", "fish", "a warm house", "climb trees"),
           ("dog", "dogs", 4, "barks", "meat", "a kennel", "run fast"),
           ("cow", "cows", 4, "moos", "grass", "a barn", "give milk"),
           ("duck", "ducks", 2, "quacks", "seeds", "a pond", "swim"),
           ("horse", "horses", 4, "neighs", "hay", "a stable", "carry people"),
           ("sheep", "sheep", 4, "baas", "grass", "a field", "grow wool"),
           ("owl", "owls", 2, "hoots", "mice", "a tree", "see at night"),
           ("frog", "frogs", 4, "croaks", "flies", "a pond", "jump far"),
           ("hen", "hens", 2, "clucks", "corn", "a coop", "lay eggs"),
           ("bee", "bees", 6, "buzzes", "nectar", "a hive", "make honey"),
           ("spider", "spiders", 8, "is silent", "insects", "a web", "spin silk"),
           ("pig", "pigs", 4, "oinks", "apples", "a sty", "dig in the mud")]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
           "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
           "nineteen", "twenty"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
DRINKS = [("tea", "the tea leaves"), ("coffee", "the ground coffee"), ("cocoa", "the cocoa powder")]
FRUITS = ["apples", "pears", "plums", "cherries", "oranges", "lemons"]


def story(r: random.Random) -> str:
    (a, he, his), (b, _, _) = r.sample(NAMES, 2)
    obj, color, spot = r.choice(OBJECTS), r.choice(COLORS), r.choice(FINDSPOTS)
    cap = he.capitalize()
    s = [f"{a} lived in {r.choice(PLACES)}.",
         f"Every morning, {a} walked to the market to buy bread.",
         f"One day, {he} found a {color} {obj} {spot}.",
         f"{cap} showed the {obj} to {his} friend {b}.",
         f'{b} said, "This {obj} {OPENS[obj]}."']
    if obj == "key":
        s.append("Together they walked to the old gate and opened it.")
        s.append(f"Behind the gate was {r.choice(REWARDS)}.")
    else:
        s.append(f"{a} kept the {color} {obj} in {his} pocket.")
    s.append(f"That evening, {a} and {b} were {r.choice(FEELINGS)}.")
    return " ".join(s)


def animal_facts(r: random.Random) -> str:
    name, plural, legs, sound, food, home, can = r.choice(ANIMALS)
    art = "An" if name[0] in "aeiou" else "A"
    lines = [f"{art} {name} is an animal.", f"{art} {name} has {NUMBERS[legs]} legs.",
             f"{art} {name} {sound}.", f"{plural.capitalize()} eat {food}.",
             f"{art} {name} lives in {home}.", f"{plural.capitalize()} can {can}."]
    r.shuffle(lines)
    return " ".join(lines[: r.randint(4, 6)])


def animal_quiz(r: random.Random) -> str:
    out = []
    for name, plural, legs, sound, food, home, can in r.sample(ANIMALS, r.randint(3, 6)):
        q = r.randrange(3)
        if q == 0:
            out.append(f"How many legs does a {name} have? A {name} has {NUMBERS[legs]} legs.")
        elif q == 1:
            out.append(f"What do {plural} eat? {plural.capitalize()} eat {food}.")
        else:
            out.append(f"Where does a {name} live? A {name} lives in {home}.")
    return " ".join(out)


def arithmetic(r: random.Random) -> str:
    out = []
    for _ in range(r.randint(4, 10)):
        a, b = r.randint(0, 10), r.randint(0, 10)
        op = r.randrange(3)
        if op == 0:
            out.append(f"{NUMBERS[a].capitalize()} plus {NUMBERS[b]} is {NUMBERS[a + b]}.")
        elif op == 1:
            a, b = max(a, b) + 10, min(a, b)
            out.append(f"{a} minus {b} equals {a - b}.")
        else:
            out.append(f"What is {a} plus {b}? The answer is {a + b}.")
    return " ".join(out)


def sequence(r: random.Random) -> str:
    kind = r.randrange(3)
    if kind == 0:
        i = r.randrange(7)
        days = [DAYS[(i + k) % 7] for k in range(r.randint(4, 9))]
        return (f"The days go in order: {', '.join(days)}. "
                f"After {days[0]} comes {days[1]}. Before {days[2]} comes {days[1]}.")
    if kind == 1:
        i = r.randrange(12)
        months = [MONTHS[(i + k) % 12] for k in range(r.randint(3, 12))]
        return (f"The months go in order: {', '.join(months)}. "
                f"The month after {months[0]} is {months[1]}.")
    start = r.randint(0, 10)
    stop = min(start + r.randint(4, 10), 19)
    return f"Let us count: {', '.join(NUMBERS[start:stop + 1])}. The next number is {NUMBERS[stop + 1]}."


def recipe(r: random.Random) -> str:
    drink, stuff = r.choice(DRINKS)
    fruit = r.choice(FRUITS)
    return (f"To make {drink}, first boil the water. Then put {stuff} in a cup. "
            f"Pour the hot water into the cup and wait for {NUMBERS[r.randint(2, 5)]} minutes. "
            f"Serve the {drink} with a plate of {fruit}.")


def letter(r: random.Random) -> str:
    (a, _, _), (b, _, _) = r.sample(NAMES, 2)
    day, month = r.choice(DAYS), r.choice(MONTHS)
    animal = r.choice(ANIMALS)
    return (f"Dear {b}, I hope you are well. On {day} I went to the farm and saw a {animal[0]}. "
            f"It {animal[3]} all day and eats {animal[4]}. In {month} I will visit you again. "
            f"Your friend, {a}.")


KINDS = [(story, 4), (animal_facts, 2), (animal_quiz, 2), (arithmetic, 2), (sequence, 2),
         (recipe, 1), (letter, 2)]


def document(r: random.Random) -> str:
    makers = [k for k, w in KINDS for _ in range(w)]
    # One document joins a few paragraphs of one or two kinds, so topics stay together.
    first, second = r.choice(makers), r.choice(makers)
    paras = [first(r) if i % 2 == 0 else second(r) for i in range(r.randint(1, 4))]
    return "\n\n".join(paras)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", default="data/sample.jsonl")
    p.add_argument("--bytes", type=int, default=600_000, help="stop once this much text is written")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    r = random.Random(args.seed)
    total = docs = 0
    with open(args.output, "w", encoding="utf-8", newline="\n") as f:
        while total < args.bytes:
            text = document(r)
            f.write(json.dumps({"id": docs, "text": text}) + "\n")
            total += len(text)
            docs += 1
    print(f"wrote {docs} documents, {total} bytes of text, to {args.output}")


if __name__ == "__main__":
    main()
