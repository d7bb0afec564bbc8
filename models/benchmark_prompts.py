"""The benchmark's prompt set: 6 task kinds x 10 chat prompts, written by hand for the benchmark.

The kinds are Spec-Bench's (multi-turn chat, translation, summarisation, question answering, math reasoning,
retrieval-augmented QA). Topics, sentences, passages and questions are disjoint from the draft's training prompts
(models/prompts.py builds those from templates and word lists; tests/test_bench.py checks the two sets share no
user turn), so acceptance is not measured on what the draft was distilled from. The multi-turn prompts carry an
earlier assistant turn written here, not produced by the target: the follow-up then continues a fixed history.
"""

from __future__ import annotations

from dataclasses import dataclass

Messages = list[dict[str, str]]
KINDS = ("multi_turn", "translation", "summarisation", "qa", "math", "rag")


@dataclass(frozen=True)
class BenchPrompt:
    kind: str  # one of KINDS
    index: int  # position within its kind, 0-based
    messages: tuple[dict[str, str], ...]

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.index}"


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


_MULTI_TURN: list[Messages] = [
    [_user("I want to start keeping a journal. Any tips?"),
     _assistant("Start small: write three sentences each evening about what happened and how you felt. Keep the "
                "notebook by your bed so it becomes part of your routine."),
     _user("What should I do on days when I have nothing to write about?")],
    [_user("What is a good houseplant for a dark apartment?"),
     _assistant("A snake plant or a ZZ plant are good choices. Both tolerate low light and need water only every "
                "two or three weeks."),
     _user("How do I know when the snake plant needs water?")],
    [_user("Can you suggest a name for my new puppy? She is a small brown dachshund."),
     _assistant("How about Hazel, Cocoa, Pretzel or Maple? They suit a small brown dog with a lively character."),
     _user("I like Pretzel. How should I start teaching her to sit?")],
    [_user("I am planning a weekend hiking trip in the mountains."),
     _assistant("That sounds great. Check the weather forecast, tell someone your route, and pack layers, water, "
                "snacks, a map and a small first-aid kit."),
     _user("What kind of shoes should I wear?")],
    [_user("How do I make my old laptop run faster?"),
     _assistant("Uninstall programs you no longer use, stop unneeded apps from starting at boot, and free some "
                "disk space. Replacing a hard drive with an SSD helps the most."),
     _user("Is it hard to replace the drive myself?")],
    [_user("What are some healthy breakfast ideas?"),
     _assistant("Oatmeal with fruit, Greek yogurt with nuts, whole-grain toast with eggs, or a smoothie with "
                "spinach and banana are all quick and nutritious."),
     _user("Which of these keeps me full the longest?")],
    [_user("I keep forgetting people's names right after I meet them."),
     _assistant("Repeat the name out loud when you are introduced, link it to something about the person, and "
                "use it once more before the conversation ends."),
     _user("Does this also work in large groups?")],
    [_user("My sourdough bread comes out very dense."),
     _assistant("Dense sourdough usually means the dough was under-proofed or the starter was weak. Make sure "
                "your starter doubles within a few hours of feeding before you bake."),
     _user("How long should the dough rise at room temperature?")],
    [_user("Should I learn the guitar or the keyboard first?"),
     _assistant("Both are good first instruments. The keyboard makes music theory easy to see, while the guitar "
                "is portable and great for accompanying songs."),
     _user("How many minutes a day should a beginner practise?")],
    [_user("I want to save money on groceries."),
     _assistant("Plan your meals for the week, shop with a list, buy store brands, and cook larger batches that "
                "you can freeze for later."),
     _user("Can you give me a simple batch recipe to start with?")],
]

_TRANSLATION = [
    "Translate to French: The bakery on the corner sells fresh croissants every morning.",
    "Translate to Spanish: My grandmother grows tomatoes and peppers in her garden.",
    "Translate to German: The concert was postponed because of the storm.",
    "Translate to Italian: We walked along the river until the sun went down.",
    "Translate to French: Could you tell me how to get to the post office?",
    "Translate to Spanish: The students finished their project two days early.",
    "Translate to German: I forgot my umbrella at the office yesterday.",
    "Translate to Italian: This soup tastes better with a little lemon.",
    "Translate to Portuguese: The airport is about twenty minutes from the city center.",
    "Translate to Dutch: Our neighbours have a very friendly old dog.",
]

