"""Tests of :mod:`qwenkit.distributed`, one file per module (``test_<module>.py``) or per concern."""
