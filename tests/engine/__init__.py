"""Tests of :mod:`qwenkit.engine`, one file per module (``test_<module>.py``) or per concern."""
