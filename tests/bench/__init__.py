"""Tests of :mod:`qwenkit.bench`, one file per module (``test_<module>.py``) or per concern."""
