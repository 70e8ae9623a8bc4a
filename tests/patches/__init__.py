"""Tests of :mod:`qwenkit.patches`, one file per module (``test_<module>.py``) or per concern."""
