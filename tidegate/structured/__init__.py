"""Structured outputs: the ``response_format`` field and the grammars it compiles to."""
