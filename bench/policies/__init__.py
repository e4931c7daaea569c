"""Policies under trial on long answers, one file each, not registered by sgl_kara: the long-answer
harness loads one with ``--policy-file bench/policies/<name>.py`` (bench/reasoning/configs.py).
A policy that wins at equal KV moves into sgl_kara/policies/."""
