"""Structured outputs (JSON schema, regex, EBNF grammar, choice) on xgrammar."""