_SUMMARY_TEXTS = [
    "The town council met on Tuesday evening to discuss the future of the old railway station. Some members "
    "want to turn the building into a public library with a small cafe, arguing that the town has lacked a "
    "central meeting place for years. Others prefer to sell it to a private developer, which would bring in "
    "money for road repairs. After a long debate, the council agreed to ask residents for their opinion in a "
    "survey next month before making a final decision.",
    "Researchers at a coastal university have been tracking the migration of grey whales for ten years. Using "
    "small satellite tags, they found that the whales now leave their feeding grounds almost two weeks later "
    "than they did a decade ago. The team believes that warmer water has changed where the whales' food can be "
    "found. They plan to continue the study and share their data with other scientists around the world.",
    "A small company that makes wooden toys has doubled its sales this year. The founders say that parents are "
    "looking for toys that last longer and do not need batteries. The company uses wood from local forests and "
    "paints its toys with water-based colours. It has hired six new workers and hopes to open a second "
    "workshop next spring.",
    "The annual science fair at the city's middle school drew more than two hundred projects this year. One "
    "student built a water filter from sand, charcoal and gravel that removed most of the dirt from muddy "
    "water. Another measured how the colour of a roof changes the temperature inside a model house. The judges "
    "said the quality of the projects was the highest they had seen.",
    "Volunteers spent the weekend cleaning the beach near the harbour. They collected more than three hundred "
    "kilograms of rubbish, most of it plastic bottles, fishing nets and food wrappers. The organisers said the "
    "amount was lower than last year, which they hope means that awareness is growing. They plan to hold "
    "another clean-up in the autumn and invite local schools to take part.",
    "A new bus line will connect the northern suburbs with the hospital and the university starting in June. "
    "Buses will run every fifteen minutes during the day and every half hour in the evening. The city expects "
    "the line to reduce traffic on the main road and make it easier for students and staff to travel without "
    "a car. Tickets will cost the same as on other city buses.",
    "The museum's new exhibition shows how people kept time before clocks were common. Visitors can see sundials, "
    "water clocks and candles marked with lines that burned down hour by hour. A large hourglass in the main "
    "hall runs for exactly one day. The curators hope the exhibition will make visitors think about how much "
    "our idea of time has changed.",
    "Farmers in the valley are trying a new way of watering their crops. Instead of flooding the fields, they "
    "use thin pipes that drip water directly onto the roots of each plant. Early results show that the method "
    "uses about half as much water and that the harvest is just as large. Several farmers say they will switch "
    "all their fields to the new system within two years.",
    "The local library has started lending out more than books. People can now borrow tools such as drills and "
    "ladders, board games, musical instruments and even cake tins. The librarians say the idea came from "
    "residents who did not want to buy expensive items they would use only once or twice. The most popular item "
    "so far is a sewing machine, which is booked for weeks ahead.",
    "A group of engineers has designed a bridge for pedestrians that can be built in a single day. The pieces are "
    "made in a factory and carried to the site by truck, where a small crane lifts them into place. The first "
    "bridge of this kind now crosses a stream in a public park. The engineers say the design could help villages "
    "that are cut off when floods wash away older bridges.",
]

_QA = [
    "Why do cats purr?",
    "How does a refrigerator keep food cold?",
    "What causes the seasons on Earth?",
    "Why is the sky blue during the day?",
    "How do birds know where to fly when they migrate?",
    "What is the difference between weather and climate?",
    "Why does bread go stale?",
    "How does a camera lens focus light?",
    "What makes a boat float on water?",
    "Why do onions make people cry when they cut them?",
]

_MATH = [
    "Sofia buys 4 notebooks at 3 dollars each and 2 pens at 1 dollar each. How much does she spend in total? "
    "Show your steps.",
    "A garden is 12 meters long and 7 meters wide. What is its area and its perimeter? Explain your answer.",
    "Tom runs 5 kilometers every weekday and 8 kilometers on Saturday. How far does he run in a week? Show your "
    "steps.",
    "A recipe needs 250 grams of flour for 10 cookies. How much flour is needed for 36 cookies? Explain.",
    "A shop sells a jacket for 80 dollars and gives a 25 percent discount. What is the new price? Show your "
    "working.",
    "There are 27 students and each table seats 4. How many tables are needed so that everyone can sit? Explain.",
    "A car uses 6 liters of fuel per 100 kilometers. How much fuel does it need for a 350 kilometer trip? Show "
    "your steps.",
    "Maya is 3 times as old as her brother. Together they are 32 years old. How old is each of them? Explain.",
    "A tank holds 120 liters and fills at 8 liters per minute. How long does it take to fill from empty? Show your "
    "steps.",
    "What is the average of 14, 19, 23, 8 and 16? Show how you calculate it.",
]

