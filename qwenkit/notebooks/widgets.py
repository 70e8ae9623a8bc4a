"""Interactive controls for JupyterLab, with the static figure a batch run shows instead.

Each function takes ``interactive``: ``True`` (a notebook opened in JupyterLab with
``interactive = True``) builds an ipywidgets control whose output area redraws on change;
``False`` (papermill, HTML reports) displays the same content for a fixed choice, so a report
never holds a dead widget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from IPython.display import HTML, display


def sample_browser(count: int, render: Callable[[int], str], interactive: bool, static_count: int = 3) -> None:
    """Browse rendered samples ``0..count-1`` with a slider; statically, show the first few."""
    if count == 0:
        display(HTML("<i>no good samples to show</i>"))
        return
    if not interactive:
        for i in range(min(static_count, count)):
            display(HTML(render(i)))
        return
    import ipywidgets as w

    # an HTML widget, not an Output one: its value is the sample (also in a saved notebook's widget
    # state), and papermill's client has no Output widget to mimic, whose replies on the shell
    # channel race its wait for the cell's reply and can hang the run (jupyter/nbclient#312)
    slider = w.IntSlider(value=0, min=0, max=count - 1, description="sample", continuous_update=False)
    view = w.HTML(value=render(0))

    def show(change) -> None:
        view.value = render(change["new"])

    slider.observe(show, names="value")
    display(w.VBox([slider, view]))


def choice_view(
    options: Sequence[Any], figure: Callable[[Any], Any], interactive: bool, label: str, static: Any = None
) -> None:
    """A slider over ``options`` redrawing ``figure(option)``; statically, ``figure(static or options[0])``."""
    if not interactive:
        display(figure(options[0] if static is None else static))
        return
    import ipywidgets as w

    slider = w.SelectionSlider(options=list(options), value=options[0], description=label, continuous_update=False)
    out = w.Output()

    def show(_=None) -> None:
        with out:
            out.clear_output(wait=True)
            display(figure(slider.value))

    slider.observe(show, names="value")
    show()
    display(w.VBox([slider, out]))
