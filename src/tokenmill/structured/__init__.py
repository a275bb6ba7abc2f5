"""Structured outputs: grammars that constrain what a request may generate (JSON schema, regex,
choice, Lark/GBNF grammar), applied as a token mask before sampling."""
