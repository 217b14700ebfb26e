"""What a run did, from its run directory alone: statistics, plots, a report page, a trace.

One job per module: :mod:`~hopnet.report.rundir` reads a run directory (and follows
growing logs), :mod:`~hopnet.report.stats` turns event records into per-rank numbers,
:mod:`~hopnet.report.gaps` sets observed iteration gaps beside Hop's Table 1 bounds,
:mod:`~hopnet.report.plots` draws them with matplotlib, :mod:`~hopnet.report.content`
decides what a page says and :mod:`~hopnet.report.html` and :mod:`~hopnet.report.markdown`
lay it out, :mod:`~hopnet.report.trace` writes Chrome
trace events, :mod:`~hopnet.report.live` and :mod:`~hopnet.report.summary` are what
`hopnet launch` shows while a run goes and when it ends. :mod:`~hopnet.report.build`
puts the page together (`hopnet report`).
"""
