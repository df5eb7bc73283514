"""A handler that outlives its request: it puts a device tensor after the request timed out."""

import time

import torch


def put_late(ctx, event):
    handle = ctx.upload(torch.ones(1024))
    time.sleep(0.3)
    ctx.put(ctx.key("late"), handle)
    return {}
