"""Reasoning accuracy under compression: GSM8K answers graded, full KV against every policy.

    python -m bench.reasoning.gsm8k ...   the harness (gsm8k.py): 100 GSM8K test problems through
                                          sgl_kara.Engine, one configuration at a time, resumable

data.py (the problems, fetched once from PyPI and cached), grading.py (answer extraction and
comparison) and stats.py (Wilson intervals, exact McNemar test) are its parts; the last two are
pure functions.
"""
