"""Reports and plots: self-contained HTML and Markdown documents and their tables
(:mod:`.document`), seaborn plots rendered to PNG (:mod:`.plots`) and comparisons of sweeps
across commits or machines (:mod:`.comparison`, ``vpipe report``).

A new plot is one function in :mod:`.plots` returning a Figure; a new report table one
function in :mod:`.document` returning a DataFrame (wrapped by ``table_section``).
"""

from vpipe import compat

__getattr__ = compat.forward_attributes(__name__, ("vpipe.report.document",))
