"""Text in, text out: tokenizers, incremental detokenizing and stop strings, for the HTTP API.

Pure logic: no Ray, no sockets. Imports :mod:`raydp.errors` only;
``transformers`` is imported when a Hugging Face tokenizer is loaded, so that
importing this package costs nothing.

Modules:

- ``tokenizer``: the :class:`TextTokenizer` protocol every tokenizer meets, and
  :func:`load_tokenizer` (a local Hugging Face directory, or None for the byte tokenizer);
- ``byte_tokenizer``: one token per UTF-8 byte, no vocabulary file;
- ``hf_tokenizer``: a ``transformers`` tokenizer from a local directory, with its chat template;
- ``detokenize``: a token stream into text chunk by chunk, never splitting a character;
- ``stops``: cutting text at the first stop string, across chunks;
- ``stream``: both together, token chunks in, text pieces out.
"""
