"""Source texts for the 'repeat' workload (see :func:`bench.schedule.workload_prompt`).

Plain, original prose and small code files, written for this benchmark: the
kind of input a user asks a model to copy, extract from, quote or edit. Real
sentences matter: a small instruct model (SmolLM2-135M) paraphrases or drifts
on strings of random words but copies readable text, so these prompts measure
what prompt-lookup speculation does on the tasks it is meant for. The topics and
styles vary (story, recipe, science, notice, notes, manual, letter, news) so
that no single text decides the result.

Each passage carries the key phrases that extraction prompts ask about (each
occurs in the passage) and one question that quoting prompts ask.
"""

from __future__ import annotations

__all__ = ["CODE_FILES", "PASSAGES", "CodeFile", "Passage"]


class Passage:
    __slots__ = ("keywords", "question", "sentences")

    def __init__(self, text: str, keywords: tuple[str, ...], question: str) -> None:
        self.sentences = tuple(s.strip() + "." for s in text.split(".") if s.strip())
        self.keywords = keywords
        self.question = question


class CodeFile:
    """A small source file and renames a code-edit prompt may ask for (old, new)."""

    __slots__ = ("renames", "text")

    def __init__(self, text: str, *renames: tuple[str, str]) -> None:
        self.text, self.renames = text, renames


PASSAGES: tuple[Passage, ...] = (
    Passage(
        "The river runs through the middle of the old town. Every spring the water rises and "
        "covers the lower streets. The people who live near the river keep boats in their "
        "gardens. In the summer the river is slow and children swim near the stone bridge. The "
        "bridge was built more than two hundred years ago and it has never been closed. "
        "Fishermen sit on the bridge in the early morning and wait for the light.",
        ("the river", "the bridge"),
        "What do the fishermen do?",
    ),
    Passage(
        "To make simple bread, mix flour, water, salt and yeast in a large bowl. Knead the dough "
        "for ten minutes until it is smooth. Leave the dough in a warm place for one hour so that "
        "it can rise. Shape the dough into a loaf and put it on a tray. Bake the bread in a hot "
        "oven for thirty minutes. Let the bread cool before you cut it, or the inside will be wet.",
        ("the dough", "the bread"),
        "How long does the bread bake?",
    ),
    Passage(
        "A battery stores energy as chemical energy. When a device is switched on, a reaction "
        "inside the battery moves electrons from one side to the other. The electrons flow "
        "through the wire and power the device. A rechargeable battery can run the reaction "
        "backwards when it is connected to a charger. Over time every battery loses some of its "
        "capacity. Heat makes a battery age faster, so phones should not be left in the sun.",
        ("battery", "the device"),
        "Why should phones not be left in the sun?",
    ),
    Passage(
        "The city library opens at nine in the morning and closes at eight in the evening. "
        "Members can borrow up to ten books at a time. Books must be returned within three "
        "weeks. The library also lends music, films and board games. On Saturdays there is a "
        "reading hour for young children in the main hall. The library is closed on public "
        "holidays, but books can still be returned through the box by the front door.",
        ("books", "the library"),
        "How many books can a member borrow?",
    ),
    Passage(
        "The team met on Monday to plan the new website. Anna will write the text for the home "
        "page. David will design the logo and choose the colours. The first version of the "
        "website must be ready by the end of the month. The team agreed to meet again next "
        "Monday to check the progress. Anna asked for a list of all the products that should "
        "appear on the website.",
        ("Anna", "the website"),
        "What will David do?",
    ),
    Passage(
        "Mars is the fourth planet from the sun. It is smaller than the earth and much colder. "
        "The surface of Mars is covered with red dust, which gives the planet its colour. Mars "
        "has two small moons. A day on Mars is a little longer than a day on the earth. "
        "Scientists have sent many robots to Mars to study its rocks and to look for signs of "
        "water.",
        ("Mars", "the earth"),
        "Why is Mars red?",
    ),
    Passage(
        "The garden behind the house is small but full of plants. Tomatoes grow along the south "
        "wall, where they get the most sun. There is a bed of herbs near the kitchen door. In the "
        "corner stands an apple tree that my grandfather planted. Every autumn the tree gives "
        "more apples than we can eat, so we give them to our neighbours. The garden needs water "
        "every evening in the summer.",
        ("the garden", "apple"),
        "Who planted the apple tree?",
    ),
    Passage(
        "The train to the coast leaves the central station every hour. The journey takes two "
        "hours and ten minutes. Tickets are cheaper if you buy them a week before you travel. "
        "There is a small cafe on the train that sells coffee, tea and sandwiches. Dogs may "
        "travel on the train if they stay on a lead. The last train back from the coast leaves "
        "at eleven at night.",
        ("the train", "the coast"),
        "How long is the journey?",
    ),
    Passage(
        "Dear Sam, thank you for your letter and for the photos of the new house. The kitchen "
        "looks bright and the view from the window is lovely. We hope to visit you in the second "
        "week of June. Please tell us if that week is not good for you. We will bring the books "
        "you left here last year. With love from all of us.",
        ("the new house", "the books"),
        "When do they hope to visit?",
    ),
    Passage(
        "To set up the printer, first remove all the orange tape. Connect the power cable and "
        "press the button on the left side. Open the front cover and put the ink cartridges into "
        "their places. Close the cover and wait until the light stops blinking. Load plain paper "
        "into the tray and print a test page. If the test page is blank, check that the tape is "
        "gone from the cartridges.",
        ("the printer", "the cover", "the test page"),
        "What should you do if the test page is blank?",
    ),
    Passage(
        "The town council voted on Tuesday to build a new swimming pool next to the school. The "
        "pool will cost four million pounds and should open in two years. Most of the money will "
        "come from the national sports fund. Some people at the meeting said that the old pool "
        "should be repaired instead. The council will show the plans for the new pool at the town "
        "hall next month.",
        ("the pool", "the council"),
        "Where will the new pool be built?",
    ),
    Passage(
        "Owls hunt at night and sleep during the day. Their large eyes help them to see in the "
        "dark, and their ears can hear a mouse moving under the snow. An owl cannot move its "
        "eyes, so it turns its whole head to look around. The soft edges of its feathers let the "
        "owl fly without a sound. Most owls live alone and many of them use the same nest for "
        "years.",
        ("owl", "the dark"),
        "Why does an owl turn its head?",
    ),
)


