"""The quick-start app: per-user order totals in ``ctx.state``."""

from pspf import App, Context

app = App("order-totals")  # the app's name is its consumer group


@app.handler("orders")  # the topic it reads
def add(order: dict, ctx: Context) -> None:
    ctx.state["total"] = ctx.state.get("total", 0) + order["amount"]
    ctx.state["count"] = ctx.state.get("count", 0) + 1


main = app
