"""What compression costs in answers: the quality harness and its parts.

    python -m bench.quality ...                  the harness (harness.py): proxy task, or --real
    python -m bench.quality.paired ...           paired comparison of two forced-output runs

fidelity.py (forced-output fidelity), real_lm.py (--real), stopping.py (--stopping),
workloads.py (teacher-forced text and recall), task.py (the proxy task) are
their modules.
"""
