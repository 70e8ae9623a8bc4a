"""Tests of :mod:`qwenkit.model`, one file per module (``test_<module>.py``) or per concern."""
