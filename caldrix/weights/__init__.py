"""Where a model comes from: the registry, MODEL resolution, GGUF conversion, fetch and list.

Everything here ends in a plain Hugging Face directory (config.json, *.safetensors, tokenizer
files with the chat template) that the rest of the server loads. Importing this package, the
registry or `source` is cheap: torch and transformers are imported only to convert a GGUF file.
The readers the architectures' loaders use are here too: gguf_index (a GGUF's tensor index and
raw blocks) and tensor_files (safetensors, one tensor at a time).
"""


class ModelNotFound(Exception):
    """MODEL cannot be turned into a loadable directory.

    `str(e)` is a complete message for the user, naming what to do about it; the CLI prints it
    as it is, without a traceback. (Here, not in source.py, so that the GGUF converter raises it
    without importing source, which imports the converter.)
    """
