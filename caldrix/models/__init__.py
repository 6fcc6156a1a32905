"""Where a model comes from: the registry, MODEL resolution, GGUF conversion, fetch and list.

Everything here ends in a plain Hugging Face directory (config.json, *.safetensors, tokenizer
files with the chat template) that the rest of the server loads. Importing this package, the
registry or `source` is cheap: torch and transformers are imported only to convert a GGUF file.
"""
