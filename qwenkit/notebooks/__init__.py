"""The notebook layer: everything ``notebooks/*.ipynb`` and ``qwenkit notebooks run`` use.

The training kit (``qwenkit/*.py``, ``qwenkit/data``, ``qwenkit/patches``, ...) never imports from
here (``qwenkit notebooks run`` aside); this layer imports the kit, the sweep package included. Its modules:

- :mod:`~qwenkit.notebooks.kernel`: helpers every notebook calls inside its kernel (paths,
  config from parameters, the device, plotting set-up, the closing summary);
- :mod:`~qwenkit.notebooks.runner` and :mod:`~qwenkit.notebooks.pages`: the papermill/nbconvert
  runner behind ``qwenkit notebooks run``, and the HTML it writes around the reports;
- :mod:`~qwenkit.notebooks.results`, :mod:`~qwenkit.notebooks.plots`,
  :mod:`~qwenkit.notebooks.widgets`: result files (long-format rows, ``metrics.json``), the
  figures drawn from them, and the JupyterLab controls with their static fallbacks;
- :mod:`~qwenkit.notebooks.progress`: live bars from a run's events in JupyterLab, collapsed
  logs in a report (notebooks 02 and 05);
- one module per notebook's computations: :mod:`~qwenkit.notebooks.samples` (01 data prep),
  :mod:`~qwenkit.notebooks.runs` (02 sharded training), :mod:`~qwenkit.notebooks.validation`
  (03 chunk-loss validation), :mod:`~qwenkit.notebooks.perf` (04 performance profiling),
  :mod:`~qwenkit.notebooks.compare` (05 comparing runs), with :mod:`~qwenkit.bench.measure`
  (matmul peak, one loss-head case, a measurement in a fresh process), which benchmarks share.
"""
