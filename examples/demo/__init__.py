"""The shop demo: ``python -m examples.demo`` (run.py), its stack (stack.py) and live view (view.py)."""
