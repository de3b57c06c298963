"""The dataflow API: pipelines as chains of steps over an app's topics, exactly once.

Example::

    from pspf import App, agg, windows

    app = App("shop")
    orders = app.stream("orders", value_type=Order)
    (orders
        .filter(lambda o: o.qty > 0)
        .map(lambda o: {"customer": o.customer, "amount": o.qty * o.price, "ts": o.ts})
        .group_by(lambda v: v["customer"], topic="shop-by-customer")
        .window(windows.tumbling(timedelta(minutes=1)), timestamp="ts")
        .agg(total=agg.Sum("amount"), n=agg.Count())
        .to("spend-per-minute"))

A chain compiles onto what a handler uses (one attempt per entry, the windows, the outbox), so
it is exactly once for the same reasons. The rooms:

- ``stream``: ``Stream`` and its steps, the graph of an app's chains (``Dataflow``);
- ``agg``: the built-in aggregations of a window;
- ``windowing``: a chain's window on the windows' machinery (``ChainWindow``);
- ``joining``: stream-stream joins (``join_interval``: each side's values kept per key on the
  windows' machinery); as-of joins read versioned tables (``pspf.tables.versions``);
- ``run``: a topic's graph compiled to the function its entries run.
"""

from __future__ import annotations

from pspf.dataflow import agg
from pspf.dataflow.run import Runner
from pspf.dataflow.stream import Dataflow, Source, Stream, WindowedStream

__all__ = ["Dataflow", "Runner", "Source", "Stream", "WindowedStream", "agg"]
