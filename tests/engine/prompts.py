"""Prompts the engine tests share."""

# a shared opening longer than two KV blocks, so requests share cacheable prefix blocks
PREFIX = ("The following are short passages written for a children's encyclopedia. Each passage explains one "
          "topic in clear and simple words, with examples. ")
PROMPTS = [PREFIX + p for p in [
    "The history of the Roman Empire",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Photosynthesis is the process by which",
    "To make a cup of tea, first",
    "Here is a list of ten animals that live in the ocean:",
    "1, 2, 3, 4,",
    "Water boils at 100 degrees Celsius. In Fahrenheit, that is",
]]
