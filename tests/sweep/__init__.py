"""Tests of :mod:`qwenkit.sweep`, one file per module (``test_<module>.py``) or per concern."""
