"""caldrix: a local OpenAI-compatible inference server for small language models.

Importing the package is cheap: it pulls in neither torch, trio nor quart.
"""

__version__ = "0.1.0"
