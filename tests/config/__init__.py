"""Tests of :mod:`qwenkit.config`, one file per module (``test_<module>.py``) or per concern."""
