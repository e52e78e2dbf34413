"""Chat requests for training the EAGLE head on the target's own replies (self-distillation).

No chat data set ships offline, so the requests are built from instruction patterns and topics; the
target's greedy replies to them (through its chat template) are the training text. The benchmark's
chat request (a lighthouse keeper's story) is deliberately not among them.
"""

from __future__ import annotations

import random

PATTERNS = (
    "Write a short story about {}.",
    "Explain {} in simple terms.",
    "What are the main benefits of {}?",
    "Give me three tips about {}.",
    "Describe {} to a child.",
    "Write a poem about {}.",
    "How does {} work?",
    "Summarize the history of {}.",
    "What should a beginner know about {}?",
    "Write a friendly email to a colleague about {}.",
    "What are common mistakes people make with {}?",
    "Compare {} with something similar and explain the differences.",
    "Tell me an interesting fact about {}.",
    "Write a short dialogue between two friends talking about {}.",
    "Why is {} important?",
    "Give a step-by-step guide to {}.",
    "Write a blog post introduction about {}.",
    "What questions do people often ask about {}?",
    "Describe a typical day involving {}.",
    "Write a short speech about {}.",
    "What would the world be like without {}?",
    "Write a diary entry about {}.",
    "List the pros and cons of {}.",
    "Write a news report about {}.",
)

MORE_PATTERNS = (
    "Write a limerick about {}.",
    "Explain {} to someone from the year 1800.",
    "What is the most surprising thing about {}?",
    "Write a product description inspired by {}.",
    "Give me a fun quiz with three questions about {}.",
    "Write the opening paragraph of a novel about {}.",
    "How would you teach a class about {}?",
    "What are five words that describe {}, and why?",
    "Write a thank-you note that mentions {}.",
    "Describe {} from the point of view of an animal.",
    "What are the biggest myths about {}?",
    "Write a short advertisement about {}.",
    "Plan a weekend activity around {}.",
    "Write a bedtime story about {}.",
    "What would an expert say about {}?",
    "Explain the science behind {}.",
    "Write a letter to your future self about {}.",
    "What are some good books or films about {}?",
    "Write a haiku sequence about {}.",
    "Describe how {} has changed over time.",
    "Write an interview with someone who knows a lot about {}.",
    "Give me a simple analogy for {}.",
    "What are the first three things to learn about {}?",
    "Write a motivational message about {}.",
)

TOPICS = (
    "a cat who learns to swim", "photosynthesis", "learning a new language", "the moon landing", "gardening",
    "a robot who wants to be a chef", "climate change", "saving money", "the water cycle", "ancient Rome",
    "a dragon afraid of the dark", "healthy sleep", "volcanoes", "writing a resume", "the internet",
    "a lost dog finding its way home", "electric cars", "meditation", "the solar system", "baking bread",
    "friendship", "recycling", "the French Revolution", "a young wizard's first spell", "exercise",
    "machine learning", "the human heart", "public speaking", "rainforests", "a detective in a small town",
    "time management", "the printing press", "honey bees", "a journey across the desert", "chess",
    "vaccines", "starting a small business", "the ocean", "a girl who can talk to birds", "music",
    "earthquakes", "cooking pasta", "the Great Wall of China", "a space station", "kindness",
    "renewable energy", "studying for exams", "dinosaurs", "a king who lost his crown", "coffee",
    "the immune system", "painting", "a haunted house", "mountains", "teamwork", "rain", "libraries",
    "a knight and a talking horse", "the stock market", "winter", "bicycles", "a village festival",
    "a fisherman and a storm", "the history of chocolate", "a clockmaker's apprentice", "owls", "gratitude",
    "a city under the sea", "how airplanes fly", "tea ceremonies", "a brave little mouse", "the Roman aqueducts",
    "a train journey through the mountains", "learning to play the piano", "glaciers", "an old bookshop", "trust",
    "a scientist who discovers a new planet", "the Olympic Games", "composting", "a pirate who loves maps",
    "the human brain", "budget travel", "a snowman who comes to life", "wind turbines", "sharks", "origami",
    "a grandmother's secret recipe", "the Industrial Revolution", "first aid", "a magical forest", "patience",
    "a lonely giant", "how vaccines are made", "birdwatching", "the Silk Road", "a windmill on a hill",
    "an inventor's failed machine", "the rainforest canopy", "learning to code", "a circus elephant", "bridges",
    "a message in a bottle", "solar panels", "the Egyptian pyramids", "a talking tree", "hiking safety",
    "a girl who builds a rocket", "photography", "the Renaissance", "a shy dragon", "deserts", "courage",
    "a haunted ship", "the history of the bicycle", "a farmer and a clever fox", "electric guitars", "fossils",
    "a family road trip", "the deep sea", "a robot learning to paint", "volunteering", "thunderstorms",
    "a small bakery in Paris", "the Vikings", "a boy who finds a map", "clean water", "penguins", "forgiveness",
    "a school for wizards", "the invention of the telephone", "coral reefs", "a lost kitten", "board games",
    "a mysterious island", "how batteries work", "the Amazon river", "a queen who loved gardens", "autumn",
    "a time traveller's mistake", "the history of writing", "yoga", "an astronaut's first day in space",
    "a village well", "the northern lights", "a tailor and a magic needle", "wolves", "a night at the museum",
    "3D printing", "a storm at sea", "the ancient Greeks", "a musician who lost her voice", "caves", "hope",
    "a clock that runs backwards", "the history of maps", "a young chef's first restaurant", "butterflies",
    "an old man and his garden", "the invention of paper", "a city at night", "a letter from the future",
)


def chat_requests(count: int, seed: int = 0) -> list[str]:
    """`count` distinct requests: a fixed shuffle of every pattern with every topic, then one of
    every further pattern with every topic (so a larger count extends a smaller one's list)."""
    requests = []
    for patterns in (PATTERNS, MORE_PATTERNS):
        pairs = [p.format(t) for p in patterns for t in TOPICS]
        random.Random(seed).shuffle(pairs)
        requests += pairs
    if count > len(requests):
        raise ValueError(f"at most {len(requests)} requests, asked for {count}")
    return requests[:count]