_RAG = [
    ("The Harbor Street community garden has 40 plots. Each plot is rented for one year at a price of 30 dollars. "
     "Gardeners must water their own plots, but compost and tools are shared. The garden is open from 7 am to 8 pm "
     "between April and October, and a waiting list is kept for new members.",
     "How much does it cost to rent a plot, and when is the garden open?"),
    ("The Northfield swimming pool reopened after a six-month renovation. The main pool now has eight lanes and a "
     "new heating system that keeps the water at 28 degrees. A separate shallow pool for children was added, and "
     "the changing rooms were rebuilt with more lockers. Entry costs 5 dollars for adults and 3 dollars for "
     "children.",
     "What changed during the renovation?"),
    ("Project Lantern is a volunteer programme that teaches adults to read. Volunteers meet their learners twice a "
     "week for one hour at the public library. Each volunteer completes a two-day training course before starting. "
     "Since it began five years ago, the programme has helped more than 600 adults.",
     "How often do volunteers meet their learners, and where?"),
    ("The Greywater hiking trail is 14 kilometers long and takes most walkers about five hours. It climbs 600 "
     "meters to a viewpoint over the lake. Dogs are allowed if they are kept on a lead. The trail is closed in "
     "winter because of ice on the upper section.",
     "Can I bring my dog on the trail, and why is it closed in winter?"),
    ("The Riverside Film Club shows one classic film every Thursday at 7 pm in the old town hall. Membership costs "
     "20 dollars a year and includes free tea and coffee. After each film, members are invited to stay for a short "
     "discussion led by a different volunteer each week.",
     "What happens after each film?"),
    ("The Eastgate recycling centre accepts paper, glass, metal cans, batteries and small electrical appliances. "
     "Large furniture must be booked in advance for a collection. The centre is closed on Mondays and public "
     "holidays. Residents must show proof of address at the gate.",
     "What do residents need to bring, and when is the centre closed?"),
    ("The Brightwood school introduced a four-day week for its older students as a trial. Lessons are longer on "
     "the remaining days, and Fridays are used for sports, clubs and independent projects. After one term, "
     "attendance rose by six percent and teachers reported fewer late arrivals.",
     "What were the results of the trial after one term?"),
    ("The Alder Valley bakery uses flour from a mill twelve kilometers away. Its best-known product is a rye bread "
     "that rises for eighteen hours before baking. The bakery opens at 6 am and usually sells out of rye bread by "
     "noon. On Sundays it only sells pastries.",
     "Why might I not find rye bread in the afternoon?"),
    ("The city's bike-sharing scheme has 900 bicycles at 75 stations. The first 30 minutes of each ride are free "
     "for members; after that, each extra half hour costs one dollar. Annual membership is 45 dollars, and "
     "bicycles can be unlocked with a phone app or a card.",
     "How much would a 90-minute ride cost a member?"),
    ("The Stonebridge observatory opens to the public on clear Friday nights. Visitors can look through a 40 "
     "centimeter telescope at the Moon, planets and bright star clusters. Tours start every half hour from 8 pm, "
     "and children under twelve must be accompanied by an adult.",
     "On which nights can the public visit, and what can they see?"),
]


def _build() -> tuple[BenchPrompt, ...]:
    by_kind: dict[str, list[Messages]] = {
        "multi_turn": _MULTI_TURN,
        "translation": [[_user(t)] for t in _TRANSLATION],
        "summarisation": [[_user(f"Summarize the following text in two sentences.\n\n{t}")] for t in _SUMMARY_TEXTS],
        "qa": [[_user(q)] for q in _QA],
        "math": [[_user(q)] for q in _MATH],
        "rag": [[_user(f"Answer the question using only the passage.\n\nPassage: {p}\n\nQuestion: {q}")]
                for p, q in _RAG],
    }
    return tuple(BenchPrompt(kind, i, tuple(m)) for kind in KINDS for i, m in enumerate(by_kind[kind]))


PROMPTS = _build()


def select(per_kind: int) -> list[BenchPrompt]:
    """The first `per_kind` prompts of every kind, interleaved by kind (kind order repeats), so a run cut short
    still covers every kind."""
    return [p for i in range(per_kind) for p in PROMPTS if p.index == i]
