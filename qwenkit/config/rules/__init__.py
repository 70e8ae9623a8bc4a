"""Each section's rules: ``check(cfg, need)`` for ranges and for the combinations a section's keys turn on.

One module per section (``rules/model.py`` for ``model``, ...); :func:`qwenkit.config.validate.validate`
runs them all. A rule that spans sections sits with the section whose key turns it on
(``data.packing`` refuses ``loss.loss_type: sample_mean``).
The sections themselves (``config/model.py``, ...) hold only fields and allowed names, so the rules
can read the whole :class:`~qwenkit.config.schema.Config` without an import circle.
"""
