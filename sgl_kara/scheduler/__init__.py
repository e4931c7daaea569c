"""Kara's scheduler glue: the periodic policy, request state, scoring and admission."""
