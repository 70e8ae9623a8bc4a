"""Tests of :mod:`qwenkit.notebooks`, one file per module (``test_<module>.py``) or per concern."""