CODE_FILES: tuple[CodeFile, ...] = (
    CodeFile(
        "def score(items):\n    total = 0\n    for item in items:\n"
        "        total += item.price * item.count\n        if total > 100:\n"
        "            total = total - item.discount\n    return total\n\n\n"
        "def report(items):\n    total = score(items)\n    print(\"Total:\", total)\n"
        "    return total\n",
        ("total", "amount"),
        ("items", "products"),
        ("score", "compute_score"),
    ),
    CodeFile(
        "class User:\n    def __init__(self, name, email):\n        self.name = name\n"
        "        self.email = email\n\n    def greet(self):\n"
        "        return \"Hello, \" + self.name\n\n    def to_dict(self):\n"
        "        return {\"name\": self.name, \"email\": self.email}\n",
        ("email", "address"),
        ("name", "full_name"),
        ("User", "Account"),
    ),
    CodeFile(
        "import csv\n\n\ndef load(path):\n    data = []\n    with open(path) as f:\n"
        "        for row in csv.reader(f):\n            data.append(row)\n    return data\n\n\n"
        "def count(data):\n    return len(data)\n\n\ndef first(data):\n"
        "    return data[0] if data else None\n",
        ("data", "rows"),
        ("path", "filename"),
        ("load", "read_rows"),
    ),
    CodeFile(
        "function resize(image, size) {\n  const width = image.width * size;\n"
        "  const height = image.height * size;\n  if (size > 4) {\n"
        "    throw new Error(\"size too large\");\n  }\n"
        "  return { width: width, height: height, size: size };\n}\n",
        ("size", "scale"),
        ("image", "picture"),
        ("resize", "scaleImage"),
    ),
    CodeFile(
        "def parse_config(lines):\n    config = {}\n    for line in lines:\n"
        "        line = line.strip()\n        if not line or line.startswith(\"#\"):\n"
        "            continue\n        key, value = line.split(\"=\", 1)\n"
        "        config[key.strip()] = value.strip()\n    return config\n",
        ("config", "settings"),
        ("lines", "rows"),
        ("parse_config", "read_settings"),
    ),
    CodeFile(
        "SELECT customer_id, name, city\nFROM customers\nWHERE city = 'Leeds'\n"
        "  AND active = 1\nORDER BY name;\n\nSELECT order_id, customer_id, total\nFROM orders\n"
        "WHERE total > 50\nORDER BY total DESC;\n",
        ("customer_id", "client_id"),
        ("customers", "clients"),
        ("total", "amount"),
    ),
)
