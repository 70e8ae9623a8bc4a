"""Tests of :mod:`qwenkit.data`, one file per module (``test_<module>.py``) or per concern."""
