"""Grammar-constrained decoding (``response_format`` JSON object / JSON schema, ``regex``).

- ``spec``: what a request asks for (``GrammarSpec``) and the checks that turn a bad or
  unsupported schema or regex into a ``GrammarError`` before anything is compiled;
- ``compiler``: xgrammar compilation against the target's tokenizer and the per-request
  matcher state (``GrammarState``: accept, roll back, fill the allowed-token bitmask);
- ``masking``: what the engine does with it each step: walk the drafted tokens to mask the
  target at every verified position, and optionally project the drafts onto the grammar.

Nothing here imports the engine or the server (they import this package).
"""
