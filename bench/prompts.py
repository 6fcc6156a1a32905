"""The chat prompts both benchmarks send (bench/decode.py, bench/serve.py)."""

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works to a child.",
    "List some facts about the planet Mars.",
    "Describe your ideal weekend in detail.",
    "What are the benefits of learning a second language?",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue? Explain step by step.",
    "Tell me about the history of the printing press.",
]
