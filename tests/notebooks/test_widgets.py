"""qwenkit.notebooks.widgets: interactive controls in JupyterLab, their content shown statically in a report."""

import ipywidgets

from qwenkit.notebooks import widgets


def test_widgets_interactive_builds_controls_static_displays_content(monkeypatch):
    shown = []
    monkeypatch.setattr(widgets, "display", shown.append)
    widgets.sample_browser(5, lambda i: f"<b>{i}</b>", interactive=False, static_count=2)
    assert [s.data for s in shown] == ["<b>0</b>", "<b>1</b>"]
    shown.clear()
    widgets.sample_browser(5, lambda i: f"<b>{i}</b>", interactive=True)
    box = shown[-1]
    assert isinstance(box, ipywidgets.VBox) and isinstance(box.children[0], ipywidgets.IntSlider)
    assert box.children[0].max == 4
    # the sample is the HTML widget's value, redrawn when the slider moves (no Output widget:
    # papermill's client would answer one on the shell channel, nbclient#312)
    slider, view = box.children
    assert isinstance(view, ipywidgets.HTML) and view.value == "<b>0</b>"
    slider.value = 3
    assert view.value == "<b>3</b>"
    shown.clear()
    widgets.choice_view([7, 64], lambda c: f"fig {c}", interactive=False, label="chunk size")
    assert shown == ["fig 7"]
    widgets.choice_view([7, 64], lambda c: f"fig {c}", interactive=True, label="chunk size")
    slider = shown[-1].children[0]
    assert isinstance(slider, ipywidgets.SelectionSlider) and slider.options == (7, 64)
